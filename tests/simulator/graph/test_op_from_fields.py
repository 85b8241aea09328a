"""``ops.op_from_fields``: the op ``Op(*vals)`` makes, every field included (``meta`` too, which ``==`` skips)."""

from __future__ import annotations

import dataclasses

import pytest

from simulator.graph.ops import CostClass, Op, OpKind, OpRole, Phase, TensorAlloc, op_from_fields


def test_every_field_as_the_constructor_sets_it():
    inner = Op(id=7, name="L1.bwd.tp.all_reduce", kind=OpKind.COLLECTIVE, stream="comm.tp", meta={"group": "tp"})
    vals = [7, "L1.bwd.block[a..b]", OpKind.COMPUTE, "compute", Phase.BWD, 1, CostClass.GEMM, 2.0e12, 3.0e9, 4.0e9,
            (8192, 1536, 12288), 1.5e-6, None, (3, 5), (TensorAlloc("activations.x", 64),), ("weights.w",), False,
            False, "fp32", OpRole.NONE, (inner,), {"fused": (), "side": ((0, 1),)}]
    assert len(vals) == len(dataclasses.fields(Op))
    want, got = Op(*vals), op_from_fields(vals)
    assert type(got) is Op and got == want
    for f in dataclasses.fields(Op):
        assert getattr(got, f.name) is getattr(want, f.name), f.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.id = 8
