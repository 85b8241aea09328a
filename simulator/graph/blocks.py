"""Layer blocks: a graph's consecutive compute kernels of one layer and phase merged into one block op, with its
memory per block and the blocking TP collectives between them folded in (``coarsen``).

The semantics (what stays separate, time, host launches, memory, TP folding, what is approximated) are those of
``run.fidelity: layer``, documented in ``simulator.policies.fidelity``, the graph policy that applies it; the
model builders use the same functions to emit a stamped layer pass as blocks directly
(``simulator.graph.builders.stamp_blocks``).
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left
from collections import defaultdict
from operator import attrgetter

from simulator.graph.op_graph import OpGraph
from simulator.graph.ops import Op, OpKind, TensorAlloc, op_copier, op_from_fields

#: op metadata that keeps a kernel out of any block (it synchronises with something outside the stream)
_UNMERGEABLE_META = frozenset({"collective", "rendezvous", "parties", "prev_step_deps", "fused"})
COMPUTE_STREAM = "compute"


def _mergeable(op: Op) -> bool:
    return (op.kind is OpKind.COMPUTE and op.stream == COMPUTE_STREAM and op.layer >= 0
            and op.fixed_duration_s is None and op.launch and not (op.meta and _UNMERGEABLE_META & op.meta.keys()))


#: collective metadata that keeps a TP collective out of a block (it meets other ranks, or runs beside a GEMM)
_UNFOLDABLE_META = frozenset({"rendezvous", "parties", "prev_step_deps", "fused_gemm", "fused"})


def foldable_tp(graph: OpGraph) -> dict[int, tuple[int, int]]:
    """Blocking TP collectives that may be folded into the block around them: collective id -> ``(a, b)``, the
    compute-stream kernels it sits between (``a`` the last kernel before it, ``b`` the next one, which waits
    for it).

    A collective qualifies when it is a ``COLLECTIVE`` with ``meta["group"] == "tp"`` on a ``comm.tp`` stream
    without a measured duration, rendezvous, ``parties``, previous-step dependencies or ``fused_gemm``
    (``tp_comm_overlap``: it runs beside a GEMM, not between kernels); every op it waits for is a
    compute-stream kernel and the last of them is ``a``; every op waiting for it is a compute-stream kernel,
    the first being ``b``, the kernel right after ``a`` on the compute stream; nothing of the next step waits
    for it; the op before it on its stream is done before ``a`` ends (a compute kernel up to ``a`` waits for
    it) and the op after it waits for a compute kernel from ``b`` on (so leaving the stream changes no
    stream order). TP collectives are never rendezvous of several simulated ranks (``api._meet_across_classes``
    meets only data-parallel and expert groups; the TP peers are folded symmetric ranks), so folding one
    drops no meeting; a collective that names one is kept.
    """
    ops = graph.ops
    cands = [op for op in ops if op.kind is OpKind.COLLECTIVE and op.meta and op.meta.get("group") == "tp"
             and "collective" in op.meta and op.stream.startswith("comm.tp") and op.fixed_duration_s is None
             and not _UNFOLDABLE_META & op.meta.keys() and op.deps]
    if not cands:
        return {}
    ids = {op.id for op in cands}
    dependents: dict[int, list[int]] = defaultdict(list)
    prev_waited: set[int] = set()
    pos: dict[int, int] = {}  # compute-stream op id -> its index on the stream
    by_stream: dict[str, list[int]] = defaultdict(list)
    at: dict[int, int] = {}  # collective id -> its index on its stream
    for op in ops:
        for d in op.deps:
            if d in ids:
                dependents[d].append(op.id)
        if op.meta and "prev_step_deps" in op.meta:
            prev_waited.update(op.meta["prev_step_deps"] or ())
        if op.stream == COMPUTE_STREAM:
            pos[op.id] = len(pos)
        elif op.stream.startswith("comm.tp"):
            at[op.id] = len(by_stream[op.stream])
            by_stream[op.stream].append(op.id)
    out: dict[int, tuple[int, int]] = {}
    for c in cands:
        users = dependents.get(c.id)
        if not users or c.id in prev_waited or any(ops[d].stream != COMPUTE_STREAM for d in c.deps) \
                or any(ops[u].stream != COMPUTE_STREAM for u in users):
            continue
        a, b = max(c.deps), min(users)
        if pos[b] != pos[a] + 1:
            continue
        seq = by_stream[c.stream]
        k = at[c.id]
        if k > 0:  # the op before it on its stream: a kernel up to ``a`` waits for it
            p = seq[k - 1]
            if not any(ops[u].stream == COMPUTE_STREAM and u <= a for u in dependents.get(p, ())) and p not in out:
                continue
        if k + 1 < len(seq):  # the op after it waits for a kernel from ``b`` on
            n = ops[seq[k + 1]]
            if not any(ops[d].stream == COMPUTE_STREAM and d >= b for d in n.deps):
                continue
        out[c.id] = (a, b)
    return out


def blocks_of(graph: OpGraph, fold: dict[int, tuple[int, int]] | None = None) -> list[list[int]]:
    """The runs of op ids ``coarsen`` merges (each of two or more ops), in graph order.

    ``fold``: TP collectives that may be folded (``foldable_tp``): the dependency of such a collective on the
    kernel before it and of the kernel after it on the collective do not end a block (the collective is folded
    where both kernels land in one block, ``coarsen``).
    """
    fold = fold or {}
    ops = graph.ops
    streams = [op.stream for op in ops]
    waited: set[int] = set()  # ops something outside their stream (or the next step) waits for
    for op in ops:
        if op.id in fold:
            continue
        st = op.stream
        for d in op.deps:
            if streams[d] != st:
                waited.add(d)
        if op.meta and "prev_step_deps" in op.meta:
            waited.update(op.meta["prev_step_deps"] or ())
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
        cross = any(streams[d] != COMPUTE_STREAM and d not in fold for d in op.deps)
        if cur is not None and k == key and not cross:
            cur.append(op.id)
        else:
            cur, key = [op.id], k
            out.append(cur)
        if op.id in waited:
            cur = None
    return [b for b in out if len(b) > 1]


#: what prices a kernel (a block's ``meta["fused_key"]``, one per part)
_signature = attrgetter("cost_class", "shape", "flops", "bytes_read", "bytes_written", "dtype")


def block_memory(seq: list[Op], users: dict[str, list[int]], size: dict[str, int],
                 first_id: int) -> tuple[list[TensorAlloc], dict[str, None], int]:
    """Memory of one block standing for ops ``seq`` (run one after another), as ``_block_op`` gives it: ``(allocs,
    uses, scratch_bytes)``: the tensors of ``seq`` that outlive the block (allocated when it starts), the tensors
    it reads that it does not make and use up itself, and the bytes of the scratch tensor that brings its demand
    at the start up to the high-water mark ``seq`` reaches one op after another (0: none needed).

    ``users``: op ids using each tensor, ascending; ``size``: bytes of each GPU tensor ops allocate; ``first_id``:
    the id of the block's first op (every use from there on is one of ``seq``'s).
    """
    allocs: list[TensorAlloc] = []
    uses: dict[str, None] = {}
    last_use: dict[str, int] = {}
    n_in: dict[str, int] = {}  # uses of each tensor inside the block (``users`` lists each use too)
    for i, p in enumerate(seq):
        for u in p.uses:
            last_use[u] = i
            n_in[u] = n_in.get(u, 0) + 1
    # made inside and used only inside (every use of it is one of the block's)
    internal = {t.name for p in seq for t in p.allocs if n_in.get(t.name, 0) == len(users.get(t.name, ()))}
    # tensors made before the block whose other users all come earlier: freed inside at kernel fidelity (``users[u]``
    # sorted, and every part comes from the block's first on: its uses from there on are all the block's)
    freed_in = {u for u, k in n_in.items() if u not in internal and u in size
                and k == len(users[u]) - bisect_left(users[u], first_id)}
    live = base = sum(size[u] for u in freed_in)
    high = live
    alive: dict[str, int] = {u: size[u] for u in freed_in}
    for i, p in enumerate(seq):
        for t in p.allocs:
            if t.name in internal and t.device == "gpu":
                alive[t.name] = t.nbytes
                live += t.nbytes
            else:
                allocs.append(t)
                if t.device == "gpu":
                    live += t.nbytes
                    base += t.nbytes
        if live > high:
            high = live
        for u in p.uses:
            if u not in internal:
                uses[u] = None
        if alive:  # freed at their last user's end (unused: at once)
            for t in p.allocs:
                if t.name in alive and last_use.get(t.name, i) <= i:
                    live -= alive.pop(t.name)
            for u in p.uses:
                if u in alive and last_use[u] <= i:
                    live -= alive.pop(u)
    return allocs, uses, high - base


def tensor_index(ops, merged) -> tuple[dict[str, list[int]], dict[str, int]]:
    """``(users, size)`` as ``block_memory`` reads them for blocks of the ops ``merged`` (parts and folded
    collectives) of graph ``ops``: the bytes of each GPU tensor ``ops`` allocate, and for each tensor ``merged``
    allocate and each such GPU tensor they use, the ids of the ops of ``ops`` using it, ascending (an op using it
    twice listed twice). ``block_memory`` reads no other tensor's users (a tensor no op allocates, such as a
    weight, is never freed in a block), so another tensor's list may be partial or missing; ``size`` has them all.
    Ops none of whose uses are among those tensors are passed over (a set test each), as most of a large
    pipeline's ops are where few of its passes are merged (the weights each pass reads, used by every micro-batch,
    would make most of them users)."""
    size = {t.name: t.nbytes for op in ops for t in op.allocs if t.device == "gpu"}
    need = {u for p in merged for u in p.uses if u in size}
    need.update(t.name for p in merged for t in p.allocs)
    users: dict[str, list[int]] = defaultdict(list)
    disjoint = need.isdisjoint
    for oid, op in enumerate(ops):  # by place (``side_blocks.coarsen_folded``: an op not copied keeps its old id)
        uses = op.uses
        if uses and not disjoint(uses):
            for u in uses:
                users[u].append(oid)  # in id order
    return users, size


def _block_op(parts: list[Op], users: dict[str, list[int]], size: dict[str, int], new_id: int | None = None,
              deps: tuple[int, ...] | None = None, comm: dict[int, Op] | None = None) -> Op:
    """One op standing for ``parts`` (consecutive kernels of one stream), with memory per block.

    ``users``: op ids using each tensor, ascending; ``size``: bytes of each GPU tensor ops allocate; ``new_id`` and
    ``deps``: the block's id and dependencies (default: the first part's). The block allocates
    the tensors of its parts that outlive it, plus one scratch tensor that brings its demand at the start up
    to the high-water mark the parts reach one after another at kernel fidelity (tensors made and used only
    inside, tensors allocated before it whose last users are in it); the scratch counts as activations.
    ``comm``: TP collectives folded in, by the id of the part they run before (``foldable_tp``): their tensors
    count like a part's, they go to ``folded_comm`` renumbered to the block's id, and ``meta["folded_at"]``
    holds the index of the part each runs before.
    """
    comm = comm or {}
    seq = [q for p in parts for q in ((comm[p.id], p) if p.id in comm else (p,))] if comm else parts
    first_id = parts[0].id
    allocs, uses, extra = block_memory(seq, users, size, first_id)
    first = parts[0]
    name = f"L{first.layer}.{first.phase.value}.block[{first.name.split('.', 2)[-1]}..{parts[-1].name.split('.', 2)[-1]}]"
    if extra > 0:
        allocs.append(TensorAlloc(f"activations.block_scratch#{first.id}", extra))
    longest = max(parts, key=lambda p: p.flops + p.bytes_read + p.bytes_written)
    meta = {"fused": tuple(parts), "fused_key": tuple(map(_signature, parts)), "launches": len(parts)}
    vals = list(_GET_FIELDS(first))  # the constructor directly (see ``_renumbered``)
    vals[0] = bid = first.id if new_id is None else new_id
    if comm:
        meta["folded_at"] = tuple(i for i, p in enumerate(parts) if p.id in comm)
        vals[_FOLDED] = tuple(_renumbered(comm[p.id], bid, (), comm[p.id].meta) for p in parts if p.id in comm)
    vals[_NAME], vals[_COST_CLASS], vals[_SHAPE] = name, longest.cost_class, ()
    vals[_FLOPS] = sum(p.flops for p in parts)
    vals[_READ] = sum(p.bytes_read for p in parts)
    vals[_WRITTEN] = sum(p.bytes_written for p in parts)
    vals[_ALLOCS], vals[_USES], vals[_META] = tuple(allocs), tuple(uses), meta
    if deps is not None:
        vals[_DEPS] = deps
    return op_from_fields(vals)


_FIELDS = tuple(f.name for f in dataclasses.fields(Op))


def _renumbered(op: Op, new_id: int, deps: tuple[int, ...], meta: dict, comm_ids: bool = True) -> Op:
    """``op`` with a new id, dependencies and metadata (the constructor directly: ``dataclasses.replace`` is
    several times slower, and large pipelines have hundreds of thousands of ops); ``comm_ids`` False: its folded
    collectives keep the ids they had (``moved``)."""
    if op.folded_comm and comm_ids:  # a block stamped by the builder (``builders.stamp_blocks``): its collectives
        # carry its id (each a collective, with no folded collectives of its own)
        return _ID_DEPS_META_FOLDED(op, new_id, deps, meta, tuple([_ID(c, new_id) for c in op.folded_comm]))
    return _ID_DEPS_META(op, new_id, deps, meta)


#: ``op`` with these fields replaced (``ops.op_copier``)
_ID = op_copier(("id",))
_ID_DEPS_META = op_copier(("id", "deps", "meta"))
_ID_DEPS_META_FOLDED = op_copier(("id", "deps", "meta", "folded_comm"))


def moved(op: Op, new_id: list[int], comm_ids: bool = True) -> Op:
    """``op`` (not merged) in a graph renumbered by ``new_id`` (old op id -> new): its id, dependencies and
    ``meta["prev_step_deps"]`` mapped, and the collectives folded into it (``Op.folded_comm``) given its id, also
    where they carried another (``comm_ids`` False: ``coarsen_ids``'s); ``op`` itself where nothing changes."""
    i = new_id[op.id]
    deps = tuple(sorted({new_id[d] for d in op.deps})) if op.deps else ()
    meta = op.meta
    if meta and "prev_step_deps" in meta:
        meta = {**meta, "prev_step_deps": tuple(sorted({new_id[d] for d in meta["prev_step_deps"]}))}
    if i == op.id and deps == op.deps and meta is op.meta and (not comm_ids or _comm_ids_ok(op)):
        return op
    return _renumbered(op, i, deps, meta, comm_ids)


def _comm_ids_ok(op: Op) -> bool:
    """Whether the collectives folded into ``op`` carry its id."""
    return not op.folded_comm or op.folded_comm[0].id == op.id


_DEPS, _META, _FOLDED = _FIELDS.index("deps"), _FIELDS.index("meta"), _FIELDS.index("folded_comm")
_NAME, _COST_CLASS, _SHAPE, _FLOPS, _READ, _WRITTEN, _ALLOCS, _USES = (
    _FIELDS.index(f) for f in ("name", "cost_class", "shape", "flops", "bytes_read", "bytes_written", "allocs", "uses"))
_GET_FIELDS = attrgetter(*_FIELDS)  # all fields of an op as one tuple, in one C call


def coarsen(graph: OpGraph, fold_tp: bool = False, comm_ids: bool = True) -> OpGraph:
    """The graph at layer fidelity (``coarsen_ids`` without the id map)."""
    return coarsen_ids(graph, fold_tp, comm_ids)[0]


def coarsen_ids(graph: OpGraph, fold_tp: bool = False, comm_ids: bool = True) -> tuple[OpGraph, list[int]]:
    """The graph at layer fidelity: each run of ``blocks_of`` replaced by one block op at its first part's
    place (dependencies on any part become dependencies on the block; ``meta["prev_step_deps"]`` and the
    parameter groups' ``grad_op`` are renumbered). A graph without such runs comes back with the same ops.

    ``fold_tp``: also fold each blocking TP collective (``foldable_tp``) whose kernels before and after land in
    one block into that block (``Op.folded_comm``; ``simulator.policies.fidelity``'s module docstring, *TP collectives*).

    ``comm_ids`` False: an op only renumbered keeps the collectives folded into it (stamped blocks,
    ``builders.stamp_blocks``) with the id they had, for a pass that gives every such op its id anyway
    (``side_blocks.fold_overlapped_tp``, which the layer-fidelity policy runs next; it copies each op again): one copy
    of each such collective less (a 175B pipeline stage has ~10,000).

    Returns:
        ``(graph, new_id)``: the new graph (``meta["fidelity"]`` records ``{"ops_before", "ops_after", "blocks",
        "folded_tp"}``) and, for each op id of ``graph``, the id of the op that stands for it in the new one.
    """
    plan = coarse_plan(graph, fold_tp)
    if plan is None:
        same = list(range(len(graph.ops)))
        info = {"ops_before": len(graph.ops), "ops_after": len(graph.ops), "blocks": 0, "folded_tp": 0}
        if comm_ids and not all(map(_comm_ids_ok, graph.ops)):  # stamped blocks' shared collectives: their ids
            return graph.with_changes(ops=tuple(moved(op, same) for op in graph.ops),
                                      meta={**graph.meta, "fidelity": info}), same
        return graph.with_changes(meta={**graph.meta, "fidelity": info}), same
    out, _, new_id, info = coarse_ops(graph, plan, comm_ids)
    pgs = tuple(pg.with_grad_op(new_id[pg.grad_op]) for pg in graph.param_groups)
    return graph.with_changes(ops=tuple(out), param_groups=pgs, meta={**graph.meta, "fidelity": info}), new_id


def coarse_plan(graph: OpGraph, fold_tp: bool) -> tuple | None:
    """What ``coarsen_ids`` merges: ``(blocks, comm_of, folded)`` (``blocks_of``'s runs; by block start, the TP
    collectives folded before each part; collective id -> its block's start), None where nothing is."""
    fold = foldable_tp(graph) if fold_tp else {}
    blocks = blocks_of(graph, fold)
    if not blocks:
        return None
    pair = {ab: c for c, ab in fold.items()}
    comm_of: dict[int, dict[int, Op]] = {}  # block start -> {part id: collective folded before it}
    for b in blocks:
        for a, n in zip(b, b[1:]):
            c = pair.get((a, n))
            if c is not None:
                comm_of.setdefault(b[0], {})[n] = graph.ops[c]
    folded = {c.id: b0 for b0, m in comm_of.items() for c in m.values()}
    return blocks, comm_of, folded


def coarse_ops(graph: OpGraph, plan: tuple, comm_ids: bool = True, keep=None,
               view: list[bool] | None = None) -> tuple[list, list, list[int], dict]:
    """``(ops, deps, new_id, info)`` of ``coarsen_ids`` for ``plan`` (``coarse_plan``): the coarsened graph's ops,
    their dependencies, the id map and ``meta["fidelity"]``. ``keep`` (an op -> bool): an op only renumbered for
    which it is false is not copied: ``ops`` holds the op of ``graph`` itself (its id and dependencies the old
    ones) and ``deps`` its new dependencies (``side_blocks.coarsen_folded``, which renumbers it once more); ``view``
    (with ``keep``): a list to which whether each op is such an op is appended."""
    blocks, comm_of, folded = plan
    info = {"ops_before": len(graph.ops), "ops_after": len(graph.ops), "blocks": len(blocks),
            "folded_tp": len(folded)}
    users, size = tensor_index(graph.ops, [graph.ops[j] for b in blocks for j in b]
                               + [c for m in comm_of.values() for c in m.values()])
    start_of = {b[0]: b for b in blocks}
    new_id = [-1] * len(graph.ops)  # first pass: ids (``prev_step_deps`` may name later ops)
    n = 0
    for op in graph.ops:
        if new_id[op.id] >= 0:  # a later part of a block already placed
            continue
        if op.id in folded:
            new_id[op.id] = new_id[folded[op.id]]
            continue
        for j in start_of.get(op.id, (op.id,)):
            new_id[j] = n
        n += 1
    out: list[Op] = []
    deps_of: list[tuple[int, ...]] = []
    for op in graph.ops:
        i = new_id[op.id]
        if i < len(out) or op.id in folded:
            continue
        b = start_of.get(op.id)
        if b is None:
            if keep is None or keep(op):
                out.append(moved(op, new_id, comm_ids))
                deps_of.append(out[-1].deps)
                if view is not None:
                    view.append(False)
            else:
                out.append(op)
                deps_of.append(tuple(sorted({new_id[d] for d in op.deps})) if op.deps else ())
                view.append(True)
            continue
        parts = [graph.ops[j] for j in b]
        comm = comm_of.get(op.id)
        ids = set(b) | ({c.id for c in comm.values()} if comm else set())
        deps = tuple(sorted({new_id[d] for p in (*parts, *(comm or {}).values()) for d in p.deps if d not in ids}))
        out.append(_block_op(parts, users, size, i, deps, comm))
        deps_of.append(deps)
        if view is not None:
            view.append(False)
    info["ops_after"] = len(out)
    return out, deps_of, new_id, info
