"""Unfused attention core and dropout kernels of the GPT builder (``attention_backend: unfused``).

Megatron-LM ran attention unfused until flash attention came in with ``--use-flash-attn`` (NVIDIA/Megatron-LM
pull request #267 by Tri Dao, opened 2022-12-09, reviewed and merged in 2023); the Megatron-LM README runs of
2020, Narayanan et al. (SC21, April 2021) and Korthikanti et al. (arXiv 2205.05198, May 2022) predate it.
Megatron-Core's ``--attention-backend`` names the choice (``flash``, ``fused``, ``unfused``, ``local``, ``auto``). The core of ``ParallelSelfAttention`` /
``CoreAttention`` (``megatron/model/transformer.py``, 2020-2022) runs, per tensor-parallel rank with
``B = b a / t`` (batch x local heads) score matrices of ``s x s``:

* forward: ``torch.baddbmm`` scores ``Q K^T / sqrt(d)`` (``[B, s, d] x [B, d, s]``, the scale in the
  GEMM's ``alpha``); the fused causal softmax ``scaled_upper_triang_masked_softmax`` (Megatron
  ``fused_kernels/scaled_upper_triang_masked_softmax.h``: row ``i`` reads its ``i + 1`` unmasked scores
  and writes the whole row, zeros above the diagonal); attention dropout (``torch.nn.Dropout``: the
  output and a 1-byte mask); ``torch.bmm`` probabilities x ``V`` (``[B, s, s] x [B, s, d]``);
* backward (autograd): ``dP = dO V^T`` and ``dV = P^T dO``; the dropout backward (``dP * mask / (1 -
  p)``); the fused softmax backward (reads the gradient and the softmax output on the lower triangle,
  writes the whole row); ``dQ = dS K`` and ``dK = dS^T Q``; the ``torch.split`` of the fused QKV output
  backward, one copy of ``dQ, dK, dV`` into the ``[T, 3h / t]`` gradient.

All four GEMMs compute the whole ``s x s`` square (no causal skipping: ``2 B s^2 d`` FLOPs each); they
are priced as batched GEMMs (``shape = (m, n, k, B)``, ``simulator.cost.roofline``). The softmax and
dropout kernels carry no FLOPs (priced by their traffic). Saved for backward per layer and TP rank (2-byte
tensors): the softmax output ``2 B s^2`` bytes, the dropout mask ``B s^2`` and the dropout output ``2 B s^2``:
``5 a s^2 b / t``, Korthikanti et al., *Reducing Activation Recomputation in Large Transformer Models*
(MLSys 2023), section 4.1 and Table 2 (``sbh (34 + 5 a s / h)`` per layer without parallelism); without
attention dropout only the softmax output, ``2 a s^2 b / t``. Selective recompute (Korthikanti section 5)
keeps none of them and re-runs this core (the same dropout mask: Megatron's checkpoint restores the RNG
state) before its backward.

**Hidden dropout** (Megatron ``--hidden-dropout``; ``bias_dropout_add`` after the attention projection
and after fc2, fused with the residual add): the add also writes a 1-byte mask per element of its ``T_n
h`` output (saved for backward: the ``2 s b h`` of Korthikanti's 34), and the backward multiplies the
branch's gradient by it (one elementwise kernel reading the gradient and the mask, writing the branch
gradient).

Not modelled with ``unfused`` (refused by ``check_attention_spec``): grouped-query attention (Megatron
repeats K/V per group), sliding windows and context parallelism.
"""

from __future__ import annotations

from simulator.graph.builders import hf_eager as hf
from simulator.graph.ops import CostClass as C

ATTENTION_BACKENDS = ("flash", "flash_varlen", "unfused")  # flash_varlen: builders/varlen.py


#: FlashAttention-1 runtimes (ms) with attention dropout 0.1 and without, ``(with, without)`` per sequence length
#: (2k, 4k, 8k, 16k tokens): A100 40GB, fp16, batch 16, 8 heads of dimension 64, no mask; Dao et al.,
#: *FlashAttention* (NeurIPS 2022, arXiv 2205.14135), Appendix E.6, Tables 15 / 18 (forward) and 16 / 19 (backward).
#: The only published with / without-dropout timing of a flash kernel found; none for FlashAttention-2, cuDNN fused
#: attention or head dim 128 on an A100 or H100, so it bounds rather than prices the effect (``flash_dropout_note``).
FA1_DROPOUT_MS = {"fwd": ((2.81, 2.40), (10.38, 8.42), (41.63, 33.54), (167.01, 134.03)),
                  "bwd": ((6.50, 5.45), (26.21, 21.57), (104.27, 84.75), (416.10, 336.00))}


