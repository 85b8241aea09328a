"""Flash attention called through flash-attn's padding helpers (``attention_backend: flash_varlen``).

llm-foundry's MPT ``flash_attn_fn`` (``llmfoundry/models/layers/attention.py``, 2023: ``attn_impl: flash``,
flash-attn 1.0.x ``flash_attn_unpadded_func``) unpads q, k and v with ``bert_padding.unpad_input`` even when
nothing is padded (``key_padding_mask`` defaults to all ones) and pads the output back with
``bert_padding.pad_input`` (``flash_attn/bert_padding.py``). Per layer and micro-batch, with ``T`` tokens and
2-byte elements:

* forward: ``index_first_axis`` (a ``torch.gather`` of the ``T`` kept rows) of each of the q, k and v views of
  the fused QKV output, three kernels each reading and writing ``2 T`` bytes per column of its width; the
  kernel on the gathered, contiguous q, k, v; ``index_put_first_axis``: a zero-filled ``[T, a d]`` output
  (``torch.zeros``) and the rows written into it (``output[indices] = values``), which the output projection
  reads as it is (no transpose copy);
* backward: the pad's backward gathers the ``T`` rows of the output gradient; the kernel's backward writes
  dq, dk, dv; each ``index_first_axis`` backward zero-fills a ``[T, width]`` gradient and ``scatter_``s into it;
  the backward of the QKV split (``qkv.split``) concatenates the three into the ``[T, qo]`` gradient of Wqkv's
  output.

Saved for backward: the gathered q, k, v in place of the fused QKV output (the same bytes). Not counted: the
``int64`` row indices (8 bytes per token) and their stride-0 broadcast reads. Refused (``check_varlen_spec``):
rotary positions (the helpers would run on the rotated q, k) and context parallelism.
"""

from __future__ import annotations

from simulator.graph.ops import CostClass as C

#: Bytes per element of the tensors the padding helpers move (flash attention's fp16 / bf16).
ELEM_BYTES = 2


def check_varlen_spec(spec) -> None:
    """Raises: ValueError: ``flash_varlen`` with rotary positions or context parallelism (not modelled)."""
    if spec.attention_backend != "flash_varlen":
        return
    if spec.position_embedding == "rope":
        raise ValueError("attention_backend flash_varlen with rotary positions is not modelled (allowed: "
                         "learned_absolute or none)")
    if spec.context_parallel_size > 1:
        raise ValueError("attention_backend flash_varlen with context parallelism is not modelled (allowed: flash)")


def unpad_fwd(bld, qkv: str, tokens: int, widths: tuple[int, int, int]) -> str:
    """The three ``index_first_axis`` gathers of q, k, v (``widths`` columns each) out of ``qkv``.

    Returns the gathered tensor (``2 T (wq + wk + wv)`` bytes), which the attention kernel reads and saves.
    """
    e = bld.e
    u = e.fresh("attn.qkv_unpad")
    total = ELEM_BYTES * tokens * sum(widths)
    for i, (part, w) in enumerate(zip("qkv", widths)):
        n = ELEM_BYTES * tokens * w
        e.kernel(f"attn.unpad_{part}", C.COPY, reads=n, writes=n, out=[(u, total)] if i == 0 else [],
                 uses=[qkv] if i == 0 else [qkv, u])
    return u


def pad_fwd(bld, att: str, tokens: int, width: int) -> str:
    """``pad_input``: the zero-filled ``[T, width]`` output and the rows of ``att`` written into it."""
    e = bld.e
    n = ELEM_BYTES * tokens * width
    out = e.fresh("attn.out_padded")
    e.kernel("attn.pad.zeros", C.MEMSET, writes=n, out=[(out, n)])
    e.kernel("attn.pad", C.COPY, reads=n, writes=n, uses=[att, out])
    return out


def pad_bwd(bld, g_out: str, tokens: int, width: int) -> str:
    """The pad's backward: the ``T`` rows of the output gradient gathered into the kernel's ``dO``."""
    e = bld.e
    n = ELEM_BYTES * tokens * width
    g = e.fresh("attn.dout_unpad")
    e.kernel("attn.pad.dgrad", C.COPY, reads=n, writes=n, out=[(g, n)], uses=[g_out])
    return g


def unpad_bwd(bld, g_unpad: str, tokens: int, widths: tuple[int, int, int]) -> str:
    """Each gather's backward (zero-fill + ``scatter_``) of dq, dk, dv, then the split's backward ``cat`` into
    the ``[T, wq + wk + wv]`` gradient of the fused QKV output, which is returned."""
    e = bld.e
    parts = []
    for part, w in zip("qkv", widths):
        n = ELEM_BYTES * tokens * w
        g = e.fresh(f"attn.d{part}_padded")
        e.kernel(f"attn.unpad_{part}.dgrad.zeros", C.MEMSET, writes=n, out=[(g, n)])
        e.kernel(f"attn.unpad_{part}.dgrad", C.COPY, reads=n, writes=n, uses=[g_unpad, g])
        parts.append(g)
    total = ELEM_BYTES * tokens * sum(widths)
    g_qkv = e.fresh("attn.dqkv_cat")
    e.kernel("attn.split.dgrad", C.COPY, reads=total, writes=total, out=[(g_qkv, total)], uses=parts)
    return g_qkv
