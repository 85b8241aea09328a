"""Stamped layer passes emitted as layer blocks directly (``run.fidelity: layer``), and the check that doing so
gave the graph ``coarsen`` would have made of the kernel-level one.

At layer fidelity ``coarsen`` (``simulator.graph.blocks``) merges each layer pass's kernels into 2-3 block ops;
building ~20 kernel ops per pass only to merge them is most of a large pipeline's build. With
``Stamper(blocks=True)`` a pass that would be stamped (``simulator.graph.builders.stamp``) is emitted as its
blocks instead: the first pass of a key is emitted kernel by kernel, recorded, and replaced by its blocks, and for
every copy the *block template* of its key (``block_template``) is stamped, which is ``coarsen`` applied once to
that pass alone in a small graph standing for its context:

* one stub op per context value (``last_compute``, ``wait_for``, the inputs' producers), on the compute stream
  where the real one is (a kernel after a stub on another stream starts a new block, as in the whole graph;
  a pass waiting for a TP collective, which may be folded or not, is stamped as kernels, ``may_fold``),
  allocating the pass's input tensors (their sizes are part of the key);
* the pass's kernels;
* one stub after them using every tensor of the pass's result (what later ops may use), and one waiting for the
  producers of those the builder said another stream will wait for (``Stamper.waited_later``, check 5).

So the pass's blocks, folded TP collectives, block memory (the scratch tensor of each block, renamed per copy
``activations.block_scratch.stamp#<op id>``) and the kernels each block's time is priced from (``meta["fused"]``,
the same objects for every copy: identical layers and micro-batches are priced once) are those ``coarsen`` makes
of the kernel-level pass in the whole graph, provided that graph reaches the pass only through its result
tensors, ``last_compute`` and ``wait_for`` (the stamper's premise) and that:

1. no op on another stream than ``compute`` outside the pass (nor a TP collective folded into a later block)
   uses a tensor made by a kernel that is not the last of its block or by a folded collective (at kernel level
   the block would end at that kernel, or the collective stay separate; an op waits for such a kernel only
   through its tensors: ``last_compute`` is a block's last kernel, ``wait_for`` a collective left separate),
   and no op of the next step waits for a stamped op;
2. no mergeable kernel of the same layer and phase is right before or after the pass on the compute stream (but
   where the pass's first kernel, or that next kernel, waits for another stream, and so starts a block);
3. the pass's input tensors that are not in its result are used by nothing after it, and each tensor of its
   result is used by something after it (what the third stub stands for);
4. the TP collective before a pass's first folded one on its stream is waited for by a compute kernel no later
   than that block, or is folded itself; the op after a pass's last folded one on its stream waits for a
   compute op from that block on (``foldable_tp``'s conditions on the stream neighbours).

5. a block a template ends at a result tensor the builder said another stream will wait for
   (``Stamper.waited_later``: sequence parallelism's saved ``1 / t`` shard, which the asynchronous column-parallel
   backward gathers again; the template's second stub after the pass, on another stream, waits for its producer)
   is waited for after the pass by an op on another stream that ``foldable_tp`` cannot fold; for a pass stamped
   folded across that producer (``Stamper.run(waits_fold=True)``, ``BlockTemplate.waits_folded``), that op is a
   TP collective folded into a later pass stamped with it folded (``_apart_waits``), as the builder said.

6. (``Stamper(prefold=True)``, ``run.fidelity: layer`` with a collective model) a template whose TP ops
   ``fold_overlapped_tp`` (``simulator.graph.side_blocks``) folds all, when applied to the small graph after
   ``coarsen``, but those no graph folds (``_cut_off``: one waiting for a context stub off the compute stream, or
   whose first compute user does: the pipeline's receive, beside a stage's first layer forward and last layer
   backward; left as ops in the template), with none of them waited for after the pass (``wait_for``, a result
   tensor) and no tensor the builder said another stream waits for (``Stamper.waited_later``), is stamped in that form
   (``BlockTemplate.prefold``), so the whole graph's ``fold_overlapped_tp`` has ~4x fewer ops to walk. Then: the
   compute ops around the pass are of another layer or phase (no run crosses its edges); on each TP stream it
   used, the ops before it that may be the stream's op before it once ``coarsen`` has folded what it may (walking
   back over the ops it may fold) are each waited for by a compute op before the pass, and those after it each
   wait for a compute op from the op holding the pass's last op there on (``BlockTemplate.tails``: an op on another
   stream waits for a block only at its last kernel, check 1) (so every neighbour's stream conditions in ``foldable_tp`` and ``fold_overlapped_tp`` hold as they hold beside the
   pass's own TP ops); check 1 takes the tensors made inside the folded blocks, check 5 also a TP op folded into
   such a pass that a compute op keeps apart from its first user (``_apart_waits``); check 4 holds by these.
   Where check 6 fails the builder stamps the graph again without (then checks 1-5).

``check`` tests all of them on the built graph; ``build_gpt_step`` builds the kernel-level graph instead where one
fails, so the result is the same graph either way (``tests/simulator/graph/test_stamp_blocks.py`` compares them
on every bundled scenario).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from itertools import repeat

from simulator.graph.blocks import COMPUTE_STREAM, _mergeable, coarsen_ids, foldable_tp
from simulator.graph.builders.stamp import _FOLDED, SCRATCH, uses_form
from simulator.graph.builders.stamp import _GET as _fields  # an op's dataclass fields, in order
from simulator.graph.op_graph import OpGraph
from simulator.graph.ops import Op, OpKind, TensorAlloc
from simulator.graph.side_blocks import fold_overlapped_tp_ids

_CTX = "ctx"  # stub stream
__all__ = ["SCRATCH", "BlockTemplate", "Instance", "block_template", "check", "may_fold"]


class BlockTemplate:
    """The block form of one stamp template (``Stamper._stamp`` stamps it like a kernel template); ``mid``: table
    indices of tensors made inside a block or by a folded collective (check 1); ``folded_uses``: table indices
    the folded collectives use; ``inputs``/``results``: table indices for check 3; ``first_cross``: the pass's
    first kernel waits for another stream (check 2); ``edges``: check 4, one per TP stream the pass uses,
    ``(stream, a, b, separate, waits_inside, slots)``: ``a`` of its first op there where ``foldable_tp`` finds it
    foldable in the template (``("in", op index)`` or ``("ctx", context slot)``), else None; ``b`` (op index)
    of its last op there where foldable, else None; that last op's index where it stays an op, else None; whether
    its first op there waits for a compute kernel of the pass, and the context slots it waits for; ``waited``:
    ``(table index, op index)`` of each tensor the builder said another stream waits for after the pass
    (``Stamper.waited_later``) and the block ending at its producer (check 5); ``regather_folded``: stamped
    pre-folded with no TP op left that uses an input a compute op made (``Stamper.last_prefold``)."""

    __slots__ = ("n_ops", "n_uid", "ops", "fresh", "consts", "layered", "result", "producer", "size", "last", "wait",
                 "scratch",
                 "mid", "folded_uses", "inputs", "results", "edges", "first_cross", "waited", "prefold",
                 "ctx_waiters", "tails", "mid_coarse", "waits_folded", "regather_folded")


def block_template(t, kops: Sequence[Op], index: dict[str, int], names: list[str], compute: tuple[bool, ...],
                   order: tuple[int, ...], sizes: tuple, devices: tuple, fold_tp: bool,
                   prefold: bool = False, waits_fold: bool = False) -> BlockTemplate:
    """The block form of kernel template ``t`` (``stamp._Template``) recorded from ``kops`` (its first pass's ops,
    table ``index``, inputs ``names``), for a context whose values lie on the compute stream where ``compute``
    is true and come in the order of slots ``order``, with input sizes ``sizes`` (None: not a GPU tensor made by
    an op) on ``devices`` (module docstring). ``prefold`` (with ``fold_tp``): the blocks ``fold_overlapped_tp`` makes
    of them where the pass qualifies (``BlockTemplate.prefold``, check 6); ``waits_fold``: the builder's word that
    what another stream waits for after the pass (``Stamper.waited_later``) is folded later (``Stamper.run``), so
    ``fold_overlapped_tp`` merges across those tensors' producers (``BlockTemplate.waits_folded``)."""
    n_ctx, n_in = len(compute), len(names)
    front = n_ctx - n_in
    stub = {s: k for k, s in enumerate(order)}  # context slot -> stub op id (stubs in the real ops' order)
    name_of = {i: n for n, i in index.items()}  # the recorded pass's tensor names (``kops`` use them)
    owner: dict[int, list[TensorAlloc]] = defaultdict(list)
    for i in range(n_in):
        n = name_of.get(i)  # None: a name given twice (its first place is in ``index``)
        if sizes[i] is not None and n is not None:
            owner[front + i].append(TensorAlloc(n, sizes[i], devices[i]))
    mini = [Op(id=k, name=f"ctx{s}", kind=OpKind.COMPUTE if compute[s] else OpKind.HOST,
               stream=COMPUTE_STREAM if compute[s] else _CTX, launch=False, allocs=tuple(owner.get(s, ())))
            for k, s in enumerate(order)]
    for r, (rec, op) in enumerate(zip(t.ops, kops)):
        ext, inner = rec[2], rec[3]
        mini.append(replace(op, id=n_ctx + r, deps=tuple(sorted({*(stub[x] for x in ext), *(n_ctx + d for d in inner)}))))
    res = _result_names(t.result)
    table = names + [f"{stem}{r}" for stem, r in t.fresh] + list(t.consts) + list(t.layered)  # only its length
    # matters below
    mini.append(Op(id=len(mini), name="future", kind=OpKind.HOST, stream=_CTX, launch=False,
                   uses=tuple(name_of[k] for k in res)))
    made = dict(t.producer)
    waited = {k: made[k] for k in t.waited if made.get(k) is not None and made[k] >= 0}  # made by the pass
    if waited:  # what another stream waits for after the pass (``Stamper.waited_later``) ends a block
        mini.append(Op(id=len(mini), name="future.waits", kind=OpKind.HOST, stream=_CTX, launch=False,
                       deps=tuple(sorted({n_ctx + r for r in waited.values()}))))
    graph = OpGraph(ops=tuple(mini))
    cand = foldable_tp(graph) if fold_tp else {}
    coarse, new_id = coarsen_ids(graph, fold_tp)
    n_after = len(mini) - n_ctx - len(kops)  # the stubs after the pass
    pre = _prefolded(coarse, new_id, t, kops, n_ctx, n_after, res, waited, waits_fold) if fold_tp and prefold \
        else None
    ctx_waiters: tuple[int, ...] = ()
    id0 = new_id  # the ids ``coarsen`` alone gives
    if pre is not None:
        coarse0 = coarse
        coarse, new_id = pre
        left = {op.name for op in coarse.ops[n_ctx:len(coarse.ops) - n_after] if op.stream != COMPUTE_STREAM}
        ctx_waiters = _apart_waits(coarse0, graph, order, n_ctx, n_after, left)
    cops = coarse.ops[n_ctx:len(coarse.ops) - n_after]
    rel = [new_id[n_ctx + r] - n_ctx for r in range(len(kops))]  # kernel index -> block-template op index
    bt = BlockTemplate()
    bt.n_ops, bt.fresh, bt.consts, bt.layered, bt.result = len(cops), t.fresh, t.consts, t.layered, t.result
    scratch: list[int] = []  # op index of each block scratch tensor, named after its op in a stamp
    recipes = []
    prefix = kops[0].name[:kops[0].name.index(".") + 1]
    for j, op in enumerate(cops):
        allocs = []
        for a in op.allocs:
            if a.name.startswith(("activations.block_scratch#", "activations.block_scratch.tp#")):
                k = len(table) + len(scratch)
                scratch.append(j)
            else:
                k = index[a.name]
            allocs.append((k, a.nbytes, a.device))
        uses = tuple(index[u] for u in op.uses)
        folded = tuple((tuple(_fields(c)), c.name[len(prefix):]) for c in op.folded_comm)
        ext = tuple(order[d] for d in op.deps if d < n_ctx)
        inner = tuple(d - n_ctx for d in op.deps if d >= n_ctx)
        base = list(_fields(op))
        base[_FOLDED] = ()
        recipes.append((tuple(base), op.name[len(prefix):], ext, inner, tuple(allocs), uses, folded))
    bt.ops = [(b, s, e, i, al, uses_form(u), f) for b, s, e, i, al, u, f in recipes]
    bt.n_uid, bt.size, bt.scratch = t.n_uid, t.size, tuple(scratch)

    def move(r):
        return r if r is None or r < 0 else rel[r]

    bt.producer = [(k, move(r)) for k, r in t.producer]
    bt.last, bt.wait = move(t.last), tuple(move(d) for d in t.wait)
    bt.waited = tuple((k, rel[r]) for k, r in waited.items())
    bt.waits_folded = pre is not None and bool(waited)  # folded across them (``waits_fold``; check 5)
    merged = {r for r in range(len(kops)) if cops[rel[r]].meta and "fused" in cops[rel[r]].meta}
    bt.mid = _mid(t, kops, rel, merged)
    if pre is None:
        bt.mid_coarse = bt.mid
    else:  # the tensors made inside a block of ``coarsen`` alone
        rel0 = [id0[n_ctx + r] - n_ctx for r in range(len(kops))]
        bt.mid_coarse = _mid(t, kops, rel0, {r for r in range(len(kops))
                                             if (coarse0.ops[n_ctx + rel0[r]].meta or {}).get("fused")})
    bt.folded_uses = tuple(index[u] for op in cops for c in op.folded_comm for u in c.uses if u in index)
    # only GPU tensors ops allocate count in a block's memory (``blocks._block_op``)
    sized = {k for k in range(n_in) if sizes[k] is not None} | {index[a.name] for op in kops for a in op.allocs
                                                                if a.device == "gpu"}
    bt.results = tuple(k for k in res if k in sized)
    bt.inputs = tuple(k for k in sized if k < n_in and k not in set(res))
    by_stream: dict[str, list[int]] = defaultdict(list)
    for r, op in enumerate(kops):
        if op.stream.startswith("comm.tp"):
            by_stream[op.stream].append(r)
    edges = []  # (stream, a of its first op if foldable, b of its last if foldable, its last if separate, ...)
    for st, seq in by_stream.items():
        first = last = None
        if n_ctx + seq[0] in cand:
            a = cand[n_ctx + seq[0]][0]
            first = ("ctx", order[a]) if a < n_ctx else ("in", rel[a - n_ctx])
        if n_ctx + seq[-1] in cand:
            last = rel[cand[n_ctx + seq[-1]][1] - n_ctx]
        separate = None if seq[-1] in merged else rel[seq[-1]]
        d0 = mini[n_ctx + seq[0]].deps
        waits_inside = any(d >= n_ctx and mini[d].stream == COMPUTE_STREAM for d in d0)
        edges.append((st, first, last, separate, waits_inside, tuple(order[d] for d in d0 if d < n_ctx)))
    bt.prefold, bt.ctx_waiters = pre is not None, ctx_waiters
    # the builder's evidence for ``Stamper.run(waits_fold)``: no TP op left uses an input a compute op made (the
    # saved shard the backward gathers again is folded)
    bt.regather_folded = bt.prefold and not any(
        k < n_in and compute[front + k] for op in cops if op.stream != COMPUTE_STREAM for k in map(index.get, op.uses)
        if k is not None)
    if bt.prefold:  # check 6 stands for check 4 at its own edges; as a neighbour's, its last op there before a later
        # pass holds where folded (users inside it), and its first waits for a kernel from there on where folded; a
        # TP op left at either end (``_cut_off``) is seen as the kernel-level op it is
        edges = [(st, None, -1 if sep is None else None, sep, True if by_stream[st][0] in merged else inside,
                  () if by_stream[st][0] in merged else slots) for st, _, _, sep, inside, slots in edges]
        # per TP stream: the op holding the pass's last op there (the op after the pass on the stream must wait for
        # a compute op from there on: an op on another stream waits for a block only at its last kernel, check 1)
        bt.tails = {st: rel[seq[-1]] for st, seq in by_stream.items()}
    else:
        bt.tails = {}
    bt.edges = tuple(edges)
    first = next((op for op in mini[n_ctx:] if op.stream == COMPUTE_STREAM), None)
    bt.first_cross = first is not None and any(mini[d].stream != COMPUTE_STREAM for d in first.deps)
    return bt


