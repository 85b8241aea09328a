"""Layer fidelity (``run.fidelity: layer``): consecutive compute kernels of one layer and phase become one op.

At kernel fidelity (the default) the engine runs every kernel the builder emits. At layer fidelity this
graph policy, which runs after every other one, replaces each maximal run of consecutive ``compute``-stream
kernels with the same ``layer`` (>= 0) and ``phase`` by one *block* op, cutting the op count (and the
engine's work) by the number of kernels per block:

* **What stays separate.** Only ``COMPUTE`` ops on stream ``compute`` with no measured duration and no
  collective / rendezvous / previous-step metadata are merged. A block ends at a kernel that an op on
  another stream (a collective, copy, send/recv, host op) or of the next step waits for, and a new block
  starts at a kernel that waits for an op on another stream: every cross-stream dependency keeps its
  exact endpoints. A micro-batch boundary always falls between blocks (another layer, phase, or a
  send/recv dependency lies between two micro-batches' kernels of one layer).
* **Time.** The block's parts (the original ops) travel in ``meta["fused"]``; the roofline prices the block
  as the sum of its parts' kernel-level times at the current clocks (``RooflineCostModel.duration_s``),
  cached by the parts' signature (``meta["fused_key"]``), so identical layers and micro-batches are priced
  once per clock. DVFS: the clock is read when the block starts (a change lands at the next block, not the
  next kernel). Interference: the block is re-rated as a whole while collectives are in flight (each
  part priced beside them and summed), i.e. the collectives' SM and HBM share is spread evenly over the
  block rather than over the kernels they overlap.
* **Host launches.** The host pays one launch per part (``meta["launches"]``); the block may start after
  the first part's launch, and does not end before the last part could have run after its own launch
  (``Executor``), so a launch-bound stream keeps its kernel-fidelity time.
* **Memory per block.** The block allocates, when it starts, every tensor of its parts that outlives it;
  the tensors used only inside it are replaced by one scratch tensor of their high-water mark inside the
  block (the peak the parts reach one after another), freed when the block ends; tensors it reads are
  freed when it (or their last later user) ends.

Measured on the bundled scenarios (``tests/simulator/policies/test_fidelity.py``): step time within 2 % and
peak memory within a few % of kernel fidelity.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from simulator.engine.memory import category
from simulator.graph.op_graph import OpGraph
from simulator.graph.ops import Op, OpKind, TensorAlloc
from simulator.policies._rewrite import GraphRewriter
from simulator.policies.registry import register_graph_policy

FIDELITIES = ("kernel", "layer")
#: op metadata that keeps a kernel out of any block (it synchronises with something outside the stream)
_UNMERGEABLE_META = frozenset({"collective", "rendezvous", "parties", "prev_step_deps", "fused"})
COMPUTE_STREAM = "compute"


@register_graph_policy("layer_fidelity", order=1000)
class LayerFidelity:
    """``run.fidelity: layer``: merge each layer's consecutive compute kernels (see the module docstring)."""

    @classmethod
    def applies(cls, cfg) -> bool:
        return getattr(cfg.run, "fidelity", "kernel") == "layer"

    def transform(self, graph: OpGraph, cfg, hw) -> OpGraph:
        return coarsen(graph)


def _mergeable(op: Op) -> bool:
    return (op.kind is OpKind.COMPUTE and op.stream == COMPUTE_STREAM and op.layer >= 0
            and op.fixed_duration_s is None and op.launch and not (op.meta and _UNMERGEABLE_META & op.meta.keys()))


def blocks_of(graph: OpGraph) -> list[list[int]]:
    """The runs of op ids ``coarsen`` merges (each of two or more ops), in graph order."""
    ops = graph.ops
    waited: set[int] = set()  # ops something outside their stream (or the next step) waits for
    for op in ops:
        for d in op.deps:
            if ops[d].stream != op.stream:
                waited.add(d)
        waited.update((op.meta or {}).get("prev_step_deps") or ())
    out: list[list[int]] = []
    cur: list[int] | None = None
    key = None
    for op in ops:
        if op.stream != COMPUTE_STREAM:
            continue
        if not _mergeable(op):
            cur = None
            continue
        k = (op.layer, op.phase)
        cross = any(ops[d].stream != COMPUTE_STREAM for d in op.deps)
        if cur is not None and k == key and not cross:
            cur.append(op.id)
        else:
            cur, key = [op.id], k
            out.append(cur)
        if op.id in waited:
            cur = None
    return [b for b in out if len(b) > 1]


