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
collectives) did not change: a pass with any other effect is emitted by ``fn`` every time. The builder keeps
out of the key's reach what it cannot express (it does not stamp at all under ZeRO-3/FSDP parameter
gathers, LoRA, fp8 or MoE).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from operator import attrgetter, itemgetter

from simulator.graph.builders.emitter import KernelEmitter
from simulator.graph.ops import Op, TensorAlloc

_FIELDS = Op.__dataclass_fields__
_NAMES = tuple(_FIELDS)
_GET = attrgetter(*_NAMES)
_ID, _NAME, _LAYER, _DEPS, _ALLOCS, _USES, _META = (
    _NAMES.index(f) for f in ("id", "name", "layer", "deps", "allocs", "uses", "meta"))


def _strings(tree, out: list) -> list:
    """The strings of a tree of tuples / lists / dicts (dict values, in order), depth first."""
    if isinstance(tree, str):
        out.append(tree)
    elif isinstance(tree, dict):
        for v in tree.values():
            _strings(v, out)
    elif isinstance(tree, (tuple, list)):
        for v in tree:
            _strings(v, out)
    return out


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


class _Template:
    """One recorded pass: its ops as recipes relative to the pass's start (see ``Stamper``)."""

    __slots__ = ("n_ops", "n_uid", "ops", "fresh", "consts", "result", "producer", "size", "last", "wait")


class Stamper:
    """Record a block pass once per key and stamp copies of it (module docstring).

    Args:
        e: The builder's emitter (its ``b``, ``producer``, ``size``, ``last_compute``, ``wait_for``, ``_uid``).
        state: The builder's bookkeeping as a hashable value; a pass that changes it is never stamped.
        enabled: False: every ``run`` calls ``fn`` (the reference the tests compare stamped graphs with).
    """

    def __init__(self, e: KernelEmitter, state: Callable[[], Hashable], enabled: bool = True):
        self.e = e
        self.state = state
        self.enabled = enabled
        self.templates: dict[Hashable, _Template | None] = {}  # None: a pass with this key cannot be stamped
        #: passes emitted by ``fn`` / stamped (for the benchmark and the tests)
        self.built = self.stamped = 0

    def _context(self, inputs) -> tuple[list[str], list[int]]:
        """The pass's input tensors and its context values: ``last_compute``, ``wait_for``, the inputs' producers."""
        e = self.e
        names = _strings(inputs, [])
        vals = [e.last_compute, *e.wait_for, *(e.producer.get(n, -1) for n in names)]
        return names, vals

    @staticmethod
    def _pattern(names: list[str], vals: list[int], n_wait: int) -> tuple:
        """Which context values are absent (-1) or equal to an earlier one, and which input names repeat."""
        first: dict[int, int] = {}
        pv = tuple(-1 if v < 0 else first.setdefault(v, i) for i, v in enumerate(vals))
        fn: dict[str, int] = {}
        return n_wait, pv, tuple(fn.setdefault(n, i) for i, n in enumerate(names))

    def run(self, key: Hashable, layer: int, fn: Callable, inputs: tuple):
        """``fn(*inputs)``, or a stamp of the template recorded under ``key`` (module docstring); returns what
        ``fn`` returns (its tensor names those of this pass)."""
        if not self.enabled:
            self.built += 1
            return fn(*inputs)
        e = self.e
        names, vals = self._context(inputs)
        full_key = (key, self._pattern(names, vals, len(e.wait_for)))
        t = self.templates.get(full_key, False)
        if t:
            self.stamped += 1
            return self._stamp(t, layer, names, vals)
        self.built += 1
        if t is None:
            return fn(*inputs)
        start, uid0, before = len(e.b), e._uid, self.state()
        result = fn(*inputs)
        self.templates[full_key] = self._record(start, uid0, layer, names, vals, result) \
            if self.state() == before else None
        return result

    def _record(self, start: int, uid0: int, layer: int, names: list[str], vals: list[int], result):
        """The template of the pass that appended ``b.ops[start:]`` (None where it cannot be stamped).

        A stamp's tensor names are a table: the inputs (``names``), then the pass's fresh tensors, then the
        constant names; recipes index it. An op id is ``start + r`` for ``r >= 0`` (inside the pass), the context
        value ``vals[-1 - r]`` for ``r < 0``, or -1 for None."""
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
                elif n in e.producer or any(a.name == n for a in op.allocs):
                    return None  # a tensor made outside the pass that is not an input, or a name that is not fresh
                else:
                    consts.append(n)
                    index[n] = -(1 << 30) - len(consts)
        n_in, n_fresh = len(names), len(fresh)
        for n, i in index.items():
            if i < -(1 << 30):
                index[n] = n_in + n_fresh + (-(1 << 30) - i) - 1
            elif i < 0:
                index[n] = n_in - i - 1

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
                                tuple((index[a.name], a.nbytes, a.device) for a in op.allocs),
                                itemgetter(*uses) if len(uses) > 1 else uses))
            t = _Template()
            t.n_ops, t.n_uid, t.ops, t.fresh, t.consts = len(ops), n_uid, recipes, fresh, consts
            t.result = _mapped(result, lambda n: _Name(index[n]))
            t.producer, t.size = [], []
            for n, i in index.items():
                if i >= n_in + n_fresh:
                    continue
                p = e.producer.get(n)
                if i >= n_in:  # a fresh tensor: where the emitter has it
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

    def _stamp(self, t: _Template, layer: int, names: list[str], vals: list[int]):
        """Append a copy of template ``t`` for ``layer`` in the context ``names`` / ``vals``."""
        e = self.e
        start, uid0 = len(e.b), e._uid
        prefix = f"L{layer}."
        table = names + [f"{stem}{uid0 + r}" for stem, r in t.fresh] + t.consts
        out = []
        i = start
        for base, suffix, ext, inner, allocs, uses in t.ops:
            v = list(base)
            v[_ID] = i
            v[_NAME] = prefix + suffix
            v[_LAYER] = layer
            if ext:
                v[_DEPS] = (*sorted([vals[s] for s in ext]), *[start + d for d in inner])
            else:
                v[_DEPS] = tuple([start + d for d in inner])
            if allocs:
                v[_ALLOCS] = tuple([TensorAlloc(table[k], nb, dev) for k, nb, dev in allocs])
            v[_USES] = (table[uses[0]],) if type(uses) is tuple and uses else (uses(table) if uses else ())
            v[_META] = dict(base[_META])  # each op its own, as built
            out.append(Op(*v))
            i += 1
        e.b.extend(out)
        e._uid += t.n_uid

        def ident(r: int | None) -> int:
            if r is None:
                return -1
            return start + r if r >= 0 else vals[-1 - r]

        for k, p in t.producer:
            e.producer[table[k]] = ident(p)
        for k, nb in t.size:
            e.size[table[k]] = nb
        e.last_compute = ident(t.last)
        e.wait_for = [ident(d) for d in t.wait]
        return _mapped(t.result, lambda n: table[n.r])
