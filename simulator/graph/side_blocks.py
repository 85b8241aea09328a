"""Layer blocks that carry TP collectives running beside their kernels (``run.fidelity: layer``).

``coarsen`` (``simulator.graph.blocks``) folds a blocking TP collective into the block around it, but a collective
that runs beside compute cuts the blocks: Megatron's asynchronous column-parallel backward
(``tp_async_grad_reduce``) issues the input-gradient all-reduce / reduce-scatter right after the input-gradient
GEMM and waits for it only before the weight-gradient accumulation, and with sequence parallelism gathers the saved
input shard again beside the input-gradient GEMM; the kernel it waits for ends a block, the kernel waiting for it
starts one, and it stays an op of its own. A 175B layer's backward is then 16 ops.

``fold_overlapped_tp`` runs on the coarsened graph: it merges each run of consecutive compute-stream ops (blocks
and mergeable kernels) of one layer and phase whose only cuts are such TP collectives into one block, with every
TP collective of the run in ``Op.folded_comm`` (blocking or beside compute, in stream order, renumbered to the
block's id) and their places in ``meta["side"]``: one ``(a, b)`` per collective, the index of the part (in
``meta["fused"]``, the block's kernels) it starts after and of the part that waits for it. The engine prices such a
block with ``simulator.cost.overlap.overlap_timeline`` (``System.side_timeline``): the kernels one after another,
each collective from the end of part ``a`` (and of the collective before it on the stream) with the interference
kernel fidelity applies (the kernels beside it slowed by its SMs and HBM traffic, it slowed by ``1 + gamma``
while they run), part ``b`` waiting for it.

A TP collective ``c`` is folded where (besides ``foldable_tp``'s metadata rules: a ``COLLECTIVE`` of group ``tp``
on a ``comm.tp`` stream, NCCL-priced, no measured duration, rendezvous, ``parties``, previous-step dependencies or
``fused_gemm``):

* every op it waits for and every op waiting for it is a compute-stream op; ``a`` is the last it waits for, ``b``
  the first waiting for it, later than ``a``; nothing of the next step waits for it;
* ``a`` and ``b`` lie in one run: consecutive compute ops, each a block or a mergeable kernel of the same layer
  (>= 0) and phase, none but the first waiting for an op on another stream that is not folded, none but the last
  waited for by one (nor by the next step); or ``b`` does and ``a`` is the compute op right before the run, whose
  first op waits for nothing else on another stream: the collective then starts with the block (``a = -1`` in
  ``meta["side"]``; the block waits for ``a``), as at a layer's start (sequence parallelism's all-gather before a
  row-parallel backward);
* its run's collectives all use one stream; the op before it on its stream is folded into this run or an earlier
  one, or a compute op up to ``a`` waits for it; the op after it is folded into this run or a later one, or waits
  for a compute op from the run's first on (so the stream's order holds).

Collectives failing these are left as ops, which cuts the runs again; the rules are applied until nothing changes.
Runs without a collective to fold are left as they are. Memory per block is ``blocks.block_memory`` over the run's
ops (blocks with their scratch) and collectives.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import chain

from simulator.graph.blocks import _FIELDS, _GET_FIELDS, _UNFOLDABLE_META, COMPUTE_STREAM, _comm_ids_ok, _mergeable, \
    _renumbered, _signature, block_memory, coarse_ops, coarse_plan, coarsen, moved, tensor_index
from simulator.graph.op_graph import OpGraph
from simulator.graph.ops import Op, OpKind, TensorAlloc, op_from_fields

__all__ = ["fold_overlapped_tp", "fold_overlapped_tp_ids"]

_UNMERGEABLE_BLOCK_META = frozenset({"collective", "rendezvous", "parties", "prev_step_deps", "side"})


def _unit(op: Op) -> bool:
    """Whether ``op`` may be part of a run: a mergeable kernel or a block (``meta["fused"]``) of a layer."""
    if _mergeable(op):
        return True
    m = op.meta
    return (op.kind is OpKind.COMPUTE and op.stream == COMPUTE_STREAM and op.layer >= 0 and m is not None
            and "fused" in m and op.fixed_duration_s is None and op.launch and not _UNMERGEABLE_BLOCK_META & m.keys())


def _candidates(ops, tp: list[int], dependents, prev_waited, on_compute: list[bool]) -> dict[int, tuple[int, int]]:
    """The TP collectives among ops ``tp`` that pass the rules on their own: id -> ``(a, b)`` (``on_compute``: each
    op id's op is on the compute stream; ``ops[i]`` for ``i`` in ``tp`` has its id and dependencies)."""
    out: dict[int, tuple[int, int]] = {}
    computes = on_compute.__getitem__
    for i in tp:
        op = ops[i]
        m = op.meta
        if not (op.kind is OpKind.COLLECTIVE and m and m.get("group") == "tp" and "collective" in m
                and op.stream.startswith("comm.tp") and op.fixed_duration_s is None and op.deps
                and not _UNFOLDABLE_META & m.keys()) or op.id in prev_waited:
            continue
        users = dependents.get(op.id)
        if not users or not all(map(computes, op.deps)) or not all(map(computes, users)):
            continue
        a, b = max(op.deps), min(users)  # compute-stream order is id order
        if b > a:
            out[op.id] = (a, b)
    return out


def _runs(compute: list[int], unit: list[bool], key: list[tuple], xdeps: dict[int, list[int]],
          xwaiters: dict[int, list[int]], folded, prev_waited) -> list[list[int]]:
    """Runs of consecutive compute ops that may merge once the collectives ``folded`` are folded (``unit``: each
    op may be part of a run; ``key``: its layer and phase; ``xdeps`` / ``xwaiters``: the ops on other streams each
    compute op waits for / that wait for it)."""
    runs: list[list[int]] = []
    cur: list[int] | None = None
    k0 = None
    for oid in compute:
        if not unit[oid]:
            cur = None
            continue
        xd = xdeps.get(oid)
        k = key[oid]
        if cur is not None and k == k0 and not (xd and any(d not in folded for d in xd)):
            cur.append(oid)
        else:
            cur, k0 = [oid], k
            runs.append(cur)
        xw = xwaiters.get(oid)
        if oid in prev_waited or (xw and any(w not in folded for w in xw)):
            cur = None
    return runs


def _plan(ops, split: bool = True, deps: list[tuple[int, ...]] | None = None
          ) -> tuple[list[list[int]], dict[int, list[int]], dict[int, tuple[int, int]]]:
    """The runs to merge, the collectives folded into each (by its first op id), in stream order, and each folded
    collective's ``(a, b)``: the last op it waits for and the first waiting for it (in its run).

    ``split``: each round cuts the runs where the collectives it drops cut them (``_split``); False: each round
    walks the compute stream again (``_runs``; the same plan, slower: the tests' reference).

    ``deps``: each op's dependencies, where ``ops[i]`` may be an op that stands at place ``i`` with another id and
    other dependencies (``coarsen_folded``); such an op is none of the TP-stream ops, units and ops with
    ``prev_step_deps``, which carry theirs."""
    on_compute = [op.stream == COMPUTE_STREAM for op in ops]
    compute = [i for i, c in enumerate(on_compute) if c]
    pos = {oid: k for k, oid in enumerate(compute)}
    prev_waited: set[int] = set()
    on_stream: dict[str, list[int]] = defaultdict(list)
    xdeps: dict[int, list[int]] = {}  # compute op -> the ops on other streams it waits for
    xwaiters: dict[int, list[int]] = defaultdict(list)  # compute op -> the ops on other streams waiting for it
    dependents: dict[int, list[int]] = defaultdict(list)  # TP op -> the ops waiting for it
    is_tp = [False] * len(ops)
    for oid, op in enumerate(ops):  # one pass: a dependency is an earlier op (``OpGraph``), so whether it is a TP op
        # is known
        m = op.meta
        if m and "prev_step_deps" in m:
            prev_waited.update(m["prev_step_deps"] or ())
        od = op.deps if deps is None else deps[oid]
        if on_compute[oid]:
            if od:
                xd = [d for d in od if not on_compute[d]]
                if xd:
                    xdeps[oid] = xd
                    for d in xd:
                        if is_tp[d]:
                            dependents[d].append(oid)
            continue
        st = op.stream
        if st.startswith("comm.tp"):
            on_stream[st].append(oid)
            is_tp[oid] = True
        for d in od:
            if on_compute[d]:
                xwaiters[d].append(oid)
            elif is_tp[d]:
                dependents[d].append(oid)
    tp = [i for seq in on_stream.values() for i in seq]
    at = {oid: (st, k) for st, seq in on_stream.items() for k, oid in enumerate(seq)}
    cand = _candidates(ops, sorted(tp), dependents, prev_waited, on_compute)
    if not cand:
        return [], {}, {}
    unit = [on_compute[i] and _unit(op) for i, op in enumerate(ops)]
    key = [(op.layer, op.phase) for op in ops]
    inf = len(ops)
    p_user: dict[int, int] = {}  # TP op -> the first compute op waiting for it (``inf``: none), as needed
    n_dep: dict[int, int] = {}  # TP op -> the last compute op it waits for (-1: none), as needed
    # runs by their first op id (the order of runs); removing a candidate only cuts runs (before the ops waiting for
    # it, after those it waits for: ``_runs``'s conditions), so each round splits the runs it cuts instead of
    # walking the compute stream again
    runs = {run[0]: run for run in _runs(compute, unit, key, xdeps, xwaiters, cand, prev_waited)}
    run_of = {oid: r for r, run in runs.items() for oid in run}
    while True:
        home: dict[int, int] = {}  # collective -> the run it folds into (in id order, as ``cand``)
        for c, (a, b) in cand.items():
            r = run_of.get(b)
            if r is None:
                continue
            if run_of.get(a) == r:
                home[c] = r
            elif pos[a] + 1 == pos[r] and all(d in cand for d in xdeps.get(r, ())):
                home[c] = r  # waits for the op right before the run, which then waits for it too: at its start
        stream_of: dict[int, str] = {}
        for c, r in home.items():  # the first collective folded into each run names its stream
            stream_of.setdefault(r, ops[c].stream)
        bad = []
        for c, (a, b) in cand.items():
            r = home.get(c)
            if r is None or stream_of[r] != ops[c].stream:
                bad.append(c)
                continue
            st, k = at[c]
            seq = on_stream[st]
            if k > 0:
                p = seq[k - 1]
                h = home.get(p)
                if h is not None:  # folded too (if it stays so): into this run or an earlier one
                    ok = h <= r
                else:
                    u = p_user.get(p)
                    if u is None:
                        u = p_user[p] = min((u for u in dependents.get(p, ()) if on_compute[u]), default=inf)
                    ok = u <= a
                if not ok:
                    bad.append(c)
                    continue
            if k + 1 < len(seq):
                n = seq[k + 1]
                h = home.get(n)
                if h is not None:
                    ok = h >= r
                else:
                    d = n_dep.get(n)
                    if d is None:
                        d = n_dep[n] = max((d for d in ops[n].deps if on_compute[d]), default=-1)
                    ok = d >= r
                if not ok:
                    bad.append(c)
        if not bad:
            break
        for c in bad:
            del cand[c]
        if not cand:
            return [], {}, {}
        if split:
            _split(runs, run_of, {u for c in bad for u in dependents[c]}, {d for c in bad for d in ops[c].deps})
        else:
            runs = {run[0]: run for run in _runs(compute, unit, key, xdeps, xwaiters, cand, prev_waited)}
            run_of = {oid: r for r, run in runs.items() for oid in run}
    folded: dict[int, list[int]] = defaultdict(list)
    for c in cand:  # id order: the stream's order
        folded[home[c]].append(c)
    return [runs[r] for r in sorted(folded)], {r: folded[r] for r in sorted(folded)}, cand


def _split(runs: dict[int, list[int]], run_of: dict[int, int], starts: set[int], ends: set[int]) -> None:
    """Cut the runs (by first op id; ``run_of``: op id -> its run's) before each op of ``starts`` and after each of
    ``ends``, in place."""
    for r in sorted({run_of[x] for x in chain(starts, ends) if x in run_of}):
        piece: list[int] = []
        for oid in runs.pop(r):
            if piece and oid in starts:
                runs[piece[0]] = piece
                piece = []
            piece.append(oid)
            run_of[oid] = piece[0]
            if oid in ends:
                runs[piece[0]] = piece
                piece = []
        if piece:
            runs[piece[0]] = piece


def _shape(units: list[Op], comms: list[Op], spots: dict[int, tuple[int, int]]) -> tuple:
    """What a merged block of ``units`` and ``comms`` (``_merged``) takes from their kinds alone, the same for every
    copy of a layer pass: ``(parts, fused_key, launches, side, order, cost_class, flops, bytes_read,
    bytes_written, name)``; ``order``: where each of its collectives comes from, in stream order (``(0, unit
    index, index in its folded_comm)`` or ``(1, index in comms)``)."""
    parts: list[Op] = []
    keys: list[tuple] = []
    first_of: dict[int, int] = {}
    last_of: dict[int, int] = {}
    launches = 0
    entries: list[tuple[int, int, tuple[int, int, int]]] = []  # (a, b, origin) with part indices
    for n, u in enumerate(units):
        first_of[u.id] = len(parts)
        m = u.meta
        if m and "fused" in m:
            off = len(parts)
            entries += [(off + j - 1, off + j, (0, n, k)) for k, j in enumerate(m.get("folded_at", ()))]
            parts += m["fused"]
            keys += m["fused_key"]
            launches += m["launches"]
        else:
            parts.append(u)
            keys.append(_signature(u))
            launches += 1
        last_of[u.id] = len(parts) - 1
    entries += [(last_of.get(spots[c.id][0], -1), first_of[spots[c.id][1]], (1, k, 0)) for k, c in enumerate(comms)]
    entries.sort(key=lambda e: e[0])  # a collective is issued after the part it waits for (stable: stream order)
    longest = max(parts, key=lambda p: p.flops + p.bytes_read + p.bytes_written)
    name = f"{parts[0].name.split('.', 2)[-1]}..{parts[-1].name.split('.', 2)[-1]}"
    return (tuple(parts), tuple(keys), launches, tuple((a, b) for a, b, _ in entries), tuple(e[2] for e in entries),
            longest.cost_class, sum(p.flops for p in parts), sum(p.bytes_read for p in parts),
            sum(p.bytes_written for p in parts), name)


def _shape_key(units: list[Op], comms: list[Op], spots: dict[int, tuple[int, int]]) -> tuple:
    """``_shape``'s inputs as far as they matter to it (a stamped block's parts are shared by its copies)."""
    at = {u.id: n for n, u in enumerate(units)}
    return (tuple(id(u.meta["fused"]) if u.meta and "fused" in u.meta else (_signature(u), u.name.split(".", 2)[-1])
                  for u in units),
            tuple((at.get(spots[c.id][0], -1), at[spots[c.id][1]]) for c in comms))


def _merged(units: list[Op], comms: list[Op], spots: dict[int, tuple[int, int]], users, size, new_id: int,
            deps: tuple[int, ...], shapes: dict) -> Op:
    """One block standing for ``units`` (blocks and kernels) and the TP collectives ``comms`` (``spots``: the
    ``(a, b)`` op ids of each, by id; ``a`` outside ``units``: it starts with the block), with its memory per
    block (``block_memory``); ``shapes``: the ``_shape`` of each ``_shape_key`` met so far."""
    key = _shape_key(units, comms, spots)
    sh = shapes.get(key)
    if sh is None:
        sh = shapes[key] = _shape(units, comms, spots)
    parts, keys, launches, side, order, cost_class, flops, br, bw, name = sh
    in_run = {u.id for u in units}
    after: dict[int, list[Op]] = defaultdict(list)  # op id -> the collectives issued after it (-1: before the run)
    for c in comms:
        after[spots[c.id][0] if spots[c.id][0] in in_run else -1].append(c)
    seq = [*after.get(-1, ()), *chain.from_iterable((u, *after.get(u.id, ())) for u in units)]
    allocs, uses, extra = block_memory(seq, users, size, units[0].id)
    first = units[0]
    if extra > 0:
        allocs.append(TensorAlloc(f"activations.block_scratch.tp#{first.id}", extra))
    meta = {"fused": parts, "fused_key": keys, "launches": launches, "side": side}
    vals = list(_GET_FIELDS(first))
    vals[0] = new_id
    vals[_F["name"]] = f"L{first.layer}.{first.phase.value}.block[{name}]"
    vals[_F["cost_class"]], vals[_F["shape"]] = cost_class, ()
    vals[_F["flops"]], vals[_F["bytes_read"]], vals[_F["bytes_written"]] = flops, br, bw
    vals[_F["allocs"]], vals[_F["uses"]], vals[_F["meta"]], vals[_F["deps"]] = tuple(allocs), tuple(uses), meta, deps
    cs = [units[i].folded_comm[j] if kind == 0 else comms[i] for kind, i, j in order]
    vals[_F["folded_comm"]] = tuple(_renumbered(c, new_id, (), c.meta) for c in cs)
    return op_from_fields(vals)


_F = {f: i for i, f in enumerate(_FIELDS)}


def fold_overlapped_tp(graph: OpGraph) -> OpGraph:
    """``graph`` (coarsened, ``blocks.coarsen``) with each run of blocks cut only by foldable TP collectives merged
    into one block carrying them (module docstring); the same graph where there is none. Every block's folded
    collectives come out with its id (also those ``coarsen(comm_ids=False)`` left with the ids they had). ``meta["fidelity"]``
    (when there) counts the collectives folded in ``folded_tp`` and the ops left in ``ops_after``."""
    return fold_overlapped_tp_ids(graph)[0]


def fold_overlapped_tp_ids(graph: OpGraph) -> tuple[OpGraph, list[int]]:
    """``(fold_overlapped_tp(graph), new_id)``: ``new_id[i]`` is the id of the op standing for op ``i`` of ``graph``
    (a run's ops and its folded collectives: the block's)."""
    return _folded(graph, graph.ops)


def coarsen_folded(graph: OpGraph) -> OpGraph:
    """``fold_overlapped_tp(coarsen(graph, fold_tp=True, comm_ids=False))`` with one renumbering of the ops both
    passes leave as they are (most of a pipeline stamped as blocks, ``builders.stamp_blocks``): the coarsened ops
    that are not TP collectives, blocks or kernels a run may merge, nor name ``prev_step_deps``, are not copied in
    between (``blocks.coarse_ops(keep)``) but renumbered once, by both id maps composed; the same graph, one graph
    check instead of two."""
    plan = coarse_plan(graph, True)
    if plan is None:
        return fold_overlapped_tp(coarsen(graph, True, comm_ids=False))
    view: list[bool] = []  # not copied: an op of ``graph`` itself
    ops, deps, first_id, info = coarse_ops(graph, plan, False, _kept, view)
    pgs = tuple(pg.with_grad_op(first_id[pg.grad_op]) for pg in graph.param_groups)
    return _folded(graph.with_changes(param_groups=pgs, meta={**graph.meta, "fidelity": info}), ops, deps,
                   first_id, view)[0]


def _kept(op: Op) -> bool:
    """Whether ``coarsen_folded`` copies ``op`` when it only renumbers it: what ``_plan`` reads the id and
    dependencies of and what a merged block takes as a part or folds."""
    m = op.meta
    if m and "prev_step_deps" in m:
        return True
    return _unit(op) if op.stream == COMPUTE_STREAM else op.stream.startswith("comm.tp")


def _folded(graph: OpGraph, ops, deps=None, first_id: list[int] | None = None,
            view: list[bool] | None = None) -> tuple[OpGraph, list[int]]:
    """``fold_overlapped_tp_ids`` of the graph whose ops are ``ops`` (``graph`` gives the rest); ``deps``,
    ``first_id`` and ``view`` (``coarsen_folded``): the ops' dependencies, and where ``view[i]``, ``ops[i]`` is an op
    of the graph ``coarse_ops`` coarsened, not copied, which is renumbered by ``first_id`` (that graph's id map) and
    the new one composed."""
    runs, comm_of, cand = _plan(ops, deps=deps)
    if not runs:
        if view is None:
            if all(map(_comm_ids_ok, ops)):
                return graph, list(range(len(ops)))
            same = list(range(len(ops)))  # ``coarsen(comm_ids=False)``: the folded collectives take their blocks' ids
            return graph.with_changes(ops=tuple(moved(op, same) for op in ops)), same
        same = list(range(len(ops)))
        out = [moved(op, first_id) if v else moved(op, same) for op, v in zip(ops, view)]
        return graph.with_changes(ops=tuple(out)), same
    folded = {c: r0 for r0, cs in comm_of.items() for c in cs}
    new_id = [-1] * len(ops)
    skip = [False] * len(ops)  # a run's later op or a folded collective: no op of its own
    for run in runs:
        for j in run[1:]:
            skip[j] = True
    for c in folded:
        skip[c] = True
    n = 0
    for oid in range(len(ops)):
        if not skip[oid]:
            new_id[oid] = n
            n += 1
    for run in runs:
        i = new_id[run[0]]
        for j in run[1:]:
            new_id[j] = i
    for c, r0 in folded.items():
        new_id[c] = new_id[r0]
    users, size = tensor_index(ops, [ops[j] for run in runs for j in run] + [ops[c] for c in folded])
    start_of = {r[0]: r for r in runs}
    out: list[Op] = []
    shapes: dict[tuple, tuple] = {}
    both = None if view is None else [new_id[i] for i in first_id]  # an op not copied: both maps composed
    for oid, op in enumerate(ops):
        if skip[oid]:
            continue
        run = start_of.get(oid)
        if run is None:
            out.append(moved(op, both) if view is not None and view[oid] else moved(op, new_id))
            continue
        comms = comm_of[op.id]
        units = [ops[j] for j in run]
        cs = [ops[c] for c in comms]
        mine = {*run, *comms}
        deps = tuple(sorted({new_id[d] for p in chain(units, cs) for d in p.deps if d not in mine}))
        spots = {c: cand[c] for c in comms}  # ``b``: the first op waiting for it, one of the run's
        out.append(_merged(units, cs, spots, users, size, new_id[op.id], deps, shapes))
    pgs = tuple(pg.with_grad_op(new_id[pg.grad_op]) for pg in graph.param_groups)
    meta = graph.meta
    if "fidelity" in meta:
        info = {**meta["fidelity"], "ops_after": len(out)}
        info["folded_tp"] = info.get("folded_tp", 0) + len(folded)
        meta = {**meta, "fidelity": info}
    return graph.with_changes(ops=tuple(out), param_groups=pgs, meta=meta), new_id