def _signature(op: Op) -> tuple:
    return (op.cost_class, op.shape, op.flops, op.bytes_read, op.bytes_written, op.dtype)


def _block_op(parts: list[Op], users: dict[str, set[int]]) -> Op:
    """One op standing for ``parts`` (consecutive kernels of one stream), with memory per block."""
    ids = {p.id for p in parts}
    internal = {t.name for p in parts for t in p.allocs if users.get(t.name, set()) <= ids}
    allocs: list[TensorAlloc] = []
    uses: dict[str, None] = {}
    live = high = 0
    internal_bytes: dict[str, int] = {}
    last_use: dict[str, int] = {}
    for i, p in enumerate(parts):
        for u in p.uses:
            last_use[u] = i
    cats: set[str] = set()
    for i, p in enumerate(parts):
        for t in p.allocs:
            if t.name in internal and t.device == "gpu":
                internal_bytes[t.name] = t.nbytes
                live += t.nbytes
                cats.add(category(t.name))
            else:
                allocs.append(t)
        high = max(high, live)
        for u in p.uses:
            if u not in internal:
                uses[u] = None
        for t in p.allocs:  # internal tensors freed at their last user's end (or at once if unused)
            if t.name in internal_bytes and last_use.get(t.name, i) <= i:
                live -= internal_bytes.pop(t.name)
        for u in p.uses:
            if u in internal_bytes and last_use[u] == i:
                live -= internal_bytes.pop(u)
    first = parts[0]
    name = f"L{first.layer}.{first.phase.value}.block[{first.name.split('.', 2)[-1]}..{parts[-1].name.split('.', 2)[-1]}]"
    if high:
        head = cats.pop() if len(cats) == 1 and next(iter(cats)) != "activations" else "activations"
        allocs.append(TensorAlloc(f"{head}.block_scratch#{first.id}", high))
    longest = max(parts, key=lambda p: p.flops + p.bytes_read + p.bytes_written)
    meta = {"fused": tuple(parts), "fused_key": tuple(_signature(p) for p in parts), "launches": len(parts)}
    return dataclasses.replace(
        first, name=name, cost_class=longest.cost_class, flops=sum(p.flops for p in parts),
        bytes_read=sum(p.bytes_read for p in parts), bytes_written=sum(p.bytes_written for p in parts),
        shape=(), allocs=tuple(allocs), uses=tuple(uses), meta=meta)


def coarsen(graph: OpGraph) -> OpGraph:
    """The graph at layer fidelity: each run of ``blocks_of`` replaced by one block op at its first part's
    place (dependencies on any part become dependencies on the block). Kernel-fidelity graphs without
    such runs come back with the same ops.

    Returns:
        The new graph; ``meta["fidelity"]`` records ``{"ops_before", "ops_after", "blocks"}``.
    """
    blocks = blocks_of(graph)
    if not blocks:
        return graph.with_changes(meta={**graph.meta, "fidelity": {"ops_before": len(graph.ops),
                                                                   "ops_after": len(graph.ops), "blocks": 0}})
    users: dict[str, set[int]] = defaultdict(set)
    for op in graph.ops:
        for u in op.uses:
            users[u].add(op.id)
    start_of = {b[0]: b for b in blocks}
    inside = {i for b in blocks for i in b[1:]}
    rw = GraphRewriter(graph)
    for op in graph.ops:
        if op.id in inside:
            continue
        b = start_of.get(op.id)
        if b is None:
            rw.copy(op)
            continue
        parts = [graph.ops[i] for i in b]
        block = _block_op(parts, users)
        ids = set(b)
        ext = {d for p in parts for d in p.deps if d not in ids}
        new = rw.copy(dataclasses.replace(block, deps=tuple(sorted(ext))))
        for i in b[1:]:
            rw.map[i] = (new,)
    out = rw.finish()
    return out.with_changes(meta={**out.meta, "fidelity": {"ops_before": len(graph.ops), "ops_after": len(out.ops),
                                                           "blocks": len(blocks)}})
