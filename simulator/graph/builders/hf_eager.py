"""Hugging Face GPT-2 eager kernels (``model.kernels: hf_eager``): the unfused attention core, the tanh GELU and
the residual dropout as PyTorch eager mode runs them, one kernel per tensor op, instead of Megatron's fused
kernels (``simulator/graph/builders/attention.py``).

Source: ``transformers`` 4.15.0 (the version Merak 0.1 pins, ``merak/setup.py`` in ml-energy/zeus @38cb3f9),
``src/transformers/models/gpt2/modeling_gpt2.py``, on PyTorch 1.10:

* ``GPT2Attention.__init__`` registers ``bias = torch.tril(torch.ones((n_positions, n_positions),
  dtype=torch.uint8)).view(1, 1, n, n)`` and ``masked_bias = torch.tensor(-1e4)``.
* ``GPT2Attention._attn``, the path taken with the config defaults ``reorder_and_upcast_attn = False`` and
  ``scale_attn_by_inverse_layer_idx = False`` (no ``attention_mask`` reaches it in a run that feeds only
  ``input_ids``, as Merak's trace of ``model.dummy_inputs`` does)::

      attn_weights = torch.matmul(query, key.transpose(-1, -2))
      attn_weights = attn_weights / (float(value.size(-1)) ** 0.5)          # scale_attn_weights (default True)
      causal_mask = self.bias[:, :, key_length - query_length : key_length, :key_length].bool()
      attn_weights = torch.where(causal_mask, attn_weights, self.masked_bias.to(attn_weights.dtype))
      attn_weights = nn.Softmax(dim=-1)(attn_weights)
      attn_weights = attn_weights.type(value.dtype)                          # a no-op: same dtype
      attn_weights = self.attn_dropout(attn_weights)
      attn_output = torch.matmul(attn_weights, value)

  ``query``, ``key``, ``value`` are ``_split_heads`` views (``view`` + ``permute(0, 2, 1, 3)``) of the
  ``c_attn`` output ``[b, s, 3h]``: ``torch.matmul`` of two 4-D tensors reshapes them to ``[b a, s, d]``
  (``[b a, d, s]`` for ``key.transpose``), which cannot be a view of that layout (the batch stride ``3 s h``
  is not ``a`` times the head stride ``d``), so each is copied once (3 copies of ``b s h`` elements).

  Per layer with ``B = b a`` score matrices, ``n = B s^2`` elements of ``w`` bytes (4 in fp32 / tf32, 2 in
  fp16): forward, the 3 head copies, the scores GEMM (writes ``w n``), the division (reads and writes ``w
  n``), the ``uint8 -> bool`` copy of the ``s x s`` mask slice, ``torch.where`` (reads ``w n`` and the
  broadcast ``s^2`` mask, writes ``w n``), the softmax over whole rows (reads and writes ``w n``), the
  dropout (``w n`` plus its 1-byte mask) and the context GEMM; backward (autograd), the two GEMMs of the
  context product, the dropout backward, ``_softmax_backward_data`` (reads the gradient and the output,
  writes ``w n``), ``where``'s backward ``where(cond, grad, 0)`` (reads ``w n`` and the mask, writes ``w
  n``), the division's backward ``grad / sqrt(d)`` (reads and writes ``w n``), the two GEMMs of the scores
  product and the ``cat`` of ``dQ, dK, dV`` into the ``[T, 3h]`` gradient (``split``'s backward). Autograd
  saves the same tensors as Megatron's unfused core (softmax output, dropout output and mask): the memory of
  ``attention.saved_core_bytes`` holds.
* ``GPT2MLP``: ``act = ACT2FN["gelu_new"]``, ``0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x +
  0.044715 * torch.pow(x, 3.0))))``: 8 elementwise kernels over ``[T, 4h]``, ``pow, mul, add, mul, tanh, add,
  mul, mul`` (10 tensor reads, 8 writes). Autograd saves ``x`` (``pow``), the ``tanh`` output and both factors
  of the last product (``0.5 x`` and ``1 + tanh``); ``x`` is the ``c_fc`` output the builder already keeps.
  Its backward runs 11 kernels: the last product's two gradients (``g * t6``, ``g * t7``), ``* 0.5``,
  ``tanh_backward`` (reads the gradient and the tanh output), ``* sqrt(2 / pi)``, ``* 0.044715``,
  ``pow_backward`` as ``grad * (3 * x.pow(2))`` (3 kernels: ``pow``, ``mul``, ``mul``) and 2 accumulations of
  ``x``'s three incoming gradients (``add``): 17 tensor reads and 11 writes.
* ``GPT2Attention.forward`` ends with ``attn_output = self.resid_dropout(attn_output)`` and ``GPT2MLP`` with
  ``self.dropout(h)``; ``GPT2Block`` then adds the residual (``attn_output + residual``): a dropout kernel
  (reads ``w T h``, writes ``w T h`` and the 1-byte mask) and an add kernel (reads ``2 w T h``, writes ``w T
  h``), where Megatron fuses them (``bias_dropout_add``). The add's backward passes the gradient through; the
  dropout's backward is the one of ``attention.hidden_dropout_bwd``.

* ``Conv1D.forward`` (``transformers.modeling_utils``, every projection of a GPT-2 block) is ``torch.addmm(self.bias,
  x.view(-1, x.size(-1)), self.weight)``; PyTorch 1.10's CUDA ``addmm_out_cuda_impl`` (``aten/src/ATen/native/
  cuda/Blas.cpp``) first copies the bias expanded to ``[T, out]`` into the result (``at::native::copy_(result,
  *self_)``, beta != 0), then runs the GEMM with ``beta = 1``, which reads that result back: a copy kernel
  writing ``w T out`` bytes and ``w T out`` more GEMM reads (``addmm_bias_copy``). The copy's buffer is counted
  as its own tensor beside the GEMM output (one ``[T, out]`` tensor more while the GEMM runs; PyTorch writes
  the GEMM into it).

The softmax and the elementwise kernels carry no FLOPs (priced by their traffic, as the Megatron ones).
"""

