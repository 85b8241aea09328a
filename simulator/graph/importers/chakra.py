"""Import a Chakra protobuf execution trace (``.et``) into an ``OpGraph``.

A Chakra ``.et`` file (MLCommons Chakra, ``schema/protobuf/et_def.proto``) is a stream of
varint-length-prefixed protobuf messages: one ``GlobalMetadata`` and then ``Node`` messages. It
is decoded here with a small hand-written protobuf wire-format reader (no ``protobuf`` package
or generated code needed), restricted to the message subset below:

* ``GlobalMetadata``: ``version`` (1), ``attr`` (2, ``AttributeProto``).
* ``Node``: ``id`` (1), ``name`` (2), ``type`` (3, ``NodeType``), ``ctrl_deps`` (4),
  ``data_deps`` (5), ``start_time_micros`` (6), ``duration_micros`` (7), ``inputs`` (8) and
  ``outputs`` (9) (``IOInfo``: ``values``/``shapes``/``types`` strings), ``attr`` (10).
* ``AttributeProto``: ``name`` (1) and the ``value`` oneof (fields 3-32: scalars and lists).

Mapping onto ops (same conventions as the Kineto importer):

* CPU nodes (attr ``is_cpu_op`` true) -> ``HOST`` ops on stream ``f"cpu.{tid}"``.
* GPU nodes -> ops on stream ``f"gpu{device}.stream{tid}"`` (Chakra stores the CUDA stream in
  ``tid`` for GPU nodes; the device comes from the node's tensors, default 0):
  ``COLLECTIVE`` for ``COMM_COLL_NODE``/``COMM_SEND_NODE``/``COMM_RECV_NODE`` (``meta``:
  ``collective``, ``comm_size`` bytes), memcpy kinds for ``Memcpy ...`` names, ``COMPUTE``
  otherwise (``cost_class`` from the kernel name).
* ``fixed_duration_s`` = ``duration_micros`` x 1e-6 (Chakra stores whole microseconds).
* ``deps`` = ``ctrl_deps`` + ``data_deps``. Ops are emitted in a topological order that
  follows node ids as closely as possible; a stream's program order is that order.

Chakra traces carry no absolute timestamps, so there is no measured step time to compare a
replay with; ``ChakraImport.total_duration_s`` is the sum of node durations.
"""

from __future__ import annotations

import heapq
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any

from simulator.graph.importers.kineto import (
    DEFAULT_MAX_BYTES,
    TraceImportError,
    _phase_label,
    classify_kernel,
    read_trace_bytes,
)
from simulator.graph.op_graph import GraphBuilder, OpGraph
from simulator.graph.ops import CostClass, OpKind, Phase

__all__ = ["ChakraImport", "load_chakra", "read_chakra_et"]

NODE_TYPES = {
    0: "INVALID_NODE", 1: "METADATA_NODE", 2: "MEM_LOAD_NODE", 3: "MEM_STORE_NODE",
    4: "COMP_NODE", 5: "COMM_SEND_NODE", 6: "COMM_RECV_NODE", 7: "COMM_COLL_NODE",
    8: "STORAGE_NODE", 9: "BATCH_NODE", 10: "CHECKPOINT_NODE",
}
COLLECTIVES = {
    0: "all_reduce", 1: "reduce", 2: "all_gather", 3: "gather", 4: "scatter", 5: "broadcast",
    6: "all_to_all", 7: "reduce_scatter", 8: "reduce_scatter_block", 9: "barrier",
}


_MAX_DURATION_US = 86_400_000_000  # a node longer than a day is refused: not a profiled duration


class _Truncated(Exception):
    pass


# ----------------------------------------------------------------------------------------------
# protobuf wire format
# ----------------------------------------------------------------------------------------------


def _varint(b: bytes, i: int) -> tuple[int, int]:
    r = 0
    shift = 0
    n = len(b)
    while True:
        if i >= n:
            raise _Truncated
        x = b[i]
        i += 1
        r |= (x & 0x7F) << shift
        if not x & 0x80:
            return r, i
        shift += 7
        if shift > 70:
            raise ValueError("varint too long")


