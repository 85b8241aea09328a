"""PyTorch FSDP ``CPUOffload(offload_params=True)`` and FSDP2 ``CPUOffloadPolicy``: sharded parameters and gradients
in host memory, AdamW on the CPU.

Selected by ``fsdp.cpu_offload`` (FSDP1) or ``fsdp.offload_policy`` / torchtitan's ``training.enable_cpu_offload``
(FSDP2, below) (``simulator.config.sections.fsdp``). Rewrites the FSDP builder graph
(``simulator/graph/builders/sharding.py``: FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD over dp > 1, one micro-batch per
step, no pipeline) with the mechanisms of ZeRO offload:

* **Parameters**: the fp32 flat-parameter shard of each unit lives in pinned host memory (FSDP1
  ``FlatParamHandle``: ``_local_shard`` is ``pin_memory()``-ed when ``offload_params``). Before each of the unit's
  all-gathers (forward, and backward where it is gathered again) its shard, ``4 ceil(n / shard_size)`` bytes, is
  copied H2D (``pre_unshard`` -> ``flat_param_to(device, non_blocking=True)``, or ``_use_low_precision_shard``'s
  ``_local_shard.to(device)`` with a bf16 ``param_dtype``) into a GPU buffer, then freed: the
  ``offload_param.fetch_shard_before`` of ZeRO-3 parameter offload, on stream ``h2d``. The gather reads it (fp32
  ``param_dtype``), or with a bf16 ``param_dtype`` the builder's cast to the low-precision shard does
  (``sharding.LOW_PRECISION_SHARD``, which the gather reads): the copy goes before that cast.
* **Gradients**: each unit's reduce-scattered gradient shard (HYBRID_SHARD: after its all-reduce across replicas),
  cast to the fp32 parameter dtype, is copied D2H into the pinned ``_cpu_grad`` (``_post_reduce_grad_callback`` ->
  ``_offload_grad``, non-blocking for sharded strategies), on stream ``d2h``; the GPU shard is freed after it.
* **The optimizer**: ``torch.optim.AdamW`` over the CPU flat parameters (one tensor per unit with
  ``use_orig_params=False``, FSDP1's default) runs on the training thread (stream ``host``) after every gradient
  copy has landed (FSDP's ``_post_backward_final_callback`` synchronizes the device when parameters are offloaded):
  one host op ``cpu.adam`` priced by ``offload_optimizer.cpu_step_times`` (the host roofline of
  ``hardware_models.host_kernels``; implementation ``torch_single`` / ``torch_foreach`` / ``torch_fused``). It updates
  the fp32 shards in place: nothing is uploaded after the step; the next step's forward fetches them.
* **Memory**: the GPU keeps no parameter, gradient or optimizer shard. The host holds, per rank, the fp32 parameter
  and gradient shards (pinned, 4 B/param each) and the Adam moments (pageable, ``torch.zeros_like`` of the CPU
  parameters, 4 B/param each). Host memory is a capacity: the node's ranks' buffers together that exceed it make an
  out-of-memory result (``offload_optimizer.host_memory_oom`` through ``OffloadSummary``), as the engine's pools do
  for each pool alone.
* **Shared host**: the node's ranks split its cores and share its memory bandwidth (``offload_optimizer.cpu_threads``,
  ``offload_ranks``: every rank of the node, dp 1 x cp 2 included), and their copies share the PCIe switch
  uplinks (the engine's links).

**FSDP2** (``fsdp.version: 2`` with ``fsdp.offload_policy``, ``fully_shard(offload_policy=CPUOffloadPolicy(
pin_memory))``; the builder of ``simulator/graph/builders/fsdp2.py``), the same mechanisms where PyTorch puts them:

* **Parameters**: each parameter's padded fp32 shard lives on the CPU, pinned when ``pin_memory``
  (pytorch/pytorch@17a7e1e0 torch/distributed/fsdp/_fully_shard/_fsdp_param.py ``_init_sharded_param``:
  ``padded_sharded_param.cpu()``, then ``.pin_memory()``). With offload, ``_get_param_all_gather_inputs`` skips its
  ``_foreach_copy_`` fast path (``use_foreach_copy`` is false for ``offload_to_cpu``, pytorch/pytorch@8fc2039d
  _fsdp_collectives.py) and each parameter's ``all_gather_inputs`` copies its shard H2D (``.to(device,
  non_blocking=True)``) before its ``param_dtype`` cast, under the all-gather copy-in stream: the unit's shard,
  ``4 x`` its padded shard elements, is copied on stream ``fsdp.all_gather_copy_in`` before the unit's cast (bf16
  ``param_dtype``) or copy-in (fp32), which reads it. A unit resharded to a smaller group after forward (an int
  ``reshard_after_forward``) gathers its backward from the GPU copy kept after forward: no copy then.
* **Gradients**: ``foreach_reduce`` copies each reduced fp32 gradient shard (after the bf16 -> fp32 cast; HSDP:
  after the replica all-reduce) to the CPU on the post-reduce stream (``new_sharded_grad.to("cpu",
  non_blocking=pin_memory)``): one D2H copy per unit after its reduction, and the unit's next reduction on that
  stream (the reduce-scatter; HSDP: the all-reduce) waits for it. ``finalize_backward`` blocks the CPU on every
  copy's event (pytorch/pytorch@62a45b6f _fsdp_param_group.py ``grad_offload_event.synchronize()``): the
  ``offload.bwd_done`` host sync before the CPU step.
* **pin_memory false**: the copies read and write pageable memory, at the pageable rate (``hw.link_rate``), and the
  training thread blocks on each: the D2H is ``non_blocking=False`` (a synchronous copy), the H2D a
  ``cudaMemcpyAsync`` from pageable memory, which returns once the driver has staged it (CUDA Runtime API, "API
  synchronization behavior"); a ``SYNC`` on stream ``host`` after each, as the activation offload of
  ``recompute.py`` waits on its pageable copies. The host's buffers are pageable.
* **First touch of the CPU gradients** (pin_memory false): ``.to("cpu")`` allocates a fresh CPU tensor for every
  parameter's reduced shard every step (``_to_copy`` allocates its output, pinned only for a ``non_blocking`` copy
  from CUDA: pytorch/pytorch@fc9325ea aten/src/ATen/native/TensorConversions.cpp ``pin_out``), which becomes the
  ``.grad`` until torchtitan's ``optimizers.zero_grad()`` (set_to_none) at the next step's start
  (pytorch/torchtitan@000204a4 torchtitan/train.py ``train_step``) frees them together. Under the rule of
  ``hardware_models.host_kernels`` (freed together, 32 MiB or more in all: returned to the kernel), every 4 KiB
  page is faulted in again each step by the synchronous copy's staging memcpy in the training thread:
  ``host_kernels.first_touch_s`` of the unit's shard bytes, the copy's ``host_s``, as ``recompute.py``'s fresh
  checkpoint buffers. Pinned copies (``non_blocking=True``) come from PyTorch's pinned caching host allocator:
  no faults.
* **Gradient accumulation** (``fully_shard``'s default ``requires_gradient_sync`` true, as torchtitan's
  ``train_step`` runs its micro-batches: no ``set_requires_gradient_sync(False)``): every micro-batch
  reduce-scatters (the builder's per-micro-batch reductions). From the second micro-batch on the parameter has a
  ``.grad``, so ``foreach_reduce`` copies with ``non_blocking = pin_memory and not to_accumulate_grad`` = false
  ("the CPU add kernel depends on the copy result", pytorch/pytorch@8fc2039d _fsdp_collectives.py
  ``foreach_reduce``): a synchronous D2H into a fresh pageable tensor (``pin_out`` above) at the pageable rate that
  the training thread waits for, pinned policy or not, then ``grad._local_tensor += new_sharded_grad`` on the
  CPU: a host op per unit ``fsdp_offload.cpu_grad_accum.<k>`` (``cpu_grad_add_s``: 8 B read, 4 B written per
  element, one dispatch per parameter) in place of the builder's GPU ``grad.shard_accum``. The temporary of each
  parameter is freed after its add, one at a time, so only parameters of 32 MiB and more (``mmap``-ed each time,
  ``host_kernels.mmapped_elements``) fault on it. ``set_requires_gradient_sync(False)`` (unsharded accumulation on
  the GPU, ``unsharded_accumulated_grad``) is not expressible in a scenario.
* **The optimizer**: ``torch.optim.AdamW`` over the CPU DTensor shards, one tensor per parameter
  (``graph.meta["param_shard_numels"]``), implementation from ``training.optimizer.impl`` (torchtitan's default
  ``fused``: torch's fused CPU AdamW).
* Priced as one copy per unit where PyTorch issues one ``.to()`` per parameter (they queue back to back on one
  stream: the copy latency and host launch once per unit, as ``offload_optimizer``'s parameter upload) and one
  ``param_dtype`` cast kernel per unit where it runs one per parameter (the same bytes); the run's warnings say so.

Refused in the config (one line, exit 2): NO_SHARD, pipelines, FSDP1 with gradient accumulation (FSDP1 does not
accumulate gradients outside ``no_sync()`` with CPU offload: torch ``FullyShardedDataParallel`` docs).
"""

