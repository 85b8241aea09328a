"""Collectives as SimPy rendezvous + max-min fair flows over the topology (engine primitive).

``CollectiveFlows(env, model)`` owns one ``FluidNetwork`` over every directed link of the
topology, with *achieved* capacities (datasheet capacity x the profile's ``ring_efficiency`` of
the link's tier). ``collective(op, ranks, nbytes)`` returns a ``Rendezvous``: each member calls
``arrive(rank)`` (a SimPy event that fires when the collective ends); the data starts moving when
the last member arrives, after the model's latency for the chosen algorithm. Flows per op:

* ring ops (all-reduce, reduce-scatter, all-gather, broadcast, reduce): one flow of the bus bytes
  per intra-node ring hop, and per node boundary one flow of bus bytes / rails on each rail (the
  link loads of ``CollectiveModel.ring_bandwidth``);
* NVLS: every member sends and receives its buffer over its NVSwitch port;
* all-to-all: one flow of S/n per ordered pair; send/recv: one flow.

Alone on the fabric this reproduces ``CollectiveModel``'s latency + bus bytes / bandwidth (without
the size efficiency and ring fill terms); concurrent collectives and other transfers crossing the
same links share them max-min fairly (``hardware_models.fabrics``).

The engine loads one simulated rank's own links (``rank_loads`` over ``PORT_LINKS``: its NVLink port, its
PCIe link, its NIC rail) with the same flows (``simulator.engine.system.System.collective_flows``).
"""

from __future__ import annotations

from typing import Sequence

import simpy

from hardware_models.collectives import CollectiveError, CollectiveModel, NcclConfig, bus_factor
from hardware_models.fabrics import FluidNetwork


class Rendezvous:
    """One collective call among ``ranks``; see the module docstring.

    Attributes:
        done: Event that fires when every flow has finished.
        start_s: Simulated time the last member arrived (None until then).
        result: The ``CollectiveResult`` of the algorithm chosen (latency and naming).
    """

    def __init__(self, owner: "CollectiveFlows", op: str, ranks: tuple[int, ...], nbytes: float, nccl: NcclConfig | None):
        self.owner = owner
        self.op = op
        self.ranks = ranks
        self.nbytes = nbytes
        self.result = owner.model.price(op, ranks, int(nbytes), nccl)
        self.done = owner.env.event()
        self.start_s: float | None = None
        self._arrived: set[int] = set()

    def arrive(self, rank: int) -> simpy.Event:
        """Member ``rank`` reaches the call. Returns ``done``.

        Raises:
            CollectiveError: ``rank`` is not a member or arrives twice.
        """
        if rank not in self.ranks:
            raise CollectiveError(f"rank {rank} is not in the process group {list(self.ranks)}")
        if rank in self._arrived:
            raise CollectiveError(f"rank {rank} arrived twice at the same {self.op}")
        self._arrived.add(rank)
        if len(self._arrived) == len(self.ranks):
            self.start_s = self.owner.env.now
            self.owner.env.process(self._run())
        return self.done

    def _run(self):
        env = self.owner.env
        lat = self.result.latency_s
        if lat > 0:
            yield env.timeout(lat)
        procs = [env.process(self.owner.net.transfer(b, links)) for b, links in self.owner.flows(self)]
        if procs:
            yield env.all_of(procs)
        self.done.succeed(env.now)


class CollectiveFlows:
    """Flow-level collectives on ``model``'s topology.

    Args:
        env: The SimPy environment.
        model: The collective cost model (topology + profile).
    """

    def __init__(self, env: simpy.Environment, model: CollectiveModel):
        self.env = env
        self.model = model
        topo = model.topo
        eff = model._ring_eff
        caps = {d["name"]: d["capacity_bytes_per_s"] * eff[d["tier"]] for _, _, d in topo.graph.edges(data=True)}
        self.net = FluidNetwork(env, caps)

    def collective(self, op: str, ranks: Sequence[int], nbytes: float, nccl: NcclConfig | None = None) -> Rendezvous:
        """A new collective call. Raises: CollectiveError as ``CollectiveModel.price``."""
        return Rendezvous(self, op, self.model.check_group(ranks), nbytes, nccl)

    def flows(self, rv: Rendezvous) -> list[tuple[float, tuple[str, ...]]]:
        """(bytes, links) of every flow of ``rv`` (``route_loads``)."""
        return route_loads(self.model, rv.op, rv.ranks, rv.nbytes, rv.result.algorithm)