from __future__ import annotations

from simulator.graph.ops import CostClass as C

KERNEL_STYLES = ("fused", "hf_eager")

#: gelu_new forward, in execution order: (kernel, tensors read)
GELU_FWD = (("pow", 1), ("mul_coeff", 1), ("add_x", 2), ("mul_sqrt_2_pi", 1), ("tanh", 1), ("add_one", 1),
            ("mul_half_x", 1), ("mul", 2))
#: gelu_new backward (autograd), in execution order: (kernel, tensors read)
GELU_BWD = (("mul.dgrad_half_x", 2), ("mul.dgrad_tanh1", 2), ("mul_half_x.dgrad", 1), ("tanh.dgrad", 2),
            ("mul_sqrt_2_pi.dgrad", 1), ("mul_coeff.dgrad", 1), ("pow.dgrad.pow2", 1), ("pow.dgrad.mul3", 1),
            ("pow.dgrad.mul", 2), ("accum_x.add0", 2), ("accum_x.add1", 2))


def is_hf_eager(spec) -> bool:
    """Whether a ``TransformerSpec`` runs Hugging Face's eager kernels (``kernels == "hf_eager"``)."""
    return spec.kernels == "hf_eager"


def check_spec(spec) -> None:
    """Raises: ValueError: an unknown ``kernels`` value, or ``hf_eager`` without ``attention_backend: unfused``,
    with SwiGLU, experts or rotary embeddings (GPT-2 has none of them; not modelled)."""
    if spec.kernels not in KERNEL_STYLES:
        raise ValueError(f"kernels must be one of {KERNEL_STYLES}, got {spec.kernels!r}")
    if spec.kernels != "hf_eager":
        return
    if spec.attention_backend != "unfused":
        raise ValueError("kernels hf_eager needs attention_backend unfused (GPT2Attention's eager path)")
    if spec.swiglu:
        raise ValueError("kernels hf_eager with swiglu is not modelled (allowed: the GELU MLP of GPT-2)")
    if spec.num_experts is not None:
        raise ValueError("kernels hf_eager with num_experts is not modelled (allowed: the dense GPT-2 MLP)")
    if spec.position_embedding == "rope":
        raise ValueError("kernels hf_eager with rotary embeddings is not modelled (allowed: GPT-2's learned "
                         "positions)")


