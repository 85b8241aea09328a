"""Unfused (Megatron-LM 2020-2022) attention: its kernels' exact FLOPs and bytes on a tiny case, the
activation memory of Korthikanti et al. 2023 (Table 2: sbh (34 + 5 a s / h) per layer), and bad input."""

from __future__ import annotations

import pytest

from simulator.api import build_graph
from simulator.config.loader import scenario_from_dict
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.ops import CostClass, Phase
from tests.conftest import refused_in_one_line

# b = 2, s = 4, h = 8, a = 4 (d = 2): B = b a = 8 score matrices, n = B s^2 = 128 elements, tri = B s (s + 1) / 2
# = 80 on or below the diagonal, one of Q, K, V or the context: B s d = 64 elements (2 bytes each)
TINY = dict(num_layers=1, hidden_size=8, num_attention_heads=4, seq_length=4, vocab_size=16, ffn_hidden_size=32,
            micro_batch_size=2, precision="bf16", attention_backend="unfused")


def _ops(**kw):
    g = build_gpt_step(TransformerSpec(**{**TINY, **kw}))
    return {op.name: op for op in g.ops}, g


def test_forward_kernels_by_hand():
    ops, _ = _ops(attention_dropout=0.1)
    want = {  # name: (flops, shape, bytes read, bytes written)
        "L0.fwd.attn.qk_bmm": (2 * 8 * 16 * 2, (4, 4, 2, 8), 2 * 2 * 64, 2 * 128),
        "L0.fwd.attn.scale_mask_softmax": (0, (), 2 * 80, 2 * 128),
        "L0.fwd.attn.dropout": (0, (), 2 * 128, 2 * 128 + 128),
        "L0.fwd.attn.pv_bmm": (2 * 8 * 16 * 2, (4, 2, 4, 8), 2 * (128 + 64), 2 * 64),
    }
    for name, (flops, shape, r, w) in want.items():
        op = ops[name]
        assert (op.flops, op.shape, op.bytes_read, op.bytes_written) == (flops, shape, r, w), name
    assert ops["L0.fwd.attn.qk_bmm"].cost_class == CostClass.GEMM
    assert ops["L0.fwd.attn.scale_mask_softmax"].cost_class == CostClass.SOFTMAX
    assert not any(op.cost_class in (CostClass.ATTENTION_FWD, CostClass.ATTENTION_BWD) for op in ops.values())


def test_backward_kernels_by_hand():
    ops, _ = _ops(attention_dropout=0.1)
    want = {
        "L0.bwd.attn.pv_bmm.dgrad_probs": (512, (4, 4, 2, 8), 256, 256),
        "L0.bwd.attn.pv_bmm.dgrad_v": (512, (4, 2, 4, 8), 384, 128),
        "L0.bwd.attn.dropout.dgrad": (0, (), 256 + 128, 256),
        "L0.bwd.attn.scale_mask_softmax.dgrad": (0, (), 2 * 2 * 80, 256),
        "L0.bwd.attn.qk_bmm.dgrad_q": (512, (4, 2, 4, 8), 384, 128),
        "L0.bwd.attn.qk_bmm.dgrad_k": (512, (4, 2, 4, 8), 384, 128),
        "L0.bwd.attn.dqkv.cat": (0, (), 3 * 2 * 64, 2 * 8 * 24),  # into the [T, 3h] QKV gradient, T = 8
    }
    for name, (flops, shape, r, w) in want.items():
        op = ops[name]
        assert (op.flops, op.shape, op.bytes_read, op.bytes_written) == (flops, shape, r, w), name
    # the whole s x s square in all four GEMMs: 4 B s^2 d forward, 8 B s^2 d backward
    core = [op for op in ops.values() if ".attn." in op.name and op.cost_class == CostClass.GEMM]
    assert sum(op.flops for op in core if op.phase == Phase.FWD) == 4 * 8 * 16 * 2
    assert sum(op.flops for op in core if op.phase == Phase.BWD) == 8 * 8 * 16 * 2


def test_no_dropout_kernel_without_attention_dropout():
    ops, _ = _ops()
    assert "L0.fwd.attn.dropout" not in ops and "L0.bwd.attn.dropout.dgrad" not in ops
    assert ops["L0.bwd.attn.pv_bmm.dgrad_v"].uses[0] == ops["L0.fwd.attn.scale_mask_softmax"].allocs[0].name


def _saved_for_backward(g) -> int:
    """Bytes of the tensors layer 0's forward allocates that a backward op reads (autograd's saved tensors)."""
    bwd_uses = {u for op in g.ops if op.phase == Phase.BWD for u in op.uses}
    return sum(t.nbytes for op in g.ops if op.phase == Phase.FWD and op.layer == 0 for t in op.allocs
               if t.name in bwd_uses)


S, B_, H, A = 4, 2, 8, 4
SBH = S * B_ * H  # 64
#: the two LayerNorms' fp32 mean and rstd (8 B per token each), read by their backward; Korthikanti's sbh terms
#: leave them out
STATS = 2 * 8 * S * B_  # 128
#: the flash kernel's fp32 log-sum-exp, 4 B per head per token (not with the unfused core)
LSE = 4 * A * S * B_  # 128


def test_activation_memory_is_korthikanti_table_2():
    """sbh (34 + 5 a s / h) bytes per layer with attention and hidden dropout (Korthikanti et al. 2023,
    section 4.1): 34 x 64 + 5 x 4 x 16 x 2 = 2,816, plus the LayerNorm statistics (``STATS``, 128): 2,944."""
    _, g = _ops(attention_dropout=0.1, hidden_dropout=0.1)
    assert _saved_for_backward(g) == SBH * (34 + 5 * A * S / H) + STATS == 2944


