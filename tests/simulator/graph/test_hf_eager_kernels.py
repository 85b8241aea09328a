"""Hugging Face GPT-2 eager kernels (``model.kernels: hf_eager``, transformers 4.15 GPT2Attention._attn, gelu_new,
resid_dropout + add): every kernel's exact bytes and FLOPs on a tiny fp32 case worked out by hand, what
autograd keeps for backward, and bad input."""

from __future__ import annotations

import pytest

from simulator.api import build_graph
from simulator.config.loader import scenario_from_dict
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.ops import CostClass, Phase
from tests.conftest import refused_in_one_line

# b = 2, s = 4, h = 8, a = 4 (d = 2), fp32 (4 bytes): B = b a = 8 score matrices, n = B s^2 = 128 elements (512
# bytes), the s x s causal mask 16 bytes (uint8 / bool), one of Q, K, V or the context B s d = 64 elements (256
# bytes); T = b s = 8 tokens, the MLP [T, f] = 8 x 32 = 256 elements (1,024 bytes); [T, h] = 64 elements.
TINY = dict(num_layers=1, hidden_size=8, num_attention_heads=4, seq_length=4, vocab_size=16, ffn_hidden_size=32,
            micro_batch_size=2, precision="fp32", attention_backend="unfused", kernels="hf_eager",
            attention_dropout=0.1, hidden_dropout=0.1)


def _ops(**kw):
    g = build_gpt_step(TransformerSpec(**{**TINY, **kw}))
    return {op.name: op for op in g.ops}, g


def _check(ops, want):
    for name, (flops, r, w) in want.items():
        op = ops[name]
        assert (op.flops, op.bytes_read, op.bytes_written) == (flops, r, w), name


def test_attention_forward_kernels_by_hand():
    ops, _ = _ops()
    _check(ops, {  # name: (flops, bytes read, bytes written)
        "L0.fwd.attn.q_contig": (0, 256, 256),  # torch.matmul's reshape copies of the permuted heads
        "L0.fwd.attn.k_contig": (0, 256, 256),
        "L0.fwd.attn.v_contig": (0, 256, 256),
        "L0.fwd.attn.qk_bmm": (2 * 8 * 16 * 2, 2 * 256, 512),
        "L0.fwd.attn.scale_div": (0, 512, 512),
        "L0.fwd.attn.causal_mask.bool": (0, 16, 16),
        "L0.fwd.attn.causal_where": (0, 512 + 16, 512),
        "L0.fwd.attn.softmax": (0, 512, 512),  # whole rows, not the lower triangle
        "L0.fwd.attn.dropout": (0, 512, 512 + 128),
        "L0.fwd.attn.pv_bmm": (2 * 8 * 16 * 2, 512 + 256, 256),
    })
    assert ops["L0.fwd.attn.softmax"].cost_class == CostClass.SOFTMAX
    assert ops["L0.fwd.attn.qk_bmm"].shape == (4, 4, 2, 8)
    assert "L0.fwd.attn.scale_mask_softmax" not in ops  # no Megatron fused softmax


def test_attention_backward_kernels_by_hand():
    ops, _ = _ops()
    _check(ops, {
        "L0.bwd.attn.pv_bmm.dgrad_probs": (512, 512, 512),
        "L0.bwd.attn.pv_bmm.dgrad_v": (512, 768, 256),
        "L0.bwd.attn.dropout.dgrad": (0, 512 + 128, 512),
        "L0.bwd.attn.softmax.dgrad": (0, 2 * 512, 512),
        "L0.bwd.attn.causal_where.dgrad": (0, 512 + 16, 512),
        "L0.bwd.attn.scale_div.dgrad": (0, 512, 512),
        "L0.bwd.attn.qk_bmm.dgrad_q": (512, 768, 256),
        "L0.bwd.attn.qk_bmm.dgrad_k": (512, 768, 256),
        "L0.bwd.attn.dqkv.cat": (0, 3 * 256, 4 * 8 * 24),
    })


def test_gelu_new_eager_kernels_by_hand():
    """8 forward kernels reading 10 and writing 8 [T, f] tensors; 11 backward kernels reading 17, writing 11."""
    ops, _ = _ops()
    fwd = [op for op in ops.values() if op.phase == Phase.FWD and ".gelu." in op.name]
    bwd = [op for op in ops.values() if op.phase == Phase.BWD and ".gelu." in op.name]
    assert [op.name.split(".gelu.")[1] for op in fwd] == ["pow", "mul_coeff", "add_x", "mul_sqrt_2_pi", "tanh",
                                                         "add_one", "mul_half_x", "mul"]
    assert (len(fwd), sum(op.bytes_read for op in fwd), sum(op.bytes_written for op in fwd)) == (8, 10240, 8192)
    assert (len(bwd), sum(op.bytes_read for op in bwd), sum(op.bytes_written for op in bwd)) == (11, 17408, 11264)
    assert all(op.cost_class == CostClass.ELEMENTWISE and op.flops == 0 for op in fwd + bwd)
    assert "L0.fwd.gelu" not in ops and "L0.bwd.gelu.dgrad" not in ops  # no single fused GELU kernel


