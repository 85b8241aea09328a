"""Topology graph: structure, routes, presets, bad input."""

from __future__ import annotations

import dataclasses

import pytest

from hardware_models import presets
from hardware_models.presets import PresetError
from hardware_models.topology import (ClusterSpec, Topology, TopologyError, build_topology,
                                      load_cluster, load_network)


def tiny(intra="nvswitch", gpus=4, **kw) -> ClusterSpec:
    base = dict(name="tiny", gpu="x", gpus_per_node=gpus, intra=intra, pcie_bytes_per_s=10e9, sockets=2,
                inter_socket_bytes_per_s=5e9, host_memory_bytes_per_s=100e9, collective_profile="x",
                nvlink_bytes_per_s=0.0 if intra == "pcie" else 100e9)
    base.update(kw)
    return ClusterSpec(**base)


def test_every_preset_builds_connected():
    for name in presets.list_presets("clusters")["clusters"]:
        spec = load_cluster(name)
        nodes = 2 if spec.nics_per_node else 1
        t = build_topology(name, nodes=nodes)
        assert t.world_size == nodes * spec.gpus_per_node, name


def test_nvswitch_route_is_two_nvlink_hops():
    t = build_topology("dgx-h100")
    assert t.rank_route(0, 5) == ("n0.gpu0->n0.nvswitch", "n0.nvswitch->n0.gpu5")
    assert t.link("n0.gpu0->n0.nvswitch")["capacity_bytes_per_s"] == 450e9


def test_rail_route_keeps_the_rail_and_nic_sits_on_gpu_pcie_switch():
    t = build_topology("dgx-h100", nodes=2)
    r = t.rank_route(3, 11)
    assert r == ("n0.gpu3->n0.pcie1", "n0.pcie1->n0.nic3", "n0.nic3->leaf3", "leaf3->n1.nic3",
                 "n1.nic3->n1.pcie1", "n1.pcie1->n1.gpu3")
    assert t.rank_route(3, 11) is r  # cached


def test_cross_rail_goes_over_the_spine():
    t = build_topology("dgx-h100", nodes=2)
    assert "leaf0->spine0" in t.rank_route(0, 9)


def test_pcie_only_route_crosses_sockets():
    t = Topology(tiny("pcie"))
    assert t.rank_route(1, 2) == ("n0.gpu1->n0.cpu0", "n0.cpu0->n0.cpu1", "n0.cpu1->n0.gpu2")


def test_bridge_pairs_use_nvlink():
    t = Topology(tiny("nvlink_bridge"))
    assert t.rank_route(0, 1) == ("n0.gpu0->n0.gpu1",)
    assert t.rank_route(2, 3) == ("n0.gpu2->n0.gpu3",)


def test_fat_tree_oversubscription_on_uplinks():
    t = build_topology("dgx-a100", nodes=4, network_overrides={"oversubscription": 2})
    up = t.link("leaf0->spine0")["capacity_bytes_per_s"]
    assert up == pytest.approx(2 * 8 * 25e9 / 2)  # 2 nodes x 8 HDR ports / 2


def test_capacities_feed_fluid_network():
    import simpy

    from hardware_models.fabrics import FluidNetwork

    t = build_topology("dgx-h100")
    FluidNetwork(simpy.Environment(), t.capacities())
    assert len(t.capacities()) == t.graph.number_of_edges()


@pytest.mark.parametrize("kw,msg", [
    (dict(nvlink_bytes_per_s=0.0), "nvlink_bytes_per_s must be > 0"),
    (dict(pcie_bytes_per_s=-1.0), "pcie_bytes_per_s must be > 0"),
    (dict(intra="torus"), "intra must be one of"),
    (dict(nvls=True, intra="pcie", nvlink_bytes_per_s=0.0), "nvls"),
])
def test_bad_cluster_spec(kw, msg):
    with pytest.raises(ValueError, match=msg):
        tiny(**kw)


def test_bad_inputs_name_the_key():
    with pytest.raises(PresetError, match="unknown cluster preset 'nope'"):
        load_cluster("nope")
    with pytest.raises(PresetError, match="clusters/dgx-h100: nvlink_bytes_per_s must be > 0"):
        load_cluster("dgx-h100", {"nvlink_bytes_per_s": 0})
    with pytest.raises(PresetError, match="unknown key"):
        load_network("ib-ndr-rail", {"bogus": 1})
    with pytest.raises(TopologyError, match="no NICs"):
        build_topology("4x-a100-pcie", nodes=2)
    with pytest.raises(TopologyError, match="outside the world"):
        build_topology("dgx-h100").gpu(8)
    with pytest.raises(TopologyError, match="does not exist"):
        build_topology("dgx-h100").route("n0.gpu0", "n3.gpu0")


def test_disconnected_topology_is_refused():
    # a node whose GPUs hang off no switch and no CPU: sockets present, but pcie attach removed
    class Broken(Topology):
        def _build_node(self, k):
            super()._build_node(k)
            self.graph.remove_edges_from([("n0.gpu3", "n0.cpu1"), ("n0.cpu1", "n0.gpu3")])

    with pytest.raises(TopologyError, match="disconnected: n0.gpu3"):
        Broken(tiny("pcie"))


def test_specs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        load_cluster("dgx-h100").gpus_per_node = 4


def test_structural_routes_equal_the_graph_search():
    """Routes built from node 0's paths and the leaf/spine wiring equal a full search for every GPU pair."""
    for cluster, network in (("dgx-h100", "ib-ndr-rail"), ("dgx-a100", "ib-hdr")):
        topo = build_topology(cluster, nodes=3, network=network)
        n = topo.world_size
        for a in range(n):
            for b in range(n):
                if a == b:
                    continue
                fast = topo.rank_route(a, b)
                ga, gb = topo.gpu(a), topo.gpu(b)
                nics = topo.cluster.nics_per_node
                if topo.node_of(a) != topo.node_of(b):
                    la, lb = a % topo.gpus_per_node % nics, b % topo.gpus_per_node % nics
                    na, nb = f"n{topo.node_of(a)}.nic{la}", f"n{topo.node_of(b)}.nic{lb}"
                    path = topo._path(ga, na)[:-1] + topo._path(na, nb, net_only=True)[:-1] + topo._path(nb, gb)
                else:
                    path = topo._path(ga, gb)
                slow = tuple(topo.graph.edges[u, v]["name"] for u, v in zip(path, path[1:]))
                assert fast == slow, (cluster, a, b)


def test_more_nodes_than_the_limit_are_refused_in_one_line():
    from hardware_models.topology import MAX_NODES

    with pytest.raises(TopologyError, match="above the 4,096 nodes"):
        build_topology("dgx-h100", nodes=MAX_NODES + 1, network="ib-ndr-rail")