def fa1_dropout_slowdown(which: str) -> tuple[float, float]:
    """Smallest and largest ``with / without - 1`` of ``FA1_DROPOUT_MS[which]`` (``"fwd"`` or ``"bwd"``) over its
    sequence lengths: forward 0.171-0.246, backward 0.193-0.238.

    Raises:
        KeyError: ``which`` is not ``"fwd"`` or ``"bwd"``.
    """
    r = [a / b - 1 for a, b in FA1_DROPOUT_MS[which]]
    return min(r), max(r)


def flash_dropout_note(backend: str, attention_dropout: float) -> str | None:
    """The run's warning when attention dropout runs inside a flash kernel, which is priced as without dropout
    (the kernel's Philox mask generation in forward and its regeneration in backward are not charged); None with
    ``unfused`` (its dropout kernels are priced) or no attention dropout."""
    if backend == "unfused" or attention_dropout <= 0:
        return None
    f, b = (fa1_dropout_slowdown(w) for w in ("fwd", "bwd"))
    return (f"model.attention_dropout {attention_dropout:g} with attention_backend {backend}: the dropout inside the "
            "flash-attention kernels is not priced (they are priced as without dropout), so attention time is a "
            f"lower bound; FlashAttention-1 ran {f[0]:.0%}-{f[1]:.0%} slower forward and {b[0]:.0%}-{b[1]:.0%} "
            "backward with dropout 0.1 (A100, head dim 64, 2k-16k tokens; Dao et al. 2022, Appendix E.6); not "
            "measured for this kernel, head dim and GPU")


def check_attention_spec(spec) -> None:
    """Check ``attention_backend`` and the dropout rates of a ``TransformerSpec``.

    Raises:
        ValueError: an unknown backend, a rate outside [0, 1), or ``unfused`` with grouped-query attention,
            a sliding window or context parallelism (not modelled).
    """
    if spec.attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {spec.attention_backend!r}")
    for name in ("attention_dropout", "hidden_dropout"):
        p = getattr(spec, name)
        if not 0 <= p < 1:
            raise ValueError(f"{name} must be in [0, 1), got {p}")
    if spec.attention_backend != "unfused":
        return
    if spec.query_groups != spec.num_attention_heads:
        raise ValueError("attention_backend unfused with grouped-query attention is not modelled (allowed: flash)")
    if spec.window_size is not None and spec.window_size < spec.seq_length:
        raise ValueError("attention_backend unfused with a sliding window is not modelled (allowed: flash)")
    if spec.context_parallel_size > 1:
        raise ValueError("attention_backend unfused with context parallelism is not modelled (allowed: flash)")


def core_sizes(spec, tp: int) -> tuple[int, int, int, int, int]:
    """``(B, s, d, n, tri)`` of one TP rank's unfused core: ``B = b a / t`` score matrices of ``s x s``,
    head dim ``d``, ``n = B s^2`` score elements, ``tri = B s (s + 1) / 2`` of them on or below the diagonal."""
    B = spec.micro_batch_size * spec.num_attention_heads // tp
    s = spec.seq_length
    return B, s, spec.head_dim, B * s * s, B * s * (s + 1) // 2


def saved_core_bytes(spec, tp: int, w: int = 2) -> int:
    """Bytes the unfused core keeps for backward per layer and micro-batch (no selective recompute): the
    softmax output (``w`` bytes per element), with attention dropout also its output and 1-byte mask:
    ``(2 w + 1) B s^2`` (``5 a s^2 b / t`` in 16-bit; Korthikanti et al. 2023, Table 2), else ``w B s^2``."""
    _, _, _, n, _ = core_sizes(spec, tp)
    return (2 * w + 1) * n if spec.attention_dropout > 0 else w * n


def backward_working_bytes(spec, tp: int, w: int = 2) -> int:
    """Peak bytes the unfused core's backward holds beyond what it saved: with dropout ``w B s^2`` (the dropout
    backward writes its result while ``dP`` lives; the dropout output is freed by then, after ``dV``), without
    ``2 w B s^2`` (``dP`` and ``dS`` beside the kept softmax output)."""
    _, _, _, n, _ = core_sizes(spec, tp)
    return w * n if spec.attention_dropout > 0 else 2 * w * n


