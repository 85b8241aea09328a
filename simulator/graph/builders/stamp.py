"""Stamping: a transformer block's pass (forward, backward, recompute) is emitted kernel by kernel once per
distinct shape and context, and copied for every other layer and micro-batch that does identical work.

A model builder emits one pass through ``Stamper.run(key, fn, inputs)``: the first call with a ``key`` runs
``fn(*inputs)`` on the ``KernelEmitter`` and records the ops it appended; a later call with the same key
appends a copy of those ops instead of running ``fn`` (new op ids, the layer's name prefix and ``layer``,
fresh tensor names, dependencies mapped onto this call's context; the same costs, shapes, tensor sizes and
metadata), and returns ``fn``'s result with its tensor names mapped the same way. The copy is exactly what
``fn`` would have emitted (``tests/simulator/graph/test_stamp.py`` builds graphs both ways and compares every
op), provided the pass depends on nothing but:

* ``key``: everything the builder knows that shapes the pass (its kind, phase, flags of the micro-batch);
* the *context*: the tensors in ``inputs`` (strings anywhere in a tuple / list / dict tree), their producers,
  the emitter's ``last_compute`` and ``wait_for`` when the pass starts (the key is extended with the pattern
  of which of these are equal or absent, so the copy's dependencies map one to one);
* tensors the pass allocates itself (``KernelEmitter.fresh`` names) and constant names nothing produces.

A recorded pass is kept as a template only when it appended only layer kernels (``op.layer`` the pass's
layer, named with its ``L<layer>.`` prefix), every dependency outside it is explained by the context, every
tensor it allocates is a fresh name, and the builder's ``state()`` (its bookkeeping of gradients, buckets,
collectives) did not change, or changed only in ways the builder's ``effects`` hooks replay (a backward's
gradients: the names it marks made and the parameter groups it finishes, for the pass's layer; the gradient
tensors it allocates, named ``...L<layer>.<rest>``, are renamed for each copy's layer, ``layer_name_parts``): a pass
with any other effect is emitted by ``fn`` every time. Kernel stamps (not ``blocks``) also rename the constant
names of the pass's layer (LoRA's adapter weights ``param.L<layer>.lora...``) and keep the strings of ``fn``'s
result that name no tensor (LoRA's saved module names) as they are. The builder keeps out of the key's reach what
it cannot express (it does not stamp at all under ZeRO-3/FSDP parameter gathers, fp8 or MoE, nor LoRA as blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from itertools import count, repeat
from operator import attrgetter, itemgetter

from simulator.graph.builders.emitter import KernelEmitter
from simulator.graph.ops import Op, op_copier, op_from_fields, tensor_alloc

_FIELDS = Op.__dataclass_fields__
_NAMES = tuple(_FIELDS)
_GET = attrgetter(*_NAMES)
_ID, _NAME, _LAYER, _ALLOCS, _META, _FOLDED = (
    _NAMES.index(f) for f in ("id", "name", "layer", "allocs", "meta", "folded_comm"))


#: a stamped op from its recipe's field values (``ops.op_copier``): its id, name, layer, deps, allocs, uses, meta and
#: folded collectives set
_STAMPED = op_copier(("id", "name", "layer", "deps", "allocs", "uses", "meta", "folded_comm"), source="fields")


def _renamed(fields: tuple, op_id: int, name: str, layer: int) -> list:
    """An op's fields with a new id, name and layer."""
    v = list(fields)
    v[_ID], v[_NAME], v[_LAYER] = op_id, name, layer
    return v


def _strings(tree, out: list) -> list:
    """The strings of a tree of tuples / lists / dicts (dict values, in order), depth first."""
    if isinstance(tree, str):
        out.append(tree)
        return out
    if isinstance(tree, dict):
        tree = tree.values()
    elif not isinstance(tree, (tuple, list)):
        return out
    for v in tree:  # a string leaf here, without a call of its own (a backward's inputs hold ~20, and ~10 None)
        if v is None:
            continue
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, (dict, tuple, list)):
            _strings(v, out)
    return out


