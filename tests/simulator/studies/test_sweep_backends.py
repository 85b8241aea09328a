"""The same sweep in one process, on the process pool and on a Dask LocalCluster (``sweep_dask.local_cluster``),
with its points in batches (``sweep.point_batches``): the same rows in the same order, value for value; and the
cluster's worker processes run under ``SWEEP_DASK_CONFIG``."""

from __future__ import annotations

import math
import sys

import pytest

from simulator.studies import sweep
from tests.conftest import ROOT

SCEN = ROOT / "scenarios/h200/dataloader_w2.yaml"
BASE = ["model.num_layers=2", "run.steps=3", "run.warmup_steps=1", "dvfs.kind=locked_clock"]
#: 20 points: batches of 2 on two workers (ceil(20 / 16)), two built graphs, graph-sharing points in between
FACTORS = {"training.micro_batch_size": [1, 2], "dataloader.num_workers": [1, 2], "dvfs.locked_clocks_mhz": [
    1980, 1830, 1605, 1410, 1245]}


def _rows(df) -> list[dict]:
    return [{k: ("nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
            for r in df.to_dict("records")]


def _sweep(**kw):
    return sweep.run_sweep(SCEN, FACTORS, BASE, progress=False, log=lambda m: None, **kw)


def test_pool_and_cluster_rows_equal_the_single_process_rows_in_grid_order():
    pytest.importorskip("dask.distributed")
    from simulator.studies.sweep_dask import local_cluster

    assert [len(b) for b in sweep.point_batches(list(range(20)), 2)] == [2] * 10  # batches, not points, are tasks
    one = _rows(_sweep(workers=1))
    assert len(one) == 20 and all(r["error"] is None for r in one)
    assert [(r["training.micro_batch_size"], r["dataloader.num_workers"], r["dvfs.locked_clocks_mhz"]) for r in one] \
        == [tuple(p.values()) for p in sweep.grid(FACTORS)]
    assert len({(r["step_time_s"], r["energy_j_per_step"]) for r in one}) == 20  # each differs: a misplaced row shows
    assert _rows(_sweep(workers=2)) == one
    cluster, client = local_cluster(2)
    try:
        assert _rows(_sweep(client=client)) == one
    finally:
        client.close()
        cluster.close()


def _profiler_off(dask_worker) -> bool:
    """On a worker (``client.run`` passes it): no statistical-profiler callback was started."""
    return "profile" not in dask_worker.periodic_callbacks


def test_local_cluster_workers_run_under_the_sweep_settings():
    pytest.importorskip("dask.distributed")
    import dask

    from simulator.studies.sweep_dask import SWEEP_DASK_CONFIG, local_cluster

    cluster, client = local_cluster(1)
    try:  # the worker imported the simulation as it started (preload), before any task or call of ours
        assert list(client.run(lambda: [m for m in ("simulator.api", "simpy") if m in sys.modules]).values()) \
            == [["simulator.api", "simpy"]]
        seen = client.run(lambda keys: {k: dask.config.get(k) for k in keys}, list(SWEEP_DASK_CONFIG))
        assert list(seen.values()) == [SWEEP_DASK_CONFIG]
        assert client.run(_profiler_off) == {a: True for a in seen}
        assert sum(client.nthreads().values()) == 1
    finally:
        client.close()
        cluster.close()
    assert dask.config.get("distributed.worker.profile.enabled") is True  # this process's settings are left as they were


def test_a_recorded_batch_is_freed_on_the_cluster(monkeypatch):
    """Each batch's rows leave the worker's memory once the sweep has recorded them (its future released), so a
    long sweep does not keep every row on the workers until it ends: when a batch starts, the worker holds the
    rows of at most the few batches just finished (the release is asynchronous), not those of all earlier ones."""
    distributed = pytest.importorskip("dask.distributed")
    real = sweep._run_points

    def spy(jobs):  # runs on the worker (a copy of this closure): it notes there what the worker holds
        worker = distributed.get_worker()
        worker.sweep_held = [*getattr(worker, "sweep_held", []), len(worker.data)]
        return real(jobs)

    monkeypatch.setattr(sweep, "_run_points", spy)
    with distributed.Client(processes=False, n_workers=1, threads_per_worker=1, dashboard_address=None) as client:
        df = _sweep(client=client)
        [held] = client.run(lambda dask_worker: dask_worker.sweep_held).values()
    assert df["error"].isna().all()
    assert len(held) == 7  # 20 points on one thread: batches of ceil(20 / 8) = 3
    assert max(held) <= 3, held  # kept until the end, the 7th batch would start beside 6 finished ones
