"""``_rewrite.replace_op`` is ``dataclasses.replace`` on ``Op`` (issue 12: a rewritten graph's per-op cost): the same
fields, the same objects in them, equal ops; an unknown field is refused as ``dataclasses.replace`` refuses it."""

from __future__ import annotations

import dataclasses

import pytest

from simulator.graph.ops import Op, OpKind, OpRole, Phase, TensorAlloc
from simulator.policies._rewrite import replace_op


def _op() -> Op:
    return Op(id=3, name="l0.qkv", kind=OpKind.COMPUTE, stream="compute", phase=Phase.FWD, layer=0, flops=2e9,
              deps=(1, 2), allocs=(TensorAlloc("act.l0.qkv", 4096),), uses=("params.l0",), meta={"x": 1})


@pytest.mark.parametrize("changes", [{}, {"id": 7, "deps": (0,)}, {"name": "n", "kind": OpKind.DATALOADER,
                                                                   "stream": "host", "role": OpRole.NONE, "meta": {}},
                                     {"pinned": False, "bytes_read": 1.5e6}])
def test_replace_op_is_dataclasses_replace(changes):
    op = _op()
    got, want = replace_op(op, **changes), dataclasses.replace(op, **changes)
    assert type(got) is Op and got == want and hash(got) == hash(want)
    for f in dataclasses.fields(Op):
        assert getattr(got, f.name) is getattr(want, f.name) or getattr(got, f.name) == getattr(want, f.name)
    assert got.meta is want.meta  # shallow, as dataclasses.replace: the same dict
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.id = 9


def test_replace_op_refuses_an_unknown_field():
    with pytest.raises(TypeError):
        dataclasses.replace(_op(), colour="red")
    with pytest.raises(TypeError, match="colour"):
        replace_op(_op(), colour="red")
