"""Block stamps (``simulator.graph.builders.stamp_blocks``): the layer-fidelity graph made from a graph whose
repeated layer passes were stamped as their blocks equals, op for op, the one ``coarsen`` makes of the kernel-level
graph (ids, names, layers, costs, dependencies, tensors and their sizes, each block's kernels and folded TP
collectives), on the tiny pipeline cases of the stamping tests and on every stage of the bundled GPT-3 175B scale
scenario; where a condition of ``stamp_blocks.check`` fails the builder makes the kernel-level graph instead."""

from __future__ import annotations

import pytest

from simulator.graph.blocks import coarsen
from simulator.graph.builders.stamp_blocks import SCRATCH
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from tests.simulator.graph.test_stamp import CASES, TINY

_PART = ("kind", "stream", "phase", "layer", "cost_class", "flops", "bytes_read", "bytes_written", "shape", "dtype",
         "role", "launch", "pinned", "host_s", "fixed_duration_s")


#: what prices a block's kernels (``RooflineCostModel.fused_s``, ``System.block_tail_s``): not their layer or
#: name (a stamped block holds the kernels of the first pass of its shape)
_PRICED = tuple(f for f in _PART if f != "layer")


def _scratch(name: str) -> bool:
    return name.startswith(SCRATCH) or name.startswith("activations.block_scratch#")


def _op_view(op) -> tuple:
    """What the engine reads of an op, less the per-graph names of block scratch tensors and of a block's parts."""
    meta = dict(op.meta)
    parts = meta.pop("fused", ())
    return (op.id, op.name, op.deps, *(getattr(op, f) for f in _PART),
            tuple((None if _scratch(a.name) else a.name, a.nbytes, a.device) for a in op.allocs), op.uses,
            tuple((c.id, c.name, c.stream, c.meta) for c in op.folded_comm),
            tuple(tuple(getattr(p, f) for f in _PRICED) for p in parts), meta)


def assert_same_layer_graph(spec: TransformerSpec, fold_tp: bool) -> dict:
    """Layer-fidelity graphs of ``spec`` made both ways are equal; returns the block build's ``meta["layer_blocks"]``."""
    ref = coarsen(build_gpt_step(spec), fold_tp)
    built = build_gpt_step(spec, blocks=True, fold_tp=fold_tp)
    new = coarsen(built, fold_tp)
    assert len(new.ops) == len(ref.ops)
    for x, y in zip(new.ops, ref.ops):
        assert _op_view(x) == _op_view(y), (x.name, y.name)
    assert new.persistent == ref.persistent and new.param_groups == ref.param_groups
    return built.meta["layer_blocks"]


@pytest.mark.parametrize("fold_tp", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_block_stamps_give_the_coarsened_graph(case, fold_tp):
    kw = {**TINY, **CASES[case]}
    for rank in range(kw.get("pipeline_parallel_size", 1)):
        assert_same_layer_graph(TransformerSpec(**kw, pipeline_rank=rank), fold_tp)
