"""ZeRO-Infinity parameter offload (host memory tier) with layer-ahead prefetch.

Selected by ``zero_optimization.offload_param.device: cpu`` (stage 3, with the optimizer offloaded
too). Runs after ``offload_optimizer``: the bf16 weights of the transformer blocks no longer live on
the GPU; their home is the host's bf16 parameter buffer (which the CPU Adam step writes), and
each block's weights are fetched H2D (stream ``h2d``) into a GPU buffer before the block runs,
in forward and again in backward (DeepSpeed ZeRO-3 releases them after use). The embeddings and
the final norm / LM head stay resident (uploaded after the CPU step, as without this policy).

Prefetch depth ``d``: the GPU holds at most ``d + 1`` block buffers, so the fetch of block ``l``
waits until block ``l - d - 1`` has finished with its buffer (forward; ``l + d + 1`` in backward)
and overlaps the compute of the blocks in between. ``d = 0`` fetches on demand: every fetch is
exposed. The summary's ``offload_param_fetch_s`` is the fetches' H2D busy time per step and
``exposed_param_fetch_s`` the per-step time the compute stream waits on them (a fetch in flight, compute idle, no
collective running: ``fetch_times``, the same definition as FSDP ``cpu_offload``'s): when PCIe cannot keep up, it
grows.
"""

from __future__ import annotations

from simulator.graph.op_graph import ModelFacts, OpGraph
from simulator.graph.ops import CostClass, OpKind, OpRole, Phase, TensorAlloc
from simulator.policies._rewrite import GraphRewriter
from simulator.policies.registry import PolicyError, register_graph_policy, register_runtime


def _enabled(cfg) -> bool:
    z = getattr(cfg, "zero_optimization", None)
    return z is not None and z.offload_param.device in ("cpu", "nvme")


@register_graph_policy("offload_param", order=40)
class OffloadParam:
    """Fetch block weights from host memory layer by layer (see the module docstring)."""

    @classmethod
    def applies(cls, cfg) -> bool:
        return _enabled(cfg)

    def transform(self, graph: OpGraph, cfg, hw) -> OpGraph:
        op_ = cfg.zero_optimization.offload_param
        return offload_param(graph, op_.prefetch_depth, op_.pin_memory)


def _segments(graph: OpGraph, phase: Phase) -> list[dict]:
    """Contiguous runs of compute ops of one block in one phase: ``{layer, first, last}``, in order."""
    segs: list[dict] = []
    for op in graph.ops:
        if op.kind != OpKind.COMPUTE or op.layer < 0 or op.phase != phase:
            continue
        if segs and segs[-1]["layer"] == op.layer and segs[-1]["open"]:
            segs[-1]["last"] = op.id
            continue
        if segs:
            segs[-1]["open"] = False
        segs.append({"layer": op.layer, "first": op.id, "last": op.id, "open": True})
    return segs


