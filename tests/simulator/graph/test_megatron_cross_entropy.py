"""The LM head's loss (``training.cross_entropy``): Megatron-LM's vocab-parallel cross-entropy against PyTorch's
``F.cross_entropy``, the fp32 logits-sized tensors each keeps, worked out by hand on a tiny model.

Megatron-LM (NVIDIA/Megatron-LM@00611e6 megatron/core/tensor_parallel/cross_entropy.py, and @0cb4a9c
megatron/core/fusions/fused_cross_entropy.py with --cross-entropy-loss-fusion): ``logits.float()`` once (4 B per
logit), then the shift, ``exp`` and division in place; ``ctx.save_for_backward(exp_logits, ...)``; backward turns
that softmax into the gradient in place and casts it to bf16 (2 B). PyTorch's ``F.cross_entropy`` =
``log_softmax`` (output saved, 4 B) + ``nll_loss`` (its backward a fresh fp32 gradient, 4 B) and the log-softmax
gradient (4 B) beside them."""

from __future__ import annotations

import pytest

from simulator.api import run_scenario, transformer_spec
from simulator.config.loader import scenario_from_dict
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.ops import Phase
from tests.conftest import refused_in_one_line

T, V = 256, 16384  # tokens of the micro-batch (1 x 256), vocabulary (a multiple of 128: no padding)
TINY = dict(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=T, vocab_size=V, ffn_hidden_size=256,
            micro_batch_size=1, precision="bf16", tied_embeddings=False, bias=False)
SCENARIO = {"name": "ce", "hardware": {"gpu": "h100-sxm-80gb"},
            "model": {"num_layers": 1, "hidden_size": 64, "num_attention_heads": 4, "seq_length": T,
                      "vocab_size": V, "untie_embeddings_and_output_weights": True},
            "training": {"micro_batch_size": 1, "global_batch_size": 1, "precision": "bf16"},
            "run": {"steps": 1, "warmup_steps": 0}}


def _logits_sized(impl: str, precision: str = "bf16") -> tuple[list[int], list[int]]:
    """Sizes of the fp32 logits-sized tensors (>= 4 T V bytes) the forward allocates and backward reads, and of
    those the backward allocates."""
    kw = {"attention_backend": "unfused"} if precision == "fp32" else {}  # flash has 16-bit kernels only
    g = build_gpt_step(TransformerSpec(**{**TINY, **kw, "precision": precision, "cross_entropy": impl}))
    bwd_uses = {u for op in g.ops if op.phase == Phase.BWD for u in op.uses}
    saved = [t.nbytes for op in g.ops if op.phase == Phase.FWD for t in op.allocs
             if t.name in bwd_uses and t.nbytes >= 4 * T * V]
    made = [t.nbytes for op in g.ops if op.phase == Phase.BWD for t in op.allocs if t.nbytes >= 2 * T * V]
    return saved, made


@pytest.mark.parametrize("impl", ["megatron", "megatron_fused"])
def test_megatron_keeps_one_fp32_softmax_and_makes_only_the_bf16_gradient(impl):
    saved, made = _logits_sized(impl)
    assert saved == [4 * T * V]  # the softmax, made in place in the fp32 copy of the logits
    assert made == [2 * T * V]  # the bf16 logits gradient (grad_input.to(logits_dtype)); the fp32 one is in place


def test_pytorch_keeps_the_log_softmax_and_makes_two_fp32_gradients():
    saved, made = _logits_sized("pytorch")
    assert saved == [4 * T * V]
    assert sorted(made) == [2 * T * V, 4 * T * V, 4 * T * V]  # nll_loss.dx, log_softmax.dx, their bf16 cast


def test_fp32_megatron_makes_no_logits_sized_tensor_in_backward():
    """fp32: ``.float()`` is a no-op, the LM head's own fp32 output becomes the softmax and then the gradient."""
    saved, made = _logits_sized("megatron", "fp32")
    assert saved == [4 * T * V] and made == []


def _peak(impl: str) -> int:
    cfg = scenario_from_dict({**SCENARIO, "training": {**SCENARIO["training"], "cross_entropy": impl}})
    return run_scenario(cfg).summary["peak_memory_allocated_bytes"]


@pytest.mark.parametrize("impl", ["megatron", "megatron_fused"])
def test_peak_by_hand(impl):
    """The logits dominate this model's peak (V = 16384, h = 64). PyTorch's peak is at the log-softmax backward:
    its saved output, the NLL gradient and the new gradient, 12 T V; Megatron's is 4 T V + 2 T V (the fp32 softmax
    beside the bf16 logits in forward, or beside its bf16 gradient in backward), everything else equal:
    6 T V = 25,165,824 B less."""
    assert _peak("pytorch") - _peak(impl) == 6 * T * V == 25_165_824


@pytest.mark.parametrize("impl,passes,reduces", [
    # unfused: max, shift, exp, row sum, division (+ the cast); the max, then the target logits and the sums
    ("megatron", {"logits.float": 6, "ce.logits_max": 4, "ce.sub_max": 8, "ce.exp": 8, "ce.sum_exp": 4,
                  "ce.normalize": 8}, [4, 4, 4]),
    # fused (@0cb4a9c): the max in the cast, the shift and exp in one in-place pass, the row sum outside the
    # compiled graphs (its own pass), the division; one all-reduce of the targets and sums
    ("megatron_fused", {"logits.float": 6, "ce.exp": 8, "ce.sum_exp": 4, "ce.normalize": 8}, [4, 8])])
