"""The indexes the layer-fidelity passes and the stage analysis build once per graph or frame, on hand-built inputs:
``blocks.tensor_index`` lists the users of the tensors a block may free (not of a weight no op allocates, which
every micro-batch reads), and ``metrics._rows_in`` masks a column by its factorized codes as ``astype(str)`` would."""

from __future__ import annotations

import numpy as np
import pandas as pd

from simulator.analysis.metrics import _codes, _rows_in
from simulator.graph.blocks import block_memory, tensor_index
from simulator.graph.ops import Op, OpKind, TensorAlloc


def _op(i: int, allocs=(), uses=()) -> Op:
    return Op(id=i, name=f"k{i}", kind=OpKind.COMPUTE, stream="compute", layer=0,
              allocs=tuple(TensorAlloc(n, b) for n, b in allocs), uses=tuple(uses))


def test_tensor_index_lists_users_of_allocated_tensors_only():
    # "w" is a weight (persistent: no op allocates it), read by ops 1, 2 and 4; "a" (100 B) is made by op 0 and read
    # by 1 and 2; "b" (50 B) is made by op 1 and read by 2 and 3 (twice by 3)
    ops = [_op(0, allocs=[("a", 100)]), _op(1, allocs=[("b", 50)], uses=["w", "a"]), _op(2, uses=["w", "a", "b"]),
           _op(3, uses=["b", "b"]), _op(4, uses=["w"])]
    users, size = tensor_index(ops, ops[1:3])  # a block of ops 1 and 2
    assert size == {"a": 100, "b": 50}
    assert users["a"] == [1, 2] and users["b"] == [2, 3, 3]
    # op 4 reads only the weight, which a block never frees: passed over (before, every user of "w" was listed)
    assert all(4 not in ids for ids in users.values())
    # the block frees "a" (its last users are the block's) and keeps "b" (op 3 reads it later): it allocates "b"
    # when it starts, reads "a" (and "w"), and needs no scratch (its peak, a + b, is at its start)
    allocs, uses, scratch = block_memory(ops[1:3], users, size, first_id=1)
    assert [t.name for t in allocs] == ["b"] and list(uses) == ["w", "a", "b"] and scratch == 0


def test_rows_in_matches_string_comparison():
    col = pd.Series(["compute", "collective", "sync", None, "memcpy_h2d", "compute"], dtype="string")
    coded = _codes(col)
    assert _rows_in(coded, "compute").tolist() == [True, False, False, False, False, True]
    assert _rows_in(coded, "collective", "memcpy_h2d").tolist() == [False, True, False, False, True, False]
    assert not _rows_in(coded, "memcpy_d2h").any()  # a value the column does not hold
    for v in ("compute", "sync", col.astype(str)[3]):  # the missing value reads as astype(str) writes it
        assert np.array_equal(_rows_in(coded, v), (col.astype(str) == v).to_numpy(bool))
