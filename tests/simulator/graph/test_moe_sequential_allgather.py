"""Megatron's SequentialMLP (``model.moe_grouped_gemm: false``) and all-gather token dispatcher
(``model.moe_token_dispatcher_type: allgather``): per-expert GEMM counts, shapes and FLOPs, the dispatcher's
collective bytes, worked out by hand on a tiny MoE (4 experts, top-2, 2 layers), and bad input."""

from __future__ import annotations

from collections import Counter

import pytest

from simulator.api import run_scenario
from simulator.cli import main
from simulator.config.loader import load_scenario
from simulator.graph.builders.moe_experts import local_expert_rows
from simulator.graph.builders.sharding import layer_param_sizes
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.ops import CostClass, OpKind
from tests.simulator.graph.test_moe import TINY, _mixtral, _scenario

# TINY: L=2, h=64, s=16, b=2 (T = 32 tokens), E=4 experts of f_e=128, top-2, SwiGLU, bf16
T, H, K, E, FE = 32, 64, 2, 4, 128


def _spec(**kw) -> TransformerSpec:
    return TransformerSpec(**{**TINY, **kw})


def _expert_gemms(g, layer: int = 0) -> list:
    return [o for o in g.ops if o.layer == layer and o.cost_class is CostClass.GEMM and ".experts." in o.name]


def _coll(g, layer: int) -> Counter:
    return Counter((o.phase.value, o.meta["group"], o.meta["collective"], o.meta["bytes"]) for o in g.ops
                   if o.kind is OpKind.COLLECTIVE and o.layer == layer)


# -- SequentialMLP ------------------------------------------------------------------------------
def test_sequential_mlp_one_gemm_per_expert_same_flops_by_hand():
    # ep 1: 4 local experts, balanced: T k / E = 16 rows each. fc1 [16, 64] x [64, 256], fc2 [16, 128] x [128, 64]
    seq = build_gpt_step(_spec(moe_grouped_gemm=False))
    grp = build_gpt_step(_spec())
    ops = {o.name: o for o in seq.ops if o.layer == 0}
    for j in range(E):
        fc1, fc2 = ops[f"L0.fwd.experts.{j}.fc1.gemm"], ops[f"L0.fwd.experts.{j}.fc2.gemm"]
        assert fc1.shape == (16, 2 * FE, H) and fc1.flops == 2 * 16 * H * 2 * FE == 524_288
        assert fc2.shape == (16, H, FE) and fc2.flops == 2 * 16 * FE * H == 262_144
        assert fc1.bytes_read == 2 * (16 * H + H * 2 * FE)  # its rows and its own weight only
        assert ops[f"L0.bwd.experts.{j}.fc1.wgrad"].shape == (2 * FE, H, 16)
    fwd = [o for o in _expert_gemms(seq) if o.phase.value == "fwd"]
    bwd = [o for o in _expert_gemms(seq) if o.phase.value == "bwd"]
    assert (len(fwd), len(bwd)) == (2 * E, 4 * E) == (8, 16)  # grouped: 2 and 4
    assert [len([o for o in _expert_gemms(grp) if o.phase.value == p]) for p in ("fwd", "bwd")] == [2, 4]
    # the same FLOPs as the grouped GEMMs of the 64 stacked rows: 3 x 2 N h 2 f_e ... forward 3,145,728
    assert sum(o.flops for o in fwd) == sum(o.flops for o in _expert_gemms(grp) if o.phase.value == "fwd") == 3_145_728
    assert sum(o.flops for o in bwd) == 2 * 3_145_728
    # torch.cat of the 4 outputs and the split's backward: one [64, 64] 16-bit copy each
    cat, split = ops["L0.fwd.experts.cat"], ops["L0.bwd.experts.split.dgrad"]
    assert cat.bytes_read == cat.bytes_written == split.bytes_written == 2 * 64 * H == 8192
    # the launches: 3 kernels per expert forward (fc1, SwiGLU, fc2) + the cat
    launched = [o for o in seq.ops if o.layer == 0 and o.phase.value == "fwd" and ".experts." in o.name]
    assert len(launched) == 3 * E + 1


