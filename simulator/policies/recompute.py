"""Activation recompute (full, selective) and activation offload to host memory.

The GPT builder emits the recompute itself (``TransformerSpec.recompute``, from
``training.recompute_granularity`` or torchtitan's ``activation_checkpoint``: ``config.sections.torchtitan_ac``):
``full`` keeps each block's input and re-runs the block's forward before its backward (Megatron-LM
``--recompute-granularity full``; torchtitan ``mode = "full"``, and with ``selective_ac_option`` n every n-th
block only); ``selective`` re-runs only the attention core (Korthikanti et al., MLSys 2023); ``op`` is torchtitan's
per-op policy (``graph.builders.op_sac``: every other matmul's, the attention's and the TP reduce-scatters' outputs
saved, the rest re-run before the block's backward). This policy checks that the graph has
blocks to recompute and adds **activation offload** as DeepSpeed's
``activation_checkpointing.cpu_checkpointing`` runs it (``deepspeed/runtime/activation_checkpointing/
checkpointing.py``, ``CheckpointFunction``): not overlapped, in line with the compute.

* forward: before block ``l`` runs, its checkpointed input ``x_l`` is copied to the host with
  ``copy_to_device(args, torch.device('cpu'))`` (``Tensor.to('cpu')``: a D2H copy into fresh pageable
  memory, in stream order on the compute stream, that the host waits for); the GPU copy is freed once
  the block's forward no longer reads it;
* backward: before block ``l``'s recompute, ``move_to_device(..., cuda_device)`` copies it back (an H2D
  copy from pageable memory, on the compute stream; the host waits until the driver has staged it).

So each block pays two copies at the pageable rate (``pageable_h2d/d2h_bytes_per_s`` of the link or
profile; unknown: the pinned rate) plus the lost launch-ahead at each host wait, and GPU memory falls
by one block input per layer. Both copies share the PCIe links with everything else (gradient and
parameter offload, input batches).

**First touch of the host buffers** (``activation_checkpointing.host_buffers``). DeepSpeed 0.3 allocates
them each iteration with ``torch.tensor(()).new_empty(...)`` (with ``contiguous_memory_optimization``: the
``num_layers`` buffers at the first checkpoint, dropped in backward) and never writes them before the
copy. PyTorch's CPU allocator takes them from glibc ``malloc``, which ``mmap``-s a buffer of 32 MiB or more
and ``munmap``-s it on free (``hardware_models.host_kernels``: the same rule as a CPU kernel's fresh
outputs), so every iteration the pageable D2H copy's staging memcpy, in the calling thread, faults in each
4 KiB page of its destination: ``host_kernels.first_touch_s`` on one thread, added to the copy as host
time (``Op.host_s`` of the copy). ``fresh`` (default, DeepSpeed 0.3): so. ``prefaulted``: a later DeepSpeed
writes one zero per page before the copy ("the pages need to be populated during the cudaMemcpy time
which increases the data copy time", deepspeed/runtime/activation_checkpointing/checkpointing.py), a host
op of the same faults ahead of the copy, while the GPU runs the queued kernels. ``reused``: resident
buffers, no faults. Buffers totalling under 32 MiB are recycled from the heap: no faults in any mode.
"""

from __future__ import annotations

from hardware_models.host_kernels import faulting_elements, first_touch_s
from simulator.config.sections.torchtitan_ac import recompute_of
from simulator.graph.op_graph import OpGraph, with_page_faults
from simulator.graph.ops import CostClass, OpKind, OpRole, Phase, TensorAlloc
from simulator.policies._rewrite import GraphRewriter
from simulator.policies.registry import PolicyError, register_graph_policy


@register_graph_policy("recompute", order=20)
class Recompute:
    """Validate recompute and add activation offload (see the module docstring)."""

    @classmethod
    def applies(cls, cfg) -> bool:
        ac = getattr(cfg, "activation_checkpointing", None)
        return recompute_of(cfg)[0] != "none" or bool(ac and ac.cpu_checkpointing)

    @staticmethod
    def needs_kernels(cfg) -> bool:
        """Only activation offload rewrites ops (the checks read layers and the graph's model facts)."""
        ac = getattr(cfg, "activation_checkpointing", None)
        return bool(ac and ac.cpu_checkpointing)

    @staticmethod
    def reuse_key(cfg, hw) -> tuple | None:
        """What ``transform`` reads beside the graph (``registry.policies_reuse_key``): the recompute; None with
        activation offload (it reads the host's CPU too: rewritten afresh)."""
        ac = getattr(cfg, "activation_checkpointing", None)
        return None if ac and ac.cpu_checkpointing else recompute_of(cfg)

    def transform(self, graph: OpGraph, cfg, hw) -> OpGraph:
        ac = getattr(cfg, "activation_checkpointing", None)
        mode = recompute_of(cfg)[0]
        return recompute(graph, None if mode == "none" else mode, bool(ac and ac.cpu_checkpointing),
                         host_buffers=ac.host_buffers if ac else "fresh", host_cpu=getattr(hw, "host_cpu", None))


def recompute(graph: OpGraph, granularity: str | None, cpu_checkpointing: bool = False, *,
              host_buffers: str = "fresh", host_cpu=None) -> OpGraph:
    """Check the recompute setting (``TransformerSpec.recompute``: full, selective, op; None: none) against the
    graph and add activation offload if asked (``host_buffers``, ``host_cpu``: see :func:`offload_activations`).

    Raises:
        PolicyError: no transformer blocks, or cpu_checkpointing without full recompute.
    """
    if not any(op.layer >= 0 for op in graph.ops):
        raise PolicyError("training.recompute_granularity: the model has no transformer blocks to recompute")
    model = graph.model
    if model is not None and granularity and model.recompute != granularity:
        raise PolicyError(
            f"training.recompute_granularity: the graph was built with recompute {model.recompute!r}, not {granularity!r}"
        )
    if not cpu_checkpointing:
        return graph
    if granularity != "full":
        raise PolicyError("activation_checkpointing.cpu_checkpointing: needs training.recompute_granularity: full")
    return offload_activations(graph, host_buffers, host_cpu)


