"""Exact timings of tiny graphs worked out by hand (toy machine: see tests/conftest.py)."""

from __future__ import annotations

import pytest

from simulator.api import simulate_graph
from simulator.graph.op_graph import GraphBuilder
from simulator.graph.ops import CostClass, OpKind, TensorAlloc
from tests.conftest import make_hw


def spans_of(result):
    return [(r.name, round(r.start_s, 9), round(r.end_s, 9)) for r in result.spans.sort_values("start_s").itertuples()]


def test_stream_order_and_fixed_durations(toy_hw):
    """Two kernels on one stream run back to back: [0,1] then [1,3]."""
    b = GraphBuilder()
    b.add("a", OpKind.COMPUTE, "compute", fixed_duration_s=1.0)
    b.add("b", OpKind.COMPUTE, "compute", fixed_duration_s=2.0)
    r = simulate_graph(b.build(), toy_hw, steps=1)
    assert spans_of(r) == [("a", 0.0, 1.0), ("b", 1.0, 3.0)]
    assert r.summary["step_time_s"] == pytest.approx(3.0)


def test_launch_bound_kernels():
    """Host launches cost 5 us each; 1 us kernels start when launched: ends at 6, 11, 16 us."""
    hw = make_hw(launch_s=5e-6)
    b = GraphBuilder()
    for i in range(3):
        b.add(f"k{i}", OpKind.COMPUTE, "compute", fixed_duration_s=1e-6)
    r = simulate_graph(b.build(), hw, steps=1)
    assert [e for _, _, e in spans_of(r)] == pytest.approx([6e-6, 11e-6, 16e-6])


def test_roofline_gemm_and_memory_bound():
    """GEMM 2e12 FLOP at 1 PFLOP/s = 2 ms; elementwise 1 GB moved at 1 TB/s = 1 ms."""
    b = GraphBuilder()
    b.add("gemm", OpKind.COMPUTE, "compute", cost_class=CostClass.GEMM, flops=2e12, shape=(1000, 1000, 1000000))
    b.add("add", OpKind.COMPUTE, "compute", cost_class=CostClass.ELEMENTWISE, bytes_read=0.5e9, bytes_written=0.5e9)
    r = simulate_graph(b.build(), make_hw(), steps=1)
    assert spans_of(r) == [("gemm", 0.0, 0.002), ("add", 0.002, 0.003)]


def test_copy_then_dependent_kernel():
    """A 1 GB H2D copy at 1 GB/s ends at 1 s; the kernel that needs it runs [1, 1.5]."""
    b = GraphBuilder()
    c = b.add("copy", OpKind.MEMCPY_H2D, "h2d", bytes_read=1e9)
    b.add("k", OpKind.COMPUTE, "compute", deps=[c], fixed_duration_s=0.5)
    r = simulate_graph(b.build(), make_hw(), steps=1)
    assert spans_of(r) == [("copy", 0.0, 1.0), ("k", 1.0, 1.5)]


def test_pcie_is_shared_max_min_fair():
    """An H2D and a D2H copy of 1 GB each share a 1 GB/s duplex limit: both end at 2 s."""
    b = GraphBuilder()
    b.add("up", OpKind.MEMCPY_H2D, "h2d", bytes_read=1e9)
    b.add("down", OpKind.MEMCPY_D2H, "d2h", bytes_read=1e9)
    r = simulate_graph(b.build(), make_hw(duplex=1e9), steps=1)
    assert sorted(e for _, _, e in spans_of(r)) == pytest.approx([2.0, 2.0])


def test_memory_lifetimes_and_peak():
    """a allocates 100 B used by b; b allocates 50 B used by nobody: peak 150 B, all freed."""
    b = GraphBuilder()
    b.add("a", OpKind.COMPUTE, "compute", fixed_duration_s=1.0, allocs=(TensorAlloc("x", 100),))
    b.add("b", OpKind.COMPUTE, "compute", fixed_duration_s=1.0, allocs=(TensorAlloc("y", 50),), uses=("x",))
    b.add("c", OpKind.COMPUTE, "compute", fixed_duration_s=1.0, allocs=(TensorAlloc("z", 10),))
    b.persistent("params.w", 1000)
    r = simulate_graph(b.build(), make_hw(), steps=2)
    assert r.summary["peak_memory_bytes"] == 1150
    mem = r.counters[r.counters.metric == "memory_bytes"]
    assert mem.value.iloc[-1] == 1000  # only the persistent tensor remains


def test_out_of_memory_is_a_result_not_a_crash():
    """200 B of activations on a 150 B GPU: the run finishes and names the tensor and shortfall."""
    b = GraphBuilder()
    b.add("a", OpKind.COMPUTE, "compute", fixed_duration_s=1.0, allocs=(TensorAlloc("act.big", 200),))
    r = simulate_graph(b.build(), make_hw(gpu_mem=150), steps=1)
    assert not r.ok
    assert "act.big" in r.summary["oom"] and "exceeds the capacity" in r.summary["oom"] and "by 0.00 GB" in r.summary["oom"]


def test_previous_step_dependency():
    """An op waiting on the previous step's op (delayed update) cannot start before it ends."""
    b = GraphBuilder()
    b.add("gpu", OpKind.COMPUTE, "compute", fixed_duration_s=1.0)
    b.add("cpu", OpKind.HOST, "cpu.worker", host_s=3.0, deps=[0], launch=False)
    b.add("gpu2", OpKind.COMPUTE, "compute", fixed_duration_s=1.0, meta={"prev_step_deps": (1,)})
    r = simulate_graph(b.build(), make_hw(), steps=2)
    s = r.spans
    step1_gpu2 = s[(s.step == 1) & (s.name == "gpu2")].iloc[0]
    assert step1_gpu2.start_s == pytest.approx(4.0)  # step 0's cpu op ends at 1 + 3 = 4