from __future__ import annotations

from hardware_models.host_kernels import (
    StreamPass,
    faulting_elements,
    first_touch_s,
    mmapped_elements,
    pass_parts,
    shared_stream_bandwidth,
)
from simulator.graph.builders.fsdp2 import COPY_IN_STREAM
from simulator.graph.builders.sharding import LOW_PRECISION_SHARD
from simulator.graph.op_graph import OpGraph, with_page_faults
from simulator.graph.ops import CostClass, OpKind, Phase, TensorAlloc
from simulator.policies._rewrite import GraphRewriter
from simulator.policies.offload_optimizer import (
    OffloadSummary,
    cpu_adam_rate,
    cpu_step_work,
    cpu_threads,
    offload_ranks,
)
from simulator.policies.offload_param import fetch_shard_before, is_param_gather, param_fetch_summary
from simulator.policies.registry import PolicyError, register_graph_policy, register_runtime

KEY = "fsdp.cpu_offload"
#: FSDP strategies whose gathers this policy feeds from host memory
STRATEGIES = ("full_shard", "shard_grad_op", "hybrid_shard")
#: GPU-resident model states of the FSDP builder that move to the host
GPU_STATES = ("params.fp32.shard", "optimizer.exp_avg", "optimizer.exp_avg_sq")
HOST_OOM_WHAT = ("FSDP cpu_offload states", "fp32 parameter and gradient shards",
                 "Adam moments (exp_avg, exp_avg_sq)")