def _mid(t, kops: Sequence[Op], rel: list[int], merged: set[int]) -> tuple[int, ...]:
    """Table indices of the tensors made inside a block (``rel``: kernel index -> op index; ``merged``: kernels
    standing in a block): by a kernel other than its block's last, or by a folded collective."""
    last_of: dict[int, int] = {}  # op index -> the last kernel it stands for
    for r, op in enumerate(kops):
        if op.stream == COMPUTE_STREAM:
            last_of[rel[r]] = r
    last_part = set(last_of.values())
    return tuple(k for k, r in t.producer if r is not None and r >= 0 and r in merged and r not in last_part)


def _prefolded(coarse: OpGraph, new_id: list[int], t, kops: Sequence[Op], n_ctx: int, n_after: int, res: list[int],
               waited: dict, waits_fold: bool = False) -> tuple[OpGraph, list[int]] | None:
    """``fold_overlapped_tp`` of a block template's small graph ``coarse`` (``coarsen_ids`` of it, ids ``new_id``)
    and the composed id map, where the pass qualifies for stamping in that form (check 6): it folds something and
    every TP op of the pass, no op after the pass waits for one (``wait_for``, a result tensor), and the builder
    named no tensor of the pass that another stream waits for after it (``Stamper.waited_later``: whether
    ``fold_overlapped_tp`` merges across its producer depends on whether the op gathering it again is folded in a
    later pass) or said that op is folded (``waits_fold``: the small graph is then folded without the stub waiting
    for those producers, which is put back after, as in the whole graph once that op is a compute block's); else
    None."""
    if any(r is not None and r >= 0 and kops[r].stream != COMPUTE_STREAM for r in t.wait):
        return None
    made = dict(t.producer)
    if waited and not waits_fold or any(made.get(k) is not None and made[k] >= 0
                                        and kops[made[k]].stream != COMPUTE_STREAM for k in res):
        return None
    if waited:  # the last op: ``future.waits``
        stub = coarse.ops[-1]
        bare = coarse.with_changes(ops=coarse.ops[:-1])
        fg, fid = fold_overlapped_tp_ids(bare)
        if fg is bare:
            return None
        fid = [*fid, len(fg.ops)]
        fg = fg.with_changes(ops=(*fg.ops, replace(stub, id=len(fg.ops), deps=tuple(sorted({fid[d] for d in stub.deps})))))
    else:
        fg, fid = fold_overlapped_tp_ids(coarse)
        if fg is coarse:
            return None
    left = [op.id for op in fg.ops[n_ctx:len(fg.ops) - n_after] if op.stream != COMPUTE_STREAM]
    if left:  # TP ops no graph folds are left as ops (the first layer's and last layer's passes beside send/recv)
        back = {fid[i]: i for i in range(len(coarse.ops))}
        if not all(_cut_off(coarse, back[x]) for x in left):
            return None
    return fg, [fid[i] for i in new_id]