def test_sequential_mlp_backward_runs_the_last_expert_first_and_param_groups_match():
    s = _spec(moe_grouped_gemm=False, expert_parallel_size=2, data_parallel_size=2)
    g = build_gpt_step(s)
    names = [p.name for p in g.param_groups if ".experts." in p.name and p.name.startswith("L1.")]
    assert names == ["L1.experts.1.fc2.weight", "L1.experts.1.fc1.weight", "L1.experts.0.fc2.weight",
                     "L1.experts.0.fc1.weight"]
    assert sum(p.numel for p in g.param_groups) == s.num_parameters
    sizes = {k: n for k, n in layer_param_sizes(s).items() if k.startswith("experts.")}
    assert sizes == {"experts.1.fc2.weight": FE * H, "experts.1.fc1.weight": 2 * FE * H,
                     "experts.0.fc2.weight": FE * H, "experts.0.fc1.weight": 2 * FE * H}
    # ep 2: each of the 2 local experts gets ep T k / E = 32 rows
    assert [o.shape[0] for o in _expert_gemms(g) if o.name.endswith("fc1.gemm")] == [32, 32]


def test_sequential_mlp_rows_follow_the_tokens_per_expert_by_hand():
    # shares 0.4 0.3 0.2 0.1 of T k = 64 copies: 25.6 19.2 12.8 6.4, cumulative 25.6 44.8 57.6 64 -> 26 45 58 64
    s = _spec(moe_grouped_gemm=False, moe_tokens_per_expert=(4, 3, 2, 1))
    assert local_expert_rows(s, T) == [26, 19, 13, 6]
    g = build_gpt_step(s)
    assert [o.shape[0] for o in _expert_gemms(g) if o.name.endswith("fc1.gemm")] == [26, 19, 13, 6]
    # ep 2: rank 0 (experts 0, 1) is the busiest: 2 x 25.6 = 51.2, 2 x 44.8 = 89.6 -> 51 and 39 rows
    assert local_expert_rows(_spec(moe_grouped_gemm=False, moe_tokens_per_expert=(4, 3, 2, 1), expert_parallel_size=2,
                                   data_parallel_size=2), T) == [51, 39]


def test_expert_without_tokens_launches_nothing_but_gets_zero_gradients():
    s = _spec(moe_grouped_gemm=False, moe_tokens_per_expert=(1, 1, 0, 0), data_parallel_size=2)
    g = build_gpt_step(s)
    assert [o.name for o in _expert_gemms(g) if o.name.endswith("fc1.gemm")] == ["L0.fwd.experts.0.fc1.gemm",
                                                                                   "L0.fwd.experts.1.fc1.gemm"]
    zero = [o.name for o in g.ops if o.layer == 0 and o.name.endswith("wgrad.zero")]
    assert zero == ["L0.bwd.experts.3.fc2.wgrad.zero", "L0.bwd.experts.3.fc1.wgrad.zero",
                    "L0.bwd.experts.2.fc2.wgrad.zero", "L0.bwd.experts.2.fc1.wgrad.zero"]
    assert sum(p.numel for p in g.param_groups) == s.num_parameters


def test_one_local_expert_has_no_cat():
    g = build_gpt_step(_spec(moe_grouped_gemm=False, expert_parallel_size=4, data_parallel_size=4))
    assert not [o for o in g.ops if "experts.cat" in o.name or "split.dgrad" in o.name]
    assert [o.shape for o in _expert_gemms(g) if o.name == "L0.fwd.experts.0.fc1.gemm"] == [(64, 2 * FE, H)]