def core_fwd(bld, qkv: str, prefix: str) -> tuple[str, dict]:
    """Emit ``GPT2Attention._attn``'s forward (module docstring) on builder ``bld``; ``qkv``: the ``c_attn``
    output. Returns the context tensor and what ``core_bwd`` reads (the keys of ``attention.unfused_fwd``)."""
    from simulator.graph.builders.attention import core_sizes, dropout_context_fwd

    e, w = bld.e, bld.w
    B, s, d, n, _ = core_sizes(bld.s, bld.tp)
    qkd = B * s * d
    heads = []
    for which in ("q", "k", "v"):  # torch.matmul's reshape of the permuted [b, a, s, d] views
        t = e.fresh(f"{prefix}.{which}_contig")
        e.kernel(f"{prefix}.{which}_contig", C.COPY, reads=w * qkd, writes=w * qkd, out=[(t, w * qkd)], uses=[qkv])
        heads.append(t)
    q, k, v = heads
    scores = e.fresh(f"{prefix}.scores")
    e.kernel(f"{prefix}.qk_bmm", C.GEMM, flops=2 * B * s * s * d, shape=(s, s, d, B), reads=w * 2 * qkd,
             writes=w * n, out=[(scores, w * n)], uses=[q, k])
    scaled = e.fresh(f"{prefix}.scaled")
    e.kernel(f"{prefix}.scale_div", C.ELEMENTWISE, reads=w * n, writes=w * n, out=[(scaled, w * n)], uses=[scores])
    cmask = e.fresh(f"{prefix}.causal_mask")
    e.kernel(f"{prefix}.causal_mask.bool", C.COPY, reads=s * s, writes=s * s, out=[(cmask, s * s)], uses=[])
    masked = e.fresh(f"{prefix}.masked")
    e.kernel(f"{prefix}.causal_where", C.ELEMENTWISE, reads=w * n + s * s, writes=w * n, out=[(masked, w * n)],
             uses=[scaled, cmask])
    probs = e.fresh(f"{prefix}.probs")
    e.kernel(f"{prefix}.softmax", C.SOFTMAX, reads=w * n, writes=w * n, out=[(probs, w * n)], uses=[masked])
    saved = {"probs": probs, "dropped": probs, "mask": None, "qkv": [q, k], "v": v, "causal_mask": cmask}
    return dropout_context_fwd(bld, prefix, saved, v), saved


def core_bwd(bld, g_ctx: str, saved: dict, qkv_numel: int) -> str:
    """Emit the autograd backward of ``core_fwd`` (module docstring) from the context gradient ``g_ctx``;
    ``qkv_numel``: elements of the ``c_attn`` output gradient. Returns that gradient."""
    from simulator.graph.builders.attention import context_dropout_bwd, core_sizes, scores_bwd

    e, w = bld.e, bld.w
    _, s, _, n, _ = core_sizes(bld.s, bld.tp)
    q, k = saved["qkv"]
    dp, dv = context_dropout_bwd(bld, g_ctx, saved, [saved["v"]])
    dm = e.fresh("attn.dmasked")
    e.kernel("attn.softmax.dgrad", C.SOFTMAX, reads=2 * w * n, writes=w * n, out=[(dm, w * n)],
             uses=[dp, saved["probs"]])
    dsc = e.fresh("attn.dscaled")
    e.kernel("attn.causal_where.dgrad", C.ELEMENTWISE, reads=w * n + s * s, writes=w * n, out=[(dsc, w * n)],
             uses=[dm, saved["causal_mask"]])
    ds = e.fresh("attn.dscores")
    e.kernel("attn.scale_div.dgrad", C.ELEMENTWISE, reads=w * n, writes=w * n, out=[(ds, w * n)], uses=[dsc])
    return scores_bwd(bld, ds, ([k], [q]), dv, qkv_numel)


def _gelu_kernel(bld, prefix: str, name: str, n_in: int, numel: int, uses: list[str]) -> str:
    """One eager elementwise kernel of ``gelu_new`` (or of its backward): reads ``n_in`` tensors of ``numel``
    elements, writes one. Returns the written tensor."""
    nb = bld.w * numel
    t = bld.e.fresh(f"{prefix}gelu.{name}")
    bld.e.kernel(f"{prefix}gelu.{name}", C.ELEMENTWISE, reads=n_in * nb, writes=nb, out=[(t, nb)], uses=uses)
    return t


