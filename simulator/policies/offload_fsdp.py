"""PyTorch FSDP ``CPUOffload(offload_params=True)``: sharded parameters and gradients in host memory, AdamW on the CPU.

Selected by ``fsdp.cpu_offload`` (``simulator.config.sections.fsdp``). Rewrites the FSDP builder graph
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

Refused in the config (one line, exit 2): NO_SHARD, pipelines, gradient accumulation (FSDP does not accumulate
gradients outside ``no_sync()`` with CPU offload: torch ``FullyShardedDataParallel`` docs).
"""

from __future__ import annotations

from simulator.graph.builders.sharding import LOW_PRECISION_SHARD
from simulator.graph.op_graph import OpGraph
from simulator.graph.ops import CostClass, OpKind, Phase, TensorAlloc
from simulator.policies._rewrite import GraphRewriter
from simulator.policies.offload_optimizer import OffloadSummary, cpu_adam_rate, cpu_step_times, offload_ranks
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
                                ranks=offload_ranks(hw))


def fsdp_cpu_offload(graph: OpGraph, hw, impl: str = "torch_single", ranks: int = 1) -> OpGraph:
    """The rewrite itself, usable without a scenario (tests, notebooks).

    Args:
        graph: The FSDP builder's step graph (``meta["sharding"]`` in ``STRATEGIES``; ``meta["shard_size"]``: ranks
            a state is sharded over; ``meta["param_bytes"]``: bytes per gathered element, ``param_dtype``).
        hw: The resolved hardware (its host prices the CPU step).
        impl: torch AdamW implementation on the CPU (``hardware_models.host_kernels.IMPLEMENTATIONS``, torch ones).
        ranks: Ranks of the node sharing its host (they split its cores and memory bandwidth).

    Raises:
        PolicyError: not an FSDP builder graph with sharded parameters, gradient accumulation, or experts reduced
            over their own group (their gradients are not FSDP's).
    """
    st = graph.meta.get("sharding")
    if graph.model is None or st not in STRATEGIES:
        raise PolicyError(f"{KEY}: needs the FSDP builder graph with sharding_strategy FULL_SHARD, SHARD_GRAD_OP or "
                          f"HYBRID_SHARD over data_parallel_size > 1, got sharding {st!r}")
    if impl not in ("torch_single", "torch_foreach", "torch_fused"):
        raise PolicyError(f"{KEY}.cpu_adam_impl: {impl!r} (allowed: torch_single, torch_foreach, torch_fused)")
    if graph.model.num_micro_batches > 1:
        raise PolicyError(f"{KEY} with gradient accumulation ({graph.model.num_micro_batches} micro-batches) is not "
                          "modelled: FSDP does not accumulate gradients outside no_sync() with CPU offload")
    if any(op.kind == OpKind.COLLECTIVE and (op.meta or {}).get("group") in ("edp", "ep") and op.phase == Phase.BWD
           and (op.meta or {}).get("collective") == "all_reduce" for op in graph.ops):
        raise PolicyError(f"{KEY} with experts reduced over their own group is not modelled yet")
    n = graph.meta["shard_size"]
    states = {t.name: t for t in graph.persistent}
    if not all(k in states for k in GPU_STATES):
        raise PolicyError(f"{KEY}: the graph has no FSDP sharded states ({', '.join(GPU_STATES)})")
    shard_bytes = states["params.fp32.shard"].nbytes  # 4 ceil(P / n): this rank's fp32 flat-parameter shard
    shard = shard_bytes // 4
    rw = GraphRewriter(graph)
    h2d = d2h = h2d_bytes = 0
    copies: list[int] = []
    last_bwd = max(op.id for op in graph.ops if op.phase == Phase.BWD and op.kind == OpKind.COMPUTE)
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
    if not h2d or not copies:
        raise PolicyError(f"{KEY}: found no parameter all-gathers or gradient reduce-scatters to offload")
    done = rw.add("offload.bwd_done", OpKind.SYNC, "host", deps=list(rw.new(last_bwd)) + copies, phase=Phase.BWD,
                  launch=False)
    times = cpu_step_times(shard, len(unit_shards), impl, hw, tensor_elements=unit_shards, pin_memory=True,
                           ranks=ranks)
    adam = rw.add("cpu.adam", OpKind.HOST, "host", deps=[done], phase=Phase.OPT, host_s=times["cpu.adam"],
                  launch=False, cost_class=CostClass.OPTIMIZER, dtype="fp32", meta={"params": shard, "impl": impl})
    rw.add("step.synchronize", OpKind.SYNC, "host", deps=[adam], phase=Phase.OTHER, launch=False)
    persistent = [t for t in graph.persistent if t.name not in GPU_STATES] + [
        TensorAlloc("params.fp32.shard.host", shard_bytes, "host_pinned"),
        TensorAlloc("grad.fp32.shard.host", shard_bytes, "host_pinned"),
        TensorAlloc("optimizer.exp_avg.host", states["optimizer.exp_avg"].nbytes, "host_pageable"),
        TensorAlloc("optimizer.exp_avg_sq.host", states["optimizer.exp_avg_sq"].nbytes, "host_pageable"),
    ]
    meta = dict(graph.meta)
    meta["fsdp_cpu_offload"] = {"impl": impl, "params_per_rank": shard, "ranks_per_host": ranks, "fetches": h2d,
                                "grad_copies": len(copies), "d2h_bytes_per_step": d2h, "h2d_bytes_per_step": h2d_bytes,
                                "cpu_adam_s": times["cpu.adam"],
                                "adam_rate": cpu_adam_rate(shard, impl, hw, "overlap", True, ranks)}
    return rw.finish(persistent=persistent, meta=meta)


def _grad_copy(rw: GraphRewriter, rs, deps, k: str) -> int:
    """D2H copy of reduce-scatter ``rs``'s fp32 gradient shard into the pinned host ``_cpu_grad``; frees the GPU shard."""
    shard = rs.allocs[0]
    return rw.add(f"fsdp_offload.d2h.grad.shard.{k}", OpKind.MEMCPY_D2H, "d2h", deps=deps, phase=Phase.BWD,
                  layer=rs.layer, cost_class=CostClass.COPY, bytes_read=float(shard.nbytes), pinned=True,
                  uses=(shard.name,))


@register_runtime("fsdp_cpu_offload")
class FsdpOffloadSummary(OffloadSummary):
    """ZeRO-Offload's summary parts (``offload_optimizer.offload_parts``) and the node's host-memory check, naming
    FSDP's host states, plus the CPU AdamW implementation used."""

    what = HOST_OOM_WHAT

    @classmethod
    def applies(cls, cfg) -> bool:
        return _enabled(cfg)

    @staticmethod
    def pinned(cfg) -> bool:
        """FSDP pins the fp32 parameter and gradient shards the copies move (module docstring), whatever
        ``zero_optimization.offload_optimizer.pin_memory`` says."""
        return True

    def summarize(self, spans, steps, counters, summary) -> dict:
        out = super().summarize(spans, steps, counters, summary)
        out.update(param_fetch_summary(spans, steps, "fsdp_offload.fetch"))
        out["fsdp_cpu_offload"] = {"impl": self.cfg.fsdp.cpu_adam_impl(self.cfg.training.optimizer.impl),
                                   "ranks_per_host": offload_ranks(self.hw)}
        return out