def _enabled(cfg) -> bool:
    f = getattr(cfg, "fsdp", None)
    return f is not None and f.offload_params


@register_graph_policy("fsdp_cpu_offload", order=30)
class FsdpCpuOffload:
    """Move FSDP's sharded states to the host and the AdamW step to the CPU (see the module docstring)."""

    @classmethod
    def applies(cls, cfg) -> bool:
        return _enabled(cfg)

    def transform(self, graph: OpGraph, cfg, hw) -> OpGraph:
        return fsdp_cpu_offload(graph, hw, impl=cfg.fsdp.cpu_adam_impl(cfg.training.optimizer.impl),
                                ranks=offload_ranks(hw), pin_memory=cfg.fsdp.offload_pinned)


def fsdp_cpu_offload(graph: OpGraph, hw, impl: str = "torch_single", ranks: int = 1,
                     pin_memory: bool = True) -> OpGraph:
    """The rewrite itself, usable without a scenario (tests, notebooks).

    Args:
        graph: The FSDP builder's step graph (``meta["sharding"]`` in ``STRATEGIES``; ``meta["shard_size"]``: ranks
            a state is sharded over; ``meta["param_bytes"]``: bytes per gathered element, ``param_dtype``); an
            FSDP2 graph (ops on stream ``fsdp.all_gather_copy_in``) gets FSDP2's copies (module docstring).
        hw: The resolved hardware (its host prices the CPU step, FSDP2's CPU gradient adds and first-touch faults).
        impl: torch AdamW implementation on the CPU (``hardware_models.host_kernels.IMPLEMENTATIONS``, torch ones).
        ranks: Ranks of the node sharing its host (they split its cores and memory bandwidth).
        pin_memory: FSDP2's ``CPUOffloadPolicy.pin_memory`` (false: pageable copies the host waits on, pageable host
            buffers); FSDP1 pins (true).

    Raises:
        PolicyError: not an FSDP builder graph with sharded parameters, gradient accumulation on an FSDP1
            graph, experts reduced over their own group (their gradients are not FSDP's), ``pin_memory`` false on
            an FSDP1 graph, or FSDP2 units other than one per block plus the root (``_fsdp2_ops``).
    """
    st = graph.meta.get("sharding")
    if graph.model is None or st not in STRATEGIES:
        raise PolicyError(f"{KEY}: needs the FSDP builder graph with sharding_strategy FULL_SHARD, SHARD_GRAD_OP or "
                          f"HYBRID_SHARD over data_parallel_size > 1, got sharding {st!r}")
    if impl not in ("torch_single", "torch_foreach", "torch_fused"):
        raise PolicyError(f"{KEY}.cpu_adam_impl: {impl!r} (allowed: torch_single, torch_foreach, torch_fused)")
    fsdp2 = any(op.stream == COPY_IN_STREAM for op in graph.ops)
    if graph.model.num_micro_batches > 1 and not fsdp2:
        raise PolicyError(f"{KEY} with gradient accumulation ({graph.model.num_micro_batches} micro-batches) is not "
                          "modelled: FSDP1 does not accumulate gradients outside no_sync() with CPU offload")
    if any(op.kind == OpKind.COLLECTIVE and (op.meta or {}).get("group") in ("edp", "ep") and op.phase == Phase.BWD
           and (op.meta or {}).get("collective") == "all_reduce" for op in graph.ops):
        raise PolicyError(f"{KEY} with experts reduced over their own group is not modelled yet")
    if not fsdp2 and not pin_memory:
        raise PolicyError(f"{KEY}: FSDP1's CPUOffload always pins its shards (allowed: pin_memory true)")
    states = {t.name: t for t in graph.persistent}
    if not all(k in states for k in GPU_STATES):
        raise PolicyError(f"{KEY}: the graph has no FSDP sharded states ({', '.join(GPU_STATES)})")
    shard_bytes = states["params.fp32.shard"].nbytes  # 4 ceil(P / n): this rank's fp32 flat-parameter shard
    shard = shard_bytes // 4
    rw = GraphRewriter(graph)
    h2d, h2d_bytes, copies, d2h, tensors, faults_s = (_fsdp2_ops(graph, rw, pin_memory, hw, ranks) if fsdp2
                                                      else _fsdp1_ops(graph, rw, pin_memory))
    if not h2d or not copies:
        raise PolicyError(f"{KEY}: found no parameter all-gathers or gradient reduce-scatters to offload")
    last_bwd = max(op.id for op in graph.ops if op.phase == Phase.BWD and op.kind == OpKind.COMPUTE)
    done = rw.add("offload.bwd_done", OpKind.SYNC, "host", deps=list(rw.new(last_bwd)) + copies, phase=Phase.BWD,
                  launch=False)
    # pin_memory True either way: FSDP2's pageable shards are first touched by the training thread too
    # (``.cpu()`` in _init_sharded_param, ``.to("cpu")`` in foreach_reduce), so they sit on its NUMA node
    work = cpu_step_work(shard, len(tensors), impl, hw, tensor_elements=tensors, pin_memory=True, ranks=ranks)
    times = {k: v[0] for k, v in work.items()}
    adam = rw.add("cpu.adam", OpKind.HOST, "host", deps=[done], phase=Phase.OPT, host_s=times["cpu.adam"],
                  launch=False, cost_class=CostClass.OPTIMIZER, dtype="fp32", meta={"params": shard, "impl": impl})
    rw.add("step.synchronize", OpKind.SYNC, "host", deps=[adam], phase=Phase.OTHER, launch=False)
    host = "host_pinned" if pin_memory else "host_pageable"
    persistent = [t for t in graph.persistent if t.name not in GPU_STATES] + [
        TensorAlloc("params.fp32.shard.host", shard_bytes, host),
        TensorAlloc("grad.fp32.shard.host", shard_bytes, host),
        TensorAlloc("optimizer.exp_avg.host", states["optimizer.exp_avg"].nbytes, "host_pageable"),
        TensorAlloc("optimizer.exp_avg_sq.host", states["optimizer.exp_avg_sq"].nbytes, "host_pageable"),
    ]
    meta = with_page_faults(graph.meta, faults_s + work["cpu.adam"][2])  # the copies' and the CPU AdamW's
    meta["fsdp_cpu_offload"] = {"impl": impl, "params_per_rank": shard, "ranks_per_host": ranks, "fetches": h2d,
                                "grad_copies": len(copies), "d2h_bytes_per_step": d2h, "h2d_bytes_per_step": h2d_bytes,
                                "cpu_adam_s": times["cpu.adam"],
                                "adam_rate": cpu_adam_rate(shard, impl, hw, "overlap", True, ranks)}
    if fsdp2:
        meta["fsdp_cpu_offload"]["pin_memory"] = pin_memory
    return rw.finish(persistent=persistent, meta=meta)


