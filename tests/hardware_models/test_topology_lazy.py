"""The lazily built topology (template node, nodes built when queried) answers what the complete graph answers."""

from __future__ import annotations

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hardware_models.collective_flows import port_capacities
from hardware_models.host_links import uplink_share
from hardware_models.topology import _WEIGHT, ClusterSpec, Topology, TopologyError, build_topology, load_network

#: (cluster, nodes, network): rail (8 leaves + spine), fat tree of 2 nodes per leaf with a half-full last leaf
CASES = [("dgx-h100", 5, "ib-ndr-rail"), ("dgx-a100", 5, "ib-hdr"), ("dgx-h100", 1, None)]


def full_search(g: nx.DiGraph, src: str, dst: str, net_only: bool = False) -> list[str]:
    """The route search of the module docstring over the complete graph (no transit through another GPU)."""
    def weight(u, v, d):
        if v != dst and g.nodes[v].get("kind") == "gpu":
            return None
        return None if net_only and d["tier"] != "net" else _WEIGHT[d["tier"]]

    return nx.dijkstra_path(g, src, dst, weight=weight)


def reference_route(topo: Topology, g: nx.DiGraph, src: str, dst: str) -> tuple[str, ...]:
    """Route by searching ``g``: cross-node GPU pairs leave and enter through NIC ``local % nics``."""
    a, b = g.nodes[src], g.nodes[dst]
    if src == dst:
        return ()
    if a.get("kind") == b.get("kind") == "gpu" and a["node"] != b["node"]:
        nics = topo.cluster.nics_per_node
        na, nb = f"n{a['node']}.nic{a['local'] % nics}", f"n{b['node']}.nic{b['local'] % nics}"
        path = full_search(g, src, na)[:-1] + full_search(g, na, nb, net_only=True)[:-1] + full_search(g, nb, dst)
    else:
        path = full_search(g, src, dst)
    return tuple(g.edges[u, v]["name"] for u, v in zip(path, path[1:]))


def answer(f, *args):
    """``f(*args)``, or "no route" where it finds none (a CPU to an NVSwitch: only through a GPU)."""
    try:
        return f(*args)
    except (TopologyError, nx.NetworkXNoPath):
        return "no route"


def per_node_graph(topo: Topology) -> nx.DiGraph:
    """Every node built by ``_build_node(k)`` itself (what the template copies must equal)."""
    ref = object.__new__(type(topo))
    ref.cluster, ref._ready, ref._g = topo.cluster, False, nx.DiGraph()
    for k in range(topo.nodes):
        ref._build_node(k)
    return ref._g


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(CASES), picks=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 40)), min_size=2,
                                                    max_size=6), leaf=st.integers(0, 7))
def test_lazy_topology_answers_as_the_full_graph(case, picks, leaf):
    cluster, nodes, network = case
    lazy = build_topology(cluster, nodes=nodes, network=network)  # queried first: only what it touches is built
    full = build_topology(cluster, nodes=nodes, network=network).graph
    local = sorted(v[3:] for v in full if v.startswith("n0."))
    devs = [f"n{k % nodes}.{local[i % len(local)]}" for k, i in picks]
    leaves = sorted(v for v in full if not v.startswith("n"))
    if leaves:
        devs.append(leaves[leaf % len(leaves)])
    for src in devs:
        assert lazy.kind(src) == full.nodes[src].get("kind")
        assert lazy.out_links(src) == list(full.adj[src].items())
        for v, d in full.adj[src].items():
            assert lazy.link(f"{src}->{v}") == d
        for dst in devs:
            assert answer(lazy.route, src, dst) == answer(reference_route, lazy, full, src, dst), (src, dst)
    assert lazy.tiers() == {d["tier"] for _, _, d in full.edges(data=True)}
    assert lazy.capacities() == {d["name"]: d["capacity_bytes_per_s"] for _, _, d in full.edges(data=True)}
    ref = per_node_graph(lazy)  # template copies = nodes built one by one, same adjacency order
    assert [(u, list(ref.adj[u].items())) for u in ref] == [(u, [(v, d) for v, d in full.adj[u].items() if v in ref])
                                                           for u in ref]
    assert all(full.nodes[u] == ref.nodes[u] for u in ref)


