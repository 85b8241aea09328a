"""LoRA fine-tuning for the GPT builder: frozen base weights, low-rank adapters on chosen Linears.

LoRA (Hu et al., *LoRA: Low-Rank Adaptation of Large Language Models*, ICLR 2022, section 4.1) keeps
every pretrained weight ``W [in, out]`` frozen and learns ``Delta W = A B`` with ``A [in, r]`` and
``B [r, out]``; the output becomes ``x W + (alpha / r) (x A) B``. Names follow Hugging Face PEFT
(``LoraConfig(r, lora_alpha, target_modules, lora_dropout)``, ``peft/tuners/lora/layer.py``
``Linear.forward``: ``result = result + lora_B(lora_A(dropout(x))) * scaling``).

**Target modules.** Hugging Face Llama names adapt the separate projections of a layer, each with its
own ``A`` and ``B``: ``q_proj`` ``[h, a d]``, ``k_proj`` and ``v_proj`` ``[h, g d]``, ``o_proj`` ``[a d, h]``,
``gate_proj`` and ``up_proj`` ``[h, f]`` (``gate_proj`` only with SwiGLU; without it the MLP's first
Linear is ``up_proj``), ``down_proj`` ``[f, h]``. Megatron-LM / NeMo names adapt the fused Linears with
one adapter each (NeMo "learns a single Low-Rank projection for KQV in a combined fashion",
``docs/source/nlp/nemo_megatron/peft/supported_methods.md``): ``linear_qkv`` ``[h, a d + 2 g d]``,
``linear_proj``, ``linear_fc1`` ``[h, 2f]`` with SwiGLU, ``linear_fc2``. ``all-linear`` (PEFT) is every block
Linear (the HF names). The two families are not mixed. Every block gets the same adapters (PEFT's
default; ``layers_to_transform`` is not modelled).

**Trainable parameters**: ``r (in + out)`` per adapter, times the layers. Llama-2-7B, ``r = 8`` on
``q_proj, v_proj``: ``32 x 2 x 8 x (4096 + 4096) = 4,194,304`` (PEFT prints "trainable params: 4,194,304").
Embeddings, norms, biases and the LM head stay frozen (PEFT ``bias="none"``; ``modules_to_save`` is not
modelled).

**Kernels.** Forward per adapter: (dropout on ``x`` when ``dropout > 0``: ``nn.Dropout``, a fused kernel that
writes the output and a 1-byte mask) GEMM ``x A`` ``(T, r, in)``, GEMM ``(x A) B`` ``(T, out, r)``, the
scale ``* alpha / r`` and the add to the base output (two elementwise kernels, as PEFT's eager
expression; the add is counted in place on the base output). Backward: the scale's backward, then for
``B`` and ``A`` each an input-gradient and a weight-gradient GEMM, (dropout backward), and the add of
the adapter's input gradient into the base Linear's. The frozen base Linear keeps its input-gradient
GEMM (backward needs it) but has no weight-gradient GEMM, no bias gradient and no gradient tensor;
norms have no ``dgamma`` kernel; the embedding has no backward. The first block's input gradient is
still computed (autograd would prune it when the embedding output does not require grad; Hugging Face
``enable_input_require_grads``, set by PEFT for gradient checkpointing, makes it run): at most
``1 / num_layers`` of the dgrad work too much otherwise (stated in the run's warnings).

**Precision and memory** (the builder's precisions): ``bf16`` / ``fp16`` keep the frozen base weights in
16 bits with no fp32 master copy (Megatron-LM ``_get_param_groups`` skips parameters without
``requires_grad``, so the optimizer makes no main parameter for them; QLoRA, Dettmers et al. 2023,
section 3, computes in bf16 over a frozen base); the adapters have a 16-bit copy, an fp32 master, an
fp32 gradient and fp32 AdamW moments (2 + 4 + 4 + 8 = 18 bytes per trainable parameter).
``amp_fp32_params`` (``torch.autocast`` over fp32 parameters): the base stays fp32 (4 bytes, frozen) and the
adapters are fp32 parameters with fp32 gradients and moments (16 bytes); their weights and, when the
input is fp32, their inputs are cast to bf16 per GEMM as autocast does. With data parallelism (DDP) only
the adapters' gradients are bucketed and all-reduced (DDP skips parameters without ``requires_grad``).

**Tensor parallelism** (PEFT ``LoraParallelLinear``, ``peft/tuners/lora/tp_layer.py``: "when the target layer
is RowParallelLinear ... split the lora matrix A into rows, and the lora_B ... should be a complete linear
layer; ... when the target layer is ColumnParallelLinear, we perform column segmentation on lora_B, while
lora_A is still a complete linear layer"): under the column-parallel QKV and fc1, ``A [in, r]`` is replicated
(every rank computes ``x A`` on the whole input) and ``B [r, out / t]`` is a ``ColumnParallelLinear`` whose input
gradient ``[T, r]`` is all-reduced in backward; under the row-parallel proj and fc2, ``A [in / t, r]`` is a
``RowParallelLinear`` whose ``[T, r]`` output is all-reduced in forward and ``B [r, out]`` is replicated. The
replicated halves get identical gradients on every TP rank (their inputs are whole), so no extra TP
reduction. The row-parallel adapter's output is added before the base output's all-reduce rather than after
it (the same kernels and bytes, in another order).

Not modelled (refused by ``check_lora_spec`` and the scenario schema): sequence parallelism, pipeline and
context parallelism, ZeRO, FSDP, the distributed optimizer, offload, experts and fp8.
"""

