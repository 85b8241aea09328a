"""How q, k and v reach the flash kernel when they come from separate projections (torchtitan's Llama, Hugging Face
Llama under PEFT), and torchtitan's ``repeat_kv`` of grouped K/V heads, for the GPT builder (flash attention with
rope).

**Separate projections** (``TransformerSpec.qkv_separate``: ``fsdp.version 2``, torchtitan's ``wq`` / ``wk`` /
``wv``; LoRA with the Hugging Face module names, ``q_proj`` / ``k_proj`` / ``v_proj``). The builder's one QKV GEMM
stands for the three; it writes q, k (read by rope) and v as separate tensors. Rope writes new q, k; v stays the
``wv`` output, viewed ``[b, g, s, d]`` by a transpose, which PyTorch's SDPA takes as it is (its last dimension is
contiguous): no copy (pytorch/torchtitan@018740b torchtitan/models/llama3/model/model.py ``Attention.forward``:
``xq.transpose(1, 2)`` and the like straight into ``F.scaled_dot_product_attention``; huggingface/transformers@
00c238b src/transformers/integrations/sdpa_attention.py ``sdpa_attention_forward``: the same). The copy of V made
contiguous belongs to Transformer Engine's fused QKV layout (NVIDIA/TransformerEngine@a0b36d0 ``get_qkv_layout``,
``_GptBuilder._contiguous_v``), Megatron's path only.

**``repeat_kv``** (``TransformerSpec.repeat_kv``, with ``g < a`` K/V heads): torchtitan before pytorch/torchtitan
pull request #2259 ("GQA without kv repeats", January 2026; its ``GQAttention`` then passes ``enable_gqa`` to SDPA,
pytorch/torchtitan@003bb42 torchtitan/models/common/attention.py) expands k and v to the ``a`` query heads before
SDPA: ``unsqueeze(x, 3).expand(bs, s, g, a / g, d).reshape(bs, s, a, d)``
(pytorch/torchtitan@0199cbc torchtitan/models/llama/model.py and @018740b .../llama3/model/model.py ``repeat_kv``),
and the reshape of the expanded view materialises a copy: per tensor one copy kernel reading ``2 T g d / t`` and
writing ``2 T a d / t`` bytes. The flash kernel then reads ``a`` K and V heads (its FLOPs are the same) and SDPA
saves the repeated k and v for backward (``3 x 2 T a d / t`` bytes of q, k, v in place of ``2 T (a + 2 g) d / t``;
the rotated k and the ``wv`` output are then read by the copies only and freed after them). Backward: the flash
kernel writes ``dk``, ``dv`` over ``a`` heads and ``expand``'s backward sums each over its ``a / g`` copies
(pytorch/pytorch tools/autograd/derivatives.yaml ``expand``: ``at::sum_to(grad, self.sym_sizes())``): one reduction
kernel per tensor reading ``2 T a d / t`` and writing ``2 T g d / t`` bytes. With context parallelism the ring
passes the repeated K/V (pytorch/torchtitan issue #1283). Needs rope (the builder's grouped K/V without rope is
not split out of the QKV output): refused otherwise (``check_qkv_layout``).
"""

from __future__ import annotations

from simulator.graph.ops import CostClass as C


def separate(s) -> bool:
    """q, k, v come from separate projections and reach the flash kernel without Transformer Engine's copy: a spec
    with ``qkv_separate``, flash attention and rope (without rope the builder keeps the one QKV output, no copy
    either way)."""
    return s.qkv_separate and s.attention_backend == "flash" and s.position_embedding == "rope"


def repeats(s) -> bool:
    """K and V are expanded to the query heads before the flash kernel (``repeat_kv`` with ``g < a``)."""
    return s.repeat_kv and s.query_groups < s.num_attention_heads


def check_qkv_layout(s) -> None:
    """Raises: ValueError: ``repeat_kv`` with grouped K/V heads outside flash attention with rope, or with the fused
    QKV projection (Megatron / Transformer Engine, which take grouped K/V as they are)."""
    if not repeats(s):
        return
    if s.attention_backend != "flash" or s.position_embedding != "rope":
        raise ValueError("model.repeat_kv (torchtitan's repeat_kv of grouped K/V heads) is modelled with "
                         "attention_backend flash and position_embedding_type rope only (allowed: repeat_kv false)")
    if not s.qkv_separate:
        raise ValueError("model.repeat_kv is modelled for separate q / k / v projections only (torchtitan: "
                         "fsdp.version 2; Hugging Face: training.lora with q_proj / k_proj / v_proj names); "
                         "Megatron's fused QKV takes grouped K/V as they are (allowed: repeat_kv false)")


def attn_widths(s, h: int, kv: int) -> tuple[int, int]:
    """``(flash input width, K width)`` per token and TP rank: ``(3 a d / t, a d / t)`` with ``repeat_kv`` (q and
    the repeated k, v), else ``(a d / t + 2 g d / t, g d / t)``; ``h = a d / t``, ``kv = g d / t``."""
    return (3 * h, h) if repeats(s) else (h + 2 * kv, kv)


def separate_fwd(bld, q_k: str, v: str, h: int, kv: int) -> list[str]:
    """Rope on the ``[T, h + kv]`` q, k and, with ``repeat_kv``, the copies of k and v to the ``h`` query width.
    Returns the tensors the flash kernel reads (and its backward keeps)."""
    e, w, T = bld.e, bld.w, bld.T
    if not repeats(bld.s):
        return [bld._rope_kernel("rope", "rope.qk", q_k, h + kv), v]
    q, k = bld._rope_kernel("rope", "rope.qk", q_k, h + kv, parts=(h, kv))
    out = [q]
    for name, x in (("k", k), ("v", v)):
        y = e.fresh(f"attn.{name}_repeated")
        e.kernel(f"attn.repeat_kv.{name}", C.COPY, reads=w * T * kv, writes=w * T * h, out=[(y, w * T * h)],
                 uses=[x])
        out.append(y)
    return out


def grad_outs(bld, h: int, kv: int) -> list[tuple[str, int]]:
    """The flash backward's outputs ``(tensor, bytes)``: with ``repeat_kv`` dq, dk and dv over the ``h`` query
    width each, else one ``[T, h + 2 kv]`` gradient."""
    e, w, T = bld.e, bld.w, bld.T
    if not repeats(bld.s):
        return [(e.fresh("attn.dqkv"), w * T * (h + 2 * kv))]
    return [(e.fresh(f"attn.d{x}"), w * T * h) for x in ("q", "k_repeated", "v_repeated")]


def reduce_grads(bld, grads: list[str], h: int, kv: int) -> list[str]:
    """``expand``'s backward with ``repeat_kv``: dk and dv summed over their ``h / kv`` copies (one reduction kernel
    each); ``grads`` as ``grad_outs`` made them. Returns ``[dq, dk, dv]`` (``grads`` unchanged otherwise)."""
    if not repeats(bld.s):
        return grads
    e, w, T = bld.e, bld.w, bld.T
    out = [grads[0]]
    for name, g in zip(("k", "v"), grads[1:]):
        y = e.fresh(f"attn.d{name}")
        e.kernel(f"attn.repeat_kv.{name}.dgrad", C.REDUCTION, reads=w * T * h, writes=w * T * kv,
                 flops=T * (h - kv), out=[(y, w * T * kv)], uses=[g])
        out.append(y)
    return out
