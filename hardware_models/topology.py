"""Cluster topology: a directed networkx graph of GPUs, switches, hosts and network links.

A cluster is ``nodes`` copies of a node preset (``ClusterSpec``: GPUs, NVSwitch or NVLink bridges,
PCIe switches, CPU sockets and host memory, NICs) joined by a scale-out network preset
(``NetworkSpec``: rail-optimised leaf/spine or a fat tree with an oversubscription ratio, over
InfiniBand or RoCE). Every physical connection becomes two directed edges (one per direction)
named ``"u->v"`` with ``capacity_bytes_per_s`` (one direction, datasheet rate), ``latency_s`` and
a ``tier`` (``nvlink``, ``pcie``, ``host``, ``net``). The edge names and capacities feed
``hardware_models.fabrics.FluidNetwork`` unchanged (``Topology.capacities()``); a route between
two devices (``Topology.route``) is computed once per pair and cached.

The graph is built lazily: one template node (node 0), the network core and the nodes a query touches;
nodes are copies of the template and the network is wired by formula, so building and querying a cluster
costs the same at any node count (``Topology.graph``, the complete graph, is built only on demand).

Graph node names: ``n{k}.gpu{i}``, ``n{k}.nvswitch``, ``n{k}.pcie{j}``, ``n{k}.cpu{s}``,
``n{k}.mem{s}``, ``n{k}.nic{r}``; network switches ``leaf{l}`` and ``spine{x}``. Global rank
``r`` is GPU ``r % gpus_per_node`` of node ``r // gpus_per_node``.

Structure sources: DGX H100/H200 put each ConnectX-7 NIC on the PCIe switch of its GPU (NVIDIA
DGX H100 User Guide, "system topology"; ``nvidia-smi topo`` shows GPU-NIC "PIX", NVIDIA/nccl#1357);
rail-optimised fabrics connect NIC ``i`` of every node to leaf ``i`` (NVIDIA DGX SuperPOD reference
architecture). Numbers come from the preset files, each with its own source.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # networkx is imported where a topology is built (start-up of single-GPU runs)
    import networkx as nx

from hardware_models import presets
from hardware_models.presets import PresetError, build_spec

INTRA_KINDS = ("nvswitch", "nvlink_bridge", "pcie")
NETWORK_KINDS = ("rail", "fat_tree")
TIERS = ("nvlink", "pcie", "host", "net")
#: Route preference per tier (lower = preferred): NCCL prefers NVLink over PCIe over the CPU
#: (``PATH_NVL`` < ``PATH_PIX`` < ``PATH_PHB`` < ``PATH_SYS`` < ``PATH_NET`` in NCCL ``src/graph/topo.h``).
_WEIGHT = {"nvlink": 1.0, "pcie": 2.0, "host": 3.0, "net": 4.0}


class TopologyError(PresetError):
    """An invalid cluster or network description (a ``PresetError``, so the CLI exits 2)."""


def _positive(obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{n} must be > 0, got {v!r}")


def _nonneg(obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{n} must be >= 0, got {v!r}")


@dataclass(frozen=True)
class ClusterSpec:
    """One node type of a cluster (all bandwidths per direction, bytes/s; datasheet rates).

    Attributes:
        name: Product name.
        gpu: GPU preset name (``hardware_models/presets/gpus``).
        gpus_per_node: GPUs per node (>= 1).
        intra: ``nvswitch`` (every GPU has one aggregate port to a non-blocking crossbar),
            ``nvlink_bridge`` (GPUs 2i and 2i+1 bridged) or ``pcie`` (no NVLink).
        nvlink_bytes_per_s: NVLink rate per GPU (all its links) or per bridge; 0 with ``pcie``.
        nvlink_latency_s: One NVLink hop's wire latency.
        nvls: The NVSwitch reduces in the switch (NVLink SHARP, third-generation NVSwitch).
        nvswitch_count: NVSwitch chips per node (descriptive; the crossbar is one graph node).
        pcie_bytes_per_s: Each GPU's and NIC's PCIe link to its switch or root port.
        pcie_switches: PCIe switches per node (0 = GPUs on CPU root ports directly). GPUs and
            NICs are spread evenly over them, switch ``j`` on socket ``j * sockets // pcie_switches``.
        pcie_switch_uplink_bytes_per_s: Switch to root complex link.
        pcie_latency_s: One PCIe hop's latency.
        sockets: CPU sockets (each with a root complex and local memory).
        inter_socket_bytes_per_s: Socket-to-socket link (UPI / xGMI) per direction.
        host_memory_bytes_per_s: DRAM bandwidth per socket.
        nics_per_node: Scale-out NICs per node (0 = single-node only).
        collective_profile: Name of the collective profile (``presets/collectives``).
        network: Default network preset for multi-node clusters ("" = none).
        sources: Citation per field.
    """

    name: str
    gpu: str
    gpus_per_node: int
    intra: str
    pcie_bytes_per_s: float
    sockets: int
    inter_socket_bytes_per_s: float
    host_memory_bytes_per_s: float
    collective_profile: str
    nvlink_bytes_per_s: float = 0.0
    nvlink_latency_s: float = 0.0
    nvls: bool = False
    nvswitch_count: int = 0
    pcie_switches: int = 0
    pcie_switch_uplink_bytes_per_s: float = 0.0
    pcie_latency_s: float = 0.0
    nics_per_node: int = 0
    network: str = ""
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Raises: ValueError: an unknown ``intra`` kind, a non-positive count or bandwidth."""
        if self.intra not in INTRA_KINDS:
            raise ValueError(f"intra must be one of {INTRA_KINDS}, got {self.intra!r}")
        _positive(self, "gpus_per_node", "pcie_bytes_per_s", "sockets", "inter_socket_bytes_per_s",
                  "host_memory_bytes_per_s")
        _nonneg(self, "nvlink_latency_s", "pcie_latency_s", "pcie_switches", "nics_per_node", "nvswitch_count",
                "nvlink_bytes_per_s", "pcie_switch_uplink_bytes_per_s")
        if self.intra != "pcie":
            _positive(self, "nvlink_bytes_per_s")
        if self.intra == "nvlink_bridge" and self.gpus_per_node % 2:
            raise ValueError(f"nvlink_bridge needs an even gpus_per_node, got {self.gpus_per_node}")
        if self.nvls and self.intra != "nvswitch":
            raise ValueError("nvls (in-switch reduction) needs intra: nvswitch")
        if self.pcie_switches:
            _positive(self, "pcie_switch_uplink_bytes_per_s")