# -- all-gather dispatcher ----------------------------------------------------------------------
@pytest.mark.parametrize("router_dtype,p", [(None, 2), ("fp32", 4)])
def test_allgather_dispatcher_collective_bytes_by_hand(router_dtype, p):
    """ep 2 (G = 2 ranks of tp_ep, here the ep group): R = G T = 64 gathered rows. The probabilities are in the
    logits' dtype, ``p`` bytes: bf16 by default (Megatron ``Router.gating``: ``router_dtype = input.dtype``), fp32
    with ``--moe-router-dtype fp32``; the probability-weighted combine and its reduce-scatter follow them (bf16 x bf16
    stays bf16, no cast back; fp32 promotes and is cast back)."""
    g = build_gpt_step(_spec(moe_token_dispatcher_type="allgather", expert_parallel_size=2, data_parallel_size=2,
                             moe_router_dtype=router_dtype))
    R = 2 * T
    assert _coll(g, 0) == Counter({
        ("fwd", "ep", "all_gather", R * E): 1,  # routing map, bool: 256
        ("fwd", "ep", "all_gather", p * R * E): 1,  # probabilities: 512 (bf16) / 1024 (fp32)
        ("fwd", "ep", "all_gather", 2 * R * H): 1,  # tokens, 16-bit: 8192
        ("fwd", "ep", "reduce_scatter", p * R * H): 1,  # weighted unpermute output: 8192 / 16384
        ("bwd", "ep", "all_gather", p * R * H): 1,  # the reduce-scatter's backward
        ("bwd", "ep", "reduce_scatter", 2 * R * H): 1,  # the token all-gather's backward
        ("bwd", "ep", "reduce_scatter", p * R * E): 1,  # the probabilities' all-gather's backward
    })
    ops = {o.name: o for o in g.ops if o.layer == 0}
    # each rank's 2 local experts take their kept copies of all 64 gathered tokens: 2 x 64 x 2 / 4 = 64 rows
    assert ops["L0.fwd.experts.fc1.gemm"].shape == (64, 2 * FE, H)
    assert ops["L0.fwd.moe.permute"].bytes_written == 2 * 64 * H
    assert ops["L0.fwd.moe.unpermute"].bytes_written == p * R * H
    assert ops["L0.fwd.moe.permuted_probs"].bytes_written == p * 64
    assert ops["L0.fwd.router.topk_softmax"].bytes_written == (p + 1) * T * E  # probabilities + bool map
    assert ("L0.fwd.moe.combine.cast" in ops) == (p == 4)
    assert "L0.fwd.moe.sort_chunks" not in ops and not [o for o in ops if "all_to_all" in o]
    assert ops["L0.fwd.moe.local_map"].bytes_written == R * 2  # [R, E_l] bool


def test_allgather_dispatcher_spans_ep_times_etp():
    # tp 2 with SP, etp 2, ep 2: G = 4, T_n = T / 2 = 16 tokens per rank, R = 64; group tp_ep
    g = build_gpt_step(_spec(moe_token_dispatcher_type="allgather", expert_parallel_size=2, data_parallel_size=2,
                             tensor_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=2))
    c = {k: n for k, n in _coll(g, 0).items() if k[1] == "tp_ep"}
    R = 64
    # bf16 probabilities (2 bytes: the model dtype, Megatron's default moe_router_dtype)
    assert c == {("fwd", "tp_ep", "all_gather", R * E): 1, ("fwd", "tp_ep", "all_gather", 2 * R * E): 1,
                 ("fwd", "tp_ep", "all_gather", 2 * R * H): 1, ("fwd", "tp_ep", "reduce_scatter", 2 * R * H): 1,
                 ("bwd", "tp_ep", "all_gather", 2 * R * H): 1, ("bwd", "tp_ep", "reduce_scatter", 2 * R * H): 1,
                 ("bwd", "tp_ep", "reduce_scatter", 2 * R * E): 1}
    assert not {k for k in _coll(g, 0) if k[1] in ("ep", "etp")}  # no all-to-all, no etp gather of the rows
    # 2 local experts of width f_e / 2: 64 rows (etp x the ep rank's N = 32)
    assert [o.shape for o in g.ops if o.name == "L0.fwd.experts.fc1.gemm"] == [(64, FE, H)]


def test_allgather_on_a_cluster_prices_the_tp_ep_group(tmp_path):
    p = _scenario(tmp_path, _mixtral(num_layers=1, seq_length=1024, moe_token_dispatcher_type="allgather",
                                     moe_grouped_gemm=False),
                  {"expert_model_parallel_size": 2, "tensor_model_parallel_size": 2, "sequence_parallel": True},
                  {"preset": "dgx-h100", "nodes": 1})
    s = run_scenario(load_scenario(p)).summary
    assert {"tp_ep", "tp"} <= set(s["comm_s_by_group"]) and "ep" not in s["comm_s_by_group"]
    assert s["comm_s_by_group"]["tp_ep"] > 0


