"""Sweep points go to the process pool or a Dask cluster in batches (``sweep.point_batches``): consecutive, covering every
point once, 8 batches per worker thread, at most 32 points each."""

from __future__ import annotations

from simulator.studies.sweep import BATCH_MAX, point_batches


def test_batches_of_a_10k_sweep_on_two_threads():
    todo = list(range(10_000))
    b = point_batches(todo, 2)
    assert [len(x) for x in b] == [32] * 312 + [16]
    assert [i for x in b for i in x] == todo


def test_batches_of_small_sweeps():
    assert [len(x) for x in point_batches(list(range(400)), 2)] == [25] * 16  # ceil(400 / 16)
    assert point_batches([3, 5, 7], 2) == [[3], [5], [7]]  # fewer points than 16 batches: one point each
    assert point_batches([3, 5, 7], 0) == [[3], [5], [7]]  # no thread reported: treated as one
    assert point_batches([], 2) == []
    assert max(len(x) for x in point_batches(list(range(100_000)), 1)) == BATCH_MAX
