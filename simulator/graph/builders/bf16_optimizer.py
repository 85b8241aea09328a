"""DeepSpeed's ``BF16_Optimizer``: what a DeepSpeed pipeline run with ZeRO stage 0 and bf16 keeps and runs.

DeepSpeed picks it for a ``PipelineModule`` with ZeRO off and model and gradient-accumulation dtype both bf16
(deepspeedai/DeepSpeed@007cca6a ``deepspeed/runtime/engine.py`` ``_do_optimizer_sanity_check`` -> ``BFLOAT16``;
``get_data_types``: ``data_types.grad_accum_dtype`` defaults to the model dtype, so the accumulation buffer below is
bf16 unless that key says fp32, which scenarios do not express: ``config/foreign_keys.py``). Source of everything
below: deepspeedai/DeepSpeed@0acdb021 ``deepspeed/runtime/bf16_optimizer.py`` (``BF16_Optimizer``), @03f6f75c
``deepspeed/runtime/pipe/engine.py`` (``_exec_backward_pass``, ``_bf16_reduce_grads``), @007cca6a
``deepspeed/runtime/engine.py`` (``allreduce_bucket``, ``communication_data_type``, ``_take_model_step``) and
@03959e2b ``deepspeed/runtime/utils.py`` (``get_global_norm_of_tensors``, ``clip_tensors_by_global_norm``,
``all_gather_dp_groups``).

Memory of one rank whose stage holds ``P`` parameters, ``d`` data-parallel ranks, ``Ps = ceil(P / d)``
(``_setup_for_real_optimizer``; the alignment padding to ``2 d`` elements ignored):

* the bf16 parameters, flattened in place (``bf16_groups_flat``): 2 P;
* the gradient-accumulation buffer of **every** parameter (``fp32_groups_gradients_flat``, in the accumulation
  dtype, bf16: ``HP_GRAD_BYTES`` P), not partitioned, allocated once;
* the fp32 master partition (``fp32_groups_flat_partition``: 4 Ps) and the Adam moments on it (8 Ps): the fp32
  state is partitioned over the data-parallel ranks like ZeRO-1;
* the autograd ``.grad`` of every bf16 parameter (2 P), from the step's first backward to the ``zero_grad`` after
  the step (``_take_model_step`` -> ``BF16_Optimizer.zero_grad`` -> ``clear_lp_grads(set_to_none=True)``);
* at the step, the fp32 copy of the gradient partition (``grad_partition.to(fp32)``: 4 Ps), freed after it.

Per micro-batch backward (every stage: the pipeline engine calls ``clear_lp_grads`` / ``update_hp_grads`` around
``torch.autograd.backward``; the last stage's ``DeepSpeedEngine.backward`` runs the optimizer's prologue and
epilogue, the same calls; ``bf16.immediate_grad_update`` false, DeepSpeed's default):

* ``clear_lp_grads()``: ``torch._foreach_zero_`` of the ``.grad`` tensors that exist (none at the step's first
  micro-batch, all of them after it): one memset of 2 P (``bf16opt.clear_lp_grads``);
* autograd accumulates the weight gradients into ``.grad`` (the builder's ``grad_accum`` kernels, 2-byte);
* ``update_hp_grads()``: per parameter tensor ``hp_grad.add_(lp.grad.to(hp_dtype))``, the ``.to`` a no-op in
  bf16: read 2 + 2, write 2 bytes per element, one launch per tensor (``bf16opt.update_hp_grads.<param>``).

After the last backward (``_exec_reduce_grads`` -> ``buffered_allreduce_fallback`` -> ``allreduce_bucket``, the
flat buffer a bucket of its own, ``communication_data_type`` bf16 with bf16 enabled: no cast): one all-reduce of
the whole buffer, 2 P bytes over the data-parallel group, then ``mul_(1 / d)`` over it (``postscale_gradients``,
``gradient_predivide_factor`` 1: read + write 2 P). The step (``BF16_Optimizer.step``):

1. ``get_global_norm_of_tensors`` over every parameter's view of the buffer but the pipe-replicated tied
   embedding of a stage that does not own it (``get_grads_for_norm``; the TP-replicated ones of TP rank > 0 are
   skipped too: rank 0 is the one built): per tensor ``t.float().norm(2)`` (the cast, read 2 + write 4 B per
   element, then the norm, read 4 B), one launch each; the 4-byte fp32 sum all-reduced over the model-parallel
   group (``_grad_stats_all_reduce``); then ``if all_groups_norm < 0.`` reads it on the host (a sync), as does
   ``clip_tensors_by_global_norm``'s ``if clip_coef < 1`` with ``clip_grad > 0``. The clip's ``mul_`` runs only
   when the norm exceeds ``clip_grad``: not priced (a converged run's norm stays under it, as Megatron's
   ``_GptBuilder._clip_grad_norm`` assumes);
2. ``param_partition.grad = grad_partition.to(fp32)``: read 2, write 4 Ps;
3. the fused Adam over the fp32 partition (read 16, write 12 Ps);
4. ``update_lp_params``: the fp32 partition copied into the bf16 one (read 4, write 2 Ps), then
   ``all_gather_dp_groups``, which with ``all_gather_into_tensor`` (every recent PyTorch) is one all-gather of the
   whole flat bf16 buffer (2 P bytes), not chunked by ``allgather_bucket_size``;
5. ``clear_hp_grads()`` (a memset of the buffer), and again from ``zero_grad`` after the step (2 memsets).
"""

