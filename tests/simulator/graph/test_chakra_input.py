"""Chakra ``.et`` input of the wrong protobuf wire type: a one-line TraceImportError, never a traceback."""

from __future__ import annotations

import pytest

from simulator.graph.importers.chakra import load_chakra
from simulator.graph.importers.kineto import TraceImportError


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(f: int, wt: int, payload: bytes) -> bytes:
    key = _varint(f << 3 | wt)
    return key + (_varint(len(payload)) + payload if wt == 2 else payload)


def _et(tmp_path, node: bytes):
    meta = _field(1, 2, b"0.0.4")
    p = tmp_path / "t.et"
    p.write_bytes(_varint(len(meta)) + meta + _varint(len(node)) + node)
    return p


def test_well_formed_node_imports(tmp_path):
    node = _field(1, 0, _varint(1)) + _field(2, 2, b"aten::add") + _field(7, 0, _varint(5))
    imp = load_chakra(_et(tmp_path, node))
    assert imp.total_duration_s == pytest.approx(5e-6)


@pytest.mark.parametrize("node", [
    _field(1, 0, _varint(1)) + _field(2, 0, _varint(5)),  # name as a varint (was AttributeError)
    _field(1, 2, b"xx"),  # id as bytes
    _field(1, 0, _varint(1)) + _field(10, 2, _field(1, 2, b"x") + _field(3, 0, _varint(7))),  # double as varint
    _field(1, 0, _varint(1)) + _field(10, 2, _field(1, 0, _varint(3))),  # attr name as varint
    _field(1, 0, _varint(1)) + _field(7, 0, _varint(10**17)),  # duration of three thousand years
])
def test_wrong_wire_types_are_one_line_errors(tmp_path, node):
    with pytest.raises(TraceImportError, match="t.et") as exc:
        load_chakra(_et(tmp_path, node))
    assert "\n" not in str(exc.value)