def _cut_off(coarse: OpGraph, x: int) -> bool:
    """Whether op ``x`` of a block template's coarsened small graph is a TP collective that neither ``coarsen`` nor
    ``fold_overlapped_tp`` folds in any graph the template stands in: it waits for a context stub off the compute
    stream (the pipeline's receive: never a TP collective, ``Stamper._block_form``), or the first compute op waiting
    for it does (that op starts a block and a run, and the collective cannot start with it: the stub is folded
    nowhere)."""
    ops = coarse.ops
    op = ops[x]
    if not op.stream.startswith("comm.tp"):
        return False
    if any(ops[d].stream == _CTX for d in op.deps):
        return True
    users = [u.id for u in ops[x + 1:] if x in u.deps and u.stream == COMPUTE_STREAM]
    return bool(users) and any(ops[d].stream == _CTX for d in ops[min(users)].deps)


def _apart_waits(coarse: OpGraph, graph: OpGraph, order: tuple[int, ...], n_ctx: int, n_after: int,
                 left: set[str] = frozenset()) -> tuple[int, ...]:
    """Context slots waited for by a TP op of the pass that ``coarsen`` leaves (in ``coarse``, of the kernel-level
    small graph ``graph``) and that a compute op of ``graph`` separates from its first user: at kernel level, where
    the ops of the whole graph between them are a superset, ``foldable_tp`` cannot fold it either, so the block
    before it ends there (check 5 for a pass stamped with it folded, ``BlockTemplate.prefold``)."""
    ops = graph.ops
    compute = [op.id for op in ops if op.stream == COMPUTE_STREAM]
    slots: dict[int, None] = {}
    for op in coarse.ops[n_ctx:len(coarse.ops) - n_after]:
        if op.stream == COMPUTE_STREAM or not op.stream.startswith("comm.tp") or op.name in left:
            continue  # ``left``: TP ops the pre-folded form leaves as ops (not folded in the later pass)
        k = op.name  # the same op in ``graph`` (``coarsen`` keeps an op it leaves, renumbered)
        c = next(x for x in ops[n_ctx:] if x.name == k and x.stream == op.stream)
        ctx = [d for d in c.deps if d < n_ctx and ops[d].stream == COMPUTE_STREAM]
        users = [x.id for x in ops if c.id in x.deps]
        if not ctx or not users:
            continue
        a, b = max(c.deps), min(users)
        if bisect_right(compute, a) < bisect_left(compute, b):
            slots.update((order[d], None) for d in ctx)
    return tuple(slots)