def _fields(b: bytes):
    """Yield ``(field_number, wire_type, value)``; value is an int or bytes."""
    i, n = 0, len(b)
    while i < n:
        key, i = _varint(b, i)
        f, wt = key >> 3, key & 7
        if wt == 0:
            v, i = _varint(b, i)
        elif wt == 1:
            if i + 8 > n:
                raise _Truncated
            v, i = b[i:i + 8], i + 8
        elif wt == 2:
            ln, i = _varint(b, i)
            if i + ln > n:
                raise _Truncated
            v, i = b[i:i + ln], i + ln
        elif wt == 5:
            if i + 4 > n:
                raise _Truncated
            v, i = b[i:i + 4], i + 4
        else:
            raise ValueError(f"unsupported wire type {wt}")
        yield f, wt, v


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _zigzag(v: int) -> int:
    return (v >> 1) ^ -(v & 1)


def _packed_varints(wt: int, v) -> list[int]:
    _expect("repeated int", 0, wt, (0, 2))
    if wt == 0:
        return [v]
    out, i = [], 0
    while i < len(v):
        x, i = _varint(v, i)
        out.append(x)
    return out


# AttributeProto value fields: field number -> (kind, is_list)
_ATTR_SCALAR = {
    3: "double", 5: "float", 7: "int", 9: "int", 11: "uint", 13: "uint", 15: "sint", 17: "sint",
    19: "fixed32", 21: "fixed64", 23: "sfixed32", 25: "sfixed64", 27: "bool", 29: "string",
    31: "bytes",
}


#: Wire type each scalar kind is encoded with (0 varint, 1 64-bit, 2 length-delimited, 5 32-bit).
_KIND_WIRE = {"double": 1, "fixed64": 1, "sfixed64": 1, "float": 5, "fixed32": 5, "sfixed32": 5,
              "int": 0, "uint": 0, "sint": 0, "bool": 0, "string": 2, "bytes": 2}


def _expect(where: str, f: int, wt: int, want: int | tuple[int, ...]) -> None:
    """Refuse a known field encoded with the wrong wire type (``ValueError``)."""
    ok = want if isinstance(want, tuple) else (want,)
    if wt not in ok:
        raise ValueError(f"{where} field {f} has wire type {wt}, expected {' or '.join(map(str, ok))}")


def _scalar(kind: str, wt: int, v):
    if wt != _KIND_WIRE[kind]:
        raise ValueError(f"AttributeProto {kind} value has wire type {wt}, expected {_KIND_WIRE[kind]}")
    if kind == "double":
        return struct.unpack("<d", v)[0]
    if kind == "float":
        return struct.unpack("<f", v)[0]
    if kind == "int":
        return _signed64(v)
    if kind == "uint":
        return v
    if kind == "sint":
        return _zigzag(v)
    if kind == "fixed32":
        return struct.unpack("<I", v)[0]
    if kind == "fixed64":
        return struct.unpack("<Q", v)[0]
    if kind == "sfixed32":
        return struct.unpack("<i", v)[0]
    if kind == "sfixed64":
        return struct.unpack("<q", v)[0]
    if kind == "bool":
        return bool(v)
    if kind == "string":
        return v.decode("utf-8", "replace")
    return bytes(v)


def _list_values(kind: str, body: bytes) -> list:
    out: list = []
    size = {"double": 8, "fixed64": 8, "sfixed64": 8, "float": 4, "fixed32": 4, "sfixed32": 4}
    for f, wt, v in _fields(body):
        if f != 1:
            continue
        if wt == 2 and kind not in ("string", "bytes"):
            if kind in size:
                step = size[kind]
                out.extend(_scalar(kind, 1 if step == 8 else 5, v[j:j + step])
                           for j in range(0, len(v) - step + 1, step))
            else:
                out.extend(_scalar(kind, 0, x) for x in _packed_varints(2, v))
        else:
            out.append(_scalar(kind, wt, v))
    return out