from __future__ import annotations

from dataclasses import dataclass

from simulator.graph.ops import CostClass as C

#: Hugging Face (Llama) module names, in the order of a block's Linears
HF_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Megatron-LM / NeMo module names of the fused Linears
MEGATRON_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
#: PEFT's shorthand for every Linear of the blocks
ALL_LINEAR = "all-linear"
#: builder Linear each module adapts
LINEAR_OF = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "proj", "gate_proj": "fc1",
             "up_proj": "fc1", "down_proj": "fc2", "linear_qkv": "qkv", "linear_proj": "proj", "linear_fc1": "fc1",
             "linear_fc2": "fc2"}


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters of a fine-tune (PEFT ``LoraConfig`` names).

    Attributes:
        rank: ``r``, the inner dimension of ``A [in, r]`` and ``B [r, out]``.
        alpha: ``lora_alpha``; the adapter output is scaled by ``alpha / r``.
        target_modules: Module names (``HF_MODULES``, ``MEGATRON_MODULES`` or ``("all-linear",)``).
        dropout: ``lora_dropout``, probability in ``[0, 1)`` (0: no dropout kernel).
    """

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    dropout: float = 0.0


def hf_names(modules: tuple[str, ...]) -> bool:
    """``target_modules`` name Hugging Face's separate projections (``HF_MODULES`` or ``all-linear``), not
    Megatron / NeMo's fused Linears."""
    return any(m in HF_MODULES or m == ALL_LINEAR for m in modules)


def allowed_modules(swiglu: bool) -> tuple[str, ...]:
    """Target names a model accepts: the HF names (``gate_proj`` only with SwiGLU), the Megatron names and
    ``all-linear``."""
    hf = tuple(m for m in HF_MODULES if swiglu or m != "gate_proj")
    return hf + MEGATRON_MODULES + (ALL_LINEAR,)


def adapter_shapes(modules: tuple[str, ...], hidden: int, ffn: int, attention_width: int, kv_width: int,
                   swiglu: bool) -> list[tuple[str, str, int, int]]:
    """The adapters of one block, ``(linear, module, in, out)`` in forward order of the builder's Linears.

    Args:
        modules: ``target_modules``.
        hidden: ``h``. ffn: ``f``. attention_width: ``a d``. kv_width: ``g d``. swiglu: gated MLP.

    Raises:
        ValueError: no module, an unknown module (the message lists the allowed ones), a name given twice,
            HF and Megatron names mixed.
    """
    allowed = allowed_modules(swiglu)
    if not modules:
        raise ValueError(f"no target module (allowed: {', '.join(allowed)})")
    for m in modules:
        if m not in allowed:
            why = " (gate_proj needs model.swiglu: true)" if m == "gate_proj" else ""
            raise ValueError(f"{m!r} is not a module of this model{why} (allowed: {', '.join(allowed)})")
    if len(set(modules)) != len(modules):
        raise ValueError(f"a module is given twice in {list(modules)}")
    if ALL_LINEAR in modules:
        if len(modules) > 1:
            raise ValueError(f"{ALL_LINEAR} already names every block Linear; give it alone")
        modules = tuple(m for m in HF_MODULES if swiglu or m != "gate_proj")
    if any(m in MEGATRON_MODULES for m in modules) and any(m in HF_MODULES for m in modules):
        raise ValueError(f"{list(modules)} mixes Hugging Face and Megatron names (allowed: one family: "
                         f"{', '.join(HF_MODULES)}; or {', '.join(MEGATRON_MODULES)})")
    dims = {"q_proj": (hidden, attention_width), "k_proj": (hidden, kv_width), "v_proj": (hidden, kv_width),
            "o_proj": (attention_width, hidden), "gate_proj": (hidden, ffn), "up_proj": (hidden, ffn),
            "down_proj": (ffn, hidden), "linear_qkv": (hidden, attention_width + 2 * kv_width),
            "linear_proj": (attention_width, hidden), "linear_fc1": (hidden, (2 if swiglu else 1) * ffn),
            "linear_fc2": (ffn, hidden)}
    order = HF_MODULES + MEGATRON_MODULES
    return [(LINEAR_OF[m], m, *dims[m]) for m in sorted(modules, key=order.index)]


