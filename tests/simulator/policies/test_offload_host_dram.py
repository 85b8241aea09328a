"""The host DRAM one rank's CPU step and its GPU's DMA copies share (``OffloadSummary``, link ``host.dram``).

Hand-worked: a host whose sustained DRAM bandwidth is 2 GB/s (one node), a 1 GB/s PCIe link per direction
(tests.conftest.make_hw, no copy latency, no launch cost). A CPU op of 2 s alone streaming 4 GB (2 GB/s on
average) and a 1 GB D2H copy start together. Max-min on host.dram (2 GB/s): both flows rise to 1 GB/s, where
the link saturates (and the copy meets its PCIe rate): the copy ends at 1 s, the CPU op has 3 GB left and
finishes them at 2 GB/s: 2.5 s (2 s alone).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from hardware_models.host import HostCpuSpec
from hardware_models.host_kernels import host_dram_share
from simulator.engine.run import run_graph
from simulator.graph.op_graph import GraphBuilder
from simulator.graph.ops import OpKind, Phase
from simulator.policies.offload_optimizer import HOST_DRAM_LINK, OffloadSummary
from simulator.policies.registry import Runtime
from tests.conftest import make_hw

CFG = SimpleNamespace(parallelism=SimpleNamespace(data_parallel_size=1),
                      zero_optimization=SimpleNamespace(offload_optimizer=SimpleNamespace(pin_memory=True)))
HOST = HostCpuSpec("toy-host", 4, 1e10, stream_bandwidth_bytes_per_s=2e9)


def _run(with_copy: bool, dram_bytes: float = 4e9):
    hw = dataclasses.replace(make_hw(), host_cpu=HOST)
    b = GraphBuilder()
    if with_copy:
        b.add("offload.d2h.grad", OpKind.MEMCPY_D2H, "d2h", phase=Phase.BWD, bytes_read=1e9, pinned=True)
    meta = {"dram_bytes": dram_bytes} if dram_bytes else {}
    b.add("cpu.adam", OpKind.HOST, "host", phase=Phase.OPT, host_s=2.0, launch=False, meta=meta)
    rec, _ = run_graph(b.build(samples_per_step=1.0), hw, steps=1,
                       attach=lambda env, s: Runtime([OffloadSummary(CFG, hw, env, s)]))
    spans = rec.spans
    return {n: (float(spans[spans.name == n].start_s.iloc[0]), float(spans[spans.name == n].end_s.iloc[0]))
            for n in spans.name}


def test_cpu_op_alone_takes_its_host_time():
    assert _run(False)["cpu.adam"] == pytest.approx((0.0, 2.0), rel=1e-12)


def test_copy_takes_half_the_dram_by_hand():
    t = _run(True)
    assert t["offload.d2h.grad"][1] == pytest.approx(1.0, rel=1e-12)
    assert t["cpu.adam"][1] == pytest.approx(2.5, rel=1e-12)


def test_host_op_without_dram_bytes_is_not_slowed():
    """A host op with no DRAM stream (no ``dram_bytes``) keeps its ``host_s`` beside a copy."""
    assert _run(True, dram_bytes=0.0)["cpu.adam"][1] == pytest.approx(2.0, rel=1e-12)


def test_dram_share_by_hand():
    two = HostCpuSpec("2s", 16, 1e10, sockets=2, stream_bandwidth_bytes_per_s=40e9)
    assert host_dram_share(two, 1, 1) == 20e9  # pinned on one node
    assert host_dram_share(two, 1) == 40e9  # spread over both
    assert host_dram_share(two, 8) == 5e9  # 4 ranks per node
    assert host_dram_share(two, 2) == 20e9  # one rank per node
    assert HOST_DRAM_LINK == "host.dram"


def test_ranks_bound_to_one_numa_node_share_it_by_hand():
    """``numa_node`` on a shared host (``numactl --cpunodebind=0 --membind=0`` around the launcher): every rank runs
    and allocates on that node, so 8 ranks split one socket's 20 GB/s and its 8 cores, where unbound they spread
    4 per node (5 GB/s each) over both sockets' 16 cores. Before, the binding was ignored with several ranks."""
    from hardware_models.host_kernels import shared_stream_bandwidth
    from simulator.policies.offload_optimizer import cpu_threads, oversubscribed_threads

    two = HostCpuSpec("2s", 16, 1e10, sockets=2, stream_bandwidth_bytes_per_s=40e9, per_core_bandwidth_bytes_per_s=10e9)
    bound = dataclasses.replace(two, numa_node=0)
    assert host_dram_share(bound, 8) == 2.5e9 and host_dram_share(two, 8) == 5e9
    assert shared_stream_bandwidth(bound, 8, threads=1) == 2.5e9 and shared_stream_bandwidth(two, 8, threads=1) == 5e9
    assert cpu_threads(SimpleNamespace(host_cpu=bound), ranks=8) == 1
    assert cpu_threads(SimpleNamespace(host_cpu=two), ranks=8) == 2
    assert "on the 8 cores of NUMA node 0" in oversubscribed_threads(
        SimpleNamespace(host_cpu=dataclasses.replace(bound, threads_used=2)), 8)
    assert oversubscribed_threads(SimpleNamespace(host_cpu=dataclasses.replace(two, threads_used=2)), 8) is None