from __future__ import annotations

from simulator.graph.ops import CostClass as C
from simulator.graph.ops import OpKind, Phase

#: Bytes per element of the gradient-accumulation buffer: ``grad_acc_dtype`` is ``get_data_types()[1]``, the model
#: dtype (bf16) unless ``data_types.grad_accum_dtype`` is given (not expressible in a scenario).
HP_GRAD_BYTES = 2
#: The buffer's persistent tensor name.
HP_BUFFER = "grad.bf16_optimizer.hp_flat"


def persistent(bld, P: int, Ps: int) -> None:
    """The states BF16_Optimizer keeps (module docstring): bf16 parameters (2 P), the accumulation buffer
    (``HP_GRAD_BYTES`` P), the fp32 master partition (4 Ps) and the Adam moments (8 Ps), bytes."""
    b = bld.b
    bld._half_params(P)
    b.persistent(HP_BUFFER, HP_GRAD_BYTES * P)
    b.persistent("params.master_fp32", 4 * Ps)
    b.persistent("optimizer.exp_avg", 4 * Ps)
    b.persistent("optimizer.exp_avg_sq", 4 * Ps)


def clear_lp_grads(bld) -> None:
    """Before a backward: ``torch._foreach_zero_`` of the 2-byte ``.grad`` tensors that exist (those of an earlier
    micro-batch of this step: ``bld.grad_made``), one memset of their bytes; nothing at the step's first."""
    if not bld.grad_made:
        return
    bld.e.kernel("bf16opt.clear_lp_grads", C.MEMSET, writes=2 * bld.s.rank_num_parameters, dtype="bf16")


def update_hp_grads(bld, ready: list[tuple[str, int, int, str | None]]) -> None:
    """After a backward: ``hp_grad.add_(lp.grad)`` per parameter tensor made by it, ``ready`` its
    ``(name, numel, op, .grad tensor or None)``; read 2 + 2, write 2 bytes per element (bf16 buffer)."""
    e, g = bld.e, HP_GRAD_BYTES
    for name, numel, op, tensor in ready:
        e.kernel(f"bf16opt.update_hp_grads.{name}", C.ELEMENTWISE, reads=(2 + g) * numel, writes=g * numel,
                 flops=numel, uses=[tensor] if tensor else [], deps=[op], dtype="bf16")
    ready.clear()


def holds_pipe_replica(spec) -> bool:
    """The stage of ``spec`` holds a pipe-replicated copy of the tied token table (``ds_pipe_replicated``: a later
    stage than the lowest of the tied group, which owns it for DeepSpeed's gradient norms)."""
    s = spec
    return s.pipeline_parallel_size > 1 and s.tied_embeddings and s.has_head and not s.has_embedding


