"""A finished run leaves nothing graph-sized for the cyclic garbage collector (``engine.run._release``)."""

from __future__ import annotations

import gc
import weakref

import pytest

from simulator.engine.run import run_graph
from simulator.graph.op_graph import GraphBuilder
from simulator.graph.ops import OpKind, TensorAlloc


@pytest.fixture
def collector_off():
    on = gc.isenabled()
    gc.collect()
    gc.disable()
    yield
    if on:
        gc.enable()


def test_graph_freed_by_reference_counting_after_the_run(toy_hw, collector_off):
    """With the collector off (as under ``gc_paused``), dropping the caller's references to the graph and the
    records frees the graph at once: the executor's reference cycles no longer hold it (before: alive until a
    collection, which for a 1,024-GPU pipeline step traversed millions of objects)."""
    b = GraphBuilder()
    a = b.add("a", OpKind.COMPUTE, "compute", fixed_duration_s=1.0, allocs=(TensorAlloc("x", 8),))
    b.add("b", OpKind.COMPUTE, "compute", fixed_duration_s=2.0, deps=[a], uses=("x",))
    graph = b.build()
    ref = weakref.ref(graph)
    rec, runtime = run_graph(graph, toy_hw, steps=2)
    assert list(rec.spans.end_s) == [1.0, 3.0, 4.0, 6.0]  # the records are complete before the release
    del graph, rec, runtime
    assert ref() is None