def may_fold(op: Op) -> bool:
    """Whether ``op`` is a TP collective ``foldable_tp`` may find foldable: a pass that waits for one is stamped as
    kernels (``blocks_of`` starts no block at a kernel waiting for a foldable collective, folded or not, and
    whether it is foldable depends on ops not yet built)."""
    return op.kind is OpKind.COLLECTIVE and op.stream.startswith("comm.tp") and bool(op.meta) \
        and op.meta.get("group") == "tp"


def _result_names(tree) -> list[int]:
    """Table indices of a template result's tensors (``stamp._Name`` leaves), each once, in order."""
    out: dict[int, None] = {}

    def walk(x):
        if hasattr(x, "r") and not isinstance(x, (str, dict, tuple, list)):
            out[x.r] = None
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (tuple, list)):
            for v in x:
                walk(v)

    walk(tree)
    return list(out)


class Instance:
    """One pass stamped as blocks: ops ``[start, end)``, its table, template, and the compute op before it."""

    __slots__ = ("start", "end", "table", "bt", "layer", "phase", "before", "vals")

    def __init__(self, start, end, table, bt, layer, phase, before, vals):
        self.start, self.end, self.table, self.bt, self.vals = start, end, table, bt, vals
        self.layer, self.phase, self.before = layer, phase, before


