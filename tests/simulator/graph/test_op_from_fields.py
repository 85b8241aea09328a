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


@pytest.mark.parametrize("source", ["op", "fields"])
def test_op_copier_is_replace_with_every_other_field_shared(source):
    """``op_copier``: the op ``dataclasses.replace`` gives, the unchanged fields the same objects."""
    from simulator.graph.ops import op_copier

    inner = Op(id=7, name="L1.bwd.tp.all_reduce", kind=OpKind.COLLECTIVE, stream="comm.tp", meta={"group": "tp"})
    src = Op(id=3, name="L1.bwd.block[a..b]", kind=OpKind.COMPUTE, stream="compute", phase=Phase.BWD, layer=1,
             cost_class=CostClass.GEMM, flops=2.0e12, shape=(8192, 1536, 12288), deps=(1, 2),
             allocs=(TensorAlloc("activations.x", 64),), uses=("weights.w",), dtype="fp32", folded_comm=(inner,),
             meta={"fused": ()})
    changed = ("id", "deps", "meta", "folded_comm")
    new = (9, (4,), {"side": ((0, 1),)}, ())
    copy = op_copier(changed, source)
    got = copy(src if source == "op" else tuple(getattr(src, f.name) for f in dataclasses.fields(Op)), *new)
    want = dataclasses.replace(src, **dict(zip(changed, new)))
    assert type(got) is Op and got == want
    for f in dataclasses.fields(Op):
        assert getattr(got, f.name) is getattr(want, f.name), f.name


def test_op_copier_refuses_unknown_fields():
    from simulator.graph.ops import op_copier

    for bad in (("id", "nope"), ("id", "id")):
        with pytest.raises(ValueError, match="distinct Op fields"):
            op_copier(bad)
    with pytest.raises(ValueError, match="source"):
        op_copier(("id",), source="tuple")


def test_tensor_alloc_is_the_constructor():
    """``tensor_alloc``: the ``TensorAlloc`` the constructor makes (frozen, equal, same hash), its fields the objects
    given."""
    from simulator.graph.ops import tensor_alloc

    name = "activations.L3.fwd.qkv#17"
    got, want = tensor_alloc(name, 1 << 20, "host_pinned"), TensorAlloc(name, 1 << 20, "host_pinned")
    assert type(got) is TensorAlloc and got == want and hash(got) == hash(want) and got.name is name
    assert (got.name, got.nbytes, got.device) == (name, 1048576, "host_pinned")
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.nbytes = 0