def test_megatron_passes_and_tp_all_reduces(impl, passes, reduces):
    """TP 2: V / 2 logits per rank; bytes per logit of each logits-sized forward pass, and the fp32 all-reduces
    (bytes per token) over the TP group (megatron/core/tensor_parallel/cross_entropy.py _VocabParallelCrossEntropy,
    fusions/fused_cross_entropy.py: ``torch.cat((predicted_logits, sum_exp_logits))``, one all-reduce)."""
    g = build_gpt_step(TransformerSpec(**{**TINY, "cross_entropy": impl, "tensor_parallel_size": 2}))
    n = T * V // 2
    fwd = [op for op in g.ops if op.phase == Phase.FWD and op.layer == -1]
    got = {op.name.removeprefix("fwd."): round(op.bytes_read + op.bytes_written) // n for op in fwd
           if op.bytes_read + op.bytes_written >= n and "gemm" not in op.name}
    assert got == passes
    assert [int(op.meta["bytes"]) // T for op in fwd if ".ce." in op.name and "all_reduce" in op.name] == reduces


@pytest.mark.parametrize("extra,impl", [({}, "megatron"),
                                        ({"fsdp": {}, "training": {"precision": "amp_fp32_params"}}, "pytorch"),
                                        ({"training": {"precision": "amp_fp32_params"}}, "pytorch"),
                                        ({"training": {"precision": "fp16"}}, "megatron"),
                                        ({"zero_optimization": {"stage": 1}}, "pytorch"),
                                        ({"training": {"lora": {"rank": 4, "alpha": 8,
                                                                "target_modules": ["q_proj"]}}}, "pytorch"),
                                        ({"training": {"cross_entropy": "pytorch"}}, "pytorch")])
def test_the_frameworks_default(extra, impl):
    d = {**SCENARIO, "hardware": {"gpu": "h100-sxm-80gb", "cluster": {"preset": "dgx-h100", "nodes": 1}}}
    d = {**d, **extra, "training": {**SCENARIO["training"], "global_batch_size": 8, **extra.get("training", {})}}
    assert transformer_spec(scenario_from_dict(d)).cross_entropy == impl


def test_unknown_impl_is_refused_in_one_line(tmp_path, capsys):
    err = refused_in_one_line(tmp_path, capsys, {**SCENARIO, "training": {**SCENARIO["training"],
                                                                         "cross_entropy": "te"}})
    assert "cross_entropy" in err and "megatron_fused" in err and "pytorch" in err


# -- what one Llama block saves (rope, GQA, SwiGLU, RMSNorm, flash attention) ----------------------------------------
# Megatron-LM + Transformer Engine: the rotated q, k are new tensors and v a strided view of the QKV output, a layout
# TE's get_qkv_layout does not take, so q, k, v are made contiguous and FusedAttnFunc saves them with the output and
# the softmax statistics (NVIDIA/TransformerEngine@a0b36d0 .../dot_product_attention/utils.py get_qkv_layout); the QKV
# output itself is saved by nothing. Korthikanti et al. 2022 (arXiv 2205.05198) section 4's 34 s b h without the
# s^2 terms (flash), with GQA's smaller K, V and SwiGLU's two fc1 halves.

LLAMA = dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2, seq_length=16,
             vocab_size=256, ffn_hidden_size=128, micro_batch_size=2, precision="bf16", tied_embeddings=False,
             bias=False, swiglu=True, normalization="RMSNorm", position_embedding="rope")


def _saved_by_layer0(**kw) -> int:
    g = build_gpt_step(TransformerSpec(**{**LLAMA, **kw}))
    bwd_uses = {u for op in g.ops if op.phase == Phase.BWD for u in op.uses}
    return sum(t.nbytes for op in g.ops if op.phase == Phase.FWD and op.layer == 0 for t in op.allocs
               if t.name in bwd_uses)


@pytest.mark.parametrize("fp8", [None, "hybrid"])
def test_llama_block_saves_by_hand(fp8):
    """T = 32 tokens, h = 64, a = 8 heads of d = 8, g = 2 K/V groups, f = 128. bf16: the two residual-stream
    outputs (x2, and x3 the next block's norm input) 2 x 2 T h, the two norm outputs 2 x 2 T h, rotated q 2 T a d
    and k 2 T g d, V's contiguous copy 2 T g d, the attention output and its contiguous (proj input) copy
    2 x 2 T h, fc1's output 2 T 2 f, SwiGLU's output 2 T f: 14 T h + 4 T g d + 6 T f = 28,672 + 2,048 + 24,576 =
    55,296 B (not the QKV output, 6,144 B, beside them), and the RMSNorm rstd (4 B per token per norm) and the flash
    log-sum-exp (4 B per head per token), read by their backward: 2 x 4 T + 4 a T = 1,280 B (1 MB per Llama-3 8B
    block): 56,576 B. fp8: the four Linear inputs (two norm outputs, the proj input, SwiGLU's output) 1 B each:
    T (3 h + f) = 10,240 less."""
    T, h, d, g, f, a = 32, 64, 8, 2, 128, 8
    bf16 = 14 * T * h + 4 * T * g * d + 6 * T * f + 2 * 4 * T + 4 * a * T
    assert bf16 == 56_576
    want = bf16 - (T * (3 * h + f) if fp8 else 0)
    assert _saved_by_layer0(fp8=fp8) == want == {None: 56_576, "hybrid": 46_336}[fp8]


@pytest.mark.parametrize("dtype", ["fp64", "bf16", "float32"])
def test_spec_refuses_a_router_dtype_it_would_price_as_the_model_dtype(dtype):
    """``TransformerSpec.moe_probs_bytes`` knows fp32 and None only: another ``moe_router_dtype`` (Megatron also takes
    fp64) would be priced as 2-byte probabilities without a word, so the spec refuses it."""
    with pytest.raises(ValueError, match="moe_router_dtype"):
        TransformerSpec(**{**TINY, "num_experts": 4, "moe_router_dtype": dtype})
