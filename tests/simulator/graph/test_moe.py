"""Mixture of experts: exact parameter counts (Mixtral-8x7B), all-to-all bytes per layer and grouped-GEMM shapes
worked out by hand, capacity factor, model FLOPs from active parameters, expert-parallel rank groups, a 2-layer
Mixtral-shaped run on a DGX H100 with ep 8, and bad input (one line, exit 2)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import yaml

from simulator.api import model_num_parameters, run_scenario, transformer_spec
from simulator.cli import main
from simulator.config.loader import load_scenario, resolve_hardware
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.ops import OpKind
from tests.conftest import ROOT

MIXTRAL = ROOT / "scenarios/models/mixtral-8x7b.json"
# tiny MoE: L=2, h=64, a=4, s=16, b=2 (T = 32 tokens), V=1000, E=4 experts of f_e=128, top-2, SwiGLU, bf16
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1000, ffn_hidden_size=128,
            micro_batch_size=2, tied_embeddings=False, bias=False, precision="bf16", swiglu=True,
            normalization="RMSNorm", position_embedding="rope", num_experts=4, moe_router_topk=2)
T, H, K, E, FE = 32, 64, 2, 4, 128


def _spec(**kw) -> TransformerSpec:
    return TransformerSpec(**{**TINY, **kw})


def _coll(graph, layer: int, group: str) -> Counter:
    return Counter((o.meta["collective"], o.meta["bytes"]) for o in graph.ops
                   if o.kind is OpKind.COLLECTIVE and o.layer == layer and o.meta["group"] == group)


def _scenario(tmp_path: Path, model: dict, parallelism: dict | None = None, cluster: dict | None = None,
              training: dict | None = None) -> Path:
    d = {"name": "moe", "hardware": {"gpu": "h100-sxm-80gb", "host": "dgx-h100-host"},
         "model": model, "training": {"micro_batch_size": 1, "precision": "bf16", **(training or {})},
         "parallelism": parallelism or {}, "run": {"steps": 3, "warmup_steps": 1}}
    if cluster is not None:
        d["hardware"]["cluster"] = cluster
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def _mixtral(**kw) -> dict:
    return {"from_hf": str(MIXTRAL), "seq_length": 4096, **kw}


# -- parameters --------------------------------------------------------------------------------
def test_mixtral_8x7b_parameter_counts_exact(tmp_path):
    # per layer: attention 2 h^2 + 2 h (g d) = 41,943,040; router h E = 32,768; experts 8 x 3 h f = 1,409,286,144;
    # 2 RMSNorms 8,192 -> 1,451,270,144 x 32 layers; + untied embedding and head 2 V h = 262,144,000 + final norm 4,096
    cfg = load_scenario(_scenario(tmp_path, _mixtral()))
    assert model_num_parameters(cfg) == 46_702_792_704  # published: "46.7B total" (Jiang et al. 2024)
    per_layer = 2 * 4096**2 + 2 * 4096 * 1024 + 4096 * 8 + 8 * 3 * 4096 * 14336 + 2 * 4096
    assert 32 * per_layer + 2 * 32000 * 4096 + 4096 == 46_702_792_704
    active = 32 * (per_layer - 6 * 3 * 4096 * 14336) + 2 * 32000 * 4096 + 4096  # top-2: 2 of the 8 experts
    assert transformer_spec(cfg).num_active_parameters == active == 12_879_925_248  # "12.9B active"
    m = cfg.model
    assert (m.num_experts, m.moe_router_topk, m.ffn_hidden_size, m.query_groups) == (8, 2, 14336, 8)


def test_expert_parallel_rank_holds_its_experts_and_param_groups_sum():
    s = _spec(expert_parallel_size=2, data_parallel_size=2)
    expert = 3 * H * FE
    dense = 2 * (1000 * H) + H + 2 * (H * (H + 2 * H) + H * H + 2 * H + H * E)  # embeddings, norms, attention, router
    assert s.num_parameters == dense + 2 * 2 * expert  # 2 layers x E / ep = 2 local experts
    assert _spec().num_parameters == dense + 2 * 4 * expert
    g = build_gpt_step(s)
    assert sum(p.numel for p in g.param_groups) == s.num_parameters
    assert [p.numel for p in g.param_groups if p.name == "L0.experts.fc1.weight"] == [2 * H * 2 * FE]


# -- kernels -----------------------------------------------------------------------------------
@pytest.mark.parametrize("recompute,n_fwd", [("none", 2), ("full", 4)])
def test_four_all_to_alls_per_layer_of_b_s_h_topk_16_bit(recompute, n_fwd):
    # dispatch and combine forward, their two backward all-to-alls: each rank sends b s h x topk 16-bit values
    g = build_gpt_step(_spec(expert_parallel_size=2, data_parallel_size=2, recompute=recompute))
    a2a = 2 * T * H * K  # 8192 bytes
    for layer in (0, 1):
        c = _coll(g, layer, "ep")
        assert c[("all_to_all", a2a)] == n_fwd + 2
        assert c[("all_gather", 8 * E * 2)] == n_fwd // 2  # tokens per expert [ep, E] int64, each forward pass
    names = [o.name for o in g.ops if o.layer == 0 and o.meta and o.meta.get("collective") == "all_to_all"]
    assert names[:2] == ["L0.fwd.ep.moe.dispatch.all_to_all", "L0.fwd.ep.moe.combine.all_to_all"]
    assert all(o.stream == "comm.ep" for o in g.ops if o.meta and o.meta.get("group") == "ep")
    assert not _coll(build_gpt_step(_spec()), 0, "ep")  # ep = 1: no all-to-all


def test_grouped_gemm_shapes_and_flops_by_hand():
    g = build_gpt_step(_spec(expert_parallel_size=2, data_parallel_size=2))
    ops = {o.name: o for o in g.ops if o.layer == 0}
    N = T * K  # balanced: each rank's 2 local experts process T k = 64 rows (ep T k / E = 32 per expert)
    fc1 = ops["L0.fwd.experts.fc1.gemm"]
    assert fc1.shape == (N, 2 * FE, H) and fc1.flops == 2 * N * H * 2 * FE
    assert fc1.bytes_read == 2 * (N * H + 2 * H * 2 * FE)  # tokens + both local experts' weights
    assert ops["L0.fwd.experts.fc2.gemm"].shape == (N, H, FE)
    wg = ops["L0.bwd.experts.fc1.wgrad"]
    assert wg.shape == (2 * 2 * FE, H, N // 2) and wg.flops == 2 * N * H * 2 * FE
    assert ops["L0.fwd.router.gemm"].shape == (T, E, H)
    assert ops["L0.fwd.experts.swiglu"].bytes_written == 2 * N * FE
    # the host waits for the tokens-per-expert counts once per forward pass (all-to-all splits, GEMM batch sizes)
    syncs = [o for o in g.ops if o.kind is OpKind.SYNC and o.layer == 0]
    assert [o.name for o in syncs] == ["L0.fwd.moe.tokens_per_expert.sync"]


@pytest.mark.parametrize("factor,n", [(None, 64), (2.0, 64), (1.0, 64), (0.5, 32), (0.3, 20)])
def test_capacity_factor_drops_tokens(factor, n):
    # capacity ceil(c T k / E) per expert from T = 32 tokens, k = 2, E = 4 (16 each when balanced): c 0.5 -> 8,
    # c 0.3 -> ceil(4.8) = 5, so 4 x 5 = 20 rows; c >= 1 drops nothing under balanced routing
    g = build_gpt_step(_spec(expert_parallel_size=2, data_parallel_size=2, moe_expert_capacity_factor=factor))
    assert _coll(g, 0, "ep")[("all_to_all", 2 * n * H)] == 4
    assert [o.shape[0] for o in g.ops if o.name == "L0.fwd.experts.fc1.gemm"] == [n]


def test_model_flops_use_active_parameters():
    s = _spec()
    qkv = H + 2 * H  # multi-head: 3h
    per_token_layer = 2 * (H * qkv + H * H + H * E + K * 3 * H * FE) + 2 * 16 * H  # + causal attention 2 s h
    assert s.model_flops_per_sample() == 3 * 16 * (2 * per_token_layer + 2 * H * 1000)
    assert s.model_flops_per_sample() < _spec(moe_router_topk=4).model_flops_per_sample()


def test_shared_expert_adds_a_dense_mlp():
    s = _spec(moe_shared_expert_intermediate_size=96)
    assert s.num_parameters - _spec().num_parameters == 2 * 3 * H * 96
    g = build_gpt_step(s)
    assert sum(p.numel for p in g.param_groups) == s.num_parameters
    assert [o.shape for o in g.ops if o.name == "L0.fwd.shared_expert.fc1.gemm"] == [(T, 2 * 96, H)]


def test_expert_gradients_reduced_over_the_expert_data_parallel_group():
    # dp 4, ep 2: expert weights are replicated on dp / ep = 2 ranks -> one fp32 all-reduce per expert tensor
    g = build_gpt_step(_spec(expert_parallel_size=2, data_parallel_size=4))
    edp = Counter((o.meta["collective"], o.meta["bytes"]) for o in g.ops if o.meta and o.meta.get("group") == "edp")
    assert edp == {("all_reduce", 4 * 2 * H * 2 * FE): 2, ("all_reduce", 4 * 2 * FE * H): 2}  # 2 layers
    ddp = sum(o.meta["bytes"] for o in g.ops if o.meta and o.meta.get("group") == "dp")
    assert ddp == 4 * (_spec().num_parameters - 2 * 4 * 3 * H * FE)  # dense parameters only
    # dp = ep: every replica of these experts is on this rank, nothing to reduce
    g2 = build_gpt_step(_spec(expert_parallel_size=2, data_parallel_size=2))
    assert not [o for o in g2.ops if o.meta and o.meta.get("group") == "edp"]


# -- cluster -----------------------------------------------------------------------------------
@pytest.mark.parametrize("nodes,ep,ep_group,edp_group", [(1, 8, tuple(range(8)), (0,)),
                                                          (1, 4, (0, 1, 2, 3), (0, 4)),
                                                          (2, 8, tuple(range(8)), (0, 8))])
def test_rank_groups_tp_cp_ep_dp(tmp_path, nodes, ep, ep_group, edp_group):
    p = _scenario(tmp_path, _mixtral(num_layers=1), {"expert_model_parallel_size": ep},
                  {"preset": "dgx-h100", "nodes": nodes})
    hw = resolve_hardware(load_scenario(p))
    assert (hw.ep_group, hw.edp_group, hw.dp_group) == (ep_group, edp_group, tuple(range(8 * nodes)))


def test_two_layer_mixtral_on_dgx_h100_ep8(tmp_path):
    p = _scenario(tmp_path, _mixtral(num_layers=2), {"expert_model_parallel_size": 8},
                  {"preset": "dgx-h100", "nodes": 1})
    cfg = load_scenario(p)
    s = run_scenario(cfg).summary
    assert s["expert_parallel_size"] == 8 and s["data_parallel_size"] == 8
    assert s["num_parameters"] == 2 * 1_451_270_144 + 2 * 32000 * 4096 + 4096
    assert s["num_active_parameters"] == 2 * (1_451_270_144 - 6 * 3 * 4096 * 14336) + 2 * 32000 * 4096 + 4096
    # 4 all-to-alls per layer of 2 x 4096 x 4096 x 2 bytes: at most the NVLink bandwidth (450 GB/s per direction
    # per H100, 7/8 of each buffer leaves the GPU) and no more than 5x slower than it
    ep = s["comm_s_by_group"]["ep"]
    wire = 2 * 4 * (7 / 8) * 2 * 4096 * 4096 * 2 / 450e9
    assert wire < ep < 5 * wire
    assert "edp" not in s["comm_s_by_group"]  # dp = ep = 8
    assert 0 < s["step_time_s"] < 1.0
    assert any("routing is assumed balanced" in w for w in s["warnings"])


# -- bad input ---------------------------------------------------------------------------------
BAD = [
    ("ep without experts", {"from_hf": str(ROOT / "scenarios/models/llama-2-7b.json"), "num_layers": 1,
                            "seq_length": 512}, {"expert_model_parallel_size": 2}, True,
     ["parallelism.expert_model_parallel_size: 2 > 1 needs model.num_experts"]),
    ("ep not dividing experts", {**_mixtral(num_layers=1), "num_experts": 6}, {"expert_model_parallel_size": 4}, True,
     ["expert_model_parallel_size: 4 must divide model.num_experts (6)"]),  # 4 divides tp x dp 8: one rule broken
    ("dp not divisible by ep", {**_mixtral(num_layers=1), "num_experts": 16}, {"expert_model_parallel_size": 16},
     True, ["expert_model_parallel_size: 16 x expert_tensor_parallel_size 1 must divide tensor_model_parallel_size x "
            "data_parallel_size 1 x 8", "etp-ep-edp"]),
    ("ep without cluster", _mixtral(num_layers=1), {"expert_model_parallel_size": 2}, False,
     ["data_parallel_size 1 x 1", "hardware.cluster"]),
    ("topk above experts", _mixtral(num_layers=1, moe_router_topk=9), {}, False,
     ["moe_router_topk (9) exceeds num_experts (8)"]),
    ("moe key without experts", {"from_hf": str(ROOT / "scenarios/models/llama-2-7b.json"), "num_layers": 1,
                                 "seq_length": 512, "moe_router_topk": 4}, {}, False,
     ["moe_router_topk needs model.num_experts"]),
    ("tensor parallel experts without sequence parallelism", _mixtral(num_layers=1),
     {"tensor_model_parallel_size": 2}, True, ["parallelism.sequence_parallel", "must be used"]),
    ("etp not dividing the expert width", _mixtral(num_layers=1, moe_ffn_hidden_size=14335),
     {"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_tensor_parallel_size": 2}, True,
     ["parallelism.expert_tensor_parallel_size: 2 must divide the expert width 14335"]),
    ("etp above tp", _mixtral(num_layers=1), {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                                              "expert_tensor_parallel_size": 4}, True,
     ["expert_tensor_parallel_size: 4 above tensor_model_parallel_size 2 is not modelled"]),
    ("etp without experts", {"from_hf": str(ROOT / "scenarios/models/llama-2-7b.json"), "num_layers": 1,
                             "seq_length": 512}, {"expert_tensor_parallel_size": 2}, True,
     ["expert_tensor_parallel_size: 2 needs model.num_experts"]),
    ("biases", _mixtral(num_layers=1, add_bias_linear=True), {}, False, ["add_bias_linear", "not modelled"]),
    ("capacity factor zero", _mixtral(num_layers=1, moe_expert_capacity_factor=0), {}, False,
     ["moe_expert_capacity_factor"]),
    ("sinkhorn", _mixtral(num_layers=1, moe_router_load_balancing_type="sinkhorn"), {}, False,
     ["moe_router_load_balancing_type", "aux_loss"]),
]


@pytest.mark.parametrize("label,model,par,cluster,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_moe_input_one_line_exit_2(tmp_path, capsys, label, model, par, cluster, expected):
    p = _scenario(tmp_path, model, par, {"preset": "dgx-h100", "nodes": 1} if cluster else None)
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and str(p) in err
    for fragment in expected:
        assert fragment in err, f"{label}: {fragment!r} not in {err!r}"


def test_amp_precision_refused_with_experts(tmp_path, capsys):
    p = _scenario(tmp_path, _mixtral(num_layers=1), training={"precision": "amp_fp32_params"})
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "num_experts needs training.precision bf16 or fp16" in err


def test_spec_refuses_what_the_schema_refuses():
    with pytest.raises(ValueError, match="must divide num_experts"):
        _spec(expert_parallel_size=3, data_parallel_size=3)
    with pytest.raises(ValueError, match="must divide tensor_parallel_size x data_parallel_size"):
        _spec(expert_parallel_size=2)
    with pytest.raises(ValueError, match="needs sequence_parallel"):
        _spec(tensor_parallel_size=2, num_attention_heads=4)
    with pytest.raises(ValueError, match="expert_tensor_parallel_size .3. must divide the expert width"):
        _spec(tensor_parallel_size=4, sequence_parallel=True, expert_tensor_parallel_size=3)
    with pytest.raises(ValueError, match="between 1 and num_experts"):
        _spec(moe_router_topk=5)
    with pytest.raises(ValueError, match="need num_experts"):
        _spec(num_experts=None, moe_ffn_hidden_size=64)
    assert math.isfinite(_spec().model_flops_per_sample())


# -- load imbalance (model.moe_tokens_per_expert) ---------------------------------------------------
def _ops(g, layer=0):
    return {o.name: o for o in g.ops if o.layer == layer}


@pytest.mark.parametrize("shares", [(3, 1), (0.75, 0.25), (300, 100)])
def test_imbalance_two_experts_three_to_one_by_hand(shares):
    # E 2, ep 2, top-1, T 32: every rank routes 24 copies to expert 0 (EP rank 0) and 8 to expert 1 (rank 1);
    # rank 0 receives 2 x 24 = 48 rows, rank 1 16 (mean 32): the representative is rank 0 (1.5x the mean)
    from simulator.graph.builders import moe

    s = _spec(num_experts=2, moe_router_topk=1, expert_parallel_size=2, data_parallel_size=2,
              moe_tokens_per_expert=shares)
    assert moe.ep_rank_loads(s, T) == [48, 16] and moe.load_imbalance(s, T) == 1.5
    g = build_gpt_step(s)
    ops = _ops(g)
    assert ops["L0.fwd.experts.fc1.gemm"].shape == (48, 2 * FE, H)
    assert ops["L0.fwd.experts.fc2.gemm"].shape == (48, H, FE)
    assert ops["L0.bwd.experts.fc1.wgrad"].shape == (2 * FE, H, 48)
    assert ops["L0.fwd.moe.permute"].bytes_written == 2 * 32 * H  # this rank's own 32 copies
    assert ops["L0.fwd.moe.unpermute"].bytes_written == 2 * T * H
    # every all-to-all moves the busiest rank's 48 rows (received in dispatch, sent in combine)
    assert _coll(g, 0, "ep")[("all_to_all", 2 * 48 * H)] == 4
    balanced = _ops(build_gpt_step(_spec(num_experts=2, moe_router_topk=1, expert_parallel_size=2,
                                         data_parallel_size=2)))
    assert balanced["L0.fwd.experts.fc1.gemm"].shape == (32, 2 * FE, H)


def test_imbalance_with_capacity_factor_by_hand():
    # capacity ceil(1.0 x 32 / 2) = 16 per expert from each rank: expert 0 keeps 16 of 24, expert 1 all 8 ->
    # 24 copies leave each rank; rank 0 receives 2 x 16 = 32 rows; the all-to-all buffer is max(24, 32) rows
    s = _spec(num_experts=2, moe_router_topk=1, expert_parallel_size=2, data_parallel_size=2,
              moe_tokens_per_expert=(3, 1), moe_expert_capacity_factor=1.0)
    g = build_gpt_step(s)
    ops = _ops(g)
    assert ops["L0.fwd.experts.fc1.gemm"].shape[0] == 32
    assert ops["L0.fwd.moe.permute"].bytes_written == 2 * 24 * H
    assert _coll(g, 0, "ep")[("all_to_all", 2 * 32 * H)] == 4


def test_imbalance_without_expert_parallelism_changes_nothing():
    # one rank holds both experts: the stacked rows are its T k copies whatever the split
    g = build_gpt_step(_spec(num_experts=2, moe_router_topk=1, moe_tokens_per_expert=(3, 1)))
    assert _ops(g)["L0.fwd.experts.fc1.gemm"].shape == (32, 2 * FE, H)


def test_mixtral_ep8_imbalance_slows_the_step_and_drops_the_balanced_warning(tmp_path):
    par, cl = {"expert_model_parallel_size": 8}, {"preset": "dgx-h100", "nodes": 1}
    bal = run_scenario(load_scenario(_scenario(tmp_path, _mixtral(num_layers=2), par, cl))).summary
    # expert 0 gets 2x the mean (2/8 of the copies): the busiest EP rank's GEMMs and all-to-alls double
    skew = _mixtral(num_layers=2, moe_tokens_per_expert=[2, 1, 1, 1, 1, 1, 1, 0])
    imb = run_scenario(load_scenario(_scenario(tmp_path, skew, par, cl))).summary
    assert not any("balanced" in w for w in imb["warnings"])
    assert any("busiest EP rank's expert load (2x the mean)" in w for w in imb["warnings"])
    assert 1.9 < imb["comm_s_by_group"]["ep"] / bal["comm_s_by_group"]["ep"] < 2.1
    assert imb["step_time_s"] > 1.2 * bal["step_time_s"]


@pytest.mark.parametrize("tokens,expected", [([1, 2, 3], "moe_tokens_per_expert: 3 numbers for num_experts 8"),
                                             ([1, 1, 1, 1, 1, 1, 1, -1], "moe_tokens_per_expert: -1.0 (allowed"),
                                             ([0] * 8, "moe_tokens_per_expert: all 0")])
def test_bad_tokens_per_expert_one_line(tmp_path, capsys, tokens, expected):
    p = _scenario(tmp_path, _mixtral(num_layers=1, moe_tokens_per_expert=tokens))
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and expected in err and str(p) in err


# -- expert tensor parallelism (parallelism.expert_tensor_parallel_size) ----------------------------
def _tp_spec(**kw) -> TransformerSpec:
    return _spec(tensor_parallel_size=2, sequence_parallel=True, **kw)


def test_etp_splits_the_experts_and_gathers_tokens_over_etp_by_hand():
    # tp 2 (SP: each rank routes T / 2 = 16 tokens, 32 copies), etp 2, ep 1: after the (absent) all-to-all the
    # 32 rows are all-gathered over etp into 64 rows of [h] (2 x 64 x H bytes), the GEMMs run on f_e / 2 columns,
    # and the [64, h] partial sums are reduce-scattered back to 32 rows
    s = _tp_spec(expert_tensor_parallel_size=2)
    g = build_gpt_step(s)
    ops = _ops(g)
    assert ops["L0.fwd.router.gemm"].shape == (16, E, H)
    assert ops["L0.fwd.experts.fc1.gemm"].shape == (64, 2 * FE // 2, H)
    assert ops["L0.fwd.experts.fc2.gemm"].shape == (64, H, FE // 2)
    etp = _coll(g, 0, "etp")
    assert etp == {("all_gather", 2 * 64 * H): 2, ("reduce_scatter", 2 * 64 * H): 2, ("all_gather", 8 * E * 2): 1}
    assert not _coll(g, 0, "ep")
    # parameters on a rank: dense attention / t, router replicated, experts / etp
    dense = 1000 * H // 2 * 2 + H + 2 * ((H * 3 * H + H * H) // 2 + 2 * H + H * E)  # padded V 1024 / 2 per rank
    assert s.vocab_per_rank == 512
    assert s.num_parameters == 2 * 512 * H + H + 2 * ((H * 3 * H + H * H) // 2 + 2 * H + H * E + 4 * 3 * H * FE // 2)
    assert sum(p.numel for p in g.param_groups) == s.num_parameters
    assert dense  # (the unpadded count, for reference)
    # SP: the router weight's gradient differs per TP rank and joins the LayerNorm all-reduce
    assert s.sequence_parallel_params == 2 * (2 * H + E * H) + H


def test_ep_over_the_tensor_parallel_ranks_by_hand():
    # tp 2, etp 1, ep 2 on 2 GPUs (dp 1): the two TP ranks hold 2 experts each at full width; each routes its 16
    # tokens (32 copies), balanced: every rank's experts receive 32 rows; the all-to-alls move 2 x 32 x H bytes
    g = build_gpt_step(_tp_spec(expert_tensor_parallel_size=1, expert_parallel_size=2))
    ops = _ops(g)
    assert ops["L0.fwd.experts.fc1.gemm"].shape == (32, 2 * FE, H)
    assert _coll(g, 0, "ep")[("all_to_all", 2 * 32 * H)] == 4
    assert not [o for o in g.ops if o.meta and o.meta.get("group") in ("etp", "edp")]


def test_etp_one_without_ep_reduces_expert_grads_over_the_tp_ranks():
    # tp 2, etp 1, ep 1: both TP ranks hold every expert (edp = 2 x 1 / 1 = 2): expert gradients all-reduced over edp
    from simulator.graph.builders import moe

    s = _tp_spec(expert_tensor_parallel_size=1)
    assert moe.expert_data_parallel_size(s) == 2
    edp = Counter(o.meta["bytes"] for o in build_gpt_step(s).ops if o.meta and o.meta.get("group") == "edp")
    assert edp == {4 * 4 * H * 2 * FE: 2, 4 * 4 * FE * H: 2}


def test_shared_expert_split_over_tp_with_sp_collectives():
    g = build_gpt_step(_tp_spec(moe_shared_expert_intermediate_size=96))
    ops = _ops(g)
    assert ops["L0.fwd.shared_expert.fc1.gemm"].shape == (T, 2 * 96 // 2, H)  # gathered T tokens, f_s / t
    tp = _coll(g, 0, "tp")
    assert tp[("all_gather", 2 * T * H)] >= 2 and tp[("reduce_scatter", 2 * T * H)] >= 2


@pytest.mark.parametrize("tp,etp,ep,ep_group,edp_group,etp_group", [
    (2, 1, 4, (0, 1, 2, 3), (0, 4), (0,)), (4, 2, 2, (0, 2), (0, 4), (0, 1)), (2, 2, 4, (0, 2, 4, 6), (0,), (0, 1))])
def test_expert_grid_rank_groups_etp_ep_edp(tmp_path, tp, etp, ep, ep_group, edp_group, etp_group):
    p = _scenario(tmp_path, _mixtral(num_layers=1), {"expert_model_parallel_size": ep, "tensor_model_parallel_size": tp,
                                                     "sequence_parallel": True, "expert_tensor_parallel_size": etp},
                  {"preset": "dgx-h100", "nodes": 1})
    hw = resolve_hardware(load_scenario(p))
    assert (hw.ep_group, hw.edp_group, hw.etp_group) == (ep_group, edp_group, etp_group)


def test_mixtral_tp2_etp1_ep4_runs_on_dgx_h100(tmp_path):
    p = _scenario(tmp_path, _mixtral(num_layers=2), {"expert_model_parallel_size": 4, "tensor_model_parallel_size": 2,
                                                     "sequence_parallel": True, "expert_tensor_parallel_size": 1},
                  {"preset": "dgx-h100", "nodes": 1})
    s = run_scenario(load_scenario(p)).summary
    assert s["num_parameters"] == 2 * 1_451_270_144 + 2 * 32000 * 4096 + 4096
    assert {"ep", "tp", "edp"} <= set(s["comm_s_by_group"]) and 0 < s["step_time_s"] < 1.0


# -- ZeRO-1/2 and the distributed optimizer with expert parallelism -------------------------------------
# TINY on ep 2, dp 4 (edp 2): dense D = 2 V h + h + 2 (3 h^2 + h^2 + 2 h + h E) = 161,600 parameters over dp,
# experts P_e = 2 layers x 2 local x 3 h f_e = 98,304 over edp
D, PE = 2 * 1000 * H + H + 2 * (3 * H * H + H * H + 2 * H + H * E), 2 * 2 * 3 * H * FE


def _persist(g) -> dict:
    return {t.name: t.nbytes for t in g.persistent}


def _bytes(g, group, op) -> list[int]:
    return sorted(o.meta["bytes"] for o in g.ops if o.meta and o.meta.get("group") == group
                  and o.meta.get("collective") == op)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_with_ep_shards_expert_states_over_edp_by_hand(stage):
    assert (D, PE) == (161_600, 98_304)
    s = _spec(expert_parallel_size=2, data_parallel_size=4, zero_stage=stage)
    assert s.num_parameters == D + PE
    g = build_gpt_step(s)
    ps = 161_600 // 4 + 98_304 // 2  # 40,400 + 49,152 = 89,552
    m = _persist(g)
    assert m["optimizer.exp_avg"] == m["optimizer.exp_avg_sq"] == m["params.master_fp32"] == 4 * ps
    assert m["params.bf16"] == 2 * (D + PE)
    # expert gradients reduce-scattered over edp, dense ones over dp, both bf16 (DeepSpeed ZeRO-1/2 keeps the
    # gradients in the model dtype); 16-bit parameters all-gathered after
    assert _bytes(g, "edp", "reduce_scatter") == [2 * 2 * FE * H] * 2 + [2 * 2 * H * 2 * FE] * 2
    assert not _bytes(g, "edp", "all_reduce")
    assert sum(_bytes(g, "dp", "reduce_scatter")) == 2 * D
    assert _bytes(g, "edp", "all_gather") == [2 * PE] and sum(_bytes(g, "dp", "all_gather")) == 2 * D
    adam = next(o for o in g.ops if o.name.endswith("adamw"))
    assert adam.flops == pytest.approx(12 * ps)


def test_zero2_keeps_the_expert_gradient_shards():
    g = build_gpt_step(_spec(expert_parallel_size=2, data_parallel_size=4, zero_stage=2))
    rs = [o for o in g.ops if o.meta and o.meta.get("group") == "edp" and o.meta.get("collective") == "reduce_scatter"]
    assert sorted(a.nbytes for o in rs for a in o.allocs) == [2 * 2 * FE * H // 2] * 2 + [2 * 2 * H * 2 * FE // 2] * 2


def test_distributed_optimizer_with_ep_by_hand():
    from simulator.graph.builders.sharding import ShardingSpec, backward_param_order

    sh = ShardingSpec("distributed_optimizer", shard_size=4, grad_bytes=4)
    s = _spec(expert_parallel_size=2, data_parallel_size=4, sharding=sh)
    g = build_gpt_step(s)
    m = _persist(g)
    ps = 161_600 // 4 + 98_304 // 2
    assert m["params.master_fp32"] == m["optimizer.exp_avg"] == 4 * ps and m["grad.ddp_buckets"] == 4 * (D + PE)
    assert sum(_bytes(g, "dp", "reduce_scatter")) == 4 * D  # one bucket of the dense gradients
    assert _bytes(g, "edp", "reduce_scatter") == [4 * 2 * FE * H] * 2 + [4 * 2 * H * 2 * FE] * 2
    assert _bytes(g, "edp", "all_gather") == [2 * PE] and _bytes(g, "dp", "all_gather") == [2 * D]
    # the bucket plan follows the builder's gradient order (MoE names included; experts left out with edp)
    order = [(n, k) for n, _, k in backward_param_order(_spec())]
    assert order == [(p.name, p.numel) for p in build_gpt_step(_spec()).param_groups]
    s2 = _spec(moe_shared_expert_intermediate_size=96, moe_shared_expert_gate=True)
    assert [(n, k) for n, _, k in backward_param_order(s2)] == [(p.name, p.numel)
                                                                for p in build_gpt_step(s2).param_groups]
    assert sum(k for _, _, k in backward_param_order(s, experts=False)) == D


def test_zero_with_ep_on_a_cluster_by_hand(tmp_path):
    # Mixtral 1 layer, ep 4 on 8 H100 (edp 2), ZeRO-1: the optimizer state is 4 bytes x (dense / 8 + experts / 2)
    p = _scenario(tmp_path, _mixtral(num_layers=1), {"expert_model_parallel_size": 4},
                  {"preset": "dgx-h100", "nodes": 1}, )
    d = yaml.safe_load(p.read_text())
    d["zero_optimization"] = {"stage": 1}
    p.write_text(yaml.safe_dump(d))
    spec = transformer_spec(load_scenario(p))
    dense = 2 * 4096**2 + 2 * 4096 * 1024 + 4096 * 8 + 2 * 4096 + 2 * 32000 * 4096 + 4096
    experts = 2 * 3 * 4096 * 14336
    assert spec.num_parameters == dense + experts
    g = build_gpt_step(spec)
    assert _persist(g)["optimizer.exp_avg"] == 4 * (-(-dense // 8) + experts // 2)
    assert run_scenario(load_scenario(p)).summary["step_time_s"] > 0


def test_zero3_with_ep_refused_one_line(tmp_path, capsys):
    p = _scenario(tmp_path, _mixtral(num_layers=1), {"expert_model_parallel_size": 4},
                  {"preset": "dgx-h100", "nodes": 1})
    d = yaml.safe_load(p.read_text())
    d["zero_optimization"] = {"stage": 3}
    p.write_text(yaml.safe_dump(d))
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "zero_optimization.stage: 3 with parallelism.expert_model_parallel_size 4" in err


def test_zero2_accumulation_with_expert_parallelism_is_refused(tmp_path, capsys):
    """ZeRO-2 reduces every micro-batch (dense gradients over dp); the expert gradients over edp would be reduced
    once per step here, so the combination is refused rather than half modelled."""
    d = yaml.safe_load(_scenario(tmp_path, _mixtral(num_layers=1), {"expert_model_parallel_size": 4},
                                 {"preset": "dgx-h100", "nodes": 1},
                                 {"global_batch_size": 16}).read_text())
    d["zero_optimization"] = {"stage": 2}
    p = tmp_path / "z.yaml"
    p.write_text(yaml.safe_dump(d))
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "zero_optimization.stage: 2 with gradient accumulation and experts" in err


def test_expert_load_beyond_one_over_topk_is_refused(tmp_path, capsys):
    """Each token goes to k different experts, so one expert gets at most T of the k T routed tokens: a share
    above 1/k is impossible and refused (was accepted as an 8x load)."""
    p = _scenario(tmp_path, _mixtral(num_layers=1, moe_tokens_per_expert=[8, 0, 0, 0, 0, 0, 0, 0]),
                  {"expert_model_parallel_size": 8}, {"preset": "dgx-h100", "nodes": 1})
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "more than 1 / moe_router_topk = 0.5" in err


def test_moe_layer_freq_bad_values_one_line(tmp_path, capsys):
    for bad in (0, [True, False]):
        p = _scenario(tmp_path, _mixtral(num_layers=2, moe_layer_freq=bad))
        assert main(["run", str(p)]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "(allowed: an integer >= 1, or a list of 0 / 1, one per layer)" in err


def test_expert_load_without_expert_parallelism_is_flagged(tmp_path):
    """With ep 1 one rank runs every expert: the split changes nothing, and the run says so (it used to drop the
    balanced-routing line and say nothing)."""
    p = _scenario(tmp_path, _mixtral(num_layers=1, seq_length=512, moe_tokens_per_expert=[2, 1, 1, 1, 1, 1, 1, 0]))
    s = run_scenario(load_scenario(p)).summary
    assert any("moe_tokens_per_expert has no effect with expert_model_parallel_size 1" in w for w in s["warnings"])
