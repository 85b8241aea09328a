"""DeepSpeed's ``FP16_Optimizer``: what a DeepSpeed run with ZeRO stage 0 and 16-bit training keeps and runs.

DeepSpeed wraps the optimizer in it for ZeRO off with model and gradient-accumulation dtype both fp16 (``FP16``), or
both bf16 without a ``PipelineModule`` (``DDP_BFLOAT16``, with ``low_precision_dtype`` bf16; bf16 with a pipeline
is ``BF16_Optimizer``: ``bf16_optimizer.py``), when the basic optimizer is ``FusedAdam`` (DeepSpeed's ``Adam`` /
``AdamW``, ``training.optimizer.impl: fused``; another is ``FP16_UnfusedOptimizer``, not modelled)
(deepspeedai/DeepSpeed@007cca6a ``deepspeed/runtime/engine.py`` ``_do_optimizer_sanity_check``,
``_configure_optimizer``, ``_configure_fp16_optimizer``). Sources of everything below: deepspeedai/DeepSpeed@051b9c8b
``deepspeed/runtime/fp16/fused_optimizer.py`` (``FP16_Optimizer.__init__`` / ``step`` / ``unscale_and_clip_grads``,
``fused_adam_legacy`` false: the engine's ``optimizer_legacy_fusion`` default), @03959e2b ``deepspeed/runtime/utils.py``
(``CheckOverflow.has_overflow``, ``_has_inf_or_nan``, ``get_flattened_grad_norm``), @18fd4c97
``deepspeed/runtime/fp16/loss_scaler.py`` (``LossScaleConfig``: loss scaling only for fp16, ``cur_scale`` 1.0 with
bf16), @007cca6a ``deepspeed/runtime/engine.py`` (``_backward_epilogue``, ``allreduce_gradients``,
``buffered_allreduce_fallback``, ``allreduce_no_retain``, ``allreduce_and_copy``, ``allreduce_bucket``,
``communication_data_type``, ``_take_model_step``) and @03f6f75c ``deepspeed/runtime/pipe/engine.py``
(``_exec_reduce_tied_grads``, ``_exec_reduce_grads``).

Param groups: Megatron-DeepSpeed hands DeepSpeed the optimizer built over two param groups, weight decay then no
weight decay (biases and norm weights: ``transformer.no_weight_decay``; deepspeedai/Megatron-DeepSpeed@dd16deb1
``megatron/optimizer/__init__.py`` ``get_param_groups``, each in ``named_parameters()`` order, an empty one left out;
``get_megatron_optimizer``: ``if args.deepspeed: return optimizer``), as Hugging Face's Trainer does, and
``FP16_Optimizer.__init__`` flattens **each group** on its own (``fp16_groups_flat[i]``, ``fp32_groups_flat[i]``):
``param_groups``. Everything the step does per group below runs once per group, one group after the other.

Memory of one rank whose stage holds ``P`` parameters (``P_i`` in group ``i``):

* the 16-bit parameters, flattened (``fp16_groups_flat``; the model's tensors made views of it): 2 P;
* the flat fp32 master copy of **every** parameter (``fp32_groups_flat``, one per group, not partitioned): 4 P, and
  the fused Adam's two moments on it: 8 P;
* the autograd ``.grad`` of every 16-bit parameter (2 P), accumulated over the micro-batches, from the step's first
  backward until ``step`` sets it to None after flattening it;
* at the step, group by group, the per-tensor fp32 copies ``p.grad.to(fp32)`` (4 P_i together) and the flat fp32
  gradient ``_flatten_dense_tensors`` concatenates them into (4 P_i; the copies freed after it, the group's ``.grad``
  set to None, the flat one freed after Adam).

After the last micro-batch's backward (``_backward_epilogue`` -> ``allreduce_gradients``; a pipeline's
``_exec_reduce_grads``, after ``_exec_reduce_tied_grads`` has all-reduced the tied embedding's ``.grad``) the engine's
``buffered_allreduce_fallback`` takes the ``.grad`` in ``named_parameters()`` order and ``allreduce_no_retain``
packs them into buckets of ``MEMORY_OPT_ALLREDUCE_SIZE`` (500,000,000) elements, a bucket closing once its elements
*exceed* it (``allreduce_buckets``). Per bucket (``allreduce_and_copy`` -> ``allreduce_bucket``): ``torch.cat``
into a fresh 16-bit flat tensor (read + write 2 B per element; none for a one-tensor bucket, a view), no cast
(``communication_data_type`` defaults to the model dtype with fp16 / bf16 enabled), ``gradient_predivide_factor``
1.0 and ``prescale_gradients`` false (DeepSpeed's defaults: postscaling), so one all-reduce of the flat tensor in
the model dtype over the data-parallel group, then ``mul_(1 / d)`` (read + write 2 B; skipped with ``d`` 1) and one
``copy_`` back into each ``.grad`` (read + write 2 B per element, one launch per tensor). It runs on the compute
stream (a synchronous ``dist.all_reduce``: the stream waits for it), with one data-parallel rank too (the all-reduce
over a one-rank group exchanges nothing: not priced).

``FP16_Optimizer.step`` (no overflow assumed: a skipped step is not modelled):

1. ``has_overflow`` over every parameter with a ``.grad``: per tensor ``float(x.float().sum())``, the fp32 copy (read
   2, write 4 B per element), its sum (read 4 B) and ``float()``, a host read: one sync per tensor; then the 1-byte
   flag all-reduced (MAX) over the model-parallel group where DeepSpeed has an ``mpu`` (tensor or pipeline
   parallelism; none without) and ``overflow_gpu[0].item()``. It runs with bf16 too (``step`` calls it whatever
   the dtype; only the loss-scale update is fp16's);
2. per group, the flatten above (per tensor ``p.grad.to(fp32)``: read 2, write 4 B; ``torch.cat``: read + write 4 B
   per element; none for a one-tensor group, a view), then the group's ``p.grad = None``;
3. ``get_flattened_grad_norm`` over the groups' flat fp32 gradients: per group ``.float()`` returns it, ``.norm(2)``
   reads 4 B per element, ``.item()`` (a host read: one per group), then the total in a fresh 4-byte tensor
   all-reduced (SUM) over the model-parallel group (with an ``mpu``) and ``.item()`` again. On a pipeline stage
   holding a pipe-replicated tied embedding (``ds_pipe_replicated``: a later stage's copy,
   ``bf16_optimizer.holds_pipe_replica``) the norm of the group holding it (weight decay) masks its range
   (``grad_norm_mask``, ``_get_norm_mask_idx``): an fp32 ``zeros`` of ``P_i + 1`` elements (4 B written), its
   ``cumsum`` (read + write 4 B), ``.bool()`` (read 4, write 1 B), ``torch.masked_fill`` (read 4 + 1, write 4 B per
   element), the norm of that;
4. ``unscale_and_clip_grads``: per group ``grad.mul_(1 / combined_scale)`` over its flat gradient (read + write 4 B
   per element), whatever ``gradient_clipping`` (the clip coefficient is folded into the scale on the host: no
   kernel, no sync of its own);
5. the fused Adam, one ``multi_tensor_applier`` per group over its flat fp32 master (read 16, write 12 B per
   element), then the flat gradients freed;
6. ``p.data.copy_(q.data)`` per tensor from the fp32 master's views (read 4, write 2 B per element, one launch each).

The engine's ``zero_grad`` after it sets the (already None) ``.grad`` to None: no kernel. The scalar kernels (the
``ByteTensor`` / ``FloatTensor`` made from host values, ``scatter_`` of the mask's few range ends) are not counted.
With tensor parallelism, on every TP rank but 0 ``_get_norm_mask_idx`` also masks the parameters that are not
tensor-parallel (``_require_avoid_recompute_norm``: ``is_model_parallel_parameter`` false, i.e. no
``tensor_model_parallel`` attribute set by Megatron's vocab-parallel embedding and column- / row-parallel weights,
column-parallel biases: ``tp_split``), so the mask kernels of step 3 run over each group holding one (the norms
always: the no-weight-decay group; learned positions: the weight-decay group). The folded TP peers are simulated as
such a rank, the slowest and largest: rank 0 skips those kernels and then waits for the others at the norm's
model-parallel all-reduce (``masked_groups``; deepspeedai/DeepSpeed@051b9c8b ``fused_optimizer.py``
``_require_avoid_recompute_norm``, deepspeedai/Megatron-DeepSpeed@dd16deb1 ``megatron/core/tensor_parallel/layers.py``
``set_tensor_model_parallel_attributes``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from simulator.graph.builders import bf16_optimizer as bf16opt
from simulator.graph.ops import CostClass as C
from simulator.graph.ops import OpKind, Phase

#: DeepSpeed's ``MEMORY_OPT_ALLREDUCE_SIZE`` (deepspeedai/DeepSpeed@007cca6a ``deepspeed/runtime/engine.py``): the
#: elements per gradient all-reduce bucket of ``allreduce_gradients`` (the engine's and the pipeline engine's call).
ALLREDUCE_BUCKET_ELEMENTS = 500_000_000
#: Bytes per element of the ``.grad`` tensors and of their all-reduce: the model dtype (fp16 or bf16).
GRAD_BYTES = 2


def step_transient_bytes(groups: Sequence[int], masked: Collection[int] = ()) -> int:
    """Bytes ``step`` holds beyond the states and the 16-bit ``.grad`` at its peak, for param groups of ``groups``
    elements (``param_groups`` order): group ``i``'s flatten holds its per-tensor fp32 copies and flat fp32 gradient
    (8 P_i) beside the flat gradients of the groups before it (4 P_j each) less their freed ``.grad`` (2 P_j); for
    each group in ``masked`` (``masked_groups``), once every ``.grad`` is freed, all the flat gradients and its norm
    mask's ``zeros``, ``cumsum`` and ``bool`` tensors (9 (P_i + 1)) less the freed ``.grad`` (2 P), if larger (module
    docstring, steps 2-3)."""
    peak = done = 0
    for n in groups:
        peak, done = max(peak, (4 - GRAD_BYTES) * done + 8 * n), done + n
    return max([peak] + [4 * done + 9 * (groups[i] + 1) - GRAD_BYTES * done for i in masked])


def tp_split(name: str) -> bool:
    """Parameter ``name`` is tensor-parallel (Megatron sets ``tensor_model_parallel`` on it): the vocab-parallel
    token table and LM head, the column-parallel ``qkv`` / ``fc1`` weights and biases, the row-parallel ``proj`` /
    ``fc2`` weights (not their biases); norms, learned positions and anything else are replicated (module
    docstring)."""
    parts = name.split(".")
    module, leaf = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)
    return (name in ("wte.weight", "lm_head.weight") or module in ("qkv", "fc1")
            or (module in ("proj", "fc2") and leaf == "weight"))


def masked_groups(spec, named: Sequence[tuple[str, int]]) -> list[int]:
    """Indices of the ``param_groups`` of ``named`` whose gradient norm ``get_flattened_grad_norm`` masks on the
    simulated rank: the weight-decay group (0) on a stage holding a pipe-replicated tied embedding
    (``bf16_optimizer.holds_pipe_replica``), and with ``tensor_parallel_size`` > 1 every group holding a parameter
    that is not tensor-parallel (``tp_split``: a TP rank other than 0, module docstring)."""
    out = {0} if bf16opt.holds_pipe_replica(spec) else set()
    if spec.tensor_parallel_size > 1:
        out |= {i for i, g in enumerate(_split(named)) if not all(tp_split(n) for n, _ in g)}
    return sorted(out)


def param_groups(named: Sequence[tuple[str, int]]) -> list[list[int]]:
    """Elements of each tensor of each non-empty param group FP16_Optimizer flattens (``fp16_groups``), in
    ``optimizer.param_groups`` order, weight decay then no weight decay (``transformer.no_weight_decay``), each in
    the order of ``named``: ``(name, elements)`` of the rank's parameters in ``named_parameters()`` order (module
    docstring)."""
    return [[n for _, n in g] for g in _split(named)]


def _split(named: Sequence[tuple[str, int]]) -> list[list[tuple[str, int]]]:
    """``named`` split into the non-empty param groups of ``param_groups``, ``(name, elements)`` each."""
    from simulator.graph.builders.transformer import no_weight_decay  # transformer imports this module

    split = ([x for x in named if not no_weight_decay(x[0])], [x for x in named if no_weight_decay(x[0])])
    return [g for g in split if g]


def allreduce_buckets(numels: Sequence[int], cap: int = ALLREDUCE_BUCKET_ELEMENTS) -> list[list[int]]:
    """DeepSpeed's ``allreduce_no_retain`` bucketing: each tensor is appended to the open bucket, which closes once
    its elements exceed ``cap`` (the tensor that crosses it included); the rest is the last bucket.

    Args:
        numels: Elements of each gradient tensor, in ``named_parameters()`` order.
        cap: ``numel_per_bucket``, elements (>= 1).

    Returns:
        The elements of each tensor, bucket by bucket (concatenated they are ``numels``).

    Raises:
        ValueError: ``cap < 1`` or a negative size.
    """
    if cap < 1 or any(n < 0 for n in numels):
        raise ValueError(f"allreduce_buckets needs cap >= 1 and sizes >= 0, got cap={cap}")
    out: list[list[int]] = []
    cur: list[int] = []
    for n in numels:
        cur.append(n)
        if sum(cur) > cap:
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


def module_numels(bld) -> list[int]:
    """Elements of each parameter tensor of the rank in ``named_parameters()`` order (the builder's gradient groups,
    which backward makes in reverse)."""
    return [g.numel for g in reversed(bld.groups)]


def rank_param_groups(bld) -> list[list[int]]:
    """``param_groups`` of the rank's parameters (``bld.groups``, in ``named_parameters()`` order)."""
    return param_groups([(g.name, g.numel) for g in reversed(bld.groups)])