def unfused_fwd(bld, qkv: str, qk: str | None, prefix: str = "attn") -> tuple[str, dict]:
    """Emit the unfused core forward (module docstring) on builder ``bld`` (``_GptBuilder``: emitter ``e``,
    spec ``s``, TP size ``tp``, element bytes ``w``). ``qkv``: the fused QKV output; ``qk``: the rotated q, k
    (rope) or None. Returns the ``[B, s, d]`` context tensor and the tensors the backward reads."""
    if hf.is_hf_eager(bld.s):  # GPT2Attention._attn's eager kernels (simulator/graph/builders/hf_eager.py)
        return hf.core_fwd(bld, qkv, prefix)
    e, w = bld.e, bld.w
    B, s, d, n, tri = core_sizes(bld.s, bld.tp)
    qkd = B * s * d  # elements of one of Q, K, V, or of the context
    src = [qkv] + ([qk] if qk else [])
    scores = e.fresh(f"{prefix}.scores")
    e.kernel(f"{prefix}.qk_bmm", C.GEMM, flops=2 * B * s * s * d, shape=(s, s, d, B), reads=w * 2 * qkd,
             writes=w * n, out=[(scores, w * n)], uses=src)
    probs = e.fresh(f"{prefix}.probs")
    e.kernel(f"{prefix}.scale_mask_softmax", C.SOFTMAX, reads=w * tri, writes=w * n, out=[(probs, w * n)],
             uses=[scores])
    saved = {"probs": probs, "dropped": probs, "mask": None, "qkv": src}
    return dropout_context_fwd(bld, prefix, saved, qkv), saved


def dropout_context_fwd(bld, prefix: str, saved: dict, v: str) -> str:
    """The core's forward tail: attention dropout over ``saved["probs"]`` (when ``attention_dropout > 0``; its
    output and mask go into ``saved``), then the ``probs x V`` batched GEMM reading ``v``. Returns the context."""
    e, w = bld.e, bld.w
    B, s, d, n, _ = core_sizes(bld.s, bld.tp)
    qkd = B * s * d
    if bld.s.attention_dropout > 0:
        dropped, mask = e.fresh(f"{prefix}.dropout.out"), e.fresh(f"{prefix}.dropout.mask")
        e.kernel(f"{prefix}.dropout", C.ELEMENTWISE, reads=w * n, writes=w * n + n,
                 out=[(dropped, w * n), (mask, n)], uses=[saved["probs"]])
        saved.update(dropped=dropped, mask=mask)
    ctx = e.fresh(f"{prefix}.context")
    e.kernel(f"{prefix}.pv_bmm", C.GEMM, flops=2 * B * s * s * d, shape=(s, d, s, B), reads=w * (n + qkd),
             writes=w * qkd, out=[(ctx, w * qkd)], uses=[saved["dropped"], v])
    return ctx


def unfused_bwd(bld, g_ctx: str, saved: dict, qkv_numel: int) -> str:
    """Emit the unfused core backward (module docstring) from the context gradient ``g_ctx``; ``saved``: what
    ``unfused_fwd`` returned; ``qkv_numel``: elements of the fused QKV gradient (``T (a d + 2 g d) / t``).
    Returns the QKV gradient."""
    if hf.is_hf_eager(bld.s):
        return hf.core_bwd(bld, g_ctx, saved, qkv_numel)
    e, w = bld.e, bld.w
    _, _, _, n, tri = core_sizes(bld.s, bld.tp)
    src = saved["qkv"]
    dp, dv = context_dropout_bwd(bld, g_ctx, saved, src)
    ds = e.fresh("attn.dscores")
    e.kernel("attn.scale_mask_softmax.dgrad", C.SOFTMAX, reads=2 * w * tri, writes=w * n, out=[(ds, w * n)],
             uses=[dp, saved["probs"]])
    return scores_bwd(bld, ds, (src, src), dv, qkv_numel)


