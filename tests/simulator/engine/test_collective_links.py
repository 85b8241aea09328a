"""Collectives as flows over a simulated rank's links (NVLink port, NIC rail, the GPU's PCIe link): concurrent
collectives, pipeline sends and offload copies share them max-min fairly; alone each takes its NCCL time.

Hand-worked on toy clusters where every collective alone takes ``latency + bus bytes / rate`` (``_Rate``), so
the sharing is the only thing tested; then hypothesis properties."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hardware_models.collectives import CollectiveModel, NcclConfig, bus_factor
from hardware_models.topology import NetworkSpec, Topology
from simulator.engine.run import run_graph, run_ranks
from simulator.graph.op_graph import GraphBuilder
from simulator.graph.ops import OpKind
from tests.conftest import make_hw
from tests.hardware_models.test_collectives import prof, tiny

MB = 1_000_000


class _Rate(CollectiveModel):
    """The real topology and routes (so the real link loads); every collective alone takes
    ``latency_s + bus bytes / rate`` (send/recv: bytes / rate)."""

    def __init__(self, topo, rate: float, latency_s: float = 0.0):
        super().__init__(topo, prof(host_dispatch_s=0.0, ring_efficiency={"nvlink": 1.0, "pcie": 1.0, "host": 1.0},
                                    p2p_efficiency={"nvlink": 1.0, "pcie": 1.0, "host": 1.0}))
        self.rate, self.lat = rate, latency_s

    def price(self, op, ranks, nbytes, nccl=None):
        n = len(ranks)
        bus = nbytes * bus_factor(op, n) if op not in ("broadcast", "reduce") else nbytes
        return SimpleNamespace(time_s=self.lat + bus / self.rate, latency_s=self.lat, busbw_bytes_per_s=self.rate,
                               algorithm="P2P" if op in ("send_recv", "all_to_all") else "Ring")


def _net(nic=100e9) -> NetworkSpec:
    return NetworkSpec(name="toy-net", kind="rail", nic_bytes_per_s=nic)


def _hw(model, *, pcie=1e12, duplex=0.0, **groups):
    hw = make_hw(pcie_bw=pcie, duplex=duplex)
    # the profile's copy rates (``pcie``) measured on the cluster's own GPU link: not scaled (Hardware.copy)
    hw = dataclasses.replace(hw, pcie=dataclasses.replace(hw.pcie, bandwidth_bytes_per_s=model.topo.cluster.pcie_bytes_per_s))
    return dataclasses.replace(hw, collectives=model, world_size=model.topo.world_size,
                               nccl=NcclConfig(interference=False), **groups)


def _coll(b, name, op, nbytes, group, stream, **meta):
    return b.add(name, OpKind.COLLECTIVE, stream, meta={"collective": op, "bytes": int(nbytes), "group": group, **meta})


def _spans(rec):
    return {r.name: (r.start_s, r.end_s) for r in rec.spans.itertuples()}


def test_tp_and_dp_all_reduce_share_one_nvlink_port():
    # 4 GPUs on a 100 GB/s NVSwitch port; each all-reduce alone moves at 80 GB/s (bus bytes = S for 2 ranks).
    # TP (0,1) 80 MB: 1 ms alone; DP (0,2) 160 MB: 2 ms alone. Together: 50 GB/s each on tx and rx until TP ends
    # at 80 / 50 = 1.6 ms (+10 us latency); DP then has 80 MB left at 80 GB/s: 1 ms more -> 2.6 ms.
    model = _Rate(Topology(tiny(nvlink=100e9)), rate=80e9, latency_s=10e-6)
    b = GraphBuilder()
    _coll(b, "tp", "all_reduce", 80 * MB, "tp", "comm.tp")
    _coll(b, "dp", "all_reduce", 160 * MB, "dp", "comm.dp")
    rec, _ = run_graph(b.build(samples_per_step=1.0), _hw(model, tp_group=(0, 1), dp_group=(0, 2)), steps=1)
    s = _spans(rec)
    assert s["tp"] == (0.0, pytest.approx(10e-6 + 1.6e-3, rel=1e-12))
    assert s["dp"] == (0.0, pytest.approx(10e-6 + 2.6e-3, rel=1e-12))


def test_each_alone_keeps_its_model_time():
    model = _Rate(Topology(tiny(nvlink=100e9)), rate=80e9, latency_s=10e-6)
    for name, group, nbytes in (("tp", "tp", 80 * MB), ("dp", "dp", 160 * MB)):
        b = GraphBuilder()
        _coll(b, name, "all_reduce", nbytes, group, "comm")
        rec, _ = run_graph(b.build(samples_per_step=1.0), _hw(model, tp_group=(0, 1), dp_group=(0, 2)), steps=1)
        assert _spans(rec)[name][1] == pytest.approx(10e-6 + nbytes / 80e9, rel=1e-12)


def test_pipeline_send_shares_the_nic_with_an_inter_node_dp_all_reduce():
    # 4 nodes x 1 GPU, one 100 GB/s NIC each. Stage 0 = rank 0 sends 80 MB to stage 1 = rank 1 while its DP
    # all-reduce over (0, 2) moves 80 MB each way (2 ranks: bus = S). Alone both take 10 us + 1 ms (80 GB/s).
    # On rank 0's NIC tx they get 50 GB/s each: both end at 10 us + 1.6 ms; the recv on stage 1 ends with the send.
    topo = Topology(tiny(gpus=1, nics_per_node=1), nodes=4, network=_net())
    model = _Rate(topo, rate=80e9, latency_s=10e-6)
    hw = _hw(model, dp_group=(0, 2), pp_group=(0, 1))
    pp = {"pp_ranks": (0, 1), "rendezvous": ("pp", "act", 0), "parties": 2}
    g0, g1 = GraphBuilder(), GraphBuilder()
    _coll(g0, "send", "send_recv", 80 * MB, "pp", "comm.pp", **pp)
    _coll(g0, "dp", "all_reduce", 80 * MB, "dp", "comm.dp")
    _coll(g1, "recv", "send_recv", 80 * MB, "pp", "comm.pp", **pp)
    (r0, _), (r1, _) = run_ranks([g0.build(samples_per_step=1.0), g1.build(samples_per_step=1.0)],
                                 [hw, hw.for_pipeline_rank(1)], steps=1)
    s0, s1 = _spans(r0), _spans(r1)
    assert s0["send"][1] == pytest.approx(10e-6 + 1.6e-3, rel=1e-12)
    assert s0["dp"][1] == pytest.approx(10e-6 + 1.6e-3, rel=1e-12)
    assert s1["recv"][1] == s0["send"][1]


def test_pipeline_send_alone_takes_its_model_time_on_both_stages():
    topo = Topology(tiny(gpus=1, nics_per_node=1), nodes=4, network=_net())
    hw = _hw(_Rate(topo, rate=80e9, latency_s=10e-6), dp_group=(0, 2), pp_group=(0, 1))
    pp = {"pp_ranks": (0, 1), "rendezvous": ("pp", "act", 0), "parties": 2}
    g0, g1 = GraphBuilder(), GraphBuilder()
    _coll(g0, "send", "send_recv", 80 * MB, "pp", "comm.pp", **pp)
    _coll(g1, "recv", "send_recv", 80 * MB, "pp", "comm.pp", **pp)
    (r0, _), (r1, _) = run_ranks([g0.build(samples_per_step=1.0), g1.build(samples_per_step=1.0)],
                                 [hw, hw.for_pipeline_rank(1)], steps=1)
    assert _spans(r0)["send"][1] == _spans(r1)["recv"][1] == pytest.approx(10e-6 + 1e-3, rel=1e-12)


def test_offload_copy_shares_the_gpus_pcie_link_with_gpudirect_traffic():
    # 2 nodes x 1 GPU; the GPU's PCIe link moves 10 GB/s each way (copy profile); its DP all-reduce over (0, 1)
    # goes GPU -> PCIe -> NIC (GPUDirect) at 8 GB/s alone: 8 MB, 1 ms. An 8 MB D2H copy (0.8 ms alone) starts
    # with it: on pcie.d2h both get 5 GB/s -> both end at 1.6 ms (the all-reduce's receive side is alone).
    topo = Topology(tiny(gpus=1, nics_per_node=1), nodes=2, network=_net())
    hw = _hw(_Rate(topo, rate=8e9), pcie=10e9, duplex=40e9, dp_group=(0, 1))
    b = GraphBuilder()
    _coll(b, "dp", "all_reduce", 8 * MB, "dp", "comm.dp")
    b.add("d2h", OpKind.MEMCPY_D2H, "copy.d2h", bytes_read=8 * MB)
    rec, _ = run_graph(b.build(samples_per_step=1.0), hw, steps=1)
    s = _spans(rec)
    assert s["dp"][1] == pytest.approx(1.6e-3, rel=1e-12)
    assert s["d2h"][1] == pytest.approx(1.6e-3, rel=1e-12)


def test_a_collective_that_does_not_fit_its_own_duplex_limit_keeps_its_time():
    # tx and rx at 8 GB/s each inside a 10 GB/s duplex limit: scaled to 5 GB/s each, the time stays 1 ms
    topo = Topology(tiny(gpus=1, nics_per_node=1), nodes=2, network=_net())
    hw = _hw(_Rate(topo, rate=8e9), pcie=10e9, duplex=10e9, dp_group=(0, 1))
    b = GraphBuilder()
    _coll(b, "dp", "all_reduce", 8 * MB, "dp", "comm.dp")
    rec, _ = run_graph(b.build(samples_per_step=1.0), hw, steps=1)
    assert _spans(rec)["dp"][1] == pytest.approx(1e-3, rel=1e-12)


def _mixed(sizes, copy_mb):
    b = GraphBuilder()
    for i, (group, mb) in enumerate(sizes):
        _coll(b, f"c{i}", "all_reduce", mb * MB, group, f"comm.{group}{i % 2}")
    if copy_mb:
        b.add("d2h", OpKind.MEMCPY_D2H, "copy.d2h", bytes_read=copy_mb * MB)
    return b.build(samples_per_step=1.0)


_SIZES = st.lists(st.tuples(st.sampled_from(["tp", "dp"]), st.integers(1, 200)), min_size=1, max_size=5)


def _run(graph, nvlink, nic, pcie, seed=0):
    # 2 nodes x 2 GPUs: TP (0, 1) over NVLink, DP (0, 2) over GPUDirect (PCIe + NIC)
    topo = Topology(tiny(gpus=2, nvlink=nvlink, nics_per_node=1), nodes=2, network=_net(nic))
    systems = []
    hw = _hw(_Rate(topo, rate=min(nvlink, nic, pcie) * 0.8, latency_s=5e-6), pcie=pcie, tp_group=(0, 1),
             dp_group=(0, 2))
    rec, _ = run_graph(graph, hw, steps=2, seed=seed, attach=lambda env, s: systems.append(s) or _NoRT())
    return rec, systems[0]


class _NoRT:
    components: list = []

    def hooks(self):
        return []

    def host_handlers(self):
        return {}


@settings(max_examples=30, deadline=None)
@given(sizes=_SIZES, copy_mb=st.integers(0, 100), k=st.floats(1.0, 4.0))
def test_more_link_bandwidth_is_never_slower(sizes, copy_mb, k):
    # the collectives' own rate stays; only the links they share get wider
    g = _mixed(sizes, copy_mb)
    topo_rate = 0.8 * 10e9
    base = _run_fixed(g, 20e9, 20e9, 10e9, topo_rate)
    wide = _run_fixed(g, 20e9 * k, 20e9 * k, 10e9 * k, topo_rate)
    assert wide.steps.end_s.iloc[-1] <= base.steps.end_s.iloc[-1] * (1 + 1e-9)


def _run_fixed(graph, nvlink, nic, pcie, rate):
    topo = Topology(tiny(gpus=2, nvlink=nvlink, nics_per_node=1), nodes=2, network=_net(nic))
    hw = _hw(_Rate(topo, rate=rate, latency_s=5e-6), pcie=pcie, tp_group=(0, 1), dp_group=(0, 2))
    return run_graph(graph, hw, steps=2)[0]


@settings(max_examples=30, deadline=None)
@given(sizes=_SIZES, copy_mb=st.integers(0, 100))
def test_bytes_are_conserved_on_every_link_and_runs_repeat(sizes, copy_mb):
    g = _mixed(sizes, copy_mb)
    rec, sys_ = _run(g, 20e9, 20e9, 10e9)
    expect = {k: 0.0 for k in sys_.network.capacities}
    for op in g.ops:
        if op.kind is OpKind.COLLECTIVE:
            for links, nbytes, _ in sys_.collective_flows(op)[0]:
                for link in links:
                    expect[link] += 2 * nbytes  # two steps
        else:
            for link in sys_.copy_links[op.kind]:
                expect[link] += 2 * op.bytes_read
    assert sys_.network.bytes_carried == pytest.approx(expect, rel=1e-12)
    again, _ = _run(g, 20e9, 20e9, 10e9)
    assert again.spans.equals(rec.spans)