def test_a_large_cluster_builds_only_the_nodes_queried():
    """4,096 nodes: a route to node 1,777, its ports and PCIe uplink, with throttled NICs, touch 2 nodes."""
    topo = build_topology("dgx-h100", nodes=4096, network="ib-ndr-rail", network_overrides={"nic_bytes_per_s": 10e9})
    rank = 1777 * 8 + 3
    route = topo.rank_route(0, rank)
    assert route == ("n0.gpu0->n0.pcie0", "n0.pcie0->n0.nic0", "n0.nic0->leaf0", "leaf0->spine0", "spine0->leaf3",
                     "leaf3->n1777.nic3", "n1777.nic3->n1777.pcie1", "n1777.pcie1->n1777.gpu3")
    assert topo.link("n1777.nic3->leaf3")["capacity_bytes_per_s"] == 10e9
    assert topo.link("leaf3->spine0")["capacity_bytes_per_s"] == 4096 * 10e9  # rail: every node's NIC, 1:1
    per_node = len(topo._local)
    assert len(topo._lazy) == per_node + 8 + 1  # routes and link lookups build no node: node 0, 8 leaves, the spine
    assert port_capacities(topo, rank) == {"nvlink.tx": 450e9, "nvlink.rx": 450e9, "nic.tx": 10e9, "nic.rx": 10e9}
    share = uplink_share(topo, rank, range(rank - 3, rank + 5))
    assert (share.uplink, share.sharers) == ("n1777.pcie1->n1777.cpu0", 2)
    assert len(topo._lazy) == 2 * per_node + 8 + 1  # nodes 0 and 1,777, 8 rail leaves, the spine
    with pytest.raises(TopologyError, match="does not exist: 'n4096.gpu0'"):
        topo.route("n0.gpu0", "n4096.gpu0")
    with pytest.raises(KeyError):
        topo.link("n1777.gpu3->n1776.gpu3")


def tiny_pcie(**kw) -> ClusterSpec:
    """4 GPUs on 2 sockets' root ports (GPUs 0-1 and NIC 0 on socket 0, GPUs 2-3 and NIC 1 on socket 1)."""
    base = dict(name="tiny", gpu="x", gpus_per_node=4, intra="pcie", pcie_bytes_per_s=10e9, sockets=2,
                inter_socket_bytes_per_s=5e9, host_memory_bytes_per_s=100e9, collective_profile="x", nics_per_node=2)
    return ClusterSpec(**{**base, **kw})


def cut(*pairs):
    """A Topology whose template node lacks the links ``pairs`` (both directions)."""
    class Cut(Topology):
        def _build_node(self, k):
            super()._build_node(k)
            self.graph.remove_edges_from([e for u, v in pairs for e in ((u, v), (v, u))])

    return Cut


def test_disconnected_custom_topologies_are_refused():
    net = load_network("ib-ndr-rail")
    # GPU 3 hangs off nothing: refused on one node and on several
    for nodes in (1, 3):
        with pytest.raises(TopologyError, match="tiny x %d is disconnected: n0.gpu3 cannot be reached" % nodes):
            cut(("n0.gpu3", "n0.cpu1"))(tiny_pcie(), nodes, net)
    # the node's NICs cut off: node 0 is whole, but no other node can be reached from it
    with pytest.raises(TopologyError, match="disconnected: n1.gpu0 cannot be reached from n0.gpu0"):
        cut(("n0.nic0", "n0.cpu0"), ("n0.nic1", "n0.cpu1"))(tiny_pcie(), 2, net)
    # sockets not joined: one node is split in two ...
    split = cut(("n0.cpu0", "n0.cpu1"))
    with pytest.raises(TopologyError, match="tiny x 1 is disconnected: n0.gpu2 cannot be reached"):
        split(tiny_pcie(), 1, net)
    # ... but on several nodes each half has a NIC, so the network joins the halves: built, routed over the network
    topo = split(tiny_pcie(), 3, net)
    g = split(tiny_pcie(), 3, net).graph
    assert topo.route("n1.gpu0", "n1.gpu2") == reference_route(topo, g, "n1.gpu0", "n1.gpu2")
    assert "leaf0->spine0" in topo.route("n1.gpu0", "n1.gpu2")
    assert topo.rank_route(0, 6) == reference_route(topo, g, "n0.gpu0", "n1.gpu2")