def _attr(body: bytes) -> tuple[str, Any]:
    name, value = "", None
    for f, wt, v in _fields(body):
        if f == 1:
            _expect("AttributeProto", f, wt, 2)
            name = v.decode("utf-8", "replace")
        elif f in _ATTR_SCALAR:
            value = _scalar(_ATTR_SCALAR[f], wt, v)
        elif 4 <= f <= 32 and f % 2 == 0:
            _expect("AttributeProto", f, wt, 2)
            value = _list_values(_ATTR_SCALAR[f - 1], v)
    return name, value


def _io(body: bytes) -> dict:
    out = {}
    for f, wt, v in _fields(body):
        if f in (1, 2, 3) and wt == 2:
            out[("values", "shapes", "types")[f - 1]] = v.decode("utf-8", "replace")
    return out


@dataclass
class ChakraNode:
    """One decoded Chakra ``Node`` (times in microseconds)."""

    id: int
    name: str = ""
    type: int = 0
    ctrl_deps: list[int] = field(default_factory=list)
    data_deps: list[int] = field(default_factory=list)
    start_time_micros: int = 0
    duration_micros: int = 0
    inputs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    attrs: dict = field(default_factory=dict)

    @property
    def type_name(self) -> str:
        """``NodeType`` name (``"COMP_NODE"``...)."""
        return NODE_TYPES.get(self.type, f"TYPE_{self.type}")


#: Wire type of each Node field (et_def.proto): 1 id, 3 type, 6/7 times are varints; 2 name,
#: 8/9 IOInfo, 10 AttributeProto are length-delimited; 4/5 deps are repeated varints.
_NODE_WIRE = {1: 0, 2: 2, 3: 0, 4: (0, 2), 5: (0, 2), 6: 0, 7: 0, 8: 2, 9: 2, 10: 2}


def _node(body: bytes) -> ChakraNode:
    n = ChakraNode(id=-1)
    for f, wt, v in _fields(body):
        if f in _NODE_WIRE:
            _expect("Node", f, wt, _NODE_WIRE[f])
        if f == 1:
            n.id = v
        elif f == 2:
            n.name = v.decode("utf-8", "replace")
        elif f == 3:
            n.type = v
        elif f == 4:
            n.ctrl_deps.extend(_packed_varints(wt, v))
        elif f == 5:
            n.data_deps.extend(_packed_varints(wt, v))
        elif f == 6:
            n.start_time_micros = v
        elif f == 7:
            if v > _MAX_DURATION_US:
                raise ValueError(f"node duration_micros {v} is more than a day")
            n.duration_micros = v
        elif f == 8:
            n.inputs = _io(v)
        elif f == 9:
            n.outputs = _io(v)
        elif f == 10:
            k, val = _attr(v)
            n.attrs[k] = val
    return n


def read_chakra_et(path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES
                   ) -> tuple[dict, list[ChakraNode]]:
    """Decode a Chakra ``.et`` file (plain or gzip).

    Args:
        path: The file.
        max_bytes: Largest accepted decompressed size, bytes.

    Returns:
        ``(metadata, nodes)``: the ``GlobalMetadata`` as a dict (``version`` plus its attrs) and
        the nodes in file order.

    Raises:
        TraceImportError: unreadable, truncated or corrupt file, or not a Chakra trace.
    """
    name = os.fspath(path)  # as typed (the folder too)
    data = read_trace_bytes(path, max_bytes)
    if not data:
        raise TraceImportError(f"{name}: empty file")
    if data.lstrip()[:1] in (b"{", b"["):
        raise TraceImportError(f"{name}: not a Chakra protobuf trace (JSON; use the Kineto importer "
                               "or chakra_converter)")
    msgs: list[bytes] = []
    i, n = 0, len(data)
    try:
        while i < n:
            ln, i = _varint(data, i)
            if i + ln > n:
                raise _Truncated
            msgs.append(data[i:i + ln])
            i += ln
        meta: dict = {}
        for f, wt, v in _fields(msgs[0]) if msgs else ():
            if f == 1 and wt == 2:
                meta["version"] = v.decode("utf-8", "replace")
            elif f == 2 and wt == 2:
                k, val = _attr(v)
                meta[k] = val
        nodes = [_node(m) for m in msgs[1:]]
    except _Truncated:
        raise TraceImportError(f"{name}: truncated or corrupt Chakra protobuf stream") from None
    except (ValueError, struct.error, IndexError) as e:
        raise TraceImportError(f"{name}: corrupt Chakra protobuf stream ({e})") from None
    if not nodes or any(nd.id < 0 for nd in nodes):
        raise TraceImportError(f"{name}: not a Chakra trace (no nodes with ids)")
    return meta, nodes


