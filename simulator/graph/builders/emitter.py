"""A small helper to emit GPU kernels with tensors, used by the model builders.

It tracks which op produced each tensor so that an op that *uses* a tensor automatically depends
on its producer (a data dependency), and it sums the bytes of every kernel from the tensor sizes
the builder passes.
"""

from __future__ import annotations

from collections.abc import Iterable

from simulator.graph.op_graph import GraphBuilder, dependencies
from simulator.graph.ops import CostClass, OpKind, Phase, tensor_alloc


class KernelEmitter:
    """Emit ops onto a ``GraphBuilder`` with tensor bookkeeping.

    Args:
        builder: Graph under construction.
        stream: Default stream for GPU kernels.
    """

    def __init__(self, builder: GraphBuilder, stream: str = "compute"):
        self.b = builder
        self.stream = stream
        self.producer: dict[str, int] = {}
        self.size: dict[str, int] = {}
        self.phase = Phase.FWD
        self.layer = -1
        #: dtype of 16-bit kernels when ``kernel`` is given none ("bf16"; "fp16" under Megatron --fp16)
        self.half = "bf16"
        #: id of the last kernel on the default stream (-1: none yet)
        self.last_compute = -1
        #: ops the next default-stream kernel waits for (a blocking collective: the current stream waits for it)
        self.wait_for: list[int] = []
        self._uid = 0

    def fresh(self, stem: str) -> str:
        """A new unique tensor name starting with ``stem``."""
        self._uid += 1
        return f"{stem}#{self._uid}"

    def kernel(
        self,
        name: str,
        cost_class: CostClass,
        *,
        reads: float = 0.0,
        writes: float = 0.0,
        flops: float = 0.0,
        shape: tuple[int, ...] = (),
        out: Iterable[tuple[str, int]] = (),
        uses: Iterable[str] = (),
        deps: Iterable[int] = (),
        dtype: str | None = None,
        kind: OpKind = OpKind.COMPUTE,
        stream: str | None = None,
        **fields,
    ) -> int:
        """Append a GPU kernel.

        Args:
            name: Op name (the layer prefix is added).
            cost_class: Kernel family.
            reads: Bytes read from HBM.
            writes: Bytes written to HBM.
            flops: FLOPs.
            shape: GEMM (m, n, k) or attention shape.
            out: Tensors allocated by the op, ``(name, bytes)``.
            uses: Tensors read (their producers become dependencies; they stay alive until done).
            deps: Extra dependencies.
            dtype: Operand dtype (default: ``self.half``).
            kind: Op kind (COMPUTE unless a copy).
            stream: Stream override.
            **fields: Other ``Op`` fields.

        Returns:
            The op id.
        """
        uses = tuple(uses)
        producer = self.producer
        dd = [producer[u] for u in uses if u in producer]
        if deps:
            dd.extend(deps)
        on_default = not stream or stream == self.stream
        if on_default and self.wait_for:
            dd.extend(self.wait_for)
            self.wait_for = []
        allocs = tuple([tensor_alloc(n, int(sz), "gpu") for n, sz in out]) if out else ()
        layer, phase = self.layer, self.phase
        op = self.b.push(
            f"L{layer}.{phase._value_}.{name}" if layer >= 0 else f"{phase._value_}.{name}",
            kind,
            stream or self.stream,
            phase,
            layer,
            cost_class,
            float(flops),
            float(reads),
            float(writes),
            tuple(map(int, shape)),
            dependencies(dd),
            allocs,
            uses,
            dtype or self.half,
            **fields,
        )
        if allocs:
            size = self.size
            for t in allocs:
                producer[t.name] = op
                size[t.name] = t.nbytes
        if on_default:
            self.last_compute = op
        return op