@dataclass(frozen=True)
class NetworkSpec:
    """A scale-out network (per-direction bandwidths in bytes/s).

    Attributes:
        name: Product name.
        kind: ``rail`` (NIC i of every node on leaf i, leaves joined by spines) or ``fat_tree``
            (``nodes_per_leaf`` nodes per leaf, all their NICs on it).
        transport: ``ib`` or ``roce`` (descriptive; the profile carries its efficiency).
        nic_bytes_per_s: One NIC port's rate (each of the cluster's ``nics_per_node`` NICs).
        link_latency_s: Per network hop (NIC-leaf, leaf-spine) latency.
        oversubscription: Leaf downlink / uplink capacity ratio (1 = non-blocking).
        nodes_per_leaf: ``fat_tree`` only: nodes under one leaf.
        busbw_efficiency: Achieved collective bus bandwidth per NIC / ``nic_bytes_per_s`` at
            >= 1 GiB (the ``net`` tier efficiency unless the collective profile sets one).
        p2p_efficiency: Achieved one-pair send/recv rate / ``nic_bytes_per_s``.
        p2p_latency_s: Fixed time of one cross-node send/recv.
        sources: Citation per field.
    """

    name: str
    kind: str
    nic_bytes_per_s: float
    transport: str = "ib"
    link_latency_s: float = 0.0
    oversubscription: float = 1.0
    nodes_per_leaf: int = 1
    busbw_efficiency: float = 1.0
    p2p_efficiency: float = 1.0
    p2p_latency_s: float = 0.0
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Raises: ValueError: unknown kind/transport, non-positive rate or ratio < 1."""
        if self.kind not in NETWORK_KINDS:
            raise ValueError(f"kind must be one of {NETWORK_KINDS}, got {self.kind!r}")
        if self.transport not in ("ib", "roce"):
            raise ValueError(f"transport must be 'ib' or 'roce', got {self.transport!r}")
        _positive(self, "nic_bytes_per_s", "nodes_per_leaf")
        _nonneg(self, "link_latency_s", "p2p_latency_s")
        for n in ("busbw_efficiency", "p2p_efficiency"):
            v = getattr(self, n)
            if not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ValueError(f"{n} must be in (0, 1], got {v!r}")
        if not isinstance(self.oversubscription, (int, float)) or self.oversubscription < 1:
            raise ValueError(f"oversubscription must be >= 1, got {self.oversubscription!r}")


# -- preset loading -------------------------------------------------------------------------------
def load_cluster(name: str, overrides: dict[str, Any] | None = None) -> ClusterSpec:
    """The cluster node preset ``name`` with optional field overrides (SI values or unit strings).

    Raises:
        PresetError: unknown name, unknown key, bad unit or a failed invariant (names the key).
    """
    data = {**presets.read("clusters", name), **(overrides or {})}
    return build_spec(ClusterSpec, data, f"preset clusters/{name}")


def load_network(name: str, overrides: dict[str, Any] | None = None) -> NetworkSpec:
    """The network preset ``name`` with optional overrides. Raises: PresetError as ``load_cluster``."""
    data = {**presets.read("networks", name), **(overrides or {})}
    return build_spec(NetworkSpec, data, f"preset networks/{name}")


# -- the graph --------------------------------------------------------------------------------------
#: Most nodes a topology may have: 4,096 nodes is 32,768 GPUs of 8-GPU nodes, twice the largest
#: published training runs the project targets (16,384 GPUs); larger inputs are refused, not slow.
MAX_NODES = 4096


def max_nodes_text(cluster: ClusterSpec) -> str:
    """The node bound in words, for errors: ``the 4,096 nodes this simulator builds (32,768 GPUs of NAME)``."""
    return (f"the {MAX_NODES:,} nodes this simulator builds ({MAX_NODES * cluster.gpus_per_node:,} GPUs of "
            f"{cluster.name})")


def _edge(name: str, cap: float, tier: str, latency_s: float) -> dict:
    """One directed link's attributes (module docstring)."""
    return {"name": name, "capacity_bytes_per_s": float(cap), "tier": tier, "latency_s": float(latency_s)}