def check(ops: Sequence[Op], inst: list[Instance]) -> str | None:
    """None where the graph made with block stamps ``inst`` is the one ``coarsen`` makes of the kernel-level
    graph (conditions 1-4 of the module docstring), else the first condition that fails, in words."""
    if not inst:
        return None
    starts = [i.start for i in inst]

    def owner(op_id: int) -> Instance | None:
        k = bisect_right(starts, op_id) - 1
        return inst[k] if k >= 0 and op_id < inst[k].end else None

    # the tensors asked about below: used by an op on another stream than ``compute``, or by a folded collective
    asked = {u for op in ops if op.stream != COMPUTE_STREAM for u in op.uses}
    asked_coarse = {i.table[k] for i in inst for k in i.bt.folded_uses}
    mid: dict[str, int] = {}
    mid_coarse: dict[str, int] = {}  # made inside a block of ``coarsen`` (a folded collective using one cuts it)
    for i in inst:  # later passes overwrite, as one by one (only the tensors asked about: the same answers)
        get = i.table.__getitem__
        hit = asked.intersection(map(get, i.bt.mid))
        if hit:
            mid.update(zip(hit, repeat(i.start)))
        if asked_coarse:
            hit = asked_coarse.intersection(map(get, i.bt.mid_coarse))
            if hit:
                mid_coarse.update(zip(hit, repeat(i.start)))
    last_use = {u: op.id for op in ops for u in op.uses}  # later ops overwrite: the last user
    for op in ops:
        if op.stream != COMPUTE_STREAM and op.uses:
            for u in op.uses:
                m = mid.get(u)
                if m is not None and (owner(op.id) is None or owner(op.id).start != m):  # own pass: in its template
                    return f"op {op.name} on stream {op.stream} uses a tensor made inside a stamped block"
        if op.meta and op.meta.get("prev_step_deps") and any(owner(d) for d in op.meta["prev_step_deps"]):
            return f"op {op.name} of the next step waits for a stamped block"
    streams: dict[str, list[int]] = defaultdict(list)
    for op in ops:
        if op.stream.startswith("comm.tp"):
            streams[op.stream].append(op.id)
    compute = [op.id for op in ops if op.stream == COMPUTE_STREAM]
    on: dict[str, list[Instance]] = defaultdict(list)  # stream -> passes with ops on it, in order
    for i in inst:
        for e in i.bt.edges:
            on[e[0]].append(i)
    edge_of = {(id(i), e[0]): e for i in inst for e in i.bt.edges}
    starts_on = {st: [q.start for q in qs] for st, qs in on.items()}
    why = _waited_later(ops, inst, compute)
    if why:
        return why
    tp_users = _tp_users(ops, streams) if any(i.bt.prefold for i in inst) else {}
    reach = _stream_reach(ops, streams, tp_users) if tp_users else {}
    for i in inst:
        t, table = i.bt, i.table
        for k in t.folded_uses:
            m = mid_coarse.get(table[k])
            if m is not None and m < i.start:
                return f"a TP collective folded into a block of layer {i.layer} uses a tensor made inside a block"
        nxt = _next_compute(ops, compute, i.end)
        for op, cut in ((i.before, t.first_cross),  # a kernel waiting for another stream starts a block
                        (nxt, nxt is not None and any(ops[d].stream != COMPUTE_STREAM and not may_fold(ops[d])
                                                      for d in nxt.deps))):
            if op is not None and not cut and _mergeable(op) and (op.layer, op.phase) == (i.layer, i.phase):
                return f"kernel {op.name} next to a stamped pass of the same layer and phase"
        for k in t.inputs:
            if last_use.get(table[k], -1) >= i.end:
                return f"an input of a stamped pass of layer {i.layer} is used after it"
        for k in t.results:
            if last_use.get(table[k], -1) < i.end:
                return f"a result of a stamped pass of layer {i.layer} is used by nothing after it"
        if t.prefold:
            why = _prefold_edges(ops, i, streams, nxt, reach)
            if why:
                return why
            continue
        for st, first, last, *_ in t.edges:
            why = _stream_edges(ops, streams.get(st, []), on[st], starts_on[st], edge_of, i, st, first, last)
            if why:
                return why
    return None