def test_selective_recompute_keeps_34_sbh_and_reruns_the_core():
    """Table 2, selective recompute: 34 sbh (and the LayerNorm statistics); the backward re-runs the core's four
    forward kernels."""
    ops, g = _ops(attention_dropout=0.1, hidden_dropout=0.1, recompute="selective")
    assert _saved_for_backward(g) == 34 * SBH + STATS
    for k in ("qk_bmm", "scale_mask_softmax", "dropout", "pv_bmm"):
        assert ops[f"L0.bwd.attn.recompute.{k}"].phase == Phase.BWD


def test_without_dropout_masks_and_dropout_output():
    """No dropout: no 1-byte masks (2 sbh) and only the softmax output of the core (2 a s^2 b)."""
    _, g = _ops()
    assert _saved_for_backward(g) == 32 * SBH + 2 * A * S * S * B_ + STATS


def test_flash_default_saves_no_s_squared_term():
    _, g = _ops(attention_backend="flash")
    # flash keeps its output (2 sbh) and its log-sum-exp instead of the s^2 tensors; no dropout masks: 32 + 2 sbh
    assert _saved_for_backward(g) == 34 * SBH + STATS + LSE


def test_batched_gemm_prices_its_tiles_over_the_batch():
    from hardware_models import presets
    from hardware_models.profile import EfficiencyProfile, GemmEfficiency
    from simulator.cost.roofline import RooflineCostModel

    gpu = presets.get("gpus", "a100-sxm4-80gb")
    prof = EfficiencyProfile(name="t", gpu=gpu.name, gemm={"bf16": GemmEfficiency(0.5, tile_m=128, tile_n=128)},
                             attention_efficiency={}, memory_bandwidth_bytes_per_s={"elementwise": 1e12})
    cm = RooflineCostModel(gpu, prof)
    # 8 x (2 x 2 tiles) = 32 tiles on 108 SMs: 32/108 waves of 2 * 128 * 128 * 64 FLOPs at 0.5 x peak / 108
    t = cm.gemm_compute_s(256, 256, 64, "bf16", batch=8)
    assert t == pytest.approx(32 / 108 * 2 * 128 * 128 * 64 / (gpu.peak("bf16") / 108 * 0.5))
    ops, _ = _ops()
    op = ops["L0.fwd.attn.qk_bmm"]
    c, m, _ = cm.split_s(op)
    assert m == op.bytes_moved / 1e12 and c == cm.gemm_compute_s(4, 4, 2, "bf16", batch=8)


BASE = {
    "name": "unfused",
    "hardware": {"gpu": "a100-sxm4-80gb", "cluster": {"preset": "dgx-a100", "nodes": 1}},
    "model": {"num_layers": 2, "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 1024,
              "vocab_size": 32000, "attention_backend": "unfused"},
    "training": {"micro_batch_size": 1, "precision": "fp16"},
    "parallelism": {"tensor_model_parallel_size": 8},
    "run": {"steps": 2, "warmup_steps": 1},
}


def test_unfused_is_slower_than_flash_and_the_gap_grows_faster_than_the_sequence():
    from simulator.api import run_scenario

    def step(backend, s):  # one GPU, GPU-bound (not launch-bound)
        m = {**BASE["model"], "hidden_size": 2048, "attention_backend": backend, "seq_length": s}
        cfg = {**BASE, "hardware": {"gpu": "a100-sxm4-80gb"}, "model": m, "parallelism": {},
               "training": {"micro_batch_size": 8 * 2048 // s, "precision": "fp16"}}
        return run_scenario(scenario_from_dict(cfg)).summary["step_time_s"]

    gap1 = step("unfused", 512) - step("flash", 512)
    gap4 = step("unfused", 2048) - step("flash", 2048)
    # the same tokens per step: the unfused core's [b, a, s, s] traffic per token grows with s on top of the FLOPs
    # per token that both backends share, so the gap grows with s. (Not 2x for 4x s: the flash kernel is priced at
    # 35% / 30% of peak and the unfused batched GEMMs at the GEMM tile rate, so the shared FLOPs per token, also
    # growing with s, cost flash more.)
    assert 0 < gap1 < gap4


@pytest.mark.parametrize("change,needle", [
    ({"parallelism": {"tensor_model_parallel_size": 1, "context_parallel_size": 2}},
     "parallelism.context_parallel_size: 2 > 1 with model.attention_backend unfused is not modelled"),
    ({"model": {**BASE["model"], "group_query_attention": True, "num_query_groups": 8}},
     "attention_backend: unfused with group_query_attention is not modelled"),
    ({"model": {**BASE["model"], "attention_backend": "sdpa"}}, "model.attention_backend"),
    ({"model": {**BASE["model"], "attention_dropout": 1.0}}, "model.attention_dropout"),
])
def test_bad_input_one_line_exit_2(tmp_path, capsys, change, needle):
    err = refused_in_one_line(tmp_path, capsys, {**BASE, **change})
    assert needle in err, err


def test_scenario_keys_reach_the_builder():
    g = build_graph(scenario_from_dict({**BASE, "model": {**BASE["model"], "attention_dropout": 0.1,
                                                          "hidden_dropout": 0.1}}))
    names = {op.name for op in g.ops}
    assert "L0.fwd.attn.dropout" in names and "L0.bwd.residual2.dropout.dgrad" in names