# ----------------------------------------------------------------------------------------------
# graph
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChakraImport:
    """Result of importing a Chakra execution trace.

    Attributes:
        graph: The op graph (see the module docstring).
        metadata: ``GlobalMetadata`` (``version``, ``schema``, ``pid``, ``time``...).
        total_duration_s: Sum of all node durations, seconds.
        warnings: Non-fatal problems.
    """

    graph: OpGraph
    metadata: dict
    total_duration_s: float
    warnings: list[str]


_DEV_RX = re.compile(r"'cuda:(\d+)'")


def _device_of(n: ChakraNode) -> int:
    m = _DEV_RX.search(n.inputs.get("values", "")) or _DEV_RX.search(n.outputs.get("values", ""))
    return int(m.group(1)) if m else 0


def _deps(by_id: dict[int, ChakraNode], forward_ctrl: bool) -> tuple[dict[int, list[int]], int]:
    deps: dict[int, list[int]] = {}
    missing = 0
    for nid, nd in by_id.items():
        ctrl = nd.ctrl_deps if forward_ctrl else [d for d in nd.ctrl_deps if d < nid]
        ds = []
        for d in dict.fromkeys(ctrl + nd.data_deps):
            if d in by_id and d != nid:
                ds.append(d)
            elif d not in by_id:
                missing += 1
        deps[nid] = ds
    return deps, missing