HOST_BUFFERS = ("fresh", "prefaulted", "reused")


def offload_activations(graph: OpGraph, host_buffers: str = "fresh", host_cpu=None) -> OpGraph:
    """Move each checkpointed block input to pageable host memory between forward and backward, with DeepSpeed's
    blocking copies and the first touch of their host buffers (module docstring).

    ``host_buffers``: ``fresh`` | ``prefaulted`` | ``reused``; ``host_cpu``: the ``HostCpuSpec`` whose
    ``page_fault_s`` prices the faults (None: ``host_kernels.DEFAULT_PAGE_FAULT_S``).

    Raises:
        PolicyError: the graph has no checkpointed block inputs (no full recompute), or an unknown ``host_buffers``.
    """
    if host_buffers not in HOST_BUFFERS:
        raise PolicyError(f"activation_checkpointing.host_buffers: unknown {host_buffers!r}; "
                          f"allowed: {', '.join(HOST_BUFFERS)}")
    size = {t.name: t.nbytes for op in graph.ops for t in op.allocs}
    producer = {t.name: op.id for op in graph.ops for t in op.allocs}
    plans = []  # per checkpoint: tensor, first forward user, backward users
    for op in graph.ops:
        if op.phase == Phase.FWD and op.layer >= 0 and op.role is OpRole.BLOCK_INPUT_NORM:
            x = op.uses[0]
            users = [o for o in graph.ops if x in o.uses]
            bwd_users = [o.id for o in users if o.phase == Phase.BWD]
            if not bwd_users or x not in size:
                continue
            plans.append(dict(x=x, layer=op.layer, first_fwd=op.id, bwd=set(bwd_users), at=min(bwd_users),
                              nbytes=size[x]))
    if not plans:
        raise PolicyError("activation_checkpointing.cpu_checkpointing: no checkpointed block inputs found")
    faults = host_buffers != "reused" and faulting_elements([p["nbytes"] for p in plans], 1.0) > 0
    for p in plans:  # seconds one thread takes to fault in the checkpoint's fresh host buffer
        p["touch_s"] = first_touch_s(host_cpu, float(p["nbytes"])) if faults else 0.0
    before_fwd = {p["first_fwd"]: p for p in plans}
    before_bwd = {p["at"]: p for p in plans}
    for k, p in enumerate(plans):
        p["host"] = f"offload.act.L{p['layer']}#{k}"
        p["back"] = f"act.reloaded.L{p['layer']}#{k}"
    rename = {}
    for p in plans:
        for u in p["bwd"]:
            rename.setdefault(u, {})[p["x"]] = p
    rw = GraphRewriter(graph)
    waits: list[int] = []  # host waits the next op must follow (the copy's .to() returns after it)

    def blocking_copy(p, kind, phase, deps, **fields) -> int:
        direction = "d2h" if kind is OpKind.MEMCPY_D2H else "h2d"
        c = rw.add(f"L{p['layer']}.{phase.value}.act_offload.{direction}", kind, "compute", deps=deps, phase=phase,
                   layer=p["layer"], cost_class=CostClass.COPY, bytes_read=float(p["nbytes"]), pinned=False, **fields)
        waits.append(rw.add(f"L{p['layer']}.{phase.value}.act_offload.{direction}.wait", OpKind.SYNC, "host",
                            deps=[c], phase=phase, layer=p["layer"]))
        return c

    for op in graph.ops:
        p = before_fwd.get(op.id)
        if p is not None:
            deps = list(rw.new(producer[p["x"]]))
            in_copy = p["touch_s"] if host_buffers == "fresh" else 0.0
            if host_buffers == "prefaulted" and p["touch_s"] > 0:  # one zero per page, on the host, before the copy
                deps.append(rw.add(f"L{p['layer']}.fwd.act_offload.prefault", OpKind.HOST, "host", deps=[],
                                   phase=Phase.FWD, layer=p["layer"], host_s=p["touch_s"], launch=False))
            p["d2h"] = blocking_copy(p, OpKind.MEMCPY_D2H, Phase.FWD, deps, uses=(p["x"],), host_s=in_copy,
                                     allocs=(TensorAlloc(p["host"], p["nbytes"], "host_pageable"),))
        p = before_bwd.get(op.id)
        if p is not None:
            p["h2d"] = blocking_copy(p, OpKind.MEMCPY_H2D, Phase.BWD, [p["d2h"]], uses=(p["host"],),
                                     allocs=(TensorAlloc(p["back"], p["nbytes"]),))
        changes, extra = {}, list(waits)
        waits.clear()
        if op.id in rename:
            m = rename[op.id]
            changes["uses"] = tuple(m[u]["back"] if u in m else u for u in op.uses)
            extra += [m[u]["h2d"] for u in op.uses if u in m]
        rw.copy(op, extra_deps=extra, **changes)
    meta = with_page_faults(graph.meta, sum(p["touch_s"] for p in plans))  # in the copies or the prefault ops
    meta["activation_offload"] = {"checkpoints": len(plans), "bytes": sum(p["nbytes"] for p in plans),
                                  "host_buffers": host_buffers, "first_touch_s": sum(p["touch_s"] for p in plans)}
    return rw.finish(meta=meta)