def test_residual_dropout_then_add():
    ops, _ = _ops()
    _check(ops, {
        "L0.fwd.residual1.dropout": (0, 256, 256 + 64),  # [T, h] fp32 and its 1-byte mask
        "L0.fwd.residual1": (0, 2 * 256, 256),
        "L0.bwd.residual1.dropout.dgrad": (0, 256 + 64, 256),
    })


def test_autograd_keeps_the_tanh_and_both_factors():
    """Without recompute the backward reads gelu_new's tanh output, 1 + tanh and 0.5 x (3 x 1,024 bytes beyond
    the c_fc output the fused GELU keeps); the dropout outputs, masks and softmax output as Megatron's core."""
    _, g = _ops()
    bwd_uses = {u for op in g.ops if op.phase == Phase.BWD for u in op.uses}
    kept = {op.name.split("L0.fwd.")[1] for op in g.ops if op.phase == Phase.FWD and op.layer == 0
            for t in op.allocs if t.name in bwd_uses}
    assert {"gelu.tanh", "gelu.add_one", "gelu.mul_half_x", "attn.softmax", "attn.dropout"} <= kept
    assert not {"gelu.pow", "gelu.add_x", "attn.scale_div", "attn.causal_where"} & kept


def test_full_recompute_reruns_the_eager_forward():
    ops, _ = _ops(recompute="full")
    assert "L0.bwd.gelu.tanh" in ops and "L0.bwd.attn.causal_where" in ops  # the recomputed forward, in backward


def test_fused_default_unchanged():
    ops, _ = _ops(kernels="fused")
    assert "L0.fwd.attn.scale_mask_softmax" in ops and "L0.fwd.gelu" in ops and "L0.fwd.attn.scale_div" not in ops


@pytest.mark.parametrize("kw,needle", [
    (dict(attention_backend="flash", precision="bf16"), "kernels hf_eager needs attention_backend unfused"),
    (dict(swiglu=True), "kernels hf_eager with swiglu is not modelled"),
    (dict(kernels="eager"), "kernels must be one of"),
])
def test_builder_refuses(kw, needle):
    with pytest.raises(ValueError, match=needle):
        TransformerSpec(**{**TINY, **kw})


BASE = {
    "name": "hf",
    "hardware": {"gpu": "a100-pcie-80gb"},
    "model": {"num_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 128, "vocab_size": 512,
              "attention_backend": "unfused", "kernels": "hf_eager"},
    "training": {"micro_batch_size": 1, "precision": "tf32"},
    "run": {"steps": 2, "warmup_steps": 1},
}


@pytest.mark.parametrize("change,needle", [
    ({"model": {**BASE["model"], "attention_backend": "flash"}, "training": {"micro_batch_size": 1, "precision": "bf16"}},
     "kernels: hf_eager with attention_backend flash"),  # bf16: tf32 with flash is a problem of its own
    ({"model": {**BASE["model"], "swiglu": True}}, "kernels: hf_eager with swiglu is not modelled"),
    ({"model": {**BASE["model"], "kernels": "eager"}}, "model.kernels"),
    ({"parallelism": {"tensor_model_parallel_size": 2}, "hardware": {"gpu": "a100-pcie-80gb",
                                                                     "cluster": {"preset": "4x-a100-pcie"}}},
     "model.kernels: hf_eager with tensor or context parallelism is not modelled"),
])
def test_bad_input_one_line_exit_2(tmp_path, capsys, change, needle):
    err = refused_in_one_line(tmp_path, capsys, {**BASE, **change})
    assert needle in err, err


def test_scenario_key_reaches_the_builder():
    names = {op.name for op in build_graph(scenario_from_dict(BASE)).ops}
    assert "L0.fwd.attn.causal_where" in names and "L0.fwd.gelu.tanh" in names


def test_conv1d_addmm_copies_the_bias_first():
    """PyTorch 1.10 addmm: the bias expanded to [T, out] is copied into the result, the GEMM (beta = 1) reads it
    back. qkv: T = 8, out = 3 h = 24: the copy reads the 24-float bias (96 B), writes 8 x 24 x 4 = 768 B; the GEMM
    reads x (8 x 8), W (8 x 24) and that result: 4 x (64 + 192 + 192) = 1,792 B."""
    ops, _ = _ops()
    _check(ops, {"L0.fwd.qkv.bias_expand": (0, 96, 768), "L0.fwd.fc1.bias_expand": (0, 128, 1024)})
    assert (ops["L0.fwd.qkv.gemm"].bytes_read, ops["L0.fwd.qkv.gemm"].bytes_written) == (1792, 768)
    fused, _ = _ops(kernels="fused")
    assert fused["L0.fwd.qkv.gemm"].bytes_read == 4 * (64 + 192) and "L0.fwd.qkv.bias_expand" not in fused
    nobias, _ = _ops(bias=False)
    assert "L0.fwd.qkv.bias_expand" not in nobias