def persistent(bld, P: int) -> None:
    """The states FP16_Optimizer keeps (module docstring): 16-bit parameters (2 P), the flat fp32 master copy (4 P)
    and the Adam moments on it (8 P), bytes; the ``.grad`` are made by backward."""
    b = bld.b
    bld._half_params(P)
    b.persistent("params.master_fp32", 4 * P)
    b.persistent("optimizer.exp_avg", 4 * P)
    b.persistent("optimizer.exp_avg_sq", 4 * P)


def reduce_grads(bld, grads: list[str]) -> None:
    """The engine's ``buffered_allreduce_fallback`` after the last backward (module docstring): per bucket the
    16-bit flatten, the all-reduce over ``dp`` (data parallel only) and its ``mul_(1 / d)``, the per-tensor copy
    back; ``grads`` the ``.grad`` tensors (alive until the step). The last op joins ``bld.comm_ops``."""
    e, g = bld.e, GRAD_BYTES
    e.phase, e.layer = Phase.BWD, -1
    last = len(bld.b) - 1
    for k, bucket in enumerate(allreduce_buckets(module_numels(bld), ALLREDUCE_BUCKET_ELEMENTS)):
        n, flat = sum(bucket), []
        if len(bucket) > 1:  # _flatten_dense_tensors of one tensor is a view of it
            flat = [e.fresh("grad.allreduce_flat")]
            last = e.kernel(f"fp16opt.allreduce_bucket.{k}.flatten", C.COPY, reads=g * n, writes=g * n,
                            out=[(flat[0], g * n)], uses=grads, deps=[last])
        if bld.dp:
            ar = bld._collective(f"fp16opt.grad_all_reduce.{k}", "all_reduce", g * n, [last], Phase.BWD, uses=flat,
                                 elem_bytes=g)
            last = e.kernel(f"fp16opt.allreduce_bucket.{k}.div", C.ELEMENTWISE, reads=g * n, writes=g * n, flops=n,
                            uses=flat, deps=[ar])
        if flat:
            for j, m in enumerate(bucket):
                last = e.kernel(f"fp16opt.allreduce_bucket.{k}.copy_.{j}", C.COPY, reads=g * m, writes=g * m,
                                uses=flat + grads, deps=[last])
    bld.comm_ops.append(last)


