"""Host dispatch time fitted from a trace's CPU timeline, on a synthetic trace worked out by hand."""

from __future__ import annotations

import pytest

from simulator.calibration.host_overhead import fit_launch_overhead, host_phase_times
from simulator.graph.op_graph import GraphBuilder
from simulator.graph.ops import OpKind, Phase


def trace():
    """Step 0-1000 us on tid 1; forward ops until 300 us (aten::add takes 20 us); backward on tid 2."""
    X = lambda name, ts, dur, tid, cat="cpu_op": {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "cat": cat}
    return {"traceEvents": [
        X("ProfilerStep#3", 0, 1000, 1, "user_annotation"),
        X("aten::linear", 10, 100, 1), X("aten::empty", 20, 5, 1),  # nested: ignored
        X("aten::add", 150, 20, 1), X("aten::add", 200, 20, 1), X("aten::layer_norm", 250, 50, 1),
        X("autograd::engine::evaluate_function: AddmmBackward0", 400, 200, 2),
        X("autograd::engine::evaluate_function: AddBackward0", 650, 100, 2),
        X("Optimizer.step#AdamW.step", 800, 150, 1, "user_annotation"),
    ]}


def test_phase_times_by_hand():
    h = host_phase_times(trace())
    assert h["fwd_s"] == pytest.approx(300e-6)  # step start to the end of the last forward op
    assert h["bwd_s"] == pytest.approx(300e-6)  # 200 + 100 us of top-level autograd events
    assert h["opt_s"] == pytest.approx(150e-6)
    assert h["aten_add_s"] == pytest.approx(20e-6)


def test_fit_divides_by_inflation_and_op_count():
    b = GraphBuilder()
    for i in range(3):
        b.add(f"f{i}", OpKind.COMPUTE, "compute", phase=Phase.FWD)
    for i in range(2):
        b.add(f"b{i}", OpKind.COMPUTE, "compute", phase=Phase.BWD)
    b.add("opt", OpKind.COMPUTE, "compute", phase=Phase.OPT)
    fit = fit_launch_overhead(trace(), b.build(), eager_tiny_op_s=10e-6)  # profiler inflation 20/10 = 2
    assert fit["profiler_inflation"] == pytest.approx(2.0)
    per = fit["launch_overhead_by_phase_s"]
    assert per["fwd"] == pytest.approx(300e-6 / 2 / 3)
    assert per["bwd"] == pytest.approx(300e-6 / 2 / 2)
    # the optimizer: one eager dispatch per launch, the rest once per step: 150 / 2 - 1 x 10 = 65 us
    assert per["opt"] == pytest.approx(10e-6)
    assert fit["host_phase_fixed_s"]["opt"] == pytest.approx(65e-6)


def test_optimizer_launches_longer_than_its_host_time_fall_back_to_per_op():
    """8 optimizer ops x 10 us exceed the 150 / 2 = 75 us measured: no fixed part, 75 / 8 us per op."""
    b = GraphBuilder()
    b.add("f", OpKind.COMPUTE, "compute", phase=Phase.FWD)
    b.add("b", OpKind.COMPUTE, "compute", phase=Phase.BWD)
    for i in range(8):
        b.add(f"opt{i}", OpKind.COMPUTE, "compute", phase=Phase.OPT)
    fit = fit_launch_overhead(trace(), b.build(), eager_tiny_op_s=10e-6)
    assert fit["launch_overhead_by_phase_s"]["opt"] == pytest.approx(75e-6 / 8)
    assert fit["host_phase_fixed_s"] == {}


def test_no_step_marker_is_an_error():
    with pytest.raises(ValueError, match="ProfilerStep"):
        host_phase_times({"traceEvents": []})