def offload_param(graph: OpGraph, prefetch_depth: int = 1, pin_memory: bool = True) -> OpGraph:
    """The rewrite itself.

    Raises:
        PolicyError: negative depth, no blocks, or the optimizer not offloaded first.
    """
    key = "zero_optimization.offload_param"
    if prefetch_depth < 0:
        raise PolicyError(f"{key}.prefetch_depth: must be >= 0 (layers fetched ahead of use), got {prefetch_depth}")
    model = graph.model
    if model is None or "offload_optimizer" not in graph.meta:
        raise PolicyError(f"{key}: needs a builder graph with offload_optimizer.device: cpu applied first")
    if graph.meta["offload_optimizer"].get("impl") == "deepspeed_cpu_adam_2020":
        raise PolicyError(f"{key}: parameter offload (ZeRO-Infinity, 2021) postdates cpu_adam_impl "
                          "deepspeed_cpu_adam_2020, which copies every parameter to the GPU in the step; allowed: "
                          "deepspeed_cpu_adam, torch_foreach, torch_single, torch_fused")
    if model.data_parallel_size > 1:
        return _offload_sharded(graph, model, pin_memory)
    nbytes = 2 * model.layer_params
    fetch_before: dict[int, list[dict]] = {}  # insert before old op id
    fetch_after: dict[int, list[dict]] = {}  # insert after old op id
    plans = []
    for phase in (Phase.FWD, Phase.BWD):
        segs = _segments(graph, phase)
        for k, s in enumerate(segs):
            p = {"layer": s["layer"], "phase": phase, "first": s["first"], "last": s["last"],
                 "tensor": f"params.L{s['layer']}.{phase.value}_fetch#{len(plans)}"}
            plans.append(p)
            j = k - prefetch_depth - 1  # the segment whose buffer this fetch reuses
            if j >= 0 and segs[j]["last"] < s["first"]:
                p["wait"] = segs[j]["last"]
                fetch_after.setdefault(segs[j]["last"], []).append(p)
            else:
                fetch_before.setdefault(segs[0]["first"] if k <= prefetch_depth else s["first"], []).append(p)
    if not plans:
        raise PolicyError(f"{key}: the model has no transformer blocks to fetch")
    first_of = {p["first"]: p for p in plans}
    last_of: dict[int, list[dict]] = {}
    for p in plans:
        last_of.setdefault(p["last"], []).append(p)
    rw = GraphRewriter(graph)

    def fetch(p, deps):
        p["id"] = rw.add(f"L{p['layer']}.{p['phase'].value}.offload_param.fetch", OpKind.MEMCPY_H2D, "h2d",
                         deps=deps, phase=p["phase"], layer=p["layer"], cost_class=CostClass.COPY,
                         bytes_read=float(nbytes), pinned=pin_memory,
                         allocs=(TensorAlloc(p["tensor"], nbytes),))

    for op in graph.ops:
        if op.role is OpRole.PARAM_UPLOAD and op.layer >= 0:
            rw.drop(op)  # block weights are not resident: nothing to upload after the CPU step
            continue
        for p in fetch_before.get(op.id, []):
            fetch(p, [])
        extra, uses = [], op.uses
        if op.id in first_of:
            extra.append(first_of[op.id]["id"])
        if op.id in last_of:
            uses = uses + tuple(p["tensor"] for p in last_of[op.id])
        rw.copy(op, extra_deps=extra, uses=uses)
        for p in fetch_after.get(op.id, []):
            fetch(p, list(rw.new(op.id)))
    persistent = [t for t in graph.persistent if t.name not in ("params.bf16", "params.fp16")]
    resident = model.num_parameters - model.num_layers * model.layer_params  # embeddings, final norm, head
    persistent.append(TensorAlloc("params.resident.bf16", 2 * resident))
    meta = dict(graph.meta)
    meta["offload_param"] = {"prefetch_depth": prefetch_depth, "fetches": len(plans), "bytes_per_fetch": nbytes}
    return rw.finish(persistent=persistent, meta=meta)


def is_param_gather(op, groups=("dp", "dp_shard")) -> bool:
    """A forward / backward parameter all-gather of the sharding builder (ZeRO-3, FSDP) over one of ``groups``."""
    m = op.meta or {}
    return (op.kind == OpKind.COLLECTIVE and m.get("collective") == "all_gather" and op.phase in (Phase.FWD, Phase.BWD)
            and m.get("group", "dp") in groups)


def fetch_shard_before(rw: GraphRewriter, op, nbytes: int, pin_memory: bool, k: int, suffix: str,
                       stream: str = "h2d", host_waits: bool = False) -> int:
    """Copy ``op`` (a parameter all-gather, or the kernel that feeds one) after an H2D copy on ``stream`` of this
    rank's ``nbytes`` shard of it from host memory into a GPU buffer that ``op`` reads (freed after it); the copy
    waits for what ``op`` waited for. ``host_waits``: the training thread blocks until the copy ends (a
    ``cudaMemcpyAsync`` from pageable memory stages through the driver's buffer before it returns: CUDA Runtime API,
    "API synchronization behavior"), a ``SYNC`` on stream ``host`` that ``op`` follows. Used by ZeRO-3 parameter
    offload and FSDP ``cpu_offload`` / ``offload_policy`` (``offload_fsdp``). Returns the copy's new id."""
    tensor = f"{op.name}.host_partition#{k}"
    name = f"{op.name.removesuffix('.param_all_gather')}.{suffix}"
    f = rw.add(name, OpKind.MEMCPY_H2D, stream, deps=sorted(rw._remap(op.deps)), phase=op.phase, layer=op.layer,
               cost_class=CostClass.COPY, bytes_read=float(nbytes), pinned=pin_memory,
               allocs=(TensorAlloc(tensor, nbytes),))
    after = [rw.add(f"{name}.wait", OpKind.SYNC, "host", deps=[f], phase=op.phase, layer=op.layer, launch=False)] \
        if host_waits else []
    rw.copy(op, extra_deps=[f, *after], uses=op.uses + (tensor,))
    return f