def route_loads(model: CollectiveModel, op: str, group: tuple[int, ...], nbytes: float,
                algorithm: str) -> list[tuple[float, tuple[str, ...]]]:
    """(bytes, topology links) of every flow of ``op`` of ``nbytes`` over ``group`` run with NCCL
    ``algorithm`` (``"Ring"``, ``"Tree"``, ``"NVLS"``, ``"NVLSTree"``, ``"P2P"``): the module docstring's
    flows (a tree is given the ring's link loads; NVLS moves the buffer both ways over every member's
    NVSwitch port).
    """
    topo, s = model.topo, float(nbytes)
    n = len(group)
    if n == 1 or s <= 0:
        return []
    if op == "send_recv":
        return [(s, topo.rank_route(group[0], group[1]))]
    if op == "all_to_all":
        return [(s / n, topo.rank_route(a, b)) for a in group for b in group if a != b]
    if algorithm in ("NVLS", "NVLSTree"):
        out = []
        for r in group:
            sw = f"n{topo.node_of(r)}.nvswitch"
            out += [(s, topo.route(topo.gpu(r), sw)), (s, topo.route(sw, topo.gpu(r)))]
        return out
    bus = s * bus_factor(op, n) if op not in ("broadcast", "reduce") else s
    per_node = model._by_node(group)
    out = []
    for members in per_node:
        if len(members) > 1:
            out += [(bus, topo.rank_route(a, b)) for a, b in zip(members, members[1:] + members[:1])]
    if len(per_node) > 1:
        rails = max(1, min(topo.cluster.nics_per_node, min(len(x) for x in per_node)))
        for k, members in enumerate(per_node):
            nxt = per_node[(k + 1) % len(per_node)]
            out += [(bus / rails, topo.rank_route(members[r], nxt[r])) for r in range(rails)]
    return out


#: The links of one rank's own devices, by the name a simulated rank gives them: its GPU's NVLink /
#: NVSwitch port (per direction), its GPU's PCIe link (``pcie.d2h`` towards the host / PCIe switch,
#: ``pcie.h2d`` back, both inside the slot's duplex limit ``pcie.duplex``: the link that GPUDirect
#: traffic to the NIC and host copies share on HGX boards) and its NIC's rail (per direction).
PORT_LINKS = ("nvlink.tx", "nvlink.rx", "pcie.d2h", "pcie.h2d", "pcie.duplex", "nic.tx", "nic.rx")


def _port_map(topo, rank: int) -> dict[str, tuple[str, ...]]:
    """Topology link name -> the names of ``PORT_LINKS`` it is, for the links of ``rank``'s own GPU and NIC."""
    gpu = topo.gpu(rank)
    out: dict[str, tuple[str, ...]] = {}
    for v, d in topo.out_links(gpu):
        kind = topo.kind(v)
        if d["tier"] == "nvlink":
            out[d["name"]] = ("nvlink.tx",)
            out[topo.link(f"{v}->{gpu}")["name"]] = ("nvlink.rx",)
        elif kind in ("pcie_switch", "cpu"):
            out[d["name"]] = ("pcie.d2h", "pcie.duplex")
            out[topo.link(f"{v}->{gpu}")["name"]] = ("pcie.h2d", "pcie.duplex")
    nics = topo.cluster.nics_per_node
    if topo.network is not None and nics:
        nic = f"n{topo.node_of(rank)}.nic{(rank % topo.gpus_per_node) % nics}"
        for v, d in topo.out_links(nic):
            if d["tier"] == "net":
                out[d["name"]] = ("nic.tx",)
                out[topo.link(f"{v}->{nic}")["name"]] = ("nic.rx",)
    return out


def port_capacities(topo, rank: int) -> dict[str, float]:
    """Datasheet capacity (bytes/s) of ``rank``'s NVLink port and NIC rail links, by ``PORT_LINKS`` name
    (the PCIe link's rates are the copy profile's, set by the caller); absent where the rank has none."""
    caps: dict[str, float] = {}
    for name, locals_ in _port_map(topo, rank).items():
        for loc in locals_:
            if not loc.startswith("pcie."):
                caps[loc] = topo.link(name)["capacity_bytes_per_s"]
    return caps


def rank_loads(model: CollectiveModel, op: str, group: tuple[int, ...], nbytes: float, algorithm: str,
               rank: int, mirror: bool = False) -> dict[tuple[str, ...], float]:
    """Bytes that ``rank``'s own links carry in one call (``route_loads``), grouped by the ``PORT_LINKS``
    each flow crosses there: ``{("nvlink.tx",): b, ("pcie.d2h", "pcie.duplex", "nic.tx"): b', ...}``.

    Every flow of the collective that crosses one of ``rank``'s own links counts, whoever sends it (two
    GPUs sharing a NIC both load it). ``mirror``: a send/recv from ``rank`` whose peer is folded into it
    by symmetry (a ring of send/recvs: the rank also receives what its predecessor sends): the
    receive side is loaded with the same bytes.
    """
    pm = _port_map(model.topo, rank)
    out: dict[tuple[str, ...], float] = {}
    for b, links in route_loads(model, op, group, nbytes, algorithm):
        loc: list[str] = []
        for link in links:
            for name in pm.get(link, ()):
                if name not in loc:
                    loc.append(name)
        if loc:
            key = tuple(loc)
            out[key] = out.get(key, 0.0) + b
    if mirror and op == "send_recv":
        swap = {"nvlink.tx": "nvlink.rx", "pcie.d2h": "pcie.h2d", "nic.tx": "nic.rx"}
        for key, b in list(out.items()):
            if any(k in swap for k in key):
                back = tuple(swap.get(k, k) for k in key)
                out[back] = out.get(back, 0.0) + b
    return out