# -- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("key,value,expected", [
    ("moe_token_dispatcher_type", "flex", "moe_token_dispatcher_type: flex is not modelled (allowed: alltoall, "
                                          "allgather)"),
    ("moe_token_dispatcher_type", "alltoall_seq", "moe_token_dispatcher_type: alltoall_seq is not modelled"),
    ("moe_token_dispatcher_type", "all2all", "model.moe_token_dispatcher_type: Input should be 'alltoall', "
                                             "'allgather'"),
    ("moe_grouped_gemm", "sometimes", "model.moe_grouped_gemm: Input should be a valid boolean"),
])
def test_bad_dispatcher_or_grouped_gemm_one_line_exit_2(tmp_path, capsys, key, value, expected):
    p = _scenario(tmp_path, _mixtral(num_layers=1, **{key: value}))
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_moe_keys_without_experts_refused(tmp_path, capsys):
    from tests.conftest import ROOT

    p = _scenario(tmp_path, {"from_hf": str(ROOT / "scenarios/models/llama-2-7b.json"), "num_layers": 1,
                             "seq_length": 512, "moe_grouped_gemm": False})
    assert main(["run", str(p)]) == 2
    assert "moe_grouped_gemm needs model.num_experts" in capsys.readouterr().err


# -- memory estimate ----------------------------------------------------------------------------
# a 4-block Mixtral-shaped MoE (h 512, 8 experts of 1024, top-2) at b 4 s 4096 on a DGX H100, ep 2: activations
# are a third of the peak (full recompute takes 1.8 of 4.5 GB off); measured 1.0001-1.0237 x the simulated peak
MEM_CASES = {
    "grouped alltoall": [],
    "sequential alltoall": ["model.moe_grouped_gemm=false"],
    "grouped allgather": ["model.moe_token_dispatcher_type=allgather"],
    "sequential allgather ep 1": ["model.moe_grouped_gemm=false", "model.moe_token_dispatcher_type=allgather",
                                  "parallelism.expert_model_parallel_size=1"],
    "allgather tp 2 etp 2 (tp_ep 4)": ["parallelism.tensor_model_parallel_size=2", "parallelism.sequence_parallel=true",
                                       "model.moe_token_dispatcher_type=allgather", "model.moe_grouped_gemm=false"],
    "sequential, imbalanced, distributed optimizer": ["model.moe_grouped_gemm=false",
                                                      "model.moe_tokens_per_expert=[4,3,2,1,1,1,1,1]",
                                                      "ddp.use_distributed_optimizer=true"],
    "allgather, fp32 router probabilities": ["model.moe_token_dispatcher_type=allgather", "model.moe_router_dtype=fp32"],
    "alltoall, fp32 router probabilities": ["model.moe_router_dtype=fp32"],
    "allgather PP2 shared expert": ["parallelism.pipeline_model_parallel_size=2", "training.global_batch_size=32",
                                    "model.moe_token_dispatcher_type=allgather",
                                    "model.moe_shared_expert_intermediate_size=1024"],
    # the first stage the larger peak (no 12 T V logits there): the experts' backward working set beside only what
    # the shared expert's backward left saved (main before: +7.5% and +6.2%)
    "alltoall PP2 gated shared expert": ["parallelism.pipeline_model_parallel_size=2", "training.global_batch_size=32",
                                         "model.moe_shared_expert_intermediate_size=1024",
                                         "model.moe_shared_expert_gate=true"],
}


@pytest.mark.parametrize("case", list(MEM_CASES))
def test_memory_estimate_follows_the_experts_and_the_dispatcher(tmp_path, case):
    from simulator.studies.memory_estimate import TOLERANCE, estimate_memory

    p = _scenario(tmp_path, _mixtral(num_layers=4, hidden_size=512, ffn_hidden_size=1024, num_attention_heads=8,
                                     vocab_size=8000), {"expert_model_parallel_size": 2},
                  {"preset": "dgx-h100", "nodes": 1}, {"micro_batch_size": 4})
    cfg = load_scenario(p, ["run.steps=2", "run.warmup_steps=1", *MEM_CASES[case]])
    sim = run_scenario(cfg).summary["peak_device_memory_bytes"]
    assert estimate_memory(cfg).peak_device_bytes == pytest.approx(sim, rel=TOLERANCE)


def test_moe_backward_peak_walks_frees_by_hand():
    from simulator.studies.moe_backward_peak import peak_excess

    # start 2; +3 (peak 5) then free 4 -> 1; +6 (peak 7) free 7 -> 0; +1 (peak 1)
    assert peak_excess([(3, 4), (6, 7), (1, 0)], start=2) == 7
    assert peak_excess([], start=2) == 2
