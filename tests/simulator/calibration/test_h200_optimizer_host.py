"""The measured H200 host's optimizer-phase host time: fixed per step plus one eager dispatch per launch.

Hand-worked from tests/data/h200 (last ProfilerStep of trace_gpt_184m_b16.json.gz):
``Optimizer.step#AdamW.step`` 1200.374 us + ``Optimizer.zero_grad#AdamW.zero_grad`` 245.626 us = 1446.000 us
profiled; profiler inflation = median top-level ``aten::add`` 16.815 us / ``tiny_kernel_us_eager`` 9.5553 us =
1.75976; so 1446.000 / 1.75976 = 821.70 us un-profiled for the graph's one optimizer op. One more optimizer
kernel adds one eager dispatch, 9.5553 us (it added 821.70 us when the phase time was divided by the op count).
"""

from __future__ import annotations

import dataclasses

import pytest

from hardware_models import presets
from simulator.api import simulate_graph
from simulator.graph.op_graph import GraphBuilder
from simulator.graph.ops import OpKind, Phase
from tests.conftest import ROOT, make_hw

MEASURED_OPT_HOST_S = 1446.000e-6 / (16.815 / 9.5553)  # 821.70 us
EAGER_OP_S = 9.5553e-6  # measurements.json micro.memory.tiny_kernel_us_eager


def _h200_host_hw():
    cpu, mem = presets.get("hosts", "h200-measured-host")
    hw = make_hw()
    return dataclasses.replace(hw, host_cpu=cpu, host_memory=mem,
                               profile=dataclasses.replace(hw.profile, launch_overhead_s=None))


def _opt_host_s(n_opt: int, steps: int = 1) -> float:
    """End of the last of ``n_opt`` zero-length optimizer kernels after one zero-length forward kernel,
    less the forward launch: the optimizer phase's host time per step on the measured H200 host."""
    b = GraphBuilder()
    b.add("fwd", OpKind.COMPUTE, "compute", phase=Phase.FWD, fixed_duration_s=0.0)
    for i in range(n_opt):
        b.add(f"opt{i}", OpKind.COMPUTE, "compute", phase=Phase.OPT, fixed_duration_s=0.0)
    r = simulate_graph(b.build(), _h200_host_hw(), steps=steps)
    fwd = presets.get("hosts", "h200-measured-host")[0].launch_overhead_by_phase_s["fwd"]
    return (r.spans["end_s"].max() / steps) - fwd


def test_fit_reproduces_the_measured_optimizer_host_time():
    assert _opt_host_s(1) == pytest.approx(MEASURED_OPT_HOST_S, rel=1e-4)


def test_one_more_optimizer_kernel_adds_one_eager_dispatch():
    assert _opt_host_s(2) - _opt_host_s(1) == pytest.approx(EAGER_OP_S, rel=1e-4)
    assert _opt_host_s(5) - _opt_host_s(1) == pytest.approx(4 * EAGER_OP_S, rel=1e-4)


def test_fixed_part_is_paid_once_per_step():
    assert _opt_host_s(3, steps=3) == pytest.approx(MEASURED_OPT_HOST_S + 2 * EAGER_OP_S, rel=1e-4)


def test_fit_on_the_trace_splits_the_phase_time_it_measures():
    from simulator.calibration.host_overhead import fit_launch_overhead, host_phase_times
    from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
    from simulator.graph.importers.kineto import read_trace_json

    trace = read_trace_json(ROOT / "tests/data/h200/trace_gpt_184m_b16.json.gz")
    assert host_phase_times(trace)["opt_s"] == pytest.approx(1446.000e-6, abs=1e-9)
    graph = build_gpt_step(TransformerSpec(num_layers=12, hidden_size=1024, num_attention_heads=16, seq_length=1024,
                                           vocab_size=32768, ffn_hidden_size=4096, micro_batch_size=16))
    fit = fit_launch_overhead(trace, graph, EAGER_OP_S)
    n_opt = sum(op.launch and op.phase is Phase.OPT for op in graph.ops)
    per, fixed = fit["launch_overhead_by_phase_s"]["opt"], fit["host_phase_fixed_s"]["opt"]
    assert per == EAGER_OP_S
    assert fixed + n_opt * per == pytest.approx(MEASURED_OPT_HOST_S, rel=1e-4)
    cpu, _ = presets.get("hosts", "h200-measured-host")  # the shipped preset is this fit
    assert cpu.host_phase_fixed_s["opt"] == pytest.approx(fixed, rel=1e-6)
    assert cpu.launch_overhead_by_phase_s["opt"] == pytest.approx(per, rel=1e-6)


def test_fixed_optimizer_time_is_flagged_where_unlike_its_fit():
    """The fixed optimizer-step host time (fitted on the 12-layer GPT's PyTorch AdamW step) is flagged where it is
    applied to another framework's step or to a model with over twice / under half the layers; not on the fit's like."""
    from simulator.api import run_warnings
    from simulator.config.loader import load_scenario, resolve_hardware
    from tests.conftest import ROOT

    def note(*sets):
        cfg = load_scenario(ROOT / "scenarios/h200/gpt_184m_b4.yaml", list(sets))
        return [w for w in run_warnings(resolve_hardware(cfg), cfg) if "fixed optimizer-step host time" in w]

    assert note() == [] and note("model.num_layers=24") == []
    assert len(note("model.num_layers=48")) == 1 and "a 48-layer model's parameter tensors" in note("model.num_layers=48")[0]
    assert "Megatron-LM's optimizer step" in note("training.precision=bf16")[0]
    assert note("hardware.launch_overhead_s=1e-5") == []  # an override carries no fixed time


def test_both_traces_step_the_same_148_tensors_so_the_fixed_time_is_not_per_tensor():
    """The evidence for keeping the fixed optimizer time per step (flagged) rather than per tensor: the b16 trace's
    model has 148 parameter tensors (the built graph's param_groups), and the only other traced step, the CPU
    foreach AdamW of the offload trace, runs one ``aten::add_`` per tensor under its ``_foreach_add_``: 148 again.
    One tensor count cannot separate a per-tensor cost from a per-step one."""
    import gzip
    import json

    from simulator.api import FIXED_OPT_FIT_TENSORS, build_graph
    from simulator.config.loader import load_scenario

    assert len(build_graph(load_scenario(ROOT / "scenarios/h200/gpt_184m_b16.yaml")).param_groups) == 148
    ev = [e for e in json.load(gzip.open(ROOT / "tests/data/h200/trace_gpt_184m_b16_offload_overlap.json.gz"))
          ["traceEvents"] if e.get("ph") == "X"]
    fa = next(e for e in ev if e["name"] == "aten::_foreach_add_")
    adds = [e for e in ev if e["name"] == "aten::add_" and e["tid"] == fa["tid"]
            and fa["ts"] <= e["ts"] <= fa["ts"] + fa["dur"]]
    assert len(adds) == FIXED_OPT_FIT_TENSORS == 148