def gelu_fwd(bld, prefix: str, fc1: str, T: int, f: int) -> str:
    """Emit ``gelu_new``'s 8 eager kernels over ``[T, f]`` (module docstring). The tensors its backward reads
    are recorded in ``bld.hf_gelu_saved[fc1]``. Returns the output tensor."""
    def k(name: str, uses: list[str]) -> str:
        return _gelu_kernel(bld, prefix, name, dict(GELU_FWD)[name], T * f, uses)

    t1 = k("pow", [fc1])                 # torch.pow(x, 3.0)
    t2 = k("mul_coeff", [t1])            # 0.044715 * x^3
    t3 = k("add_x", [fc1, t2])           # x + ...
    t4 = k("mul_sqrt_2_pi", [t3])        # sqrt(2 / pi) * (...)
    t5 = k("tanh", [t4])
    t6 = k("add_one", [t5])              # 1.0 + tanh
    t7 = k("mul_half_x", [fc1])          # 0.5 * x
    out = k("mul", [t7, t6])
    if not hasattr(bld, "hf_gelu_saved"):
        bld.hf_gelu_saved = {}
    bld.hf_gelu_saved[fc1] = (t5, t6, t7)
    return out


def gelu_bwd(bld, prefix: str, g: str, fc1: str, T: int, f: int) -> str:
    """Emit ``gelu_new``'s 11 autograd backward kernels (module docstring) from the output gradient ``g``;
    ``fc1``: the input ``gelu_fwd`` ran on (the key of what it saved). Returns the input gradient."""
    t5, t6, t7 = bld.hf_gelu_saved.pop(fc1)

    def k(name: str, uses: list[str]) -> str:
        return _gelu_kernel(bld, prefix, name, dict(GELU_BWD)[name], T * f, uses)

    g7 = k("mul.dgrad_half_x", [g, t6])        # d(0.5 x) = g * (1 + tanh)
    g6 = k("mul.dgrad_tanh1", [g, t7])         # d(1 + tanh) = g * 0.5 x
    gx_a = k("mul_half_x.dgrad", [g7])         # x's first gradient: 0.5 * g7
    g4 = k("tanh.dgrad", [g6, t5])             # tanh_backward(g6, tanh)
    g3 = k("mul_sqrt_2_pi.dgrad", [g4])        # x's second gradient (through x + ...): sqrt(2 / pi) * g4
    g1 = k("mul_coeff.dgrad", [g3])            # 0.044715 * g3
    x2 = k("pow.dgrad.pow2", [fc1])            # x.pow(2)
    x2b = k("pow.dgrad.mul3", [x2])            # 3 * x^2
    gx_c = k("pow.dgrad.mul", [g1, x2b])       # x's third gradient
    acc = k("accum_x.add0", [gx_a, g3])
    return k("accum_x.add1", [acc, gx_c])


def addmm_bias_copy(bld, name: str, T: int, out_dim: int) -> str | None:
    """With ``hf_eager``, the expanded-bias copy of a block projection's ``torch.addmm`` (module docstring): a
    COPY kernel reading the ``out_dim`` bias and writing ``[T, out_dim]``; returns its tensor (the GEMM reads it),
    or None (no copy: fused kernels, a layer without bias, or outside the blocks)."""
    s = bld.s
    if not is_hf_eager(s) or bld.e.layer < 0 or not (s.bias or (name == "qkv" and s.qkv_bias)):
        return None
    e, w = bld.e, bld.w
    t = e.fresh(f"{name}.bias_expand")
    e.kernel(f"{name}.bias_expand", C.COPY, reads=w * out_dim, writes=w * T * out_dim, out=[(t, w * T * out_dim)],
             uses=[])
    return t


def residual_dropout_add(bld, name: str, x: str, branch: str) -> tuple[str, str]:
    """``GPT2Block``'s ``residual + dropout(branch)`` as two eager kernels (module docstring). Returns the
    output and the dropout mask."""
    e, w, T, h = bld.e, bld.w, bld.Tn, bld.s.hidden_size
    dropped, mask = e.fresh(f"{name}.dropout.out"), e.fresh(f"{name}.dropout_mask")
    e.kernel(f"{name}.dropout", C.ELEMENTWISE, reads=w * T * h, writes=w * T * h + T * h,
             out=[(dropped, w * T * h), (mask, T * h)], uses=[branch])
    return bld._add(name, x, dropped, bld.act, w, bld.act), mask