def _tp_users(ops: Sequence[Op], streams: dict[str, list[int]]) -> dict[int, tuple[int, bool]]:
    """Each TP-stream op waited for: ``(the first compute op waiting for it, whether every op waiting for it is on
    the compute stream)``."""
    tp = {x for seq in streams.values() for x in seq}
    out: dict[int, tuple[int, bool]] = {}
    for op in ops:
        on = op.stream == COMPUTE_STREAM
        for d in op.deps:
            if d in tp:
                first, only = out.get(d, (len(ops), True))
                out[d] = (min(first, op.id) if on else first, only and on)
    return out


def _stream_reach(ops: Sequence[Op], streams: dict[str, list[int]],
                  tp_users: dict[int, tuple[int, bool]]) -> dict[str, tuple[list[int], list[int]]]:
    """Per TP stream, for each of its ops ``x`` (by position): walking back from ``x`` over the ops ``coarsen`` may
    fold (a superset of ``foldable_tp``'s candidates) to the first it cannot, the latest first compute user of the
    ops passed (``back``); walking forward likewise, the earliest last compute dependency (``ahead``)."""
    def foldable(x: Op) -> bool:
        u = tp_users.get(x.id)
        return may_fold(x) and bool(x.deps) and u is not None and u[1] \
            and all(ops[d].stream == COMPUTE_STREAM for d in x.deps)

    out = {}
    n = len(ops)
    for st, seq in streams.items():
        fold = [foldable(ops[x]) for x in seq]
        first = [tp_users.get(x, (n, True))[0] for x in seq]
        last = [max((d for d in ops[x].deps if ops[d].stream == COMPUTE_STREAM), default=-1) for x in seq]
        back, ahead = first[:], last[:]
        for j in range(1, len(seq)):
            if fold[j]:
                back[j] = max(back[j], back[j - 1])
        for j in range(len(seq) - 2, -1, -1):
            if fold[j]:
                ahead[j] = min(ahead[j], ahead[j + 1])
        out[st] = (back, ahead)
    return out