def layer_name_parts(name: str, layer: int) -> tuple[str, str] | None:
    """``(head, tail)`` of a tensor or parameter name ``head + "L<layer>." + tail`` that holds its layer once, at its
    start or after a ``.`` (``grad.L3.fc1.weight``: ``("grad.", "fc1.weight")``); the name for layer ``k`` is
    ``head + f"L{k}." + tail``. None where the name holds ``L<layer>.`` nowhere or more than once."""
    mark = f"L{layer}."
    i = name.find(mark)
    if i < 0 or (i and name[i - 1] != ".") or name.find(mark, i + 1) >= 0:
        return None
    return name[:i], name[i + len(mark):]


class _Name:
    """A tensor name in a template's result: its recipe (see ``Stamper._record``)."""

    __slots__ = ("r",)

    def __init__(self, r):
        self.r = r


def _mapped(tree, f: Callable):
    """``tree`` with every string (``_Name``) leaf ``s`` replaced by ``f(s)`` (same containers)."""
    if isinstance(tree, (str, _Name)):
        return f(tree)
    if isinstance(tree, dict):
        return {k: _mapped(v, f) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(_mapped(v, f) for v in tree)
    if isinstance(tree, list):
        return [_mapped(v, f) for v in tree]
    return tree


def _maker(tree) -> Callable[[list], object]:
    """``table -> _mapped(tree, lambda n: table[n.r])`` for a template's result ``tree`` (``_Name`` leaves), with the
    walk over the tree done once: a dict of names is one ``itemgetter`` call per stamp."""
    if isinstance(tree, _Name):
        return itemgetter(tree.r)
    if isinstance(tree, dict):
        keys, vals = tuple(tree), tuple(tree.values())
        if len(vals) > 1 and all(isinstance(v, _Name) for v in vals):
            get = itemgetter(*[v.r for v in vals])
            return lambda table: dict(zip(keys, get(table)))
        fs = tuple(map(_maker, vals))
        return lambda table: {k: f(table) for k, f in zip(keys, fs)}
    if isinstance(tree, (tuple, list)):
        fs = tuple(map(_maker, tree))
        if isinstance(tree, tuple):
            return lambda table: tuple([f(table) for f in fs])
        return lambda table: [f(table) for f in fs]
    return lambda table: tree


class _StampPlan:
    """What ``Stamper._stamp`` reads of a template ``t`` in the form its C-level calls take, made once per template:
    the fresh tensors' stems and uid offsets (``stems``, ``offsets``); ``result`` (``_maker``); the stamped ops' names
    by layer (``names``: made for a layer's first stamp, shared by its later ones); and ``updates``, by whether the
    pass is a copy: the table indices of the tensors whose producer a stamp sets in the emitter (``made``), each
    producer's place in the list ``[-1, the stamp's op ids..., context values...]`` (``made_at``), and the table
    indices and bytes of the sizes it sets (``sized``, ``sizes``).

    A copy (``updates[True]``) sets them for its inputs and the tensors of its result only: the builder knows a
    copy's tensors by those names alone (it did not run ``fn``), so nothing looks the others up (three in four of a
    175B pass's tensors). A recorded pass re-emitted as its blocks (``updates[False]``) sets every one, over those
    ``fn`` left."""

    __slots__ = ("stems", "offsets", "result", "suffixes", "names", "updates", "layered")

    def __init__(self, t, n_in: int) -> None:
        self.suffixes = tuple(r[1] for r in t.ops)
        self.names: dict[int, tuple[str, ...]] = {}
        self.stems, self.offsets = tuple(s for s, _ in t.fresh), tuple(r for _, r in t.fresh)
        self.result = _maker(t.result)
        known = set(range(n_in))  # the inputs (``n_in`` of them: the template's key fixes how many) and the result
        _mapped(t.result, lambda n: known.add(n.r) if isinstance(n, _Name) else None)
        #: the layer-named tensors (a backward's gradients, ``Stamper`` effects): after the constants, set every stamp
        #: (the builder reads their producers: the optimizer's uses)
        self.layered = t.layered
        first = n_in + len(t.fresh) + len(t.consts)
        known.update(range(first, first + len(self.layered)))
        self.updates = {True: self._updates(t, known), False: self._updates(t, None)}

    @staticmethod
    def _updates(t, known: set[int] | None) -> tuple:
        """``(made, made_at, sized, sizes)`` of the tensors in ``known`` (None: all)."""
        made = [(k, p) for k, p in t.producer if known is None or k in known]
        sized = [(k, nb) for k, nb in t.size if known is None or k in known]
        return (tuple(k for k, _ in made),
                tuple(0 if p is None else (1 + p if p >= 0 else t.n_ops - p) for _, p in made),
                tuple(k for k, _ in sized), tuple(nb for _, nb in sized))


class _Template:
    """One recorded pass: its ops as recipes relative to the pass's start (see ``Stamper``); with block stamps also
    the recorded pass's ops (``kops``) and tensor table (``index``)."""

    __slots__ = ("n_ops", "n_uid", "ops", "fresh", "consts", "result", "producer", "size", "last", "wait", "kops",
                 "index", "scratch", "waited", "layered", "effects")


#: stem of a stamped block's scratch tensor (``stamp_blocks``), named after the block op's id
SCRATCH = "activations.block_scratch.stamp#"


def uses_form(keys: tuple[int, ...]):
    """An op's uses as a recipe holds them: table indices, read by ``Stamper._stamp`` (one C call for several)."""
    return itemgetter(*keys) if len(keys) > 1 else keys


class Stamper:
    """Record a block pass once per key and stamp copies of it (module docstring).

    Args:
        e: The builder's emitter (its ``b``, ``producer``, ``size``, ``last_compute``, ``wait_for``, ``_uid``).
        state: The builder's bookkeeping as a hashable value; a pass that changes it is never stamped.
        enabled: False: every ``run`` calls ``fn`` (the reference the tests compare stamped graphs with).
        blocks: Stamp a pass's layer blocks instead of its kernels (``stamp_blocks``; ``run.fidelity: layer``),
            folding blocking TP collectives where ``fold_tp``; ``instances`` lists the passes so stamped.
        prefold: With ``fold_tp``: also fold the TP collectives beside compute once per template where the pass
            qualifies (``simulator.graph.side_blocks``; ``stamp_blocks`` check 6).
        effects: The builder's hooks that replay what a pass did to its state (``Stamper.effects``; not with
            ``blocks``).

    ``last_prefold``: whether the latest ``run`` stamped its pass with its TP collectives folded (the builder's
    evidence for ``run(waits_fold=True)``).
    """

    def __init__(self, e: KernelEmitter, state: Callable[[], Hashable], enabled: bool = True, blocks: bool = False,
                 fold_tp: bool = False, prefold: bool = False, effects: tuple[Callable, ...] | None = None):
        self.e = e
        #: ``(mark, of, replay)``: ``mark()`` before a recorded pass; ``of(mark, before, after, start, end, layer)``
        #: the replayable effects of the pass that appended ops ``start..end - 1`` for ``layer`` and changed the
        #: state from ``before`` to ``after`` (None: not replayable); ``replay(effects, layer, start)`` after a stamp
        #: of it at op ``start``. None: a pass that changes the state is never stamped (so too with ``blocks``)
        self.effects = effects if not blocks else None
        self.blocks, self.fold_tp, self.prefold = blocks, fold_tp, prefold
        self.block_templates: dict[Hashable, object] = {}  # None: stamp the kernels
        self.instances: list = []
        self.state = state
        self.enabled = enabled
        self.templates: dict[Hashable, _Template | None] = {}  # None: a pass with this key cannot be stamped
        self._marks: list[str] | None = None  # ``waited_later`` names of the pass being recorded
        self.last_prefold = False
        #: passes emitted by ``fn`` / stamped (for the benchmark and the tests)
        self.built = self.stamped = 0
        #: the TP collectives folded into a block template's op (``stamp_blocks``), by (that op's, layer): made for the
        #: layer's first stamp of it, with that block's id, and shared by the later copies, whose ids they do not
        #: carry (a 175B stage stamps ~10,000 of them); ``blocks.coarsen`` and ``side_blocks.fold_overlapped_tp``, the
        #: layer-fidelity policy that every graph built with ``blocks`` goes through, give each block's its id
        self.comm_copies: dict[tuple[int, int], tuple[Op, ...]] = {}
        self._plans: dict[int, _StampPlan] = {}  # by ``id(template)``

    def _context(self, inputs) -> tuple[list[str], list[int]]:
        """The pass's input tensors and its context values: ``last_compute``, ``wait_for``, the inputs' producers."""
        e = self.e
        names = _strings(inputs, [])
        vals = [e.last_compute, *e.wait_for, *map(e.producer.get, names, repeat(-1, len(names)))]
        return names, vals

    @staticmethod
    def _pattern(names: list[str], vals: list[int], n_wait: int) -> tuple:
        """Which context values are absent (-1) or equal to an earlier one, and which input names repeat."""
        first: dict[int, int] = {}
        setv = first.setdefault
        pv = tuple([-1 if v < 0 else setv(v, i) for i, v in enumerate(vals)])
        fn: dict[str, int] = {}
        return n_wait, pv, tuple(map(fn.setdefault, names, range(len(names))))

    def waited_later(self, name: str) -> None:
        """The builder's word that an op on another stream than ``compute`` (no TP collective ``foldable_tp`` may
        fold) will wait for tensor ``name`` of the pass being recorded, after the pass (sequence parallelism's
        saved ``1 / t`` shard, gathered again in backward): a block template ends a block at its producer, as
        ``coarsen`` does in the whole graph (``stamp_blocks``, whose ``check`` verifies the word). Outside a
        recording, nothing."""
        if self._marks is not None:
            self._marks.append(name)

    def run(self, key: Hashable, layer: int, fn: Callable, inputs: tuple, waits_fold: bool = False):
        """``fn(*inputs)``, or a stamp of the template recorded under ``key`` (module docstring); returns what
        ``fn`` returns (its tensor names those of this pass).

        ``waits_fold``: the builder's word that the ops on another stream that will wait for the tensors it names
        in this pass (``waited_later``) are TP collectives folded into a later pass stamped with them folded
        (``last_prefold``): with ``prefold``, the pass may then be stamped with its TP collectives folded across
        those tensors' producers (``stamp_blocks`` check 6; check 1 finds a word that was wrong)."""
        self.last_prefold = False
        if waits_fold:
            key = (key, "waits_fold")
        if not self.enabled:
            self.built += 1
            return fn(*inputs)
        e = self.e
        names, vals = self._context(inputs)
        full_key = (key, self._pattern(names, vals, len(e.wait_for)))
        t = self.templates.get(full_key, False)
        if t:
            self.stamped += 1
            if self.blocks:
                return self._stamp_blocks(t, full_key, layer, names, vals, waits_fold)
            start = len(e.b)
            result = self._stamp(t, layer, names, vals)
            if t.effects is not None:
                self.effects[2](t.effects, layer, start)
            return result
        self.built += 1
        if t is None:
            return fn(*inputs)
        start, uid0, before = len(e.b), e._uid, self.state()
        mark = self.effects[0]() if self.effects is not None else None
        self._marks = [] if self.blocks else None
        try:
            result = fn(*inputs)
        finally:
            marks, self._marks = self._marks, None
        after, fx = self.state(), None
        if after != before and self.effects is not None:
            fx = self.effects[1](mark, before, after, start, len(e.b), layer)
        t = self._record(start, uid0, layer, names, vals, result, fx is not None) if after == before or fx else None
        if t is not None:
            t.effects = fx
            t.waited = tuple(dict.fromkeys(t.index[n] for n in marks or () if n in t.index))
        self.templates[full_key] = t
        if t is not None and self.blocks and self._block_form(t, full_key, names, vals, waits_fold) is not None:
            # the recorded pass itself as its blocks, like every later copy (``coarsen`` then has nothing to merge
            # there); ``stamp_blocks.check`` verifies it with the copies
            e.b.truncate(start)
            e._uid, e.last_compute, e.wait_for = uid0, vals[0], vals[1:len(vals) - len(names)]
            return self._stamp_blocks(t, full_key, layer, names, vals, waits_fold, copy=False)
        return result

    def _record(self, start: int, uid0: int, layer: int, names: list[str], vals: list[int], result,
                layered_ok: bool = False):
        """The template of the pass that appended ``b.ops[start:]`` (None where it cannot be stamped).

        A stamp's tensor names are a table: the inputs (``names``), then the pass's fresh tensors, then the
        constant names, then the layer-named ones (``layer_name_parts``: the tensors it allocates where
        ``layered_ok``, a pass whose effects the builder replays; without ``blocks`` the constants of its layer);
        recipes index it. An op id is ``start + r`` for ``r >= 0`` (inside the pass), the context value
        ``vals[-1 - r]`` for ``r < 0``, or -1 for None."""
        e = self.e
        ops = e.b.ops[start:]
        n_uid = e._uid - uid0
        prefix = f"L{layer}."
        slot: dict[int, int] = {}  # context value -> its first slot
        for i, v in enumerate(vals):
            if v >= 0:
                slot.setdefault(v, i)
        index = {}  # tensor name -> index in the table
        for i, n in enumerate(names):
            index.setdefault(n, i)
        fresh: list[tuple[str, int]] = []
        consts: list[str] = []
        layered: list[tuple[str, str]] = []
        for op in ops:
            if op.layer != layer or not op.name.startswith(prefix):
                return None  # not a kernel of the layer
            for n in [a.name for a in op.allocs] + list(op.uses):
                if n in index:
                    continue
                stem, sep, u = n.rpartition("#")
                if sep and u.isdigit() and uid0 < int(u) <= uid0 + n_uid:
                    fresh.append((stem + "#", int(u) - uid0))
                    index[n] = -len(fresh)  # placed after the inputs below
                elif layered_ok and e.producer.get(n, -1) >= start and (parts := layer_name_parts(n, layer)):
                    layered.append(parts)  # a layer-named tensor the pass makes (a gradient)
                    index[n] = -(1 << 40) - len(layered)
                elif n in e.producer or any(a.name == n for a in op.allocs):
                    return None  # a tensor made outside the pass that is not an input, or a name that is not fresh
                elif not self.blocks and (parts := layer_name_parts(n, layer)) is not None:
                    layered.append(parts)  # a layer's constant (LoRA's adapter weights: ``param.L<layer>...``)
                    index[n] = -(1 << 40) - len(layered)
                else:
                    consts.append(n)
                    index[n] = -(1 << 30) - len(consts)
        n_in, n_fresh = len(names), len(fresh)
        n_const = n_in + n_fresh + len(consts)  # the first layer-named slot
        for n, i in index.items():
            if i < -(1 << 40):
                index[n] = n_const + (-(1 << 40) - i) - 1
            elif i < -(1 << 30):
                index[n] = n_in + n_fresh + (-(1 << 30) - i) - 1
            elif i < 0:
                index[n] = n_in - i - 1

        def literal(n: str) -> str:
            if self.blocks or layer_name_parts(n, layer) is not None:
                raise KeyError(n)  # a name of the layer the pass neither reads nor makes (or block stamps, whose
            return n  # check wants every result a tensor); else not a tensor (LoRA's saved module names): the same
            # in every copy

        def ident(d: int):
            if d >= start:
                return d - start  # inside the pass
            if d < 0:
                return None  # none (-1)
            return -1 - slot[d]  # a context slot (KeyError: a dependency the context does not explain)

        try:
            recipes = []
            for op in ops:
                ext = tuple(-1 - ident(d) for d in op.deps if d < start)
                inner = tuple(d - start for d in op.deps if d >= start)
                uses = tuple(index[u] for u in op.uses)
                recipes.append((tuple(_GET(op)), op.name[len(prefix):], ext, inner,
                                tuple((index[a.name], a.nbytes, a.device) for a in op.allocs), uses_form(uses), ()))
            t = _Template()
            t.n_ops, t.n_uid, t.ops, t.fresh, t.consts = len(ops), n_uid, recipes, fresh, consts
            t.layered, t.effects = tuple(layered), None
            t.kops, t.index = (list(ops), index) if self.blocks else (None, None)
            t.scratch = ()
            t.result = _mapped(result, lambda n: _Name(index[n]) if n in index else literal(n))
            t.producer, t.size = [], []
            for n, i in index.items():
                if n_in + n_fresh <= i < n_const:
                    continue
                p = e.producer.get(n)
                if i >= n_in:  # a fresh (or layer-named) tensor: where the emitter has it
                    if p is not None:
                        t.producer.append((i, ident(p)))
                    if n in e.size:
                        t.size.append((i, e.size[n]))
                elif p is not None and p != vals[len(vals) - n_in + i]:  # an input whose producer the pass moved
                    t.producer.append((i, ident(p)))
            t.last = ident(e.last_compute)
            t.wait = tuple(ident(d) for d in e.wait_for)
        except KeyError:
            return None
        return t

    def _stamp(self, t: _Template, layer: int, names: list[str], vals: list[int], copy: bool = True):
        """Append a copy of template ``t`` for ``layer`` in the context ``names`` / ``vals`` (``copy``: False for the
        recorded pass re-emitted, ``_StampPlan.updates``)."""
        e = self.e
        start, uid0 = len(e.b), e._uid
        prefix = f"L{layer}."
        comms = self.comm_copies
        plan = self._plans.get(id(t))
        if plan is None:  # ``t`` lives as long as the stamper (``templates``, ``block_templates``)
            plan = self._plans[id(t)] = _StampPlan(t, len(names))
        table = names + list(map(str.__add__, plan.stems, map(str, map(uid0.__add__, plan.offsets)))) + t.consts
        if plan.layered:  # a backward's gradients (``layer_name_parts``)
            table += [f"{h}{prefix}{tl}" for h, tl in plan.layered]
        if t.scratch:  # a block template's scratch tensors (``stamp_blocks``), named after their ops
            table += [f"{SCRATCH}{start + r}" for r in t.scratch]
        op_names = plan.names.get(layer)
        if op_names is None:
            op_names = plan.names[layer] = tuple(map(prefix.__add__, plan.suffixes))
        moved, ctx = start.__add__, vals.__getitem__  # an op id inside the pass / a context slot's
        out = []
        for i, (base, _, ext, inner, allocs, uses, folded), name in zip(count(start), t.ops, op_names):
            deps = (*sorted(map(ctx, ext)), *map(moved, inner)) if ext else tuple(map(moved, inner))
            if folded:  # a block's TP collectives (``stamp_blocks``), made once per layer (``comm_copies``)
                fc = comms.get((id(folded), layer))
                if fc is None:
                    fc = comms[id(folded), layer] = tuple([op_from_fields(_renamed(c, i, prefix + s, layer))
                                                           for c, s in folded])
            else:
                fc = base[_FOLDED]
            if not allocs:
                made = base[_ALLOCS]
            elif len(allocs) == 1:  # most kernels (one output)
                k, nb, dev = allocs[0]
                made = (tensor_alloc(table[k], nb, dev),)
            else:
                made = tuple([tensor_alloc(table[k], nb, dev) for k, nb, dev in allocs])
            out.append(_STAMPED(
                base, i, name, layer, deps, made,
                (table[uses[0]],) if type(uses) is tuple and uses else (uses(table) if uses else ()),
                dict(base[_META]),  # each op its own, as built
                fc))
        e.b.extend(out)
        e._uid += t.n_uid
        self._table = table

        def ident(r: int | None) -> int:
            if r is None:
                return -1
            return start + r if r >= 0 else vals[-1 - r]

        made, made_at, sized, sizes = plan.updates[copy]
        where = [-1, *range(start, start + t.n_ops), *vals]  # ``made_at`` indexes it
        e.producer.update(zip(map(table.__getitem__, made), map(where.__getitem__, made_at)))
        e.size.update(zip(map(table.__getitem__, sized), sizes))
        e.last_compute = ident(t.last)
        e.wait_for = [ident(d) for d in t.wait]
        return plan.result(table)

    def _block_form(self, t: _Template, key: Hashable, names: list[str], vals: list[int], waits_fold: bool = False):
        """The block template (``stamp_blocks.block_template``) of template ``t`` in the context ``names`` /
        ``vals``, made once per key, context pattern and input sizes; None where the pass is stamped as kernels
        (``waits_fold``: ``run``'s)."""
        from simulator.graph.builders import stamp_blocks as sb

        e = self.e
        ops = e.b.ops
        cs = sb.COMPUTE_STREAM
        compute = tuple([v >= 0 and ops[v].stream == cs for v in vals])
        if not all(compute) and any(v >= 0 and not c and sb.may_fold(ops[v]) for v, c in zip(vals, compute)):
            return None  # whether it is folded depends on what follows: kernels
        front = len(vals) - len(names)
        if min(vals[front:], default=0) >= 0:  # every input made by an op
            sizes = tuple(map(e.size.get, names))
        else:
            get = e.size.get
            sizes = tuple([get(n) if v >= 0 else None for n, v in zip(names, vals[front:])])
        # stubs in the real ops' order, of equal values the first slot (the one recipes name) last: slots sorted by
        # (value, -slot)
        order = tuple([-j for _, j in sorted(zip(vals, range(0, -len(vals), -1)))])
        bkey = (key, compute, order, sizes)
        bt = self.block_templates.get(bkey, False)
        if bt is False:
            devices = tuple(next((a.device for a in ops[vals[front + i]].allocs if a.name == n), "gpu")
                            if sizes[i] is not None else "gpu" for i, n in enumerate(names))
            sizes = tuple(s if d == "gpu" else None for s, d in zip(sizes, devices))
            try:
                bt = sb.block_template(t, t.kops, t.index, names, compute, order, sizes, devices, self.fold_tp,
                                       self.prefold, waits_fold)
            except (KeyError, ValueError):  # a pass the block form cannot stand for: its kernels, merged later
                bt = None
            self.block_templates[bkey] = bt
        return bt

    def _stamp_blocks(self, t: _Template, key: Hashable, layer: int, names: list[str], vals: list[int],
                      waits_fold: bool = False, copy: bool = True):
        """Append template ``t``'s pass as its layer blocks (``stamp_blocks``; its kernels where that form is not
        known) and list it in ``instances`` (``copy``: ``_stamp``'s)."""
        from simulator.graph.builders import stamp_blocks as sb

        bt = self._block_form(t, key, names, vals, waits_fold)
        if bt is None:
            return self._stamp(t, layer, names, vals, copy)
        self.last_prefold = bt.regather_folded
        e = self.e
        ops = e.b.ops
        before = next((op for op in reversed(ops) if op.stream == sb.COMPUTE_STREAM), None)
        start = len(ops)
        result = self._stamp(bt, layer, names, vals, copy)
        self.instances.append(sb.Instance(start, len(ops), self._table, bt, layer, e.phase, before, vals))
        return result