def _fsdp1_ops(graph: OpGraph, rw: GraphRewriter,
               pin_memory: bool) -> tuple[int, int, list[int], int, list[int], float]:
    """FSDP1's ops (module docstring): ``(fetches, H2D bytes, gradient copy ids, D2H bytes, elements of each CPU
    tensor)``, the flat-parameter shard of each unit."""
    n = graph.meta["shard_size"]
    h2d = d2h = h2d_bytes = 0
    copies: list[int] = []
    unit_shards: list[int] = []
    pending: dict[int, int] = {}  # reduce-scatter old id -> its op (HYBRID: the replica all-reduce comes after it)
    for op in graph.ops:
        m = op.meta or {}
        if op.phase == Phase.OPT and op.kind != OpKind.COLLECTIVE:
            rw.drop(op)  # the GPU AdamW (and anything of the step on the GPU)
            continue
        if op.name == "step.synchronize":
            break
        cast = op.name.endswith(LOW_PRECISION_SHARD)  # bf16 param_dtype: the fetch feeds the cast, not the gather
        if cast or (is_param_gather(op) and not any(graph.ops[d].name.endswith(LOW_PRECISION_SHARD)
                                                    for d in op.deps)):
            # the fp32 shard of the gathered unit (the cast reads exactly it)
            nb = int(op.bytes_read) if cast else 4 * -(-(int(m["bytes"]) // graph.meta["param_bytes"]) // n)
            fetch_shard_before(rw, op, nb, True, h2d, "fsdp_offload.fetch")
            h2d += 1
            h2d_bytes += nb
            continue
        new = rw.copy(op)
        if op.kind == OpKind.COLLECTIVE and op.name.startswith("fsdp.grad_reduce_scatter."):
            k = op.name.rsplit(".", 1)[-1]
            pending[op.id] = op
            if graph.meta.get("sharding") != "hybrid_shard":
                copies.append(_grad_copy(rw, op, [new], k))
                d2h += op.allocs[0].nbytes
                unit_shards.append(op.allocs[0].nbytes // 4)
        elif op.kind == OpKind.COLLECTIVE and op.name.startswith("fsdp.grad_all_reduce_replicas."):
            rs = next(graph.ops[d] for d in op.deps if d in pending)
            k = op.name.rsplit(".", 1)[-1]
            copies.append(_grad_copy(rw, rs, [new], k))
            d2h += rs.allocs[0].nbytes
            unit_shards.append(rs.allocs[0].nbytes // 4)
    return h2d, h2d_bytes, copies, d2h, unit_shards, 0.0  # pinned copies: no faults


#: ``foreach_reduce``'s CPU gradient accumulation, ``grad._local_tensor += new_sharded_grad`` (fp32, in place)
GRAD_ADD = StreamPass("grad.add_(cpu partial)", 8.0, 4.0)
#: the builder's GPU kernel adding a later micro-batch's reduced shards into the step's (``_accumulate_shards``)
GPU_SHARD_ACCUM = "grad.shard_accum"
#: FSDP2's reduction chain of unit bucket ``k`` (``fsdp2.fsdp2_reduce``), in order
FSDP2_REDUCE = ("fsdp.grad_reduce_scatter.", "fsdp.grad_all_reduce_replicas.", "fsdp.grad_cast_fp32.")


def _fsdp2_ops(graph: OpGraph, rw: GraphRewriter, pin_memory: bool, hw=None,
               ranks: int = 1) -> tuple[int, int, list[int], int, list[int], float]:
    """FSDP2's ops (module docstring): ``(fetches, H2D bytes, gradient copy ids, D2H bytes, elements of each CPU
    tensor, first-touch fault seconds of the copies)``, one CPU tensor per parameter (``meta["param_shard_numels"]``). With gradient accumulation each later
    micro-batch's reduced shards are copied synchronously into fresh pageable tensors and added on the CPU (module
    docstring, "Gradient accumulation"); ``hw`` (its host) and ``ranks`` price the adds and the first-touch faults.

    Raises:
        PolicyError: a unit's reduced shard is not the sum of its layer's parameter shards (units other than one
            block each and the root: the per-parameter fault rule would not know its tensors).
    """
    fp32_gather = graph.meta["param_bytes"] == 4
    last: dict[str, int] = {}  # unit bucket -> old id of the last op of its reduction (the D2H copy follows it)
    layer_of: dict[str, int] = {}  # unit bucket -> its layer (-1: the root), from its reduce-scatter copy-in
    for op in graph.ops:
        if op.name.startswith(FSDP2_REDUCE):
            last[op.name.rsplit(".", 1)[-1]] = op.id
        elif ".fsdp.reduce_scatter_copy_in." in op.name or op.name.startswith("fsdp.reduce_scatter_copy_in."):
            layer_of[op.name.rsplit(".", 1)[-1]] = op.layer
    # the partial shards a later micro-batch adds into the step's gradient (the builder's GPU grad.shard_accum)
    accum = {op.id for op in graph.ops if op.name.endswith(GPU_SHARD_ACCUM)}
    partials = {u for op in graph.ops if op.id in accum for u in op.uses}
    numels: dict[int, list[int]] = {}
    parts: dict[int, list[int]] = {}
    for g, n, ps in zip(graph.param_groups, graph.meta["param_shard_numels"],
                        graph.meta.get("param_part_shard_numels") or [(n,) for n in graph.meta["param_shard_numels"]]):
        numels.setdefault(g.layer, []).append(n)
        parts.setdefault(g.layer, []).extend(ps)
    # the step's CPU .grad tensors (first micro-batch) are freed together by zero_grad(set_to_none=True)
    step_faults = faulting_elements(graph.meta["param_shard_numels"], 4.0) > 0
    cpu = hw.host_cpu if hw is not None else None
    # the post-reduce stream's next reduction waits for the copy: the replica all-reduce's (HSDP), else the
    # reduce-scatter's
    follows = FSDP2_REDUCE[1] if any(op.name.startswith(FSDP2_REDUCE[1]) for op in graph.ops) else FSDP2_REDUCE[0]
    h2d = d2h = h2d_bytes = 0
    faults_s = 0.0
    copies: list[int] = []
    shard_of: dict[str, object] = {}  # unit bucket -> the op whose first alloc is its fp32 gradient shard
    for op in graph.ops:
        if op.phase == Phase.OPT and op.kind != OpKind.COLLECTIVE:
            rw.drop(op)  # the GPU AdamW (and anything of the step on the GPU)
            continue
        if op.name == "step.synchronize":
            break
        if op.id in accum:
            rw.drop(op)  # the partials are added on the CPU instead (below)
            continue
        fetch = op.name.endswith(".fsdp.all_gather_cast") or (
            fp32_gather and op.name.endswith(".fsdp.all_gather_copy_in")
            and not any("sharded_post_forward" in u for u in op.uses))  # reshard int: backward gathers the GPU copy
        if fetch:
            nb = int(op.bytes_read)  # the unit's padded fp32 shard, which the cast / fp32 copy-in reads
            fetch_shard_before(rw, op, nb, pin_memory, h2d, "fsdp_offload.fetch", stream=COPY_IN_STREAM,
                               host_waits=not pin_memory)
            h2d += 1
            h2d_bytes += nb
            continue
        k = op.name.rsplit(".", 1)[-1] if op.name.startswith(FSDP2_REDUCE) else None
        new = rw.copy(op, extra_deps=copies[-1:] if op.name.startswith(follows) else ())
        if k is None:
            continue
        if op.name.startswith((FSDP2_REDUCE[0], FSDP2_REDUCE[2])):
            shard_of[k] = op
        if op.id != last[k]:
            continue
        src = shard_of[k]
        nbytes = src.allocs[0].nbytes
        layer = layer_of.get(k, op.layer)
        if 4 * sum(numels.get(layer, ())) != nbytes:
            raise PolicyError(f"{KEY}: unit bucket {k}'s reduced shard ({nbytes} B) is not its layer's parameter "
                              "shards: only one FSDP unit per block plus the root is modelled")
        adding = src.allocs[0].name in partials
        # .to("cpu", non_blocking=pin_memory and not accumulating): a blocking copy allocates pageable memory
        pinned = pin_memory and not adding
        if adding:  # freed after its add, one parameter at a time: only the ones glibc mmaps fault
            fault_bytes = 4.0 * mmapped_elements(parts[layer], 4.0)
        else:
            fault_bytes = float(nbytes) if not pin_memory and step_faults else 0.0
        touch = first_touch_s(cpu, fault_bytes) if fault_bytes else 0.0
        faults_s += touch
        temp = (TensorAlloc(f"grad.fp32.partial.host.b{k}", nbytes, "host_pageable"),) if adding else ()
        copies.append(_grad_copy(rw, src, [new], k, pinned, host_s=touch, allocs=temp))
        d2h += nbytes
        wait = None
        if not pinned:  # a synchronous .to("cpu"): the training thread waits for it
            wait = rw.add(f"fsdp_offload.d2h.grad.shard.{k}.wait", OpKind.SYNC, "host", deps=[copies[-1]],
                          phase=Phase.BWD, layer=op.layer, launch=False)
        if adding:
            add_s = cpu_grad_add_s(parts[layer], hw, ranks)
            rw.add(f"fsdp_offload.cpu_grad_accum.{k}", OpKind.HOST, "host", deps=[wait], phase=Phase.BWD,
                   layer=op.layer, host_s=add_s, launch=False, cost_class=CostClass.ELEMENTWISE, dtype="fp32",
                   uses=(temp[0].name,), meta={"params": nbytes // 4, "first_touch_s": touch})
    return h2d, h2d_bytes, copies, d2h, list(graph.meta["param_shard_numels"]), faults_s


def cpu_grad_add_s(tensor_elements, hw, ranks: int = 1) -> float:
    """Seconds of ``foreach_reduce``'s CPU accumulation ``sharded_param.grad._local_tensor += new_sharded_grad``
    over one unit's parameters (``tensor_elements``: each parameter's shard elements, fp32): one in-place add per
    parameter (``GRAD_ADD``: reads 8, writes 4 bytes per element), priced by the host roofline
    (``host_kernels.pass_parts``) on the threads and DRAM share the rank's CPU AdamW gets (``cpu_threads``,
    ``shared_stream_bandwidth`` over ``ranks`` ranks, memory on the training thread's node), plus one op dispatch
    (``hw.launch.per_op_s``) per parameter, as ``cpu_step_work`` prices a per-tensor pass."""
    cpu = hw.host_cpu
    t = cpu_threads(hw, "overlap", ranks)
    bw = shared_stream_bandwidth(cpu, ranks, t, 1)
    _, stream, fault = pass_parts(GRAD_ADD, float(sum(tensor_elements)), cpu, t, 1, None, bw)
    return stream + fault + len(tensor_elements) * hw.launch.per_op_s


def _grad_copy(rw: GraphRewriter, rs, deps, k: str, pinned: bool = True, host_s: float = 0.0,
               allocs: tuple = ()) -> int:
    """D2H copy of op ``rs``'s fp32 gradient shard (its first alloc: the reduce-scatter's, or FSDP2's fp32 cast's)
    into host memory (FSDP1's pinned ``_cpu_grad``; FSDP2's ``.to("cpu")``); frees the GPU shard. ``host_s``: the
    first-touch faults of a fresh pageable destination, serial with the transfer; ``allocs``: a host tensor it
    allocates (FSDP2's accumulation temporary)."""
    shard = rs.allocs[0]
    return rw.add(f"fsdp_offload.d2h.grad.shard.{k}", OpKind.MEMCPY_D2H, "d2h", deps=deps, phase=Phase.BWD,
                  layer=rs.layer, cost_class=CostClass.COPY, bytes_read=float(shard.nbytes), pinned=pinned,
                  uses=(shard.name,), host_s=host_s, allocs=allocs)


@register_runtime("fsdp_cpu_offload")
class FsdpOffloadSummary(OffloadSummary):
    """ZeRO-Offload's summary parts (``offload_optimizer.offload_parts``) and the node's host-memory check, naming
    FSDP's host states, plus the CPU AdamW implementation used."""

    @property
    def what(self) -> tuple[str, str, str]:
        """``HOST_OOM_WHAT``, named after the key that asked for the offload (FSDP2: ``offload_policy``; pageable
        shards in the pageable pool)."""
        if self.cfg.fsdp.offload_policy is None:
            return HOST_OOM_WHAT
        if self.cfg.fsdp.offload_pinned:
            return ("FSDP2 offload_policy states",) + HOST_OOM_WHAT[1:]
        return ("FSDP2 offload_policy states", "nothing", "fp32 parameter and gradient shards, Adam moments")

    @classmethod
    def applies(cls, cfg) -> bool:
        return _enabled(cfg)

    @staticmethod
    def pinned(cfg) -> bool:
        """The shards the copies move sit on the training thread's NUMA node (the host DRAM share of
        ``OffloadSummary``), whatever ``zero_optimization.offload_optimizer.pin_memory`` says: FSDP1 pins them
        (module docstring); FSDP2's pageable ones (``pin_memory`` false) are first touched by that thread too."""
        return True

    def summarize(self, spans, steps, counters, summary) -> dict:
        out = super().summarize(spans, steps, counters, summary)
        out.update(param_fetch_summary(spans, steps, "fsdp_offload.fetch"))
        f = self.cfg.fsdp
        out["fsdp_cpu_offload"] = {"impl": f.cpu_adam_impl(self.cfg.training.optimizer.impl),
                                   "ranks_per_host": offload_ranks(self.hw)}
        if f.offload_policy is not None:
            out["fsdp_cpu_offload"]["pin_memory"] = f.offload_pinned
        return out
