"""The run frames built by columns equal the frames pandas builds from the rows (issue 12: per-run fixed
cost), on hand-made records; ``column_array`` infers the dtypes pandas does; presets are built once."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hardware_models import presets
from hardware_models.presets import PresetError
from simulator.graph.ops import CostClass, OpKind, Phase
from simulator.recording.recorder import (
    COUNTER_COLUMNS, DEPENDENCY_COLUMNS, LAUNCH_COLUMNS, SPAN_COLUMNS, Recorder, column_array, dependencies_frame,
    launches_frame, numeric_column, string_column)

_value = st.one_of(st.integers(-2**62, 2**62), st.floats(allow_nan=True), st.booleans(), st.none(),
                   st.sampled_from(["a", "comm.dp", ""]), st.integers(2**64, 2**70))


@settings(max_examples=300, deadline=None)
@given(st.lists(_value, min_size=1, max_size=8))
def test_column_array_infers_what_pandas_infers(values):
    got, want = pd.Series(column_array(values)), pd.Series(values)
    assert got.dtype == want.dtype
    assert got.equals(want)


def _op(i, name, stream, kind, phase, layer, flops, nbytes):
    return SimpleNamespace(id=i, name=name, stream=stream, kind=kind, phase=phase, layer=layer,
                           cost_class=CostClass.GEMM if kind == OpKind.COMPUTE else CostClass.OTHER,
                           flops=flops, bytes_moved=nbytes)


def _recorder() -> Recorder:
    a = _op(0, "qkv", "compute", OpKind.COMPUTE, Phase.FWD, 0, 2.0e9, 1024)
    b = _op(1, "allreduce", "comm.dp", OpKind.COLLECTIVE, Phase.BWD, -1, 0, 4096.0)
    rec = Recorder()
    rec.span(0, a, 0, 1.5e-3)  # an int start (env.now starts at 0): the column is still float64
    rec.span(0, b, 1.0e-3, 2.0e-3, "comm.dp.1")  # a span on its own channel stream
    rec.span(1, a, 2.0e-3, 3.5e-3)
    rec.span(1, b, 3.0e-3, 4.0e-3)
    rec.counter(0.002, "gpu0", "power_w", 300.0)
    rec.counter(0.0, "gpu0", "sm_clock_mhz", 1980)  # an int value among floats
    rec.counter(0.002, "gpu0.hbm", "memory_bytes", 4096)  # same instant: kept after the power sample
    rec.counter(0.001, "gpu0", "power_w", 450.5)
    return rec


def test_spans_frame_equals_the_frame_of_its_rows():
    rec = _recorder()
    want = pd.DataFrame(rec.spans, columns=SPAN_COLUMNS)
    want["duration_s"] = want.end_s - want.start_s
    got = rec.spans_frame()
    pd.testing.assert_frame_equal(got, want, check_exact=True)
    assert got.stream.tolist() == ["compute", "comm.dp.1", "compute", "comm.dp"]
    assert str(got.start_s.dtype) == "float64" and str(got.layer.dtype) == "int64"
    assert str(got.flops.dtype) == "float64"  # 2e9 and the int 0


def test_spans_frame_equals_the_frame_of_its_rows_when_every_span_names_its_stream():
    """The executor's case: each span names its stream (the column is the spans' streams, not their ops')."""
    a = _op(0, "qkv", "compute", OpKind.COMPUTE, Phase.FWD, 0, 2.0e9, 1024)
    b = _op(1, "allreduce", "comm.dp", OpKind.COLLECTIVE, Phase.BWD, -1, 0, 4096.0)
    rec = Recorder()
    for step, (op, stream) in enumerate([(a, "compute"), (b, "comm.dp.1"), (a, "compute.2"), (b, "comm.dp")]):
        rec.span(step, op, step * 1e-3, step * 1e-3 + 5e-4, stream)
    want = pd.DataFrame(rec.spans, columns=SPAN_COLUMNS)
    want["duration_s"] = want.end_s - want.start_s
    got = rec.spans_frame()
    pd.testing.assert_frame_equal(got, want, check_exact=True)
    assert got.stream.tolist() == ["compute", "comm.dp.1", "compute.2", "comm.dp"]


def test_counters_frame_is_the_rows_in_stable_time_order():
    rec = _recorder()
    got = rec.counters_frame()
    want = pd.DataFrame(rec.counters, columns=COUNTER_COLUMNS).sort_values("t_s", kind="stable", ignore_index=True)
    pd.testing.assert_frame_equal(got, want, check_exact=True)
    assert list(zip(got.t_s, got.metric)) == [(0.0, "sm_clock_mhz"), (0.001, "power_w"), (0.002, "power_w"),
                                              (0.002, "memory_bytes")]
    assert got.value.tolist() == [1980.0, 450.5, 300.0, 4096.0]


def _system_with_clock():
    """``(system, its GPU pool, t)``: the pool's clock reads ``t[0]`` (set by the test; the int 0 first, as ``env.now``)."""
    import simpy

    from simulator.engine.system import System
    from tests.conftest import make_hw

    t = [0]
    sys_ = System(simpy.Environment(), make_hw(), Recorder())
    pool = sys_.memory["gpu"]
    pool._clock = lambda: t[0]
    return sys_, pool, t