def _sync(bld, name: str, deps: list[int]) -> list[int]:
    """A host read of a device value (``.item()`` / ``float()``) after ``deps``."""
    return [bld.b.add(name, OpKind.SYNC, "host", deps=deps, phase=Phase.OPT, launch=False)]


def _masked_grad(bld, flat: str, P: int, deps: list[int], k: int) -> str:
    """``get_flattened_grad_norm``'s mask (of the pipe-replicated or the not tensor-parallel ranges) over group
    ``k``'s ``P``-element fp32 flat gradient (module docstring, step 3): returns the masked copy the norm reads."""
    e = bld.e
    z, cs, mb, out = (e.fresh(f"grad.norm_mask.{w}") for w in ("zeros", "cumsum", "bool", "masked"))
    i = e.kernel(f"fp16opt.grad_norm.mask.zeros.{k}", C.MEMSET, writes=4 * (P + 1), out=[(z, 4 * (P + 1))],
                 deps=deps, dtype="fp32")
    i = e.kernel(f"fp16opt.grad_norm.mask.cumsum.{k}", C.REDUCTION, reads=4 * (P + 1), writes=4 * (P + 1), flops=P,
                 out=[(cs, 4 * (P + 1))], uses=[z], deps=[i], dtype="fp32")
    i = e.kernel(f"fp16opt.grad_norm.mask.bool.{k}", C.CAST, reads=4 * (P + 1), writes=P + 1, flops=P,
                 out=[(mb, P + 1)], uses=[cs, z], deps=[i], dtype="fp32")
    e.kernel(f"fp16opt.grad_norm.masked_fill.{k}", C.ELEMENTWISE, reads=5 * P, writes=4 * P, flops=P,
             out=[(out, 4 * P)], uses=[flat, mb], deps=[i], dtype="fp32")
    return out