def norm_numels(bld) -> list[int]:
    """Elements of each tensor ``get_grads_for_norm`` returns: every parameter of the stage but the tied token
    table on a later stage that holds a replica of it (``holds_pipe_replica``)."""
    replica = holds_pipe_replica(bld.s)
    return [g.numel for g in reversed(bld.groups) if not (replica and g.name.startswith("wte"))]


def reduce_grads(bld) -> None:
    """After the last backward (data parallel only): the all-reduce of the whole accumulation buffer in bf16
    (``HP_GRAD_BYTES`` P bytes) and its ``mul_(1 / d)``; they join ``bld.comm_ops``, which the step waits for."""
    if not bld.dp:
        return
    e, n = bld.e, bld.s.rank_num_parameters
    e.phase, e.layer = Phase.BWD, -1
    ar = bld._collective("bf16opt.grad_all_reduce", "all_reduce", HP_GRAD_BYTES * n, [len(bld.b) - 1], Phase.BWD,
                         elem_bytes=HP_GRAD_BYTES)
    div = e.kernel("bf16opt.grad_all_reduce.div", C.ELEMENTWISE, reads=HP_GRAD_BYTES * n, writes=HP_GRAD_BYTES * n,
                   flops=n, deps=[ar], dtype="bf16")
    bld.comm_ops.append(div)


def step(bld, Ps: float, lp_grads: list[str], deps: list[int]) -> int:
    """``BF16_Optimizer.step`` and the ``zero_grad`` after it (module docstring, steps 1-5), ``Ps`` the elements of
    this rank's fp32 partition, after ``deps``; returns the op the post-step all-gather follows (the bf16 copy)."""
    e, s = bld.e, bld.s
    e.phase, e.layer = Phase.OPT, -1
    norms = []
    for j, m in enumerate(norm_numels(bld)):
        f32 = e.fresh("grad.norm_fp32")
        cast = e.kernel(f"bf16opt.grad_norm.{j}.float", C.CAST, reads=HP_GRAD_BYTES * m, writes=4 * m, flops=m,
                        out=[(f32, 4 * m)], deps=deps, dtype="fp32")
        norms.append(e.kernel(f"bf16opt.grad_norm.{j}.norm", C.REDUCTION, reads=4 * m, writes=4, flops=2 * m,
                              uses=[f32], deps=[cast], dtype="fp32"))
    red = bld._grad_stats_all_reduce("bf16opt.grad_norm", norms or deps)
    sync = [bld.b.add("bf16opt.grad_norm.item", OpKind.SYNC, "host", deps=red, phase=Phase.OPT, launch=False)]
    if s.clip_grad > 0:  # clip_tensors_by_global_norm: `if clip_coef < 1` reads the coefficient on the host
        sync = [bld.b.add("bf16opt.clip_coef.item", OpKind.SYNC, "host", deps=sync, phase=Phase.OPT, launch=False)]
    part = e.fresh("grad.partition_fp32")
    cast = e.kernel("bf16opt.grad_partition.to_fp32", C.CAST, reads=HP_GRAD_BYTES * Ps, writes=4 * Ps, flops=Ps,
                    out=[(part, 4 * Ps)], deps=sync, dtype="fp32")
    P = s.rank_num_parameters
    adam = e.kernel("adamw", C.OPTIMIZER, reads=16 * Ps, writes=12 * Ps, flops=12 * Ps, uses=[part], deps=[cast],
                    dtype="fp32", meta={"params": P})
    copy = e.kernel("bf16opt.update_lp_params.copy", C.CAST, reads=4 * Ps, writes=2 * Ps, flops=Ps, deps=[adam],
                    dtype="bf16")
    last = copy
    if bld.dp:
        last = bld._collective("bf16opt.param_all_gather", "all_gather", 2 * P, [copy], Phase.OPT, elem_bytes=2)
        bld.comm_ops.append(last)
    for k, what in enumerate(("step", "zero_grad")):  # clear_hp_grads in step(), then again in zero_grad()
        last = e.kernel(f"bf16opt.clear_hp_grads.{what}", C.MEMSET, writes=HP_GRAD_BYTES * P, dtype="bf16",
                        uses=lp_grads if k == 1 else [], deps=[last])  # .grad set to None by zero_grad: freed after
    return copy
