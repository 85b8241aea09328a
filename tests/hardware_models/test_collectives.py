"""Collective cost model and flow primitive: hand-worked cases, properties, bad input."""

from __future__ import annotations

import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from hardware_models.collective_flows import CollectiveFlows
from hardware_models.collectives import (CollectiveError, CollectiveModel, CollectiveProfile, NcclConfig,
                                         bus_factor, load_collective_profile)
from hardware_models.topology import ClusterSpec, Topology, build_topology

RING = NcclConfig(algo="ring", proto="simple")


def tiny(intra="nvswitch", gpus=4, nvlink=100e9, **kw) -> ClusterSpec:
    base = dict(name="tiny", gpu="x", gpus_per_node=gpus, intra=intra, pcie_bytes_per_s=10e9, sockets=2,
                inter_socket_bytes_per_s=5e9, host_memory_bytes_per_s=100e9, collective_profile="x",
                nvlink_bytes_per_s=0.0 if intra == "pcie" else nvlink)
    base.update(kw)
    return ClusterSpec(**base)


def prof(**kw) -> CollectiveProfile:
    tiers = {"nvlink": 1.0, "pcie": 1.0, "host": 1.0}
    base = dict(name="p", host_dispatch_s=30e-6, ring_efficiency=dict(tiers), p2p_efficiency=dict(tiers),
                p2p_latency_s={"nvlink": 0.0, "pcie": 0.0, "host": 0.0}, simple_base_s=10e-6,
                simple_step_s={"nvlink": 2e-6})
    base.update(kw)
    return CollectiveProfile(**base)


def test_four_rank_ring_all_reduce_by_hand():
    # alpha = 10 us + 2(n-1) = 6 steps x 2 us = 22 us; beta: 2(n-1)/n x S / 100 GB/s
    m = CollectiveModel(Topology(tiny()), prof())
    r = m.price("all_reduce", [0, 1, 2, 3], 400_000_000, RING)
    assert r.latency_s == pytest.approx(22e-6)
    assert r.time_s == pytest.approx(22e-6 + 1.5 * 4e8 / 100e9)
    assert r.busbw_bytes_per_s == pytest.approx(r.algbw_bytes_per_s * 1.5)
    assert r.eager_time_s == r.time_s and r.host_dispatch_s == 30e-6
    assert (r.algorithm, r.protocol) == ("Ring", "Simple")


def test_ring_over_pcie_counts_shared_socket_link():
    # 4 GPUs, 2 per socket: the ring 0-1-2-3-0 crosses the 5 GB/s socket link once each way
    m = CollectiveModel(Topology(tiny("pcie")), prof())
    b, tier, _ = m.ring_bandwidth((0, 1, 2, 3))
    assert (b, tier) == (5e9, "host")


def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert bus_factor("all_gather", 8) == bus_factor("reduce_scatter", 8) == pytest.approx(7 / 8)
    assert bus_factor("broadcast", 8) == bus_factor("send_recv", 2) == 1.0


def test_two_flows_on_one_link_share_it():
    env = simpy.Environment()
    f = CollectiveFlows(env, CollectiveModel(Topology(tiny("nvlink_bridge", gpus=2)), prof()))
    ends = []

    def member(rv, rank):
        t = yield rv.arrive(rank)
        ends.append(t)

    for _ in range(2):
        rv = f.collective("send_recv", [0, 1], 1e9)
        env.process(member(rv, 0))
        env.process(member(rv, 1))
    env.run()
    assert ends == pytest.approx([0.02] * 4)  # 2 GB over one 100 GB/s link; alone it takes 0.01 s


def test_collective_waits_for_late_member():
    env = simpy.Environment()
    f = CollectiveFlows(env, CollectiveModel(Topology(tiny()), prof()))
    rv = f.collective("all_reduce", [0, 1, 2, 3], 4e8, RING)

    def member(rank, delay):
        yield env.timeout(delay)
        yield rv.arrive(rank)

    for rank, d in ((0, 0.0), (1, 0.0), (2, 1.0), (3, 5.0)):
        env.process(member(rank, d))
    env.run()
    assert rv.start_s == 5.0
    assert rv.done.value == pytest.approx(5.0 + 22e-6 + 1.5 * 4e8 / 100e9)