def step(bld, grads: list[str], deps: list[int]) -> None:
    """``FP16_Optimizer.step`` (module docstring, steps 1-6) over this rank's param groups (``rank_param_groups``),
    after ``deps``; ``grads`` the 16-bit ``.grad`` tensors the builder tracks (the weights': the first group's),
    freed by that group's flatten."""
    e, s = bld.e, bld.s
    e.phase, e.layer = Phase.OPT, -1
    named = [(g.name, g.numel) for g in reversed(bld.groups)]
    groups, masked = param_groups(named), masked_groups(s, named)
    numels = [m for g in groups for m in g]  # fp16_params: group after group
    last = deps
    for j, m in enumerate(numels):  # CheckOverflow.has_overflow_serial: float(x.float().sum()) per tensor
        f32 = e.fresh("grad.overflow_fp32")
        cast = e.kernel(f"fp16opt.has_inf_or_nan.{j}.float", C.CAST, reads=2 * m, writes=4 * m, flops=m,
                        out=[(f32, 4 * m)], uses=grads, deps=last, dtype="fp32")
        total = e.kernel(f"fp16opt.has_inf_or_nan.{j}.sum", C.REDUCTION, reads=4 * m, writes=4, flops=m, uses=[f32],
                         deps=[cast], dtype="fp32")
        last = _sync(bld, f"fp16opt.has_inf_or_nan.{j}.item", [total])
    last = _sync(bld, "fp16opt.overflow.item", bld._grad_stats_all_reduce("fp16opt.overflow", last, nbytes=1))
    flats, j = [], 0
    for i, group in enumerate(groups):  # _flatten_dense_tensors([p.grad.to(fp32) ...]) per group, then p.grad = None
        held = grads if i == 0 else []
        copies = []
        for m in group:
            t = e.fresh("grad.fp32_copy")
            e.kernel(f"fp16opt.grad_to_fp32.{j}", C.CAST, reads=2 * m, writes=4 * m, flops=m, out=[(t, 4 * m)],
                     uses=held, deps=last, dtype="fp32")
            copies.append(t)
            j += 1
        if len(copies) == 1:
            flats.append(copies[0])
            continue
        flats.append(e.fresh("grad.fp32_flat"))
        n = sum(group)
        e.kernel(f"fp16opt.grad_flat.cat.{i}", C.COPY, reads=4 * n, writes=4 * n, out=[(flats[-1], 4 * n)],
                 uses=copies + held, dtype="fp32")
    last = [e.last_compute]
    for i, (group, flat) in enumerate(zip(groups, flats)):  # get_flattened_grad_norm: one norm and .item() each
        P = sum(group)
        src = _masked_grad(bld, flat, P, last, i) if i in masked else flat
        norm = e.kernel(f"fp16opt.grad_norm.norm.{i}", C.REDUCTION, reads=4 * P, writes=4, flops=2 * P, uses=[src],
                        deps=last, dtype="fp32")
        last = _sync(bld, f"fp16opt.grad_norm.item.{i}", [norm])
    last = _sync(bld, "fp16opt.grad_norm.total.item", bld._grad_stats_all_reduce("fp16opt.grad_norm", last))
    for i, (group, flat) in enumerate(zip(groups, flats)):  # unscale_and_clip_grads
        P = sum(group)
        last = [e.kernel(f"fp16opt.unscale_and_clip_grads.mul.{i}", C.ELEMENTWISE, reads=4 * P, writes=4 * P,
                         flops=P, uses=[flat], deps=last, dtype="fp32")]
    adams = []
    for i, (group, flat) in enumerate(zip(groups, flats)):  # FusedAdam.step: one multi_tensor_applier per group
        P = sum(group)
        adams.append(e.kernel(f"adamw.{i}", C.OPTIMIZER, reads=16 * P, writes=12 * P, flops=12 * P, uses=[flat],
                              deps=[adams[-1]] if adams else last, dtype="fp32", meta={"params": P}))
    for j, m in enumerate(numels):  # p.data.copy_(q.data) from the fp32 master's views
        e.kernel(f"fp16opt.update_fp16.{j}", C.CAST, reads=4 * m, writes=2 * m, flops=m, deps=[adams[-1]])