def _prefold_edges(ops: Sequence[Op], i: Instance, streams: dict[str, list[int]], nxt: Op | None,
                   reach: dict[str, tuple[list[int], list[int]]]) -> str | None:
    """Check 6, for pass ``i`` stamped with its TP collectives beside compute folded (``BlockTemplate.prefold``):
    the compute ops right before and after it are of another layer or phase (no run of ``fold_overlapped_tp``
    crosses the pass's edges), and on each TP stream the pass used, each op before it that ``coarsen`` may leave
    as the stream's op before the pass (walking back over the ops it may fold) is waited for by a compute op
    before the pass, and each op after it that may be the stream's next is waiting for a compute op from the op
    holding the pass's last op there on (``BlockTemplate.tails``; it waits for a block at its last kernel, check 1,
    which is from the kernel after that op's on) (so ``foldable_tp`` and ``fold_overlapped_tp`` find every
    neighbour's stream conditions as with the pass's TP ops there: those hold there, their users and dependencies
    lying inside the pass)."""
    for op, edge in ((i.before, ops[i.start]), (nxt, ops[i.end - 1])):
        if op is not None and op.layer >= 0 and (op.layer, op.phase) == (edge.layer, edge.phase):
            return f"a pass of layer {i.layer} stamped with its TP collectives folded has a neighbour of its phase"
    for st, *_ in i.bt.edges:
        seq = streams.get(st, [])
        back, ahead = reach.get(st, ((), ()))
        j = bisect_left(seq, i.start) - 1
        if j >= 0 and back[j] >= i.start:
            return f"a TP op before a folded pass of layer {i.layer} is not waited for before it"
        k = bisect_left(seq, i.end)
        if k < len(seq) and ahead[k] < i.start + i.bt.tails[st]:
            return f"a TP op after a folded pass of layer {i.layer} does not wait for a kernel after it"
    return None