def _topo(by_id: dict[int, ChakraNode], deps: dict[int, list[int]]) -> list[int] | None:
    """Kahn's algorithm, smallest node id first; ``None`` if there is a cycle."""
    indeg = {nid: len(ds) for nid, ds in deps.items()}
    succ: dict[int, list[int]] = {nid: [] for nid in by_id}
    for nid, ds in deps.items():
        for d in ds:
            succ[d].append(nid)
    heap = [nid for nid, k in indeg.items() if k == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        nid = heapq.heappop(heap)
        order.append(nid)
        for x in succ[nid]:
            indeg[x] -= 1
            if indeg[x] == 0:
                heapq.heappush(heap, x)
    return order if len(order) == len(by_id) else None


def load_chakra(path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES) -> ChakraImport:
    """Import a Chakra protobuf execution trace as a replayable ``OpGraph``.

    Args:
        path: ``.et`` file (plain or gzip).
        max_bytes: Largest accepted decompressed size, bytes.

    Returns:
        A ``ChakraImport``.

    Raises:
        TraceImportError: unreadable / corrupt file, not a Chakra trace, or a dependency cycle.
    """
    name = os.fspath(path)  # as typed (the folder too)
    meta, nodes = read_chakra_et(path, max_bytes)
    warnings: list[str] = []
    by_id: dict[int, ChakraNode] = {}
    for nd in nodes:
        if nd.id in by_id:
            warnings.append(f"duplicate node id {nd.id} (kept the first)")
            continue
        by_id[nd.id] = nd
    deps, missing = _deps(by_id, forward_ctrl=True)
    order = _topo(by_id, deps)
    if order is None:
        # Some converter versions emit control edges that point forward (to a node's later
        # part or child), which close cycles; keep only backward control edges then.
        deps, missing = _deps(by_id, forward_ctrl=False)
        order = _topo(by_id, deps)
        n_fwd = sum(1 for nd in by_id.values() for d in nd.ctrl_deps if d > nd.id)
        warnings.append(f"control dependencies formed cycles; dropped {n_fwd} forward ctrl_deps")
    if order is None:
        raise TraceImportError(f"{name}: dependency cycle among the nodes")
    if missing:
        warnings.append(f"dropped {missing} dependencies on unknown nodes")
    b = GraphBuilder()
    new_id: dict[int, int] = {}
    phase_of: dict[int, Phase] = {}
    total_us = 0
    for nid in order:
        nd = by_id[nid]
        a = nd.attrs
        is_cpu = bool(a.get("is_cpu_op", False))
        tid = a.get("tid", 0)
        if not isinstance(tid, (int, str)) or isinstance(tid, bool):
            tid = 0
        dur_s = max(0, nd.duration_micros) * 1e-6
        total_us += max(0, nd.duration_micros)
        ph = _phase_label(nd.name)
        if ph is None and not is_cpu:  # a kernel inherits the phase of the CPU op launching it
            ph = next((phase_of[d] for d in nd.ctrl_deps if d in phase_of
                       and by_id[d].attrs.get("is_cpu_op")), None)
        ph = ph or Phase.OTHER
        phase_of[nid] = ph
        m: dict[str, Any] = {"chakra_id": nid, "chakra_type": nd.type_name,
                             "dur_us": nd.duration_micros}
        if "rf_id" in a:
            m["rf_id"] = a["rf_id"]
        fields: dict[str, Any] = dict(phase=ph, fixed_duration_s=dur_s, launch=False, meta=m)
        if is_cpu or nd.type in (0, 1, 8, 9, 10):
            kind, stream = OpKind.HOST, f"cpu.{tid}"
            fields["host_s"] = dur_s
        else:
            stream = f"gpu{_device_of(nd)}.stream{tid}"
            m["kernel"] = nd.name
            if nd.type in (5, 6, 7):
                kind = OpKind.COLLECTIVE
                ct = a.get("comm_type")
                m["collective"] = (COLLECTIVES.get(ct, str(ct)) if nd.type == 7 and isinstance(ct, int) else
                                   str(ct) if nd.type == 7 else
                                   ("send" if nd.type == 5 else "recv"))
                size = a.get("comm_size")
                if isinstance(size, (int, float)) and not isinstance(size, bool) and 0 <= size < float("inf"):
                    m["comm_size"] = size
                    fields["bytes_read"] = float(size)
                elif size is not None:
                    warnings.append(f"node {nid}: comm_size {size!r} is not a byte count (ignored)")
            elif nd.type == 2 or nd.name.startswith("Memcpy HtoD"):
                kind, fields["cost_class"] = OpKind.MEMCPY_H2D, CostClass.COPY
            elif nd.type == 3 or nd.name.startswith("Memcpy DtoH"):
                kind, fields["cost_class"] = OpKind.MEMCPY_D2H, CostClass.COPY
            elif nd.name.startswith("Memcpy"):
                kind, fields["cost_class"] = OpKind.MEMCPY_D2D, CostClass.COPY
            elif nd.name.startswith("Memset"):
                kind, fields["cost_class"] = OpKind.COMPUTE, CostClass.MEMSET
            else:
                kind, fields["cost_class"] = OpKind.COMPUTE, classify_kernel(nd.name)
        label = nd.name if len(nd.name) <= 200 else nd.name[:197] + "..."
        new_id[nid] = b.add(label, kind, stream, deps=[new_id[d] for d in deps[nid]], **fields)
    graph = b.build(source=f"chakra:{os.path.basename(name)}", meta={"path": os.fspath(path), "chakra": meta})
    return ChakraImport(graph=graph, metadata=meta, total_duration_s=total_us * 1e-6,
                        warnings=warnings)