def spec_adapters(spec) -> list[tuple[str, str, int, int]]:
    """``adapter_shapes`` of a ``TransformerSpec`` (``spec.lora`` set)."""
    return adapter_shapes(spec.lora.target_modules, spec.hidden_size, spec.ffn_hidden_size, spec.attention_width,
                          spec.query_groups * spec.head_dim, spec.swiglu)


def check_rank(rank: int, shapes: list[tuple[str, str, int, int]]) -> None:
    """Raises: ValueError: ``rank <= 0`` or above ``min(in, out)`` of a targeted Linear (``A B`` cannot have a
    higher rank than that)."""
    if rank <= 0:
        raise ValueError(f"rank must be > 0, got {rank}")
    for _, m, i, o in shapes:
        if rank > min(i, o):
            raise ValueError(f"rank {rank} exceeds min(in, out) = {min(i, o)} of {m} [{i}, {o}] (allowed: 1..{min(i, o)})")


def check_lora_spec(s) -> None:
    """Check ``TransformerSpec.lora`` (nothing when it is None).

    Raises:
        ValueError: bad modules or rank (``adapter_shapes``, ``check_rank``), ``alpha <= 0``, dropout outside
            ``[0, 1)``, or a combination that is not modelled (sequence, pipeline or context parallelism, ZeRO or
            sharding with data parallelism, experts, fp8).
    """
    lo = s.lora
    if lo is None:
        return
    check_rank(lo.rank, spec_adapters(s))
    if not lo.alpha > 0:
        raise ValueError(f"lora alpha must be > 0, got {lo.alpha}")
    if not 0 <= lo.dropout < 1:
        raise ValueError(f"lora dropout must be in [0, 1), got {lo.dropout}")
    dp = s.data_parallel_size > 1
    for what, on in (("sequence parallelism", s.sequence_parallel and s.tensor_parallel_size > 1),
                     ("pipeline parallelism",
                     s.pipeline_parallel_size > 1), ("context parallelism", s.context_parallel_size > 1),
                     ("ZeRO", dp and s.zero_stage > 0), ("sharded data parallelism", dp and s.sharding is not None),
                     ("experts", bool(s.num_experts)), ("fp8", s.fp8 is not None)):
        if on:
            raise ValueError(f"LoRA with {what} is not modelled yet")


#: builder Linears that are column-parallel under tensor parallelism (the others, proj and fc2, are row-parallel)
COLUMN_PARALLEL = ("qkv", "fc1")