def _waited_later(ops: Sequence[Op], inst: list[Instance], compute: list[int]) -> str | None:
    """Check 5: each block a template ends at a tensor the builder said another stream waits for after the pass
    (``BlockTemplate.waited``, ``Stamper.waited_later``) is waited for, after the pass, by an op on another stream
    than ``compute`` that ``foldable_tp`` cannot find foldable at kernel level (so the kernel-level block ends
    there too): not a TP collective (``may_fold``), or one that no op waits for, or that an op on another stream
    waits for, or that the first compute op waiting for it does not follow right after its last dependency (a
    compute op of the graph lies between them; each is a kernel or a run of consecutive kernels, so one lies
    between their kernels too)."""
    need = {i.start + j: i for i in inst for _, j in i.bt.waited}
    if not need:
        return None
    waiters: dict[int, list[int]] = defaultdict(list)  # block op -> ops on other streams waiting for it
    for op in ops:
        if op.stream != COMPUTE_STREAM:
            for d in op.deps:
                if d in need and op.id >= need[d].end:
                    waiters[d].append(op.id)
    probe = {u for us in waiters.values() for u in us if may_fold(ops[u])}
    users: dict[int, list[int]] = defaultdict(list)
    if probe:
        for op in ops:
            for d in op.deps:
                if d in probe:
                    users[d].append(op.id)

    def unfoldable(u: int) -> bool:
        if u not in probe:
            return True
        us = users.get(u)
        if not us or any(ops[x].stream != COMPUTE_STREAM for x in us):
            return True
        if any(ops[d].stream != COMPUTE_STREAM for d in ops[u].deps):
            return True
        a, b = max(ops[u].deps), min(us)
        return bisect_right(compute, a) < bisect_left(compute, b)

    # a TP op folded into a later pass stamped with it folded, that ``foldable_tp`` could not fold at kernel level
    apart = {j.vals[s]: j.start for j in inst if j.bt.prefold for s in j.bt.ctx_waiters}
    for p, i in need.items():
        if apart.get(p, -1) >= i.end:
            continue
        if i.bt.waits_folded:
            return f"a pass of layer {i.layer} stamped folded across a tensor another stream waits for is not " \
                   "followed by a pass folding that op"
        if not any(unfoldable(u) for u in waiters.get(p, ())):
            return f"a block of a stamped pass of layer {i.layer} ends where no other stream waits for it"
    return None


def _stream_edges(ops, seq: list[int], passes: list[Instance], starts: list[int], edge_of: dict, i: Instance,
                  st: str, first, last) -> str | None:
    """Check 4 for pass ``i`` on TP stream ``st`` (``seq``: the graph's ops on it; ``passes``: the stamped passes
    with ops on it, ``starts`` theirs): ``foldable_tp``'s conditions on the neighbours, on the stream, of the pass's
    first op (``first``: its ``a``, where foldable in the template) and last op (``last``: its ``b``)."""
    k = bisect_left(starts, i.start)
    if first is not None:
        a = i.start + first[1] if first[0] == "in" else i.vals[first[1]]
        j = bisect_left(seq, i.start) - 1
        prev_op = seq[j] if j >= 0 else None
        pq = passes[k - 1] if k > 0 else None
        p = prev_op
        if pq is not None and (prev_op is None or prev_op < pq.end):  # the kernel-level op before is pq's last
            _, _, pl, sep, _, _ = edge_of[id(pq), st]
            p = None if pl is not None else pq.start + sep  # foldable itself: the condition holds
        if p is not None and not any(ops[u].stream == COMPUTE_STREAM and p in ops[u].deps for u in range(p + 1, a + 1)):
            return f"the TP collective before the first of a stamped pass of layer {i.layer} is waited for later"
    if last is not None:
        j = bisect_left(seq, i.end)
        next_op = seq[j] if j < len(seq) else None
        nq = passes[k + 1] if k + 1 < len(passes) else None
        b = i.start + last
        if nq is not None and (next_op is None or next_op >= nq.start):  # the kernel-level op after is nq's first
            *_, inside, slots = edge_of[id(nq), st]
            if not inside and not any(nq.vals[x] >= b and ops[nq.vals[x]].stream == COMPUTE_STREAM for x in slots):
                return f"the TP collective after the last of a stamped pass of layer {i.layer} may not wait for it"
        elif next_op is not None and not any(ops[d].stream == COMPUTE_STREAM and d >= b for d in ops[next_op].deps):
            return f"the op after a foldable TP collective of layer {i.layer} does not wait for its block"
    return None


def _next_compute(ops: Sequence[Op], compute: list[int], end: int) -> Op | None:
    k = bisect_left(compute, end)
    return ops[compute[k]] if k < len(compute) else None
