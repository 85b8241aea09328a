"""Gradient-norm work of the optimizer step outside Megatron's optimizer: what DeepSpeed ZeRO-1/2 runs every step,
PyTorch's ``torch.nn.utils.clip_grad_norm_`` and FSDP's ``clip_grad_norm_``. Megatron's own norm is
``_GptBuilder._clip_grad_norm``; the model-parallel all-reduce all of them share is
``_GptBuilder._grad_stats_all_reduce``.

Every kernel here is memory-bound, one launch per op, bytes counted as the kernel moves them (the roofline's
``REDUCTION`` / ``CAST`` / ``ELEMENTWISE`` efficiency tables price them). The scalar kernels between the big ones
(``torch.stack`` of the per-tensor norms, ``square``, ``sum``, ``pow``, the clip coefficient's ``div`` and
``clamp``, DeepSpeed's nan/inf mask) read and write a few bytes each: not counted, as in
``_GptBuilder._fsdp_clip_grad_norm``.

* **DeepSpeed ZeRO-1/2** (``deepspeed_zero_step``; source deepspeedai/DeepSpeed@7dee2e0
  ``deepspeed/runtime/zero/stage_1_and_2.py`` ``DeepSpeedZeroOptimizer.step``), over this rank's partition of the
  flat 16-bit gradients (``averaged_gradients``: one view per parameter tensor the partition touches,
  ``zero_partition_pieces``):

  1. with ``check_grad_overflow`` (fp16; the ctor's default True, bf16's ``bf16.check_grad_overflow`` default
     False): ``has_overflow_partitioned_grads_serial``, per tensor ``_has_inf_or_nan``: ``x.float()``,
     ``isnan``, ``isinf``, ``logical_or``, ``.float()``, ``max`` (``HAS_INF_OR_NAN``: 28 B per 16-bit element,
     6 launches); ``overflow.byte()`` all-reduced (MAX, 1 byte) over the data-parallel group, then over the
     model-parallel group (``_model_parallel_all_reduce``), then ``overflow_gpu[0].item()``: a host sync.
  2. ``scaled_global_norm`` -> ``get_grad_norm_direct``: per tensor ``torch.linalg.vector_norm(g.double())``:
     the fp64 copy (read 2, write 8 B per element) and its norm (read 8 B); the stacked squares summed, the
     4-byte fp32 total all-reduced (SUM) over the data-parallel group and the model-parallel group; no host read
     (``mask_nan_or_inf_with_val_inplace`` and the clip coefficient stay on the device). Computed whatever
     ``gradient_clipping`` (the norm is logged as ``_global_grad_norm``).
  3. ``single_grad_partition = self.flatten(averaged_gradients).to(fp32)``: ``torch.cat`` of the views (read +
     write 2 B per element) and the cast to fp32 (read 2, write 4 B), a fresh fp32 gradient partition the
     optimizer reads (no cast with fp32 gradients: ``.to`` returns the tensor), after the norm's all-reduce (a
     synchronous ``dist.all_reduce``: the current stream waits for it).
  4. ``unscale_and_clip_grads``: ``grad.data.mul_(1. / combined_scale)`` over the fp32 partition (read + write
     4 B per element), whatever ``gradient_clipping`` (0: ``combined_scale`` is the loss scale, 1.0 with bf16,
     and the ``mul_`` still runs).

  Per 16-bit partition element: 18 B for the norm, 10 B for the flat fp32 copy, 8 B for the ``mul_`` (36 B; the
  earlier unpriced estimate of 26 B left the copy out), plus 28 B with the fp16 overflow check. With optimizer
  offload the CPU path replaces all of it (``simulator.policies.offload_optimizer``).
* **DeepSpeed ZeRO-3** (``deepspeed_zero_step`` with ``stage3``; source deepspeedai/DeepSpeed@007cca6a
  ``deepspeed/runtime/zero/stage3.py`` ``DeepSpeedZeroOptimizer_Stage3.step``), the same four stages over this
  rank's gradient partition, with two differences:

  1. fp16 only (``_overflow_check_and_loss_scale_update``: ``if self.dtype == torch.float16: check_overflow()``):
     ``has_overflow(partition_gradients=True)`` runs ``torch.isinf(grad_partitions_flat_buffer).any()`` and
     ``torch.isnan(...).any()`` over the whole flat 16-bit partition (``ZERO3_HAS_INF_OR_NAN``: 6 B per element,
     4 launches), ``logical_or_`` into a 1-element tracker, the 1-byte flag all-reduced (MAX) over the
     data-parallel group and the model-parallel group, then ``overflow_gpu[0].item()``: a host sync.
  2. ``_get_norm_groups`` -> ``get_grad_norm_direct`` over ``averaged_gradients``: one view per parameter tensor,
     each its own ZeRO-3 partition of ``ceil(numel / dp)`` elements (``partition_parameters.py`` ``_aligned_size``
     pads every parameter to a multiple of the world size; ``zero3_partition_pieces``), ``g.double().norm(2)``
     each; the stacked squares summed in fp64, so the total all-reduced (SUM) over the data-parallel group is 8
     bytes, and the same fp64 tensor over the model-parallel group (``_model_parallel_all_reduce``;
     ``_grad_stats_all_reduce`` with ``nbytes=8``; deepspeedai/DeepSpeed@007cca6a ``stage3.py``).

  Then ``_prepare_fp32_grad_for_sub_group`` (``self.flatten(averaged_gradients).to(fp32)``: the flat copy and
  the cast, as ZeRO-1/2) and ``unscale_and_clip_grads`` (``mul_(1. / combined_scale)`` whatever ``clip_grad``),
  per ``sub_group_size`` sub-group (one sub-group priced: DeepSpeed's default ``sub_group_size`` 1e9 covers a
  rank's partition up to a billion elements; the per-sub-group launches beyond it are not counted).
* **PyTorch** ``clip_grad_norm_`` (``torch_clip_grad_norm``; source pytorch/pytorch@01a57d8
  ``torch/nn/utils/clip_grad.py``, ``_get_total_norm`` and ``_clip_grads_with_norm_``): per (device, dtype)
  group one ``torch._foreach_norm`` (read the gradient once, one 4-byte norm per tensor), the
  ``vector_norm`` of the stacked norms, ``clip_coef = max_norm / (total_norm + 1e-6)`` clamped at 1 on the
  device, one ``torch._foreach_mul_`` (read + write every gradient) whatever the norm; ``error_if_nonfinite``
  False (the default): no host read. Under DDP the gradients are already all-reduced: no collective; with
  pipeline or tensor parallelism the norm's all-reduce over the model-parallel ranks (torchtitan's
  ``dist_utils.clip_grad_norm_``) is ``_grad_stats_all_reduce``. Priced as one launch each per dtype group
  (``foreach`` kernels are chunked by ``multi_tensor_apply``: those launches are not counted).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from simulator.graph.ops import CostClass as C
from simulator.graph.ops import OpKind, Phase

#: DeepSpeed ``_has_inf_or_nan(x)`` over a 16-bit gradient, per element: ``(name, cost class, read B, write B)``
#: of each kernel (deepspeedai/DeepSpeed@7dee2e0 stage_1_and_2.py: ``float_x = x.float()``, ``float_x.isnan()``,
#: ``float_x.isinf()``, ``nan.logical_or(inf)``, ``inf_or_nan.float()``, ``.max()``; bool tensors 1 B).
HAS_INF_OR_NAN = (("float", C.CAST, 2, 4), ("isnan", C.ELEMENTWISE, 4, 1), ("isinf", C.ELEMENTWISE, 4, 1),
                  ("logical_or", C.ELEMENTWISE, 2, 1), ("to_float", C.CAST, 1, 4), ("max", C.REDUCTION, 4, 0))


#: DeepSpeed ZeRO-3 ``has_overflow(partition_gradients=True)`` over the flat 16-bit gradient partition, per element:
#: ``(name, cost class, read B, write B)`` (deepspeedai/DeepSpeed@007cca6a stage3.py: ``torch.isinf(buf).any()``,
#: ``torch.isnan(buf).any()``; bool tensors 1 B, each ``.any()`` a 1-byte result; the ``logical_or_`` into the
#: 1-element tracker and its ``.to(torch.uint8)`` are scalars, not counted).
ZERO3_HAS_INF_OR_NAN = (("isinf", C.ELEMENTWISE, 2, 1), ("isinf_any", C.REDUCTION, 1, 0),
                        ("isnan", C.ELEMENTWISE, 2, 1), ("isnan_any", C.REDUCTION, 1, 0))


def zero3_partition_pieces(numels: Sequence[int], dp: int) -> list[int]:
    """The gradient views of one rank's ZeRO-3 partition: one per parameter tensor, ``ceil(numel / dp)``
    elements each (DeepSpeed ZeRO-3 partitions every parameter on its own, padded to a multiple of ``dp``:
    deepspeedai/DeepSpeed@007cca6a ``deepspeed/runtime/zero/partition_parameters.py`` ``_aligned_size`` /
    ``_padding_size``; ``stage3.py`` ``averaged_gradients`` holds each parameter's gradient partition).

    Args:
        numels: Elements of each parameter tensor.
        dp: Ranks the parameters are partitioned over (>= 1).

    Returns:
        Elements of each view, in the order given.

    Raises:
        ValueError: ``dp < 1`` or a negative size.
    """
    if dp < 1 or any(n < 0 for n in numels):
        raise ValueError(f"zero3_partition_pieces needs dp >= 1 and sizes >= 0, got dp={dp}")
    return [-(-n // dp) for n in numels if n]


def zero_partition_pieces(numels: Sequence[int], dp: int) -> list[int]:
    """The gradient views of the ZeRO-1/2 partition that touches the most parameter tensors.

    DeepSpeed flattens the parameters in ``model.parameters()`` order into one buffer, splits it into ``dp``
    partitions of ``ceil(total / dp)`` elements (``get_data_parallel_partitions``; the alignment padding ignored)
    and gives each rank one view per tensor its partition overlaps (``get_partition_info``). The data-parallel
    ranks are folded into one simulated rank and meet at the norm's all-reduce, so the rank with the most views
    (the most launches; the lowest such rank on a tie) is the one built.

    Args:
        numels: Elements of each parameter tensor, in ``model.parameters()`` order.
        dp: Data-parallel ranks the partition is split over (>= 1).

    Returns:
        Elements of each view of that partition, in order (their sum: the partition's size, less the padding of
        the last partition).

    Raises:
        ValueError: ``dp < 1`` or a negative size.
    """
    if dp < 1 or any(n < 0 for n in numels):
        raise ValueError(f"zero_partition_pieces needs dp >= 1 and sizes >= 0, got dp={dp}")
    size = -(-sum(numels) // dp)
    best: list[int] = []
    for r in range(dp):
        lo, hi, start, pieces = r * size, (r + 1) * size, 0, []
        for n in numels:
            a, b = max(lo, start), min(hi, start + n)
            if b > a:
                pieces.append(b - a)
            start += n
        if len(pieces) > len(best):
            best = pieces
    return best


def deepspeed_zero_step(bld, pieces: Sequence[int], n: float, grads: list[str], deps: list[int],
                        check_overflow: bool, stage3: bool = False) -> tuple[list[str], list[int]]:
    """DeepSpeed ZeRO-1/2's (ZeRO-3's with ``stage3``) work between the gradient reduction and the optimizer kernel
    (module docstring).

    Args:
        bld: The ``_GptBuilder`` (its emitter, ``_collective``, ``_grad_stats_all_reduce``, ``_grad_elem_bytes``).
        pieces: Elements of each gradient view of the partition (``zero_partition_pieces``).
        n: Elements of the partition (the fp32 gradient partition the optimizer reads).
        grads: Gradient tensors of the partition (read by the first kernels).
        deps: Ops the step waits for (the reductions).
        check_overflow: Run ``has_overflow`` (fp16).
        stage3: ZeRO-3's step: its overflow check over the flat partition (``ZERO3_HAS_INF_OR_NAN``) and its
            8-byte (fp64) norm all-reduces (over the data-parallel group, then the model-parallel one);
            ``pieces`` from ``zero3_partition_pieces``.

    Returns:
        ``(grads, deps)`` for the optimizer kernel: the fp32 gradient partition and the ``mul_``.
    """
    e, g = bld.e, bld._grad_elem_bytes
    if check_overflow:
        last = []
        for j, m in ([("flat", n)] if stage3 else enumerate(pieces)):
            for name, cc, rd, wr in (ZERO3_HAS_INF_OR_NAN if stage3 else HAS_INF_OR_NAN):
                last = [e.kernel(f"zero.has_inf_or_nan.{j}.{name}", cc, reads=rd * m, writes=wr * m or (1 if stage3 else 4),
                                 flops=m, uses=grads, deps=last or deps, dtype="fp32")]
        ar = bld._collective("zero.overflow.all_reduce", "all_reduce", 1, last, Phase.OPT)
        deps = [bld.b.add("zero.overflow.item", OpKind.SYNC, "host", deps=bld._grad_stats_all_reduce(
            "zero.overflow", [ar]), phase=Phase.OPT, launch=False)]
    norms = []
    for j, m in enumerate(pieces):
        dbl = e.fresh("grad.fp64")
        cast = e.kernel(f"zero.grad_norm.{j}.double", C.CAST, reads=g * m, writes=8 * m, flops=m,
                        out=[(dbl, 8 * m)], uses=grads, deps=deps, dtype="fp64")
        norms.append(e.kernel(f"zero.grad_norm.{j}.vector_norm", C.REDUCTION, reads=8 * m, writes=8, flops=2 * m,
                              uses=[dbl], deps=[cast], dtype="fp64"))
    ar = bld._collective("zero.grad_norm.all_reduce", "all_reduce", 8 if stage3 else 4, norms or deps, Phase.OPT,
                         elem_bytes=8 if stage3 else 4)
    norm = bld._grad_stats_all_reduce("zero.grad_norm", [ar], nbytes=8 if stage3 else 4)
    flat = e.fresh("grad.partition_flat")
    cat = e.kernel("zero.grad_partition.flatten", C.COPY, reads=g * n, writes=g * n, out=[(flat, g * n)],
                   uses=grads, deps=norm, dtype="fp32" if g == 4 else None)
    part = [flat]
    if g != 4:
        part = [e.fresh("grad.partition_fp32")]
        cat = e.kernel("zero.grad_partition.to_fp32", C.CAST, reads=g * n, writes=4 * n, flops=n,
                       out=[(part[0], 4 * n)], uses=[flat], deps=[cat], dtype="fp32")
    mul = e.kernel("zero.unscale_and_clip_grads.mul", C.ELEMENTWISE, reads=4 * n, writes=4 * n, flops=n, uses=part,
                   deps=[cat], dtype="fp32")
    return part, [mul]


def norm_then_mul(bld, prefix: str, n: float, grads: list[str], deps: list[int],
                  reduce: Callable[[list[int]], list[int]]) -> list[int]:
    """One fused norm over ``n`` fp32 gradient elements (read 4 B, 2 FLOPs each; a 4-byte result), the total's
    reduction ``reduce(deps) -> deps`` (an all-reduce, or nothing), then the clip coefficient's ``mul_`` over every
    gradient (read + write 4 B): ``clip_grad_norm_`` of PyTorch (``torch_clip_grad_norm``) and of FSDP
    (``_GptBuilder._fsdp_clip_grad_norm``). Ops ``<prefix>.norm`` and ``<prefix>.mul``; returns the optimizer's
    deps (the ``mul_``)."""
    e = bld.e
    norm = e.kernel(f"{prefix}.norm", C.REDUCTION, reads=4 * n, writes=4, flops=2 * n, uses=grads, deps=deps,
                    dtype="fp32")
    return [e.kernel(f"{prefix}.mul", C.ELEMENTWISE, reads=4 * n, writes=4 * n, flops=n, uses=grads,
                     deps=reduce([norm]), dtype="fp32")]


def torch_clip_grad_norm(bld, n: float, grads: list[str], deps: list[int]) -> list[int]:
    """``torch.nn.utils.clip_grad_norm_`` of a PyTorch loop (module docstring) over the ``n`` fp32 gradient
    elements of this rank: ``clip_grad.foreach_norm``, the model-parallel all-reduce where there is one
    (``_grad_stats_all_reduce``; none under DDP alone), ``clip_grad.foreach_mul``. Returns the optimizer's deps."""
    return norm_then_mul(bld, "clip_grad.foreach", n, grads, deps,
                         lambda d: bld._grad_stats_all_reduce("clip_grad.total_norm", d))