def context_dropout_bwd(bld, g_ctx: str, saved: dict, v_uses: list[str]) -> tuple[str, str]:
    """The core's backward head: ``dP = dO V^T`` (reading ``v_uses``) and ``dV = P^T dO``, then the attention
    dropout's backward when ``saved`` has a mask. Returns ``(dP, dV)``."""
    e, w = bld.e, bld.w
    B, s, d, n, _ = core_sizes(bld.s, bld.tp)
    qkd = B * s * d
    dp = e.fresh("attn.dprobs")
    e.kernel("attn.pv_bmm.dgrad_probs", C.GEMM, flops=2 * B * s * s * d, shape=(s, s, d, B), reads=w * 2 * qkd,
             writes=w * n, out=[(dp, w * n)], uses=[g_ctx, *v_uses])
    dv = e.fresh("attn.dv")
    e.kernel("attn.pv_bmm.dgrad_v", C.GEMM, flops=2 * B * s * s * d, shape=(s, d, s, B), reads=w * (n + qkd),
             writes=w * qkd, out=[(dv, w * qkd)], uses=[saved["dropped"], g_ctx])
    if saved["mask"] is not None:
        dp2 = e.fresh("attn.dropout.dx")
        e.kernel("attn.dropout.dgrad", C.ELEMENTWISE, reads=w * n + n, writes=w * n, out=[(dp2, w * n)],
                 uses=[dp, saved["mask"]])
        dp = dp2
    return dp, dv


def scores_bwd(bld, ds: str, qk_uses: tuple[list[str], list[str]], dv: str, qkv_numel: int) -> str:
    """The core's backward tail from the scores gradient ``ds``: ``dQ = dS K`` and ``dK = dS^T Q`` (reading
    ``qk_uses[0]`` and ``qk_uses[1]``), then the copy of ``dQ, dK, dV`` into the ``qkv_numel``-element QKV
    gradient. Returns it."""
    e, w = bld.e, bld.w
    B, s, d, n, _ = core_sizes(bld.s, bld.tp)
    qkd = B * s * d
    grads = []
    for which, uses in zip(("q", "k"), qk_uses):
        g = e.fresh(f"attn.d{which}")
        e.kernel(f"attn.qk_bmm.dgrad_{which}", C.GEMM, flops=2 * B * s * s * d, shape=(s, d, s, B),
                 reads=w * (n + qkd), writes=w * qkd, out=[(g, w * qkd)], uses=[ds, *uses])
        grads.append(g)
    g_qkv = e.fresh("attn.dqkv")
    e.kernel("attn.dqkv.cat", C.COPY, reads=w * 3 * qkd, writes=w * qkv_numel, out=[(g_qkv, w * qkv_numel)],
             uses=[*grads, dv])
    return g_qkv


def residual_dropout_add(bld, name: str, x: str, branch: str, branch_bytes: int) -> tuple[str, str | None]:
    """The residual add of a block (``bld._add``); with ``hidden_dropout`` Megatron's fused
    ``bias_dropout_add``: the same kernel also writes a 1-byte mask per element, kept for backward.
    Returns the output and the mask (None without dropout)."""
    if bld.s.hidden_dropout <= 0:
        return bld._add(name, x, branch, bld.act, branch_bytes, bld.act), None
    if hf.is_hf_eager(bld.s):  # GPT2Block: resid_dropout, then the add (two kernels)
        return hf.residual_dropout_add(bld, name, x, branch)
    e, T, h = bld.e, bld.Tn, bld.s.hidden_size
    y, mask = e.fresh(f"{name}.out"), e.fresh(f"{name}.dropout_mask")
    e.kernel(name, C.ELEMENTWISE, reads=(bld.act + branch_bytes) * T * h, writes=bld.act * T * h + T * h,
             out=[(y, bld.act * T * h), (mask, T * h)], uses=[x, branch], dtype="fp32")
    return y, mask


def hidden_dropout_bwd(bld, name: str, g: str, mask: str | None) -> str:
    """The branch gradient through the hidden dropout (``g * mask / (1 - p)``, residual dtype); ``g`` itself
    without dropout."""
    if mask is None:
        return g
    e, T, h = bld.e, bld.Tn, bld.s.hidden_size
    y = e.fresh(f"{name}.dx")
    e.kernel(f"{name}.dgrad", C.ELEMENTWISE, reads=bld.act * T * h + T * h, writes=bld.act * T * h,
             out=[(y, bld.act * T * h)], uses=[g, mask], dtype="fp32")
    return y
