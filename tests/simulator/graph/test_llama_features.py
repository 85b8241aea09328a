"""Llama-style decoder features (GQA, SwiGLU, RMSNorm, RoPE, untied head): counts, kernels, FLOPs."""

from __future__ import annotations

import dataclasses

import pytest

from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step

# tiny Llama-like model: h 64, a 8 heads of d 8, g 2 K/V groups, f 160, V 1000, 2 layers, s 16, b 2
TINY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 8, "num_query_groups": 2, "seq_length": 16,
            "vocab_size": 1000, "ffn_hidden_size": 160, "micro_batch_size": 2, "tied_embeddings": False, "bias": False,
            "swiglu": True, "normalization": "RMSNorm", "position_embedding": "rope", "precision": "bf16"}
T = 2 * 16


def spec(**kw) -> TransformerSpec:
    return TransformerSpec(**{**TINY, **kw})


def ops(g, suffix):
    """Ops whose name is ``suffix`` or ends with ``.suffix`` (names are ``L<layer>.<phase>.<kernel>``)."""
    return [op for op in g.ops if op.name == suffix or op.name.endswith("." + suffix)]


def test_tiny_llama_parameter_count_by_hand():
    s = spec()
    # per layer: q/k/v 64 x (64 + 2*2*8) = 6144, o 64*64 = 4096, gate+up+down 3*64*160 = 30720, 2 RMSNorms 128
    assert s.layer_params == 6144 + 4096 + 30720 + 128 == 41088
    h, g, d, f = 64, 2, 8, 160
    assert s.layer_params == 2 * h * h + 2 * h * g * d + 3 * h * f + 2 * h  # the closed form
    # token embedding 64000 + 2 layers + final RMSNorm 64 + untied head 64000; no position table
    assert s.num_parameters == 64000 + 2 * 41088 + 64 + 64000 == 210240
    graph = build_gpt_step(s)
    assert sum(p.numel for p in graph.param_groups) == 210240
    assert not any("wpe" in p.name or p.name.endswith("bias") for p in graph.param_groups)


def test_published_llama_counts():
    """Llama-2-7B (HF card: 6.74B; exact 6,738,415,616) and Llama-3.1-8B (8,030,261,248) from their shapes."""
    llama2 = {"num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_query_groups": None, "vocab_size": 32000,
                  "ffn_hidden_size": 11008}
    n = spec(**llama2).num_parameters
    assert n == 6_738_415_616 and abs(n / 6.74e9 - 1) < 1e-3
    assert spec(**{**llama2, "num_query_groups": 8, "vocab_size": 128256, "ffn_hidden_size": 14336}).num_parameters \
        == 8_030_261_248


def test_qkv_gemm_shapes_with_gqa():
    g = build_gpt_step(spec())
    qo = 64 + 2 * 2 * 8  # h + 2 g d = 96
    assert ops(g, "L0.fwd.qkv.gemm")[0].shape == (T, qo, 64)
    assert ops(g, "L0.bwd.qkv.dgrad")[0].shape == (T, 64, qo)
    assert ops(g, "L0.bwd.qkv.wgrad")[0].shape == (qo, 64, T)
    att = ops(g, "L0.fwd.attn")[0]
    assert att.flops == 4 * 2 * 8 * 16**2 * 8 / 2  # per query head, as multi-head attention
    assert att.bytes_read == 2 * T * qo  # q plus the smaller grouped k, v
    mha = ops(build_gpt_step(spec(num_query_groups=None)), "L0.fwd.attn")[0]
    assert mha.flops == att.flops and mha.bytes_read == 2 * T * 3 * 64
    # tensor parallel 2: column-parallel QKV has 96 / 2 outputs, 1 K/V group per rank
    tp = build_gpt_step(spec(tensor_parallel_size=2))
    assert ops(tp, "L0.fwd.qkv.gemm")[0].shape == (T, 48, 64)
    with pytest.raises(ValueError, match="num_query_groups"):
        spec(num_query_groups=2, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="num_query_groups \\(3\\) must divide"):
        spec(num_query_groups=3)


def test_swiglu_rmsnorm_rope_kernel_set():
    g = build_gpt_step(spec())
    names = {op.name.split(".", 2)[2] for op in g.ops if op.name.startswith("L0.")}
    assert {"swiglu", "swiglu.dgrad", "rope", "rope.dgrad", "ln1.dgamma"} <= names
    assert not {"gelu", "gelu.dgrad", "ln1.dgamma_dbeta"} & names
    assert not ops(g, "pos_embed.dgrad")
    assert ops(g, "L0.fwd.fc1.gemm")[0].shape == (T, 2 * 160, 64)
    assert ops(g, "L0.fwd.fc2.gemm")[0].shape == (T, 64, 160)
    sw, swb = ops(g, "L0.fwd.swiglu")[0], ops(g, "L0.bwd.swiglu.dgrad")[0]
    assert (sw.bytes_read, sw.bytes_written) == (2 * 2 * T * 160, 2 * T * 160)
    assert (swb.bytes_read, swb.bytes_written) == (2 * 3 * T * 160, 2 * 2 * T * 160)
    rope = ops(g, "L0.fwd.rope")[0]
    assert rope.bytes_written == 2 * T * (64 + 2 * 8)  # rotated q and k (not v)
    assert len(ops(g, "fwd.rope")) == len(ops(g, "bwd.rope.dgrad")) == 2
    # RMSNorm keeps one fp32 statistic per token, LayerNorm two
    ln = build_gpt_step(spec(normalization="LayerNorm"))
    def stats(graph):
        return [t.nbytes for t in ops(graph, "L0.fwd.ln1")[0].allocs if "stats" in t.name]

    assert stats(g) == [4 * T] and stats(ln) == [8 * T]
    assert ops(g, "L0.fwd.ln1")[0].bytes_moved == ops(ln, "L0.fwd.ln1")[0].bytes_moved  # same traffic


def test_model_flops_match_megatron_formula():
    """Megatron-LM num_floating_point_operations per sample (causal attention halved, as our MFU)."""
    s = spec()
    L, h, a, g, f, V, sq = 2, 64, 8, 2, 160, 1000, 16
    megatron = 12 * sq * L * h * h * ((1 + g / a + sq / h / 2) + (f / h) * 3 / 2 + V / (2 * L * h))
    assert s.model_flops_per_sample() == pytest.approx(megatron, rel=1e-12)


def test_gpt2_defaults_unchanged():
    base = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16, "vocab_size": 1000,
                "ffn_hidden_size": 256, "micro_batch_size": 2}
    s = TransformerSpec(**base)
    assert (s.qkv_out_size, s.fc1_out_size, s.position_table_rows) == (192, 256, 16)
    assert s == dataclasses.replace(s, num_query_groups=None, swiglu=False, normalization="LayerNorm")


@pytest.mark.parametrize("kw", [{"recompute": "full"}, {"recompute": "selective"}, {"bias": True},
                                {"qkv_bias": True}, {"tensor_parallel_size": 2, "sequence_parallel": True},
                                {"tied_embeddings": True, "num_micro_batches": 2}])
def test_param_groups_sum_to_count_in_every_mode(kw):
    """Every parameter tensor's gradient is produced once: the groups sum to num_parameters."""
    s = spec(**kw)
    g = build_gpt_step(s)
    assert sum(p.numel for p in g.param_groups) == s.num_parameters
    rope = [op for op in g.ops if op.name.split(".", 2)[-1] == "rope"]  # forward, and recomputed in backward
    assert len(rope) == 2 * s.num_micro_batches * (2 if s.recompute == "full" else 1)
