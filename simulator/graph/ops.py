"""Operators of the step graph.

An *op* is one unit of work the engine schedules: a GPU kernel, a host<->device copy, a piece of
host CPU work (the CPU Adam step, a dataloader batch), or a synchronisation point. Ops run on a
*stream* (an in-order queue, as CUDA streams are): ``compute`` for GPU kernels, ``h2d``/``d2h`` for
the copy engines, ``host`` for the training thread's CPU work. Within a stream ops run in the order
they appear in the graph; across streams they wait only for their explicit dependencies.

Memory is declared on the ops: an op *allocates* tensors (name, bytes) when it starts; a tensor is
freed once every op that lists it in ``uses`` has finished (or right after the producer if no op
uses it). Tensors named in ``persistent`` ops are allocated before the step and never freed.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from enum import Enum
from operator import attrgetter


class OpKind(str, Enum):
    """What kind of work an op is; decides which cost model prices it."""

    COMPUTE = "compute"  # GPU kernel
    MEMCPY_H2D = "memcpy_h2d"
    MEMCPY_D2H = "memcpy_d2h"
    MEMCPY_D2D = "memcpy_d2d"
    COLLECTIVE = "collective"
    HOST = "host"  # CPU work on the host (seconds of one thread or a parallel region)
    DATALOADER = "dataloader"  # wait for the next input batch
    SYNC = "sync"  # host waits for the device (cudaDeviceSynchronize)


class Phase(str, Enum):
    """Which part of the training step an op belongs to."""

    DATA = "data"
    FWD = "fwd"
    BWD = "bwd"
    OPT = "opt"
    OTHER = "other"


class CostClass(str, Enum):
    """Kernel family, used to pick the efficiency table of the roofline cost model."""

    GEMM = "gemm"
    ATTENTION_FWD = "attention_fwd"
    ATTENTION_BWD = "attention_bwd"
    ELEMENTWISE = "elementwise"
    NORM = "norm"
    SOFTMAX = "softmax"
    REDUCTION = "reduction"
    CAST = "cast"
    OPTIMIZER = "optimizer"
    EMBEDDING = "embedding"
    MEMSET = "memset"
    COPY = "copy"
    OTHER = "other"


class OpRole(str, Enum):
    """What a builder op is for, typed, so that policies find the ops they rewrite without reading names.

    ``NONE`` for every op the builder gives no role (and every imported op)."""

    NONE = ""
    INPUT_COPY = "input_copy"  # the batch's host-to-device copy (tokens and labels; the DataLoader feeds it)
    BLOCK_INPUT_NORM = "block_input_norm"  # a block's first forward op (ln1): it reads the block's input
    WEIGHT_GRAD = "weight_grad"  # a linear layer's weight-gradient GEMM (bf16 dW)
    BIAS_GRAD = "bias_grad"  # a linear layer's bias-gradient reduction
    NORM_GRAD = "norm_grad"  # a norm's gamma (and beta) gradient reduction
    GRAD_ACCUM = "grad_accum"  # accumulation of a bf16 weight gradient into its fp32 ``.grad``
    PARAM_UPLOAD = "param_upload"  # ZeRO-Offload: updated 16-bit parameters copied back to the GPU


@dataclass(frozen=True, slots=True)
class TensorAlloc:
    """A tensor an op allocates.

    Attributes:
        name: Unique tensor name within the graph.
        nbytes: Size in bytes.
        device: ``"gpu"`` or ``"host_pinned"`` / ``"host_pageable"``.
    """

    name: str
    nbytes: int
    device: str = "gpu"


@dataclass(frozen=True, slots=True)
class Op:
    """One schedulable operator.

    Attributes:
        id: Index of the op in its graph (0..n-1), assigned by the graph.
        name: Human-readable name (``"L3.fwd.qkv"``).
        kind: What kind of work this is.
        stream: In-order queue it runs on (``"compute"``, ``"h2d"``, ``"d2h"``, ``"host"``...).
        phase: Step phase.
        layer: Transformer layer index, or -1 outside the blocks.
        cost_class: Kernel family for the cost model.
        flops: Floating-point operations (multiply-add = 2).
        bytes_read: Bytes read from device memory (HBM) or, for copies, bytes moved.
        bytes_written: Bytes written to device memory.
        shape: GEMM ``(m, n, k)``, batched GEMM ``(m, n, k, batch)`` or attention ``(batch*heads, seq_q, seq_k, head_dim)``.
        host_s: CPU seconds for HOST ops (single-thread equivalent unless ``threads`` > 1); for copies, host
            seconds serial with the transfer (first-touch faults of a fresh pageable buffer).
        fixed_duration_s: If set, the op takes exactly this long (measured durations on replay).
        deps: Ids of ops that must finish before this op starts.
        allocs: Tensors allocated when the op starts.
        uses: Names of tensors the op reads (keeps them alive until it finishes).
        launch: Whether the host must launch the op (GPU kernels and copies in eager mode).
        pinned: For copies: whether the host buffer is pinned.
        dtype: Element type of the main operands (``"bf16"``, ``"fp32"``).
        role: What the builder emitted the op for (``OpRole``), for the policies.
        folded_comm: Layer fidelity: the blocking TP collectives folded into this block op
            (``simulator.policies.fidelity``), each renumbered to this op's id; the block's time includes
            each one's NCCL-model time alone, and the recorder reports each as a collective span.
    """

    id: int
    name: str
    kind: OpKind
    stream: str
    phase: Phase = Phase.OTHER
    layer: int = -1
    cost_class: CostClass = CostClass.OTHER
    flops: float = 0.0
    bytes_read: float = 0.0
    bytes_written: float = 0.0
    shape: tuple[int, ...] = ()
    host_s: float = 0.0
    fixed_duration_s: float | None = None
    deps: tuple[int, ...] = ()
    allocs: tuple[TensorAlloc, ...] = ()
    uses: tuple[str, ...] = ()
    launch: bool = True
    pinned: bool = True
    dtype: str = "bf16"
    role: OpRole = OpRole.NONE
    folded_comm: tuple["Op", ...] = ()
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def bytes_moved(self) -> float:
        """Bytes read plus bytes written (the memory traffic of a kernel, or a copy's size x2)."""
        return self.bytes_read + self.bytes_written


def _comms_key(comms: tuple[Op, ...]) -> tuple:
    """The pricing key of the TP collectives folded into a block (``price_key``): each one's collective, group, bytes
    and pipeline ranks, from its ``meta``."""
    return tuple((c.meta["collective"], c.meta.get("group", "dp"), int(c.meta["bytes"]), c.meta.get("pp_ranks"))
                 for c in comms)


def price_key(op: Op, fused_id=None, comms_key=_comms_key) -> tuple:
    """What a kernel's time and power activity depend on besides the clocks and interference: ops with equal
    keys are priced alike (``simulator.cost.roofline.RooflineCostModel``'s ``duration_s``, ``split_s``, ``fused_s``;
    the power meter's activity).

    A block (``meta["fused"]``): its parts' signature ``meta["fused_key"]`` (``fused_s``'s cache key); any other
    op: its kind, fixed duration and ``split_s``'s cache key fields. A block with TP collectives folded in
    (``Op.folded_comm``) adds each one's pricing key (``System.collective_result``'s: collective, group, bytes,
    pipeline ranks), whose time ``System.kernel_s`` adds to the block's, and where they run beside its kernels
    (``meta["side"]``, ``graph.side_blocks``).

    ``fused_id``: a function giving each ``meta["fused_key"]`` an int, equal for equal keys (``PriceKeys``): the key
    holds that int instead (two ops' keys are equal exactly when they are without it); ``comms_key``: the folded
    collectives' part (``_comms_key`` or a cache of it).
    """
    m = op.meta
    if m and "fused" in m:
        key = ("fused", m["fused_key"] if fused_id is None else fused_id(m["fused_key"]))
    else:
        key = (op.kind, op.fixed_duration_s, op.cost_class, op.shape, op.flops, op.bytes_read, op.bytes_written,
               op.dtype)
    if op.folded_comm:
        key += comms_key(op.folded_comm)
        if "side" in m:  # collectives beside the kernels (``graph.side_blocks``): where each runs
            key += (m["side"],)
    return key


_META_OF = attrgetter("meta")


class PriceKeys:
    """Interns ``price_key``: each op's key as a small int, computed once per op (held by id with the op, so that
    its id stays its own while the table lives); ops that price alike share the int.

    ``of(op)`` is the int; ``by_op`` (``id(op) -> (op, int)``) is the table hot loops read first. A block's folded TP
    collectives (``Op.folded_comm``, renumbered to the block's id) take the block's int once the block has one: their
    spans are metered at the block's activity, as the per-op-id caches before these keys gave them.
    """

    def __init__(self) -> None:
        self.by_op: dict[int, tuple[Op, int]] = {}
        self._ids: dict[tuple, int] = {}
        #: blocks' ``meta["fused_key"]`` (a tuple per kernel: hashed once here, not once per block): by ``id`` (the
        #: key held, so that its id stays its own) and by value, each an int
        self._fused_by_id: dict[int, tuple[tuple, int]] = {}
        self._fused: dict[tuple, int] = {}
        #: ``_comms_key`` by the ids of the collectives' ``meta`` dicts (a stamped block's copies share them; the dicts
        #: held, so that their ids stay theirs)
        self._comms: dict[tuple, tuple[list, tuple]] = {}

    def _comms_key(self, comms: tuple[Op, ...]) -> tuple:
        metas = list(map(_META_OF, comms))
        ids = tuple(map(id, metas))
        hit = self._comms.get(ids)
        if hit is None:
            hit = self._comms[ids] = (metas, _comms_key(comms))
        return hit[1]

    def _fused_id(self, fused_key: tuple) -> int:
        hit = self._fused_by_id.get(id(fused_key))  # stamped copies of a block share their parts' key
        if hit is None:
            hit = self._fused_by_id[id(fused_key)] = (fused_key, self._fused.setdefault(fused_key, len(self._fused)))
        return hit[1]

    def of(self, op: Op) -> int:
        """The interned ``price_key(op)``."""
        hit = self.by_op.get(id(op))
        if hit is not None:
            return hit[1]
        k = self._ids.setdefault(price_key(op, self._fused_id, self._comms_key), len(self._ids))
        self.by_op[id(op)] = (op, k)
        for c in op.folded_comm:  # a TP collective folded into a block carries the block's id (and, metered, its
            self.by_op.setdefault(id(c), (c, k))  # activity: ``PowerMeter``); nothing prices it as a kernel
        return k

    def release(self) -> None:
        """Drop the ops held (the interned keys stay)."""
        self.by_op = {}
        self._fused_by_id, self._comms = {}, {}


def _slot_writer(cls: type, params: str, values: dict[str, str], name: str, env: dict | None = None):
    """A function ``name(params) -> cls`` giving a new ``cls`` (a frozen ``slots=True`` dataclass) whose fields are set
    to ``values`` (a Python expression over ``params`` per field name, in the order of ``fields(cls)``).

    A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__`` looked up per field
    (``dataclasses._field_init``); calling each slot descriptor's ``__set__`` is ~2.5x faster, and storing attributes
    on a *draft* faster again (a plain class with ``cls``'s base and slots, so the same layout: ``STORE_ATTR`` on a
    slot takes no call), which is then given its class ``cls`` by ``__class__`` assignment, which CPython allows
    between classes with one base whose instances have the same layout and slots
    (python/cpython@b2276390879dc6329df38d2f16b1b2f795f1ee41 Objects/typeobject.c, ``compatible_for_assignment``,
    ``same_slots_added``). The object made is a ``cls`` like any other (``type(x) is cls``, frozen, equal and hashing
    as ``cls(...)`` would): ~2.8x faster than the descriptor calls for an ``Op`` with a few fields changed
    (``op_copier``: 0.83 vs 2.29 us, ``timeit`` on the shared machine). Generated like the dataclass's own
    ``__init__`` (``exec`` of a fixed template over the field names, nothing from input). ``env``: more names
    ``params`` and ``values`` may read (the defaults of ``new_op``)."""
    draft = type(f"_{cls.__name__}Draft", cls.__bases__, {"__slots__": cls.__slots__})  # the same base, as required
    names = [f.name for f in fields(cls)]
    body = "".join(f"    x.{n} = {values[n]}\n" for n in names)
    env = {**(env or {}), "new": object.__new__, "Draft": draft, "cls": cls}
    exec(f"def {name}({params}):\n    x = new(Draft)\n{body}    x.__class__ = cls\n    return x\n", env)  # noqa: S102
    return env[name]


#: ``op_from_fields(vals) -> Op``: the same op as ``Op(*vals)`` (``vals``: every field's value, in ``fields(Op)``
#: order; no defaults, no checks), built ~3x faster (``_slot_writer``); used by the graph passes that copy hundreds
#: of thousands of ops (the stamper, ``blocks.coarsen``, ``side_blocks.fold_overlapped_tp``)
op_from_fields = _slot_writer(Op, "vals", {f.name: f"vals[{i}]" for i, f in enumerate(fields(Op))}, "op_from_fields")

def _op_maker():
    """``new_op``: ``Op``'s own signature (the same parameters, order and defaults; ``meta`` a new dict when not
    given, as the field's ``default_factory``), building the op slot by slot (``_slot_writer``)."""
    env, params = {"_NO_META": _NO_META}, []
    for f in fields(Op):
        if f.name == "meta":
            params.append("meta=_NO_META")
        elif f.default is MISSING:
            params.append(f.name)
        else:
            env[f"_d_{f.name}"] = f.default
            params.append(f"{f.name}=_d_{f.name}")
    values = {f.name: f.name for f in fields(Op)}
    values["meta"] = "{} if meta is _NO_META else meta"
    return _slot_writer(Op, ", ".join(params), values, "new_op", env)


_NO_META = object()  # ``new_op``'s ``meta`` not given

#: ``new_op(id, name, kind, stream, phase=..., ...) -> Op``: the same op as ``Op(...)`` with the same arguments (every
#: field by position or keyword, the same defaults), ~3x faster (``_slot_writer``); for the builders, which make one
#: op per kernel (``GraphBuilder.add`` / ``push``)
new_op = _op_maker()

#: ``tensor_alloc(name, nbytes, device) -> TensorAlloc``: the same as ``TensorAlloc(name, nbytes, device)``, built
#: faster (``_slot_writer``; the stamper makes one per stamped tensor)
tensor_alloc = _slot_writer(TensorAlloc, "name, nbytes, device", {f: f for f in ("name", "nbytes", "device")},
                            "tensor_alloc")


def op_copier(changed: tuple[str, ...], source: str = "op"):
    """A function ``f(src, *values) -> Op`` giving the op with the fields named in ``changed`` set to ``values`` (in
    that order) and every other field taken from ``src``: an ``Op`` (``source="op"``: its attributes) or a tuple
    of every field's value in ``fields(Op)`` order (``source="fields"``, as a stamp template's recipes hold them).
    The same op as ``dataclasses.replace(src, **dict(zip(changed, values)))`` (no checks, no ``__post_init__``), built
    slot by slot like ``op_from_fields`` (``_slot_writer``) without the intermediate list of values, for the graph
    passes that copy every op of a large pipeline (``blocks.coarsen``, ``side_blocks.fold_overlapped_tp``, the
    stamper).

    Raises:
        ValueError: a name in ``changed`` that is not a field of ``Op``, given twice, or an unknown ``source``.
    """
    names = [f.name for f in fields(Op)]
    if source not in ("op", "fields") or len(set(changed)) != len(changed) or not set(changed) <= set(names):
        raise ValueError(f"op_copier: changed must name distinct Op fields ({changed!r}), source 'op' or 'fields'")
    arg = {n: f"v{k}" for k, n in enumerate(changed)}
    values = {n: arg.get(n) or (f"src.{n}" if source == "op" else f"src[{i}]") for i, n in enumerate(names)}
    return _slot_writer(Op, "".join(["src", *(f", {a}" for a in arg.values())]), values, "op_copy")
