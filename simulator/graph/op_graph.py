"""The immutable step graph (``OpGraph``) and the ``GraphBuilder`` that makes one.

Ops are stored in a topological order: every dependency of op ``i`` has an id below ``i``. The
order is also each stream's program order (CUDA-stream semantics: a stream runs its ops in the
order they were issued). Builders, trace importers and policies all produce this one type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import networkx as nx

from simulator.graph.ops import CostClass, Op, OpKind, Phase, TensorAlloc, new_op

SCHEMA_VERSION = "1.0"


class GraphError(ValueError):
    """The graph is malformed (unknown dependency, cycle, duplicate tensor)."""


#: ``OpGraph.meta`` key: seconds per step the host's threads spend on first-touch page faults of fresh host buffers
#: (``hardware_models.host_kernels.first_touch_s``), inside the host ops and copies that the policies priced with
#: them; the run summary's ``host_page_fault_s``
PAGE_FAULT_META = "page_fault_s"


def with_page_faults(meta: dict, seconds: float) -> dict:
    """``meta`` (a graph's, copied by a policy) with ``seconds`` of first-touch faults per step added to
    ``PAGE_FAULT_META``."""
    out = dict(meta)
    if seconds:
        out[PAGE_FAULT_META] = out.get(PAGE_FAULT_META, 0.0) + float(seconds)
    return out


@dataclass(frozen=True)
class ParamGroup:
    """One parameter tensor and where its gradient is finished (typed structure for policies).

    Attributes:
        name: Parameter name (``"L3.qkv.weight"``, ``"wte.weight"``).
        numel: Elements.
        layer: Transformer layer, or -1 outside the blocks.
        grad_bytes_per_element: Bytes per element of its ``.grad`` (4: fp32 gradients).
        grad_op: Id of the op that finalises its gradient in the last micro-batch.
        grad_tensor: GPU tensor holding the gradient, when the graph models it as a tensor.
    """

    name: str
    numel: int
    layer: int
    grad_bytes_per_element: int
    grad_op: int
    grad_tensor: str | None = None

    @property
    def grad_bytes(self) -> int:
        """Bytes of the gradient."""
        return self.numel * self.grad_bytes_per_element

    def with_grad_op(self, grad_op: int) -> "ParamGroup":
        """This group with its gradient finished by op ``grad_op`` (as ``dataclasses.replace(self, grad_op=...)``,
        without its per-field ``__init__``: the policies renumber every group of a graph)."""
        new = object.__new__(ParamGroup)
        d = new.__dict__
        d.update(self.__dict__)
        d["grad_op"] = grad_op
        return new


@dataclass(frozen=True)
class ModelFacts:
    """What the model builder knew about the model and the step that policies and summaries read (typed, in
    place of the builder's spec: a policy never needs the builder's types).

    Attributes:
        precision: ``training.precision`` the graph was built with (``"bf16"``, ``"amp_bf16"``...).
        recompute: Activation recompute built in (``"none"``, ``"full"``, ``"selective"``).
        num_parameters: Parameters held by one tensor-parallel rank (the whole model with ``t = 1``).
        num_layers: Transformer blocks of the model.
        layer_params: Parameters of one block on one tensor-parallel rank.
        upload_groups: ``(name, layer, params)`` of the parameter uploads a ZeRO-Offload step makes after the
            CPU step, in forward order: ``"embed"`` (token and position tables), ``"L0"``... (each block),
            ``"head"`` (final norm and an untied LM head).
        tied_embeddings: The LM head shares the token-embedding weight.
        data_parallel_size: Data-parallel ranks.
        rank_layers: Transformer blocks held by this pipeline rank.
        num_micro_batches: Micro-batches per step.
    """

    precision: str
    recompute: str
    num_parameters: int
    num_layers: int
    layer_params: int
    upload_groups: tuple[tuple[str, int, int], ...]
    tied_embeddings: bool
    data_parallel_size: int
    rank_layers: int
    num_micro_batches: int


@dataclass(frozen=True)
class OpGraph:
    """An immutable operator DAG for one training step.

    Attributes:
        ops: Ops in topological (and per-stream program) order; ``ops[i].id == i``.
        persistent: Tensors resident for the whole run (weights, gradients, optimizer state).
        samples_per_step: Training samples processed by one step (global, for throughput).
        tokens_per_step: Tokens processed by one step.
        model_flops_per_step: Model FLOPs of one step, no recompute (for MFU), per GPU.
        policies: Names of the policies that rewrote the graph, in order.
        source: Where the graph came from (``"builder:gpt"``, ``"kineto:<file>"``).
        param_groups: Parameter tensors in the order backward finishes their gradients (builder
            graphs; empty for imported traces).
        model: Facts of the built model (``ModelFacts``; None for imported traces).
    """

    ops: tuple[Op, ...]
    persistent: tuple[TensorAlloc, ...] = ()
    samples_per_step: float = 0.0
    tokens_per_step: float = 0.0
    model_flops_per_step: float = 0.0
    policies: tuple[str, ...] = ()
    source: str = ""
    param_groups: tuple[ParamGroup, ...] = ()
    model: ModelFacts | None = None
    schema_version: str = SCHEMA_VERSION
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        """Check ids, dependency order and tensor-name uniqueness.

        Raises:
            GraphError: an id out of place, a dependency on a later op, or a tensor allocated twice.
        """
        seen: set[str] = {t.name for t in self.persistent}
        if len(seen) != len(self.persistent):
            raise GraphError("duplicate persistent tensor name")
        for i, op in enumerate(self.ops):
            if op.id != i:
                raise GraphError(f"op {op.name!r} has id {op.id}, expected {i}")
            for d in op.deps:
                if not 0 <= d < i:
                    raise GraphError(f"op {i} ({op.name}) depends on {d}, which is not an earlier op")
            for t in op.allocs:
                if t.name in seen:
                    raise GraphError(f"tensor {t.name!r} allocated twice (op {op.name})")
                seen.add(t.name)

    def __len__(self) -> int:
        return len(self.ops)

    def streams(self) -> list[str]:
        """Names of the streams used, in first-use order."""
        return list(dict.fromkeys(op.stream for op in self.ops))

    def to_networkx(self) -> nx.DiGraph:
        """The graph as a ``networkx.DiGraph`` (nodes are op ids with ``op`` attributes).

        Same-stream program order is added as edges with ``kind="stream"``, explicit
        dependencies with ``kind="data"``.
        """
        import networkx as nx

        g = nx.DiGraph()
        last: dict[str, int] = {}
        for op in self.ops:
            g.add_node(op.id, op=op)
            for d in op.deps:
                g.add_edge(d, op.id, kind="data")
            if op.stream in last:
                g.add_edge(last[op.stream], op.id, kind="stream")
            last[op.stream] = op.id
        return g

    def total(self, attr: str, phase: Phase | None = None, kind: OpKind | None = None) -> float:
        """Sum a numeric op attribute (``flops``, ``bytes_read``...) over matching ops."""
        return float(
            sum(
                getattr(op, attr)
                for op in self.ops
                if (phase is None or op.phase == phase) and (kind is None or op.kind == kind)
            )
        )

    def with_changes(self, **changes) -> "OpGraph":
        """A copy with some graph-level fields replaced (checked again only when ``ops`` or ``persistent``
        change: the other fields take no part in ``__post_init__``'s checks).

        Raises:
            GraphError: see ``OpGraph``.
        """
        if "ops" in changes or "persistent" in changes:
            return dataclasses.replace(self, **changes)
        new = object.__new__(OpGraph)
        for f in dataclasses.fields(self):
            object.__setattr__(new, f.name, changes.pop(f.name) if f.name in changes else getattr(self, f.name))
        if changes:
            raise TypeError(f"OpGraph has no field(s) {', '.join(changes)}")
        return new


def dependencies(deps: Iterable[int | None]) -> tuple[int, ...]:
    """An op's ``deps`` from ids gathered by a builder: distinct, ascending, without ``None`` and negative ids
    (-1: "no op yet")."""
    s = set(deps)
    if None in s:
        s.discard(None)
    dd = sorted(s)
    if dd and dd[0] < 0:
        return tuple([d for d in dd if d >= 0])
    return tuple(dd)


class GraphBuilder:
    """Mutable helper that assigns ids and collects ops, then freezes into an ``OpGraph``.

    Example:
        >>> b = GraphBuilder()
        >>> a = b.add("a", OpKind.COMPUTE, "compute", flops=1e9)
        >>> c = b.add("c", OpKind.MEMCPY_D2H, "d2h", bytes_read=1e6, deps=[a])
        >>> len(b.build())
        2
    """

    def __init__(self) -> None:
        self._ops: list[Op] = []
        self._persistent: list[TensorAlloc] = []

    def __len__(self) -> int:
        return len(self._ops)

    @property
    def ops(self) -> Sequence[Op]:
        """Ops added so far."""
        return self._ops

    def add(self, name: str, kind: OpKind, stream: str, deps: Iterable[int] = (), **fields) -> int:
        """Append an op and return its id.

        Args:
            name: Op name.
            kind: Op kind.
            stream: Stream the op runs on.
            deps: Ids of earlier ops it waits for (duplicates and negatives are dropped).
            **fields: Any other ``Op`` field.
        """
        i = len(self._ops)
        self._ops.append(new_op(i, name, kind, stream, deps=dependencies(deps), **fields))
        return i

    def push(self, name: str, kind: OpKind, stream: str, phase: Phase, layer: int, cost_class: CostClass,
             flops: float, bytes_read: float, bytes_written: float, shape: tuple[int, ...], deps: tuple[int, ...],
             allocs: tuple[TensorAlloc, ...], uses: tuple[str, ...], dtype: str, **fields) -> int:
        """``add`` for a kernel whose fields are all given and whose ``deps`` are already ``dependencies(...)``
        (``KernelEmitter.kernel``, one call per GPU kernel of a build): append the op, return its id."""
        i = len(self._ops)
        self._ops.append(new_op(i, name, kind, stream, phase, layer, cost_class, flops, bytes_read, bytes_written,
                                shape, deps=deps, allocs=allocs, uses=uses, dtype=dtype, **fields))
        return i

    def add_op(self, op: Op, deps: Iterable[int] | None = None) -> int:
        """Append a copy of an existing op with a new id (and optionally new deps)."""
        i = len(self._ops)
        dd = op.deps if deps is None else tuple(sorted(set(deps)))
        self._ops.append(dataclasses.replace(op, id=i, deps=dd))
        return i

    def extend(self, ops: Iterable[Op]) -> None:
        """Append ops that already carry their ids (``len(self)``, ``len(self) + 1``... : a stamped copy,
        ``builders.stamp``; checked by ``build``)."""
        self._ops.extend(ops)

    def truncate(self, n: int) -> None:
        """Drop every op from id ``n`` on (a recorded pass re-emitted as its stamped blocks, ``builders.stamp``)."""
        del self._ops[n:]

    def persistent(self, name: str, nbytes: int, device: str = "gpu") -> None:
        """Declare a tensor resident for the whole run."""
        self._persistent.append(TensorAlloc(name, int(nbytes), device))

    def build(self, **graph_fields) -> OpGraph:
        """Freeze into an ``OpGraph``.

        Raises:
            GraphError: see ``OpGraph``.
        """
        return OpGraph(ops=tuple(self._ops), persistent=tuple(self._persistent), **graph_fields)