def rank_adapters(spec) -> list[tuple[str, str, int, int]]:
    """The adapters of one block as one tensor-parallel rank holds them, ``(linear, module, in, out)`` of its
    ``A [in, r]`` and ``B [r, out]`` (PEFT ``LoraParallelLinear``, ``peft/tuners/lora/tp_layer.py``): under a
    column-parallel Linear ``A`` is whole (replicated) and ``B`` split by columns (``out / t``); under a row-parallel
    one ``A`` is split by rows (``in / t``) and ``B`` whole. The same as ``spec_adapters`` with ``t = 1``."""
    t = spec.tensor_parallel_size
    return [(lin, m, i, o // t) if lin in COLUMN_PARALLEL else (lin, m, i // t, o)
            for lin, m, i, o in spec_adapters(spec)]


def layer_trainable_parameters(spec) -> int:
    """Adapter parameters of one block on one TP rank: ``sum r (in + out)`` over its adapters (``rank_adapters``)."""
    r = spec.lora.rank
    return sum(r * (i + o) for _, _, i, o in rank_adapters(spec))


def trainable_parameters(spec) -> int:
    """Trainable parameters held by one TP rank (the whole model's with ``t = 1``: the adapters of every block):
    Llama-2-7B, ``r = 16`` on all seven HF modules: ``32 x 16 x (4 x 8192 + 2 x 15104 + 15104) = 39,976,960``."""
    return spec.num_layers * layer_trainable_parameters(spec)


def model_flops_per_sample(spec) -> float:
    """Training FLOPs per sample done by a LoRA step: the base matrices forward and input gradient (2 x their
    forward: no weight gradient), attention 3 x (forward and backward), the adapters 3 x (forward, input and
    weight gradients), per GPU (divided by the tensor-parallel size). The same accounting as
    ``TransformerSpec.model_flops_per_sample`` (which is 3 x the forward of everything) otherwise."""
    h, s, V = spec.hidden_size, spec.seq_length, spec.vocab_size
    mlp = (3 if spec.swiglu else 2) * h * spec.ffn_hidden_size
    mat = s * (spec.num_layers * 2 * (h * spec.qkv_out_size + spec.attention_width * h + mlp) + 2 * h * V)
    att = s * spec.num_layers * 4 * spec.attention_width * spec.attention_pairs / s
    whole = spec.num_layers * spec.lora.rank * sum(i + o for _, _, i, o in spec_adapters(spec))
    adapters = 2 * s * whole  # 2 r (in + out) FLOPs per token and adapter, forward
    return (2.0 * mat + 3.0 * att + 3.0 * adapters) / spec.tensor_parallel_size


# -- builder hooks (``bld``: the GPT builder) ----------------------------------------------------
def persistent(bld) -> None:
    """Persistent model states with LoRA: the frozen base (16-bit, or fp32 under ``amp_fp32_params``), the
    adapters' copy, fp32 master (16-bit precisions), AdamW moments and DDP buckets of the adapters only."""
    s, b = bld.s, bld.b
    P, Pa = s.rank_num_parameters, trainable_parameters(s)
    if bld.amp:
        b.persistent("params.fp32.frozen", 4 * P)
        b.persistent("params.lora.fp32", 4 * Pa)
    else:
        b.persistent(f"params.{bld.e.half}.frozen", 2 * P)
        b.persistent(f"params.lora.{bld.e.half}", 2 * Pa)
        b.persistent("params.lora.master_fp32", 4 * Pa)
    b.persistent("optimizer.exp_avg", 4 * Pa)
    b.persistent("optimizer.exp_avg_sq", 4 * Pa)
    if bld.dp and bld.zero == 0:
        b.persistent("grad.ddp_buckets", 4 * Pa)  # DDP buckets hold the parameters that require grad


def _gemm(bld, name: str, m: int, n: int, k: int, a: str, b: str, out: str, out_numel: int) -> str:
    """A 16-bit GEMM ``[m, k] x [k, n]`` reading the tensors ``a`` and ``b``; returns its output tensor."""
    e = bld.e
    y = e.fresh(out)
    e.kernel(name, C.GEMM, flops=2 * m * n * k, shape=(m, n, k), reads=2 * (m * k + k * n), writes=2 * m * n,
             out=[(y, 2 * out_numel)], uses=[a, b])
    return y


def _cast_weight(bld, name: str, numel: int) -> str:
    """Autocast's cast of an fp32 weight to bf16; returns the 16-bit copy."""
    w16 = bld.e.fresh(f"{name}.w16")
    bld.e.kernel(f"{name}.cast_w", C.CAST, reads=4 * numel, writes=2 * numel, out=[(w16, 2 * numel)], dtype="fp32")
    return w16


def adapter_fwd(bld, linear: str, x: str, x_fp32: bool, y: str, save: bool) -> list | None:
    """The adapters of block Linear ``linear`` on its input ``x`` (fp32 when ``x_fp32`` under autocast), added in
    place to its output ``y``. Returns what ``adapter_bwd`` needs (None when nothing is adapted or not saved)."""
    e, T, lo = bld.e, bld.T, bld.s.lora
    if e.layer < 0:
        return None
    r = lo.rank
    saved = []
    for lin, mod, i, o in bld.lora_adapters:  # this TP rank's shapes (rank_adapters)
        if lin != linear:
            continue
        p = f"lora.{mod}"
        xa = x
        if bld.amp and x_fp32:  # autocast casts the fp32 input again for the adapter's matmul
            xa = e.fresh(f"{p}.in16")
            e.kernel(f"{p}.cast_in", C.CAST, reads=4 * T * i, writes=2 * T * i, out=[(xa, 2 * T * i)], uses=[x],
                     dtype="fp32")
        mask = None
        if lo.dropout > 0:  # nn.Dropout: output + bool mask (saved for backward)
            xd, mask = e.fresh(f"{p}.dropout.out"), e.fresh(f"{p}.dropout.mask")
            e.kernel(f"{p}.dropout", C.ELEMENTWISE, reads=2 * T * i, writes=3 * T * i, flops=T * i,
                     out=[(xd, 2 * T * i), (mask, T * i)], uses=[xa])
            xa = xd
        wa, wb = f"param.L{e.layer}.{p}.A", f"param.L{e.layer}.{p}.B"
        if bld.amp:  # autocast: the fp32 adapter weights are cast to bf16 per forward
            wa, wb = (_cast_weight(bld, f"{p}.{ab}", n) for ab, n in (("A", r * i), ("B", r * o)))
        ha = _gemm(bld, f"{p}.A.gemm", T, r, i, xa, wa, f"{p}.A.out", T * r)
        if bld.tp > 1 and lin not in COLUMN_PARALLEL:  # row-parallel A (RowParallelLinear): sum x A over the ranks
            e.producer[ha] = bld._tp_op(f"lora.{mod}.A.all_reduce", "all_reduce", 2 * T * r, uses=[ha])
        hb = _gemm(bld, f"{p}.B.gemm", T, o, r, ha, wb, f"{p}.B.out", T * o)
        sc = e.fresh(f"{p}.scaled")
        e.kernel(f"{p}.scale", C.ELEMENTWISE, reads=2 * T * o, writes=2 * T * o, flops=T * o, out=[(sc, 2 * T * o)],
                 uses=[hb])
        e.producer[y] = e.kernel(f"{p}.add", C.ELEMENTWISE, reads=4 * T * o, writes=2 * T * o, flops=T * o,
                                 uses=[y, sc])
        saved.append((lin, mod, i, o, xa, mask, ha, wa, wb))
    return saved if save and saved else None


def adapter_bwd(bld, g: str, saved: list | None, dx: str) -> str:
    """Backward of ``adapter_fwd`` from the 16-bit gradient ``g`` of the Linear's output: per adapter the scale's
    backward, ``B``'s and ``A``'s input- and weight-gradient GEMMs (fp32 gradient accumulation, gradient ready
    for DDP), dropout backward, and an in-place add of the adapter's input gradient into ``dx`` (the base
    Linear's). Returns ``dx``."""
    if not saved:
        return dx
    e, T, r = bld.e, bld.T, bld.s.lora.rank
    for lin, mod, i, o, xa, mask, ha, wa, wb in saved:
        p = f"lora.{mod}"
        gs = e.fresh(f"{p}.scale.dx")
        e.kernel(f"{p}.scale.dgrad", C.ELEMENTWISE, reads=2 * T * o, writes=2 * T * o, flops=T * o,
                 out=[(gs, 2 * T * o)], uses=[g])
        gha = _gemm(bld, f"{p}.B.dgrad", T, r, o, gs, wb, f"{p}.B.dx", T * r)
        if bld.tp > 1 and lin in COLUMN_PARALLEL:  # column-parallel B: its input gradient is summed over the ranks
            e.producer[gha] = bld._tp_op(f"lora.{mod}.B.dgrad.all_reduce", "all_reduce", 2 * T * r, uses=[gha])
        dwb = _gemm(bld, f"{p}.B.wgrad", o, r, T, gs, ha, f"{p}.B.dw16", r * o)
        wid, gname = bld._accumulate_grad(f"{p}.B", dwb, r * o)
        bld._grad_ready(f"{p}.B", r * o, wid, gname)
        gxa = _gemm(bld, f"{p}.A.dgrad", T, i, r, gha, wa, f"{p}.A.dx", T * i)
        dwa = _gemm(bld, f"{p}.A.wgrad", r, i, T, gha, xa, f"{p}.A.dw16", r * i)
        wid, gname = bld._accumulate_grad(f"{p}.A", dwa, r * i)
        bld._grad_ready(f"{p}.A", r * i, wid, gname)
        if mask is not None:
            gd = e.fresh(f"{p}.dropout.dx")
            e.kernel(f"{p}.dropout.dgrad", C.ELEMENTWISE, reads=3 * T * i, writes=2 * T * i, flops=T * i,
                     out=[(gd, 2 * T * i)], uses=[gxa, mask])
            gxa = gd
        e.producer[dx] = e.kernel(f"{p}.dx.add", C.ELEMENTWISE, reads=4 * T * i, writes=2 * T * i, flops=T * i,
                                  uses=[dx, gxa])
    return dx
