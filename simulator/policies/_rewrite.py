"""A small helper for graph policies: copy a graph op by op, dropping, changing and inserting ops.

Ids are re-assigned; dependencies of copied ops are remapped; a dropped op's dependents inherit
its dependencies (so dropping never loses an ordering constraint). ``meta["prev_step_deps"]`` of
copied ops are remapped too; new ops can name previous-step dependencies by *new* id through
``prev_step`` once all ops are in place (``finish``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from simulator.graph.op_graph import GraphBuilder, OpGraph
from simulator.graph.ops import Op, TensorAlloc


#: ``Op``'s fields, in order (``replace_op``)
_OP_FIELDS = tuple(f.name for f in dataclasses.fields(Op))
#: ``Op`` sets its fields in its generated ``__init__`` alone (no ``__post_init__``, every field in ``__init__``): a copy
#: may set them directly
_PLAIN_OP = not hasattr(Op, "__post_init__") and all(f.init for f in dataclasses.fields(Op))


def replace_op(op: Op, **changes) -> Op:
    """``dataclasses.replace(op, **changes)``: the same ``Op`` (every field as given or as ``op``'s, the same objects),
    set slot by slot while ``Op`` has nothing in its construction besides setting them (``_PLAIN_OP``; else
    ``dataclasses.replace`` itself). About half the time of ``dataclasses.replace``, once per op of a rewritten graph.

    Raises:
        TypeError: a change names no field of ``Op``.
    """
    if not _PLAIN_OP:
        return dataclasses.replace(op, **changes)
    unknown = changes.keys() - _OP_FIELDS_SET
    if unknown:
        raise TypeError(f"Op has no field {sorted(unknown)[0]!r}")
    new = object.__new__(Op)
    for name in _OP_FIELDS:
        _SET(new, name, changes[name] if name in changes else getattr(op, name))
    return new


_OP_FIELDS_SET = frozenset(_OP_FIELDS)
_SET = object.__setattr__


class GraphRewriter:
    """Rebuild ``graph`` with changes.

    Example:
        >>> rw = GraphRewriter(graph)
        >>> for op in graph.ops:
        ...     rw.copy(op)
        >>> new = rw.finish()
    """

    def __init__(self, graph: OpGraph):
        self.g = graph
        self.b = GraphBuilder()
        self.map: dict[int, tuple[int, ...]] = {}
        self._prev: dict[int, set[int]] = {}

    def new(self, old_id: int) -> tuple[int, ...]:
        """New ids standing for old op ``old_id`` (several when it was dropped)."""
        return self.map.get(old_id, ())

    def _remap(self, deps: Iterable[int]) -> set[int]:
        out: set[int] = set()
        for d in deps:
            out.update(self.map.get(d, ()))
        return out

    def copy(self, op: Op, extra_deps: Iterable[int] = (), **changes) -> int:
        """Copy an op (old deps remapped, ``extra_deps`` are new ids); returns its new id."""
        deps = self._remap(op.deps) | set(extra_deps)
        meta = dict(changes.pop("meta", op.meta) or {})
        prev = meta.pop("prev_step_deps", None)
        new = replace_op(op, id=len(self.b), deps=tuple(sorted(deps)), meta=meta, **changes)
        self.b.extend((new,))  # it carries its id and sorted deps already (``add_op`` would copy it once more)
        i = new.id
        self.map[op.id] = (i,)
        if prev:
            self._prev.setdefault(i, set()).update(("old", p) for p in prev)  # type: ignore[arg-type]
        return i

    def drop(self, op: Op) -> None:
        """Leave ``op`` out; ops depending on it depend on its dependencies instead."""
        self.map[op.id] = tuple(sorted(self._remap(op.deps)))

    def alias(self, op: Op, new_ids: Iterable[int]) -> None:
        """Leave ``op`` out; ops depending on it depend on ``new_ids`` instead."""
        self.map[op.id] = tuple(sorted(set(new_ids)))

    def add(self, name: str, kind, stream: str, deps: Iterable[int] = (), **fields) -> int:
        """Insert a new op (``deps`` are new ids)."""
        return self.b.add(name, kind, stream, deps=deps, **fields)

    def prev_step(self, new_id: int, prev_new_ids: Iterable[int]) -> None:
        """Make new op ``new_id`` wait for new ops ``prev_new_ids`` of the previous step."""
        self._prev.setdefault(new_id, set()).update(("new", p) for p in prev_new_ids)  # type: ignore[arg-type]

    def finish(self, persistent: Iterable[TensorAlloc] | None = None, **graph_fields) -> OpGraph:
        """Freeze the new graph (graph-level fields copied from the original unless given)."""
        ops = list(self.b.ops)
        for i, refs in self._prev.items():
            ids: set[int] = set()
            for tag, ref in refs:
                ids.update(self.map.get(ref, ()) if tag == "old" else (ref,))
            meta = dict(ops[i].meta or {})
            meta["prev_step_deps"] = tuple(sorted(ids))
            ops[i] = dataclasses.replace(ops[i], meta=meta)
        fields = dict(
            persistent=tuple(self.g.persistent if persistent is None else persistent),
            samples_per_step=self.g.samples_per_step, tokens_per_step=self.g.tokens_per_step,
            model_flops_per_step=self.g.model_flops_per_step, policies=self.g.policies, source=self.g.source,
            model=self.g.model, meta=dict(self.g.meta),
            param_groups=tuple(dataclasses.replace(pg, grad_op=max(self.map[pg.grad_op]))
                               for pg in self.g.param_groups if self.map.get(pg.grad_op)),
        )
        fields.update(graph_fields)
        return OpGraph(ops=tuple(ops), **fields)