def test_flow_primitive_matches_priced_model_alone():
    env = simpy.Environment()
    m = CollectiveModel(build_topology("dgx-a100", nodes=2), load_collective_profile("dgx-a100"))
    f = CollectiveFlows(env, m)
    rv = f.collective("all_reduce", list(range(16)), 2**30, RING)
    for r in range(16):
        rv.arrive(r)
    env.run()
    priced = m.price("all_reduce", list(range(16)), 2**30, RING)
    assert rv.done.value == pytest.approx(priced.time_s, rel=1e-6)


@settings(max_examples=30, deadline=None)
@given(b1=st.floats(1e9, 1e12), k=st.floats(1.0, 10.0), s=st.integers(1, 2**31),
       op=st.sampled_from(["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"]))
def test_more_bandwidth_is_never_slower(b1, k, s, op):
    p = prof()
    t1 = CollectiveModel(Topology(tiny(nvlink=b1)), p).price(op, [0, 1, 2, 3], s).time_s
    t2 = CollectiveModel(Topology(tiny(nvlink=b1 * k)), p).price(op, [0, 1, 2, 3], s).time_s
    assert t2 <= t1 * (1 + 1e-12)


@settings(max_examples=25, deadline=None)
@given(arrivals=st.lists(st.floats(0, 10), min_size=4, max_size=4), s=st.integers(0, 2**30),
       op=st.sampled_from(["all_reduce", "all_to_all", "all_gather"]))
def test_never_ends_before_last_arrival_and_bytes_conserved(arrivals, s, op):
    env = simpy.Environment()
    f = CollectiveFlows(env, CollectiveModel(Topology(tiny("pcie")), prof()))
    rv = f.collective(op, [0, 1, 2, 3], s)

    def member(rank, d):
        yield env.timeout(d)
        yield rv.arrive(rank)

    for r, d in enumerate(arrivals):
        env.process(member(r, d))
    env.run()
    assert rv.done.value >= max(arrivals)
    expect: dict[str, float] = {}
    for b, links in f.flows(rv):
        for link in links:
            expect[link] = expect.get(link, 0.0) + b
    for link, carried in f.net.bytes_carried.items():
        assert carried == pytest.approx(expect.get(link, 0.0), abs=1e-6)


def test_same_inputs_same_result():
    m = CollectiveModel(build_topology("dgx-h100"), load_collective_profile("dgx-h100"))
    assert m.price("all_reduce", list(range(8)), 2**25) == m.price("all_reduce", list(range(8)), 2**25)


def test_tuner_picks_nvls_for_large_ring_for_medium():
    m = CollectiveModel(build_topology("dgx-h100"), load_collective_profile("dgx-h100"))
    assert m.price("all_reduce", list(range(8)), 2**30).algorithm == "NVLS"
    assert m.price("all_reduce", list(range(8)), 2**25).algorithm == "Ring"
    assert m.price("all_reduce", list(range(8)), 2**30, NcclConfig(nvls_enable=False)).algorithm != "NVLS"


@pytest.mark.parametrize("ranks,nccl,msg", [
    ([0, 8], None, "outside the world"),
    ([0, 0], None, "twice"),
    ([], None, "empty"),
    ([0, 1], NcclConfig(algo="nvls"), "NVSwitch with in-switch reduction"),
])
def test_bad_groups_and_overrides(ranks, nccl, msg):
    m = CollectiveModel(build_topology("dgx-a100"), load_collective_profile("dgx-a100"))
    with pytest.raises(CollectiveError, match=msg):
        m.price("all_reduce", ranks, 1024, nccl)


def test_bad_override_names():
    with pytest.raises(CollectiveError, match="nccl.algo"):
        NcclConfig(algo="collnet")
    with pytest.raises(CollectiveError, match="nccl.proto"):
        NcclConfig(proto="fast")
    with pytest.raises(CollectiveError, match="nchannels"):
        NcclConfig(nchannels=0)
    with pytest.raises(ValueError, match="ring_efficiency.nvlink must be in"):
        prof(ring_efficiency={"nvlink": 0.0, "pcie": 1.0, "host": 1.0})


def test_nchannels_caps_bus_bandwidth():
    m = CollectiveModel(build_topology("dgx-h100"), load_collective_profile("dgx-h100"))
    r = m.price("all_reduce", list(range(8)), 2**30, NcclConfig(algo="ring", proto="simple", nchannels=4))
    assert r.busbw_bytes_per_s < 4 * 20.6e9