def _offload_sharded(graph: OpGraph, model: ModelFacts, pin_memory: bool) -> OpGraph:
    """ZeRO-3 parameter offload over ``dp`` > 1 ranks (see the module docstring): every parameter
    all-gather of forward and backward is preceded by the H2D copy of this rank's partition of that
    unit, ``ceil(bytes / dp)``, which the gather reads; the post-step upload of the partition is gone.

    Raises:
        PolicyError: the graph is not the ZeRO-3 builder's (no per-unit parameter all-gathers).
    """
    key = "zero_optimization.offload_param"
    dp = model.data_parallel_size
    if graph.meta.get("sharding") != "zero3":
        raise PolicyError(f"{key}: with data_parallel_size {dp} > 1 needs the ZeRO-3 builder graph "
                          f"(zero_optimization.stage 3), got sharding {graph.meta.get('sharding')!r}")
    rw = GraphRewriter(graph)
    fetches, nbytes_total = 0, 0
    for op in graph.ops:
        if op.role is OpRole.PARAM_UPLOAD:
            rw.drop(op)  # the updated 16-bit partition stays in host memory (CPU Adam wrote it there)
            continue
        m = op.meta or {}
        if is_param_gather(op, ("dp",)):
            nb = -(-int(m["bytes"]) // dp)
            fetch_shard_before(rw, op, nb, pin_memory, fetches, "offload_param.fetch")
            fetches += 1
            nbytes_total += nb
            continue
        rw.copy(op)
    if not fetches:
        raise PolicyError(f"{key}: found no parameter all-gathers to feed from host memory")
    persistent = [t for t in graph.persistent if t.name not in ("params.bf16.partition", "params.fp16.partition")]
    meta = dict(graph.meta)
    meta["offload_param"] = {"prefetch_depth": None, "fetches": fetches, "bytes_per_step": nbytes_total}
    return rw.finish(persistent=persistent, meta=meta)


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _minus(iv: list[tuple[float, float]], cut: list[tuple[float, float]]) -> float:
    """Length of the union ``iv`` outside the union ``cut`` (both merged, sorted)."""
    total, j = 0.0, 0
    for a, b in iv:
        t = a
        while j < len(cut) and cut[j][1] <= t:
            j += 1
        k = j
        while k < len(cut) and cut[k][0] < b:
            total += max(0.0, min(cut[k][0], b) - t)
            t = max(t, cut[k][1])
            k += 1
        total += max(0.0, b - t)
    return total


def fetch_times(spans, steps, suffix: str) -> tuple[float, float]:
    """Per measured step (means, s): the H2D parameter fetches' busy time and their exposed time.

    Busy: the union of the spans whose name ends in ``suffix`` (``fsdp_offload.fetch`` for FSDP ``cpu_offload``,
    ``offload_param.fetch`` for ZeRO-3 ``offload_param``). Exposed (``exposed_param_fetch_s``, one definition for
    both): the time the compute stream waits on a parameter fetch, i.e. the time a fetch is in flight while the
    compute stream is idle and no collective runs; the all-gather a fetch feeds (ZeRO-3 over ``dp > 1``, FSDP)
    counts as exposed communication instead, not twice. ``spans``: one rank's spans; ``steps``: its steps with
    ``warmup``. Tiny case (``tests/simulator/policies/test_exposed_param_fetch.py``): compute busy over [0, 2] and
    [6, 10] s, a fetch over [3, 5] and its all-gather over [5, 6]: 2 s exposed (the idle [2, 3] before the fetch
    starts is not the fetch's)."""
    meas = steps[~steps.warmup]
    busy, exposed = [], []
    for row in meas.itertuples():
        d = spans[spans.step == row.step]
        f = _union(list(zip(*(d[d.name.str.endswith(suffix)][c] for c in ("start_s", "end_s")))))
        other = d[(d.stream == "compute") | (d.kind == "collective")]
        busy.append(sum(b - a for a, b in f))
        exposed.append(_minus(f, _union(list(zip(other.start_s, other.end_s)))))
    return (sum(busy) / len(busy), sum(exposed) / len(exposed)) if busy else (0.0, 0.0)


def param_fetch_summary(spans, steps, suffix: str) -> dict:
    """The summary's parameter-fetch keys for the fetches named ``*suffix``: ``offload_param_fetch_s`` (H2D busy
    time per measured step) and ``exposed_param_fetch_s`` (the compute stream's wait on them), both ``fetch_times``.
    Used by ZeRO-3 ``offload_param`` and FSDP ``cpu_offload`` alike."""
    busy, exposed = fetch_times(spans, steps, suffix)
    return {"offload_param_fetch_s": busy, "exposed_param_fetch_s": exposed}


@register_runtime("offload_param")
class OffloadParamSummary:
    """Adds the parameter fetches to the summary: ``offload_param_fetch_s`` (their H2D busy time per measured step,
    ``fetch_times``; with this policy the block weights are fetched instead of uploaded after the CPU step, so
    ``offload_h2d_s`` counts only the resident parameters' upload, 0 with ZeRO-3 over dp > 1) and
    ``exposed_param_fetch_s`` (the compute stream's wait on them; ``param_fetch_summary``)."""

    def __init__(self, cfg, hw, env, system):
        pass

    @classmethod
    def applies(cls, cfg) -> bool:
        return _enabled(cfg)

    def summarize(self, spans, steps, counters, summary) -> dict:
        return param_fetch_summary(spans, steps, "offload_param.fetch")