class Topology:
    """The directed link graph of ``nodes`` x ``cluster`` joined by ``network``, built lazily.

    Every node is a copy of one template node (node 0, ``_build_node(0)``) renamed ``n{k}.``, and the
    network wires NIC ``r`` of node ``k`` to one leaf by formula (``_leaf_of``), so the topology keeps the
    template, the network core (rail: its leaves and spine) and only the nodes a query touches
    (``link``, ``out_links``, ``kind``, ``route``): building and querying it costs the same at 2 nodes and at
    ``MAX_NODES``. Every query answers what the complete graph answers (``graph``, built in full on first
    use, O(nodes): for ``capacities`` and searches that leave the structure, e.g. a route from a leaf).

    Args:
        cluster: The node description.
        nodes: Number of nodes (>= 1).
        network: The scale-out network; required when ``nodes > 1``.

    Raises:
        TopologyError: ``nodes < 1``, several nodes without a network or NICs, NIC counts that do
            not match, or a graph in which some GPU cannot reach another (checked structurally on the
            template: ``_check_connected``).
    """

    def __init__(self, cluster: ClusterSpec, nodes: int = 1, network: NetworkSpec | None = None):
        if not isinstance(nodes, int) or nodes < 1:
            raise TopologyError(f"cluster.nodes must be an integer >= 1, got {nodes!r}")
        if nodes > MAX_NODES:
            raise TopologyError(f"cluster.nodes: {nodes} is above {max_nodes_text(cluster)}")
        if nodes > 1 and cluster.nics_per_node == 0:
            raise TopologyError(f"cluster.nodes: {cluster.name} has no NICs (nics_per_node: 0), so nodes must be 1; "
                                f"got {nodes}")
        if nodes > 1 and network is None:
            raise TopologyError(f"cluster.network: {nodes} nodes of {cluster.name} need a network preset")
        self.cluster = cluster
        self.nodes = nodes
        self.network = network if nodes > 1 else None
        import networkx as nx

        self._ready = False
        self._routes: dict[tuple[str, str], tuple[str, ...]] = {}
        self._links: dict[str, dict] = {}  # link() answers
        self._node0_paths: dict[tuple[str, str], list[str] | None] = {}
        self._g = nx.DiGraph()  # the graph _link / _build_node write to
        self._build_node(0)
        self._local = self._g  # the template: node 0's devices and links
        self._check_connected()
        self._lazy = self._local.copy()  # template + network core + the nodes queries touched
        self._g = self._lazy
        self._built: set[int] = set()
        self._full: nx.DiGraph | None = None
        if self.network is not None:
            if self.network.kind == "rail":
                for r in range(self.cluster.nics_per_node):
                    self._lazy.add_node(f"leaf{r}", kind="leaf")
            self._ensure(0)
            if self.network.kind == "rail" and self._n_leaves() > 1:
                for r in range(self.cluster.nics_per_node):
                    self._spine_link(f"leaf{r}", self._lazy)
        self._built.add(0)
        self._tmpl = self._lazy.copy()  # fixed search graph of in-node routes: node 0 + its uplinks + core
        self._ready = True

    @property
    def graph(self) -> "nx.DiGraph":
        """The complete directed graph (all nodes, built on first use in the order of the module docstring;
        O(nodes) time and memory). While the template is built: the graph under construction."""
        if not self._ready:
            return self._g
        if self._full is None:
            self._full = self._build_full()
        return self._full

    # world
    @property
    def gpus_per_node(self) -> int:
        """GPUs per node."""
        return self.cluster.gpus_per_node

    @property
    def world_size(self) -> int:
        """Number of GPUs (= nodes x gpus_per_node)."""
        return self.nodes * self.cluster.gpus_per_node

    def gpu(self, rank: int) -> str:
        """Graph node of global rank ``rank``. Raises: TopologyError: rank outside the world."""
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank!r} is outside the world (0..{self.world_size - 1})")
        g = self.cluster.gpus_per_node
        return f"n{rank // g}.gpu{rank % g}"

    def node_of(self, rank: int) -> int:
        """Node index of global rank ``rank``."""
        return rank // self.cluster.gpus_per_node

    # links
    def _link(self, u: str, v: str, cap: float, tier: str, latency_s: float = 0.0,
              g: "nx.DiGraph | None" = None) -> None:
        g = self._g if g is None else g
        for a, b in ((u, v), (v, u)):
            g.add_edge(a, b, **_edge(f"{a}->{b}", cap, tier, latency_s))

    def _build_node(self, k: int) -> None:
        c = self.cluster
        p = f"n{k}."
        for s in range(c.sockets):
            self.graph.add_node(f"{p}cpu{s}", kind="cpu")
            self.graph.add_node(f"{p}mem{s}", kind="memory")
            self._link(f"{p}cpu{s}", f"{p}mem{s}", c.host_memory_bytes_per_s, "host")
        for s in range(1, c.sockets):
            self._link(f"{p}cpu{s - 1}", f"{p}cpu{s}", c.inter_socket_bytes_per_s, "host")
        for j in range(c.pcie_switches):
            self.graph.add_node(f"{p}pcie{j}", kind="pcie_switch")
            self._link(f"{p}pcie{j}", f"{p}cpu{j * c.sockets // c.pcie_switches}", c.pcie_switch_uplink_bytes_per_s,
                       "pcie", c.pcie_latency_s)

        def attach(dev: str, i: int, count: int) -> None:
            if c.pcie_switches:
                self._link(dev, f"{p}pcie{i * c.pcie_switches // count}", c.pcie_bytes_per_s, "pcie", c.pcie_latency_s)
            else:
                self._link(dev, f"{p}cpu{i * c.sockets // count}", c.pcie_bytes_per_s, "pcie", c.pcie_latency_s)

        for i in range(c.gpus_per_node):
            self.graph.add_node(f"{p}gpu{i}", kind="gpu", node=k, local=i)
            attach(f"{p}gpu{i}", i, c.gpus_per_node)
        for r in range(c.nics_per_node):
            self.graph.add_node(f"{p}nic{r}", kind="nic", node=k, rail=r)
            attach(f"{p}nic{r}", r, c.nics_per_node)
        if c.intra == "nvswitch":
            self.graph.add_node(f"{p}nvswitch", kind="nvswitch", nvls=c.nvls)
            for i in range(c.gpus_per_node):
                self._link(f"{p}gpu{i}", f"{p}nvswitch", c.nvlink_bytes_per_s, "nvlink", c.nvlink_latency_s)
        elif c.intra == "nvlink_bridge":
            for i in range(0, c.gpus_per_node, 2):
                self._link(f"{p}gpu{i}", f"{p}gpu{i + 1}", c.nvlink_bytes_per_s, "nvlink", c.nvlink_latency_s)

    # -- the network by formula -----------------------------------------------------------------
    def _n_leaves(self) -> int:
        n = self.network
        assert n is not None
        return self.cluster.nics_per_node if n.kind == "rail" else -(-self.nodes // n.nodes_per_leaf)

    def _leaf_of(self, k: int, r: int) -> str:
        """The leaf NIC ``r`` of node ``k`` is wired to (rail: leaf ``r``; fat tree: the node's leaf)."""
        n = self.network
        assert n is not None
        return f"leaf{r}" if n.kind == "rail" else f"leaf{k // n.nodes_per_leaf}"

    def _spine_link(self, leaf: str, g: "nx.DiGraph") -> None:
        """One aggregate uplink per leaf: its downlink capacity / oversubscription."""
        n = self.network
        assert n is not None
        down = (self.nodes * n.nic_bytes_per_s if n.kind == "rail"
                else n.nodes_per_leaf * self.cluster.nics_per_node * n.nic_bytes_per_s)
        if "spine0" not in g:
            g.add_node("spine0", kind="spine")
        self._link(leaf, "spine0", down / n.oversubscription, "net", n.link_latency_s, g)

    def _copy_node(self, k: int, g: "nx.DiGraph") -> None:
        """Add node ``k`` to ``g``: the template's devices and links renamed ``n{k}.`` (attribute ``node``: k)."""
        own = f"n{k}."
        for v, d in self._local.nodes(data=True):
            g.add_node(own + v[3:], **({**d, "node": k} if "node" in d else d))
        for u, nbrs in self._local.adj.items():
            a = own + u[3:]
            for v, d in nbrs.items():
                b = own + v[3:]
                g.add_edge(a, b, **{**d, "name": f"{a}->{b}"})

    def _ensure(self, k: int) -> None:
        """Materialise node ``k`` (its devices, links and uplinks; a fat-tree leaf with its first node)."""
        if k in self._built:
            return
        g = self._lazy
        if k:
            self._copy_node(k, g)
        n = self.network
        if n is not None:
            for r in range(self.cluster.nics_per_node):
                leaf = self._leaf_of(k, r)
                new = leaf not in g
                self._link(f"n{k}.nic{r}", leaf, n.nic_bytes_per_s, "net", n.link_latency_s, g)
                if new and n.kind == "fat_tree" and self._n_leaves() > 1:
                    self._spine_link(leaf, g)
        self._built.add(k)

    def _build_full(self) -> "nx.DiGraph":
        """The complete graph: every node, then the network (leaves, uplinks node by node, the spine)."""
        import networkx as nx

        g = nx.DiGraph()
        for k in range(self.nodes):
            self._copy_node(k, g)
        n = self.network
        if n is not None:
            if n.kind == "rail":
                for r in range(self.cluster.nics_per_node):
                    g.add_node(f"leaf{r}", kind="leaf")
            for k in range(self.nodes):
                for r in range(self.cluster.nics_per_node):
                    self._link(f"n{k}.nic{r}", self._leaf_of(k, r), n.nic_bytes_per_s, "net", n.link_latency_s, g)
            if self._n_leaves() > 1:
                for leaf in range(self._n_leaves()):
                    self._spine_link(f"leaf{leaf}", g)
        return g

    def _node_index(self, dev: str) -> int | None:
        """Node ``k`` of a node-local device name ``n{k}.<template device>``; None for any other name."""
        head, dot, tail = dev.partition(".")
        if not dot or head[:1] != "n" or not head[1:].isdigit() or str(int(head[1:])) != head[1:]:
            return None
        k = int(head[1:])
        return k if k < self.nodes and "n0." + tail in self._local else None

    def _has(self, dev: str) -> bool:
        """``dev`` is a device of the topology (materialising its node, or its fat-tree leaf)."""
        k = self._node_index(dev)
        if k is not None:
            self._ensure(k)
            return True
        return self._attrs(dev) is not None

    def _attrs(self, dev: str) -> dict | None:
        """Attributes of device ``dev`` without building its node (a node-local device: the template's, whose
        ``node`` is 0); None: no such device. A fat-tree leaf is built with its first node."""
        if self._node_index(dev) is not None:
            return self._local.nodes["n0." + dev.partition(".")[2]]
        if self.network is not None and self.network.kind == "fat_tree" and dev.startswith("leaf"):
            num = dev[4:]
            if num.isdigit() and str(int(num)) == num and int(num) < self._n_leaves():
                self._ensure(int(num) * self.network.nodes_per_leaf)
        return self._lazy.nodes[dev] if dev in self._lazy else None

    def _check_connected(self) -> None:
        """Every GPU reachable from ``n0.gpu0``, decided on the template: node ``k``'s GPUs are copies of
        node 0's, and the network joins every NIC to every other (each NIC has its uplink; the leaves share
        the spine), so a GPU of node ``k`` is reached iff node 0's GPU 0 reaches one of its own NICs and the GPU
        is reached from one of its node's NICs inside the node (node 0: or from GPU 0 inside the node)."""
        import networkx as nx

        g, c = self._local, self.cluster
        src = "n0.gpu0"
        own = nx.descendants(g, src) | {src}
        nics = [f"n0.nic{r}" for r in range(c.nics_per_node)] if self.nodes > 1 else []
        out = bool(nics) and any(n in own for n in nics)
        via_net: set[str] = set()
        if out:
            for n in nics:
                via_net |= nx.descendants(g, n)
        missing = [f"n0.gpu{i}" for i in range(c.gpus_per_node) if f"n0.gpu{i}" not in own | via_net]
        if not missing and self.nodes > 1:
            missing = [f"n1.gpu{i}" for i in range(c.gpus_per_node) if f"n0.gpu{i}" not in via_net]
        if missing:
            raise TopologyError(f"topology of {self.cluster.name} x {self.nodes} is disconnected: "
                                f"{missing[0]} cannot be reached from {src}")

    def tiers(self) -> set[str]:
        """Tiers of the topology's links (the template's, plus ``net`` with a network)."""
        used = {d["tier"] for _, _, d in self._local.edges(data=True)}
        return used | ({"net"} if self.network is not None else set())

    def capacities(self) -> dict[str, float]:
        """Link name -> datasheet capacity, bytes/s (the ``FluidNetwork`` argument; every link: O(nodes))."""
        return {d["name"]: d["capacity_bytes_per_s"] for _, _, d in self.graph.edges(data=True)}

    def link(self, name: str) -> dict:
        """Edge attributes of link ``name`` (``"u->v"``; a link inside a node or a NIC's uplink without building
        the node). Raises: KeyError: unknown link."""
        hit = self._links.get(name)
        if hit is not None:
            return hit
        u, v = name.split("->")
        ku, kv = self._node_index(u), self._node_index(v)
        n = self.network
        if ku is not None and ku == kv:
            d = {**self._local.edges["n0." + u.partition(".")[2], "n0." + v.partition(".")[2]], "name": name}
        elif n is not None and (ku is None) != (kv is None) and self._is_uplink(u, v):
            d = _edge(name, n.nic_bytes_per_s, "net", n.link_latency_s)
        else:
            self._has(u)
            self._has(v)
            d = self._lazy.edges[u, v]
        self._links[name] = d
        return d

    def _is_uplink(self, u: str, v: str) -> bool:
        """``u``-``v`` (either way) is a NIC and the leaf ``_leaf_of`` wires it to."""
        nic, leaf = (u, v) if self._node_index(u) is not None else (v, u)
        a = self._attrs(nic)
        return a.get("kind") == "nic" and leaf == self._leaf_of(self._node_index(nic), a["rail"])

    def kind(self, dev: str) -> str | None:
        """The ``kind`` of device ``dev`` (``gpu``, ``nic``, ``pcie_switch``, ``cpu``, ...; a fat-tree leaf has
        none). Raises: TopologyError: unknown device."""
        a = self._attrs(dev)
        if a is None:
            raise TopologyError(f"link to a device that does not exist: {dev!r}")
        return a.get("kind")

    def out_links(self, dev: str) -> list[tuple[str, dict]]:
        """``(neighbour, edge attributes)`` of every link leaving ``dev``, in the complete graph's order.
        Raises: TopologyError: unknown device."""
        if not self._has(dev):
            raise TopologyError(f"link to a device that does not exist: {dev!r}")
        g = self._lazy if self._node_index(dev) is not None else self.graph  # a leaf's links span all nodes
        return list(g.adj[dev].items())

    def route(self, src: str, dst: str) -> tuple[str, ...]:
        """Link names from graph node ``src`` to ``dst`` (cached; NVLink preferred over PCIe, CPU,
        network; no transit through another GPU).

        Raises:
            TopologyError: unknown node, or no path.
        """
        key = (src, dst)
        hit = self._routes.get(key)
        if hit is not None:
            return hit
        a, b = self._attrs(src), self._attrs(dst)
        for node, attrs in ((src, a), (dst, b)):
            if attrs is None:
                raise TopologyError(f"link to a device that does not exist: {node!r}")
        if src == dst:
            self._routes[key] = ()
            return ()
        ka, kb = self._node_index(src), self._node_index(dst)
        nics = self.cluster.nics_per_node
        if ka is not None and ka == kb:
            path = self._in_node(src, dst, ka)
        elif self.network is not None and a.get("kind") == "gpu" and b.get("kind") == "gpu" and nics:
            # rail affinity: GPU i leaves and enters through NIC i % nics (one NIC per GPU on HGX;
            # NCCL picks the closest NIC per GPU, src/graph/search.cc)
            na, nb = f"n{ka}.nic{a['local'] % nics}", f"n{kb}.nic{b['local'] % nics}"
            path = self._in_node(src, na, ka)[:-1] + self._net_path(na, nb)[:-1] + self._in_node(nb, dst, kb)
        else:
            path = self._path(src, dst)
        names = tuple(f"{u}->{v}" for u, v in zip(path, path[1:]))
        self._routes[key] = names
        return names

    def _in_node(self, src: str, dst: str, k: int) -> list[str]:
        """Path between two devices of node ``k``: the template's path (searched on node 0 with its uplinks and
        the network core), renamed (every node is a copy), so a ring over thousands of nodes costs one search per
        pair of local devices; a search of the complete graph if the template's path leaves the node."""
        own = f"n{k}."
        tmpl_key = ("n0." + src[len(own):], "n0." + dst[len(own):])
        if tmpl_key not in self._node0_paths:
            try:
                self._node0_paths[tmpl_key] = self._search(self._tmpl, *tmpl_key)
            except TopologyError:  # joined only through another node: search this pair
                self._node0_paths[tmpl_key] = None
        tmpl = self._node0_paths[tmpl_key]
        if tmpl is None or not all(v.startswith("n0.") for v in tmpl):  # the path leaves the node: search this pair
            return self._path(src, dst)
        return tmpl if k == 0 else [own + v[3:] for v in tmpl]

    def _net_path(self, na: str, nb: str) -> list[str]:
        """NIC-to-NIC path over the scale-out network: NIC -> its leaf (-> spine -> the other leaf) -> NIC, as
        ``_leaf_of`` wires it: the network's links form a tree (each NIC has one uplink, each leaf one spine
        link), so this is the only path on ``net`` links, the one a search finds."""
        la = self._leaf_of(int(na[1:na.index(".")]), int(na[na.index(".nic") + 4:]))
        lb = self._leaf_of(int(nb[1:nb.index(".")]), int(nb[nb.index(".nic") + 4:]))
        return [na, la, nb] if la == lb else [na, la, "spine0", lb, nb]

    def _path(self, src: str, dst: str, net_only: bool = False) -> list[str]:
        """A search of the complete graph (``graph``)."""
        return self._search(self.graph, src, dst, net_only)

    def _search(self, g: "nx.DiGraph", src: str, dst: str, net_only: bool = False) -> list[str]:
        import networkx as nx

        def weight(u: str, v: str, d: dict) -> float | None:
            if v != dst and g.nodes[v].get("kind") == "gpu":
                return None
            if net_only and d["tier"] != "net":
                return None
            return _WEIGHT[d["tier"]]

        try:
            return nx.dijkstra_path(g, src, dst, weight=weight)
        except nx.NetworkXNoPath:
            raise TopologyError(f"no route from {src} to {dst} in {self.cluster.name} x {self.nodes}") from None

    def rank_route(self, a: int, b: int) -> tuple[str, ...]:
        """``route`` between global ranks ``a`` and ``b``."""
        return self.route(self.gpu(a), self.gpu(b))

    def route_latency_s(self, links: tuple[str, ...]) -> float:
        """Sum of the wire latencies of ``links``."""
        return sum(self.link(n)["latency_s"] for n in links)


def build_topology(cluster: str | ClusterSpec, nodes: int = 1, network: str | NetworkSpec | None = None,
                   cluster_overrides: dict[str, Any] | None = None,
                   network_overrides: dict[str, Any] | None = None) -> Topology:
    """Build a ``Topology`` from preset names (or specs) with optional field overrides.

    Raises:
        PresetError: unknown preset, bad override, or an invalid topology.
    """
    spec = load_cluster(cluster, cluster_overrides) if isinstance(cluster, str) else (
        dataclasses.replace(cluster, **cluster_overrides) if cluster_overrides else cluster)
    if network is None and nodes > 1 and spec.network:
        network = spec.network
    net = load_network(network, network_overrides) if isinstance(network, str) else network
    return Topology(spec, nodes, net)