def test_counters_frame_with_memory_columns_equals_the_frame_of_all_rows():
    """The memory timelines passed as columns (``System.memory_counters``) give the frame of the recorded rows
    followed by theirs: stable time order, the values' dtype inferred over all of them (ints among floats)."""
    sys_, pool, t = _system_with_clock()
    pool.alloc("params.L0.w", 1_000, 0)
    t[0] = 0.001
    pool.alloc("act.L0.x", 3_000, 0.001)
    pool.alloc("act.L0.y", 5_000, 0.001)  # same instant: one sample each, the last value
    t[0] = 0.002
    pool.free("act.L0.x")
    rec = _recorder()
    cols = sys_.memory_counters()
    rows = list(zip(*cols))
    assert rows[:3] == [(0, pool.name, "memory_bytes", 1_000), (0.001, pool.name, "memory_bytes", 9_000),
                        (0.002, pool.name, "memory_bytes", 6_000)]
    assert (0.001, pool.name, "memory_bytes.activations", 8_000) in rows
    assert rows == ([(t_, pool.name, "memory_bytes", v) for t_, v in pool.timeline]
                    + [(t_, pool.name, f"memory_bytes.{c}", v) for t_, c, v in pool.category_timeline])
    got = rec.counters_frame(cols)
    want = pd.DataFrame(rec.counters + rows, columns=COUNTER_COLUMNS).sort_values("t_s", kind="stable",
                                                                                 ignore_index=True)
    pd.testing.assert_frame_equal(got, want, check_exact=True)
    assert str(got.value.dtype) == "float64" and str(got.t_s.dtype) == "float64"
    only = Recorder().counters_frame(cols)  # memory rows alone: int values stay int64
    pd.testing.assert_frame_equal(only, pd.DataFrame(rows, columns=COUNTER_COLUMNS).sort_values(
        "t_s", kind="stable", ignore_index=True), check_exact=True)
    assert str(only.value.dtype) == "int64"
    empty = Recorder().counters_frame(([], [], [], []))
    assert list(empty.columns) == COUNTER_COLUMNS and empty.empty


def test_launches_frame_by_hand():
    graph = SimpleNamespace(ops=[SimpleNamespace(id=0, launch=True), SimpleNamespace(id=1, launch=False),
                                 SimpleNamespace(id=2, launch=True)])
    got = launches_frame(graph, [[0.5, 9.0, None], [1.25, None, 2.0]], [0.25, 1.0, 0.5])
    want = pd.DataFrame([(0, 0, 0.25, 0.5), (1, 0, 1.0, 1.25), (1, 2, 1.5, 2.0)], columns=LAUNCH_COLUMNS)
    pd.testing.assert_frame_equal(got, want, check_exact=True)
    assert launches_frame(graph, [[None, None, None]], [0.25, 1.0, 0.5]).empty
    assert list(launches_frame(graph, [[0.5, None, None]], None).columns) == LAUNCH_COLUMNS


def test_dependencies_frame_by_hand():
    graph = SimpleNamespace(ops=[SimpleNamespace(id=0, deps=(), meta=None),
                                 SimpleNamespace(id=1, deps=(0,), meta={"prev_step_deps": (2,)}),
                                 SimpleNamespace(id=2, deps=(0, 1), meta={})])
    want = pd.DataFrame([(1, 0, 0), (2, 0, 0), (2, 1, 0), (1, 2, 1)], columns=DEPENDENCY_COLUMNS)
    pd.testing.assert_frame_equal(dependencies_frame(graph), want, check_exact=True)
    empty = dependencies_frame(SimpleNamespace(ops=[SimpleNamespace(id=0, deps=(), meta=None)]))
    assert empty.empty and list(empty.columns) == DEPENDENCY_COLUMNS


def test_presets_are_built_once_and_bad_names_still_raise():
    assert presets.get("gpus", "h200-sxm-141gb") is presets.get("gpus", "h200-sxm-141gb")
    for _ in range(2):
        with pytest.raises(PresetError):
            presets.get("gpus", "no-such-gpu")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(_value, max_size=5), min_size=1, max_size=4))
def test_block_columns_infer_what_pandas_infers_from_all_rows(blocks):
    """``numeric_column`` / ``string_column`` of blocks (a string standing for a block of repeated values) give the
    array pandas infers from every row one after another: same dtype, same values."""
    rows = [v for b in blocks for v in b]
    want = pd.Series(rows, dtype=object if not rows else None)
    if rows:
        got = pd.Series(numeric_column(blocks))
        assert got.dtype == want.dtype and got.equals(want)
    lengths = [len(b) for b in blocks]
    as_str = [b[0] if len(b) and all(v == b[0] and type(v) is str for v in b) else b for b in blocks]
    rows_str = [v for b, n in zip(as_str, lengths) for v in ([b] * n if isinstance(b, str) else b)]
    if rows_str:
        got = pd.Series(string_column(as_str, lengths))
        want = pd.Series(rows_str)
        assert got.dtype == want.dtype and got.equals(want)


def test_counters_frame_with_memory_parts_equals_the_frame_of_all_rows():
    """The memory timelines passed as blocks (``System.memory_counter_parts``: a pool's scope, and its total's metric,
    one string for the block) give the frame of the recorded rows followed by their rows."""
    sys_, pool, t = _system_with_clock()
    pool.alloc("params.L0.w", 1_000, 0)
    t[0] = 0.001
    pool.alloc("act.L0.x", 3_000, 0.001)
    t[0] = 0.0005  # an earlier instant than the recorded samples after it: the stable time order puts it first
    pool.free("act.L0.x")
    rec = _recorder()
    parts = sys_.memory_counter_parts()
    assert any(isinstance(p[1], str) and isinstance(p[2], str) for p in parts)
    rows = list(zip(*sys_.memory_counters()))
    got = rec.counters_frame(parts=parts)
    want = pd.DataFrame(rec.counters + rows, columns=COUNTER_COLUMNS).sort_values("t_s", kind="stable",
                                                                                 ignore_index=True)
    pd.testing.assert_frame_equal(got, want, check_exact=True)
    assert got.equals(want)
    assert Recorder().counters_frame(parts=[([], "gpu", "memory_bytes", [])]).empty
