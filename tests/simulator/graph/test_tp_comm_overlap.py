"""tp_comm_overlap: the sequence-parallel all-gathers and reduce-scatters run beside their GEMMs (Megatron-LM
--tp-comm-overlap), or inside a fused GEMM + collective kernel that takes nothing from the GEMM."""

from __future__ import annotations

import pytest

from simulator.api import build_graph, run_scenario
from simulator.config.errors import ScenarioError
from simulator.config.loader import scenario_from_dict

BASE = {
    "name": "tpo",
    "hardware": {"gpu": "h100-sxm-80gb", "cluster": {"preset": "dgx-h100", "nodes": 1}},
    "model": {"num_layers": 2, "hidden_size": 8192, "num_attention_heads": 64, "seq_length": 2048, "vocab_size": 1024},
    "training": {"micro_batch_size": 1, "precision": "bf16"},
    "parallelism": {"tensor_model_parallel_size": 8, "sequence_parallel": True},
    "run": {"steps": 3, "warmup_steps": 1},
}


def _cfg(mode):
    # against the blocking backward (async_tensor_model_parallel_allreduce false): the same collectives in each mode
    return scenario_from_dict({**BASE, "parallelism": {**BASE["parallelism"], "tp_comm_overlap": mode,
                                                       "async_tensor_model_parallel_allreduce": False}})


def _op(g, name):
    return next(op for op in g.ops if op.name == name)


@pytest.mark.parametrize("mode", [True, "fused"])
def test_the_gather_starts_with_its_gemm_and_the_next_kernel_waits_for_both(mode):
    g = build_graph(_cfg(mode))
    ag, gemm = _op(g, "L0.fwd.tp.ln1.all_gather"), _op(g, "L0.fwd.qkv.gemm")
    assert ag.id not in gemm.deps and set(ag.deps) <= set(gemm.deps)  # both start after ln1
    after = next(op for op in g.ops if op.id > gemm.id and op.stream == "compute")
    assert ag.id in after.deps
    rs, proj = _op(g, "L0.fwd.tp.proj.reduce_scatter"), _op(g, "L0.fwd.proj.gemm")
    assert proj.id not in rs.deps and set(rs.deps) == set(proj.deps)  # beside the GEMM, from its inputs
    assert bool(ag.meta.get("fused_gemm")) == (mode == "fused")


def test_blocking_gathers_feed_their_gemm():
    g = build_graph(_cfg(False))
    assert _op(g, "L0.fwd.tp.ln1.all_gather").id in _op(g, "L0.fwd.qkv.gemm").deps


def test_overlap_hides_communication_and_fused_hides_it_without_slowing_either_side():
    s = {m: run_scenario(_cfg(m)).summary for m in (False, True, "fused")}
    off, ovl, fused = s[False], s[True], s["fused"]
    assert fused["step_time_s"] < ovl["step_time_s"] < off["step_time_s"]
    assert ovl["exposed_comm_s"] < 0.5 * off["exposed_comm_s"]
    # the fused kernel's collectives run at their isolated NCCL time; the overlapped ones slow down beside compute
    assert fused["comm_s_by_group"]["tp"] == pytest.approx(off["comm_s_by_group"]["tp"], rel=1e-9)
    assert ovl["comm_s_by_group"]["tp"] > off["comm_s_by_group"]["tp"]


def test_overlap_needs_sequence_parallelism():
    with pytest.raises(ScenarioError, match="tp_comm_overlap needs sequence_parallel"):
        scenario_from_dict({**BASE, "parallelism": {"tensor_model_parallel_size": 8, "tp_comm_overlap": True}})
