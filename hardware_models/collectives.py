"""NCCL-style collective cost model over a ``Topology``.

For each (algorithm, protocol) NCCL enables on the group, the device time is

    t = latency(algorithm, protocol, steps, hops) + bus_bytes / (B_algo * f_proto * eff(bus_bytes))

* ``latency`` follows NCCL ``src/graph/tuning.cc`` (NVIDIA/nccl v2.30.7, read as summarised in
  ``research/MULTI_GPU.md`` section 1.1): a base per protocol plus one per-hop term per ring step,
  intra-node steps at the NVLink/PCIe hop latency and ``2(N-1)`` (all-reduce) or ``N-1``
  inter-node steps at the network hop latency; tree: ``2((ppn-1) intra + log2(N) inter)``.
  The Simple-protocol base and intra-node step come from the cluster's collective profile (fitted
  where measurements exist); LL and LL128 use tuning.cc's constants (``_TUNING``).
* ``B_algo`` is an *achieved* bus bandwidth derived from the topology: for a ring, the smallest
  ``capacity x efficiency(tier) / load`` over the links the ring's hops cross (load = how many
  ring hops cross the link, 1/rails for each inter-node hop, as NCCL spreads channels over the
  NICs); the efficiency per tier is stored in the collective profile with its source; never a
  bare link peak. NVLS: ``port capacity x nvls_efficiency`` is the *algorithm* bandwidth.
* ``f_proto``: Simple 1, LL 0.5, LL128 0.92 (tuning.cc v2.30); tree: LL 1/3.8, LL128 120/128.
* ``eff(b) = b / (b + half_size_bytes)``: the size-dependent efficiency of the bottleneck tier.

The algorithm and protocol are chosen as NCCL's tuner does: the pair with the smallest modelled
time among those NCCL enables (NVLS only on an NVSwitch with in-switch reduction, >= 2 GPUs per
node, Simple only; NVLSTree only across nodes; LL128 only over NVLink), but evaluated on this
calibrated model rather than on tuning.cc's raw bandwidth constants (which are 24 % too fast on
the vidur H100 data, MULTI_GPU.md finding 2). ``algo``/``proto``/``nvls_enable``/``nchannels``
override it as ``NCCL_ALGO``/``NCCL_PROTO``/``NCCL_NVLS_ENABLE``/``NCCL_MIN/MAX_NCHANNELS`` do.

The host-side dispatch of the collective (the PyTorch call) is a separate term,
``host_dispatch_s``: back-to-back eager calls take ``max(host_dispatch_s, time_s)`` each
(``eager_time_s``), which is what the vidur profiler measured below ~4 MiB.

Reporting follows nccl-tests ``doc/PERFORMANCE.md``: ``algbw = S / t`` (S the per-rank buffer;
for reduce-scatter/all-gather the total array), ``busbw = algbw x`` 2(n-1)/n (all-reduce),
(n-1)/n (reduce-scatter, all-gather, all-to-all), 1 (broadcast, reduce, send/recv).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from hardware_models.presets import PresetError, build_spec
from hardware_models import presets
from hardware_models.topology import TIERS, Topology

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce", "send_recv")
ALGOS = ("ring", "tree", "nvls", "nvlstree", "p2p")
PROTOS = ("ll", "ll128", "simple")
_ALGO_NAMES = {"ring": "Ring", "tree": "Tree", "nvls": "NVLS", "nvlstree": "NVLSTree", "p2p": "P2P"}
_PROTO_NAMES = {"ll": "LL", "ll128": "LL128", "simple": "Simple"}

#: NCCL v2.30.7 ``src/graph/tuning.cc`` latencies, s (MULTI_GPU.md section 1.1): base per
#: (algorithm, protocol) and per-hop per (algorithm, protocol, tier). ``host`` hops use PCIe's.
_TUNING = {
    "base": {("ring", "ll"): 6.6e-6, ("ring", "ll128"): 14.0e-6, ("ring", "simple"): 8.4e-6,
             ("tree", "ll"): 6.8e-6, ("tree", "ll128"): 14.0e-6, ("tree", "simple"): 8.4e-6},
    "hop": {("ring", "ll"): {"nvlink": 0.6e-6, "pcie": 1.0e-6, "net": 2.7e-6},
            ("ring", "ll128"): {"nvlink": 1.9e-6, "pcie": 2.5e-6, "net": 4.0e-6},
            ("ring", "simple"): {"nvlink": 3.4e-6, "pcie": 5.7e-6, "net": 14.0e-6},
            ("tree", "ll"): {"nvlink": 0.6e-6, "pcie": 1.0e-6, "net": 5.0e-6},
            ("tree", "ll128"): {"nvlink": 1.25e-6, "pcie": 1.9e-6, "net": 8.5e-6},
            ("tree", "simple"): {"nvlink": 4.0e-6, "pcie": 4.0e-6, "net": 14.0e-6}},
    "nvlstree_net_hop": 20.9e-6,
}
#: Bandwidth factor per protocol relative to Simple (tuning.cc v2.30: LL 0.5 busBw, LL128 0.92;
#: tree LL / 3.8, LL128 x 120/128) and the tree's 0.92 of the ring bus bandwidth.
_PROTO_BW = {"ring": {"ll": 0.5, "ll128": 0.92, "simple": 1.0}, "tree": {"ll": 1 / 3.8, "ll128": 120 / 128, "simple": 1.0}}
_TREE_BW = 0.92


class CollectiveError(PresetError):
    """A collective the model cannot price (bad group, op, override or fabric); CLI exit 2."""


@dataclass(frozen=True)
class CollectiveProfile:
    """Achieved-bandwidth and latency parameters of one cluster's fabric, with provenance.

    Attributes:
        name: Profile name.
        host_dispatch_s: Host time of one eager collective call (PyTorch dispatch), s.
        simple_base_s: Simple-protocol base latency of ring/tree, s (tuning.cc: 8.4 us).
        simple_step_s: Simple per-ring-step latency per tier (``nvlink``, ``pcie``, ``host``,
            ``net``), s; missing tiers take tuning.cc's value.
        ring_efficiency: Achieved bus bandwidth / link capacity per tier (large messages).
        half_size_bytes: Bus bytes at which a tier reaches half its achieved bandwidth.
        p2p_efficiency: Achieved send/recv rate / bottleneck link capacity per tier.
        p2p_latency_s: Fixed send/recv time per worst tier on the route, s.
        nvls_efficiency: NVLS algorithm bandwidth / NVSwitch port capacity (0 = no NVLS data).
        nvls_half_size_bytes: Buffer bytes at which NVLS reaches half its bandwidth.
        nvls_latency_s: NVLS latency (tuning.cc v2.30: 25 us per NVLink hop, base 0).
        channel_bytes_per_s: Achieved bus bandwidth of one NCCL channel (for ``nchannels``;
            0 = unknown).
        ring_fill_bytes_per_s: Rate of the ring's pipeline fill/drain: one chunk (S/n) that is
            not overlapped with the ring steps adds ``(S/n) / ring_fill_bytes_per_s`` (0 = none).
            It makes the achieved busbw grow with n, as the vidur H100 data do (307 / 333 / 350
            GB/s at 32-64 MiB for n = 2 / 4 / 8, MULTI_GPU.md 2.2).
        nccl_sm_channels: SMs one collective holds while in flight when ``nccl.nchannels`` is not
            set: NCCL runs one thread block (CTA) per channel, and a GEMM CTA that fills an SM's
            shared memory cannot share the SM with it, so the SM is lost to compute (the NCCL
            default channel count of the fabric). Default 24: NVIDIA developer forum thread
            337991, an ``ncclAllGather`` on H100 held 24 blocks (MULTI_GPU.md section 5).
        hbm_bytes_per_bus_byte: HBM bytes (reads + writes) a collective moves on each GPU per
            bus byte (beta): a ring step writes the received chunk into the FIFO buffer, reads it
            and writes the result (the reduced chunk or the gathered copy), 3 per bus byte. The
            collective's HBM traffic is ``beta x busbw``. Default 3, the upper end of MULTI_GPU.md
            section 5 ("beta about 2-3 for reduction traffic").
        overlap_comm_slowdown: gamma: while compute kernels run beside it, a collective
            progresses at ``1 / (1 + gamma)`` of its isolated rate. Default 0.3: vTrain measured
            NCCL about 30 % slower in training than in isolated profiling, Daydream about 34 %
            (MULTI_GPU.md section 5).
        sources: Citation per field; ``fit`` entries hold the fit error where fitted.
    """

    name: str
    host_dispatch_s: float
    ring_efficiency: dict[str, float]
    p2p_efficiency: dict[str, float]
    p2p_latency_s: dict[str, float]
    simple_base_s: float = 8.4e-6
    simple_step_s: dict[str, float] = field(default_factory=dict)
    half_size_bytes: dict[str, float] = field(default_factory=dict)
    nvls_efficiency: float = 0.0
    nvls_half_size_bytes: float = 0.0
    nvls_latency_s: float = 25e-6
    channel_bytes_per_s: float = 0.0
    ring_fill_bytes_per_s: float = 0.0
    nccl_sm_channels: int = 24
    hbm_bytes_per_bus_byte: float = 3.0
    overlap_comm_slowdown: float = 0.3
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Raises: ValueError: unknown tier, efficiency outside (0, 1], negative time/size."""
        for fname in ("ring_efficiency", "p2p_efficiency", "p2p_latency_s", "simple_step_s", "half_size_bytes"):
            d = getattr(self, fname)
            if not isinstance(d, dict):
                raise ValueError(f"{fname} must be a mapping of tier -> value, got {d!r}")
            for k, v in d.items():
                if k not in TIERS:
                    raise ValueError(f"{fname}.{k}: unknown tier; allowed: {list(TIERS)}")
                if not isinstance(v, (int, float)) or isinstance(v, bool):
                    raise ValueError(f"{fname}.{k} must be a number, got {v!r}")
                if fname.endswith("efficiency") and not 0 < v <= 1:
                    raise ValueError(f"{fname}.{k} must be in (0, 1], got {v}")
                if v < 0:
                    raise ValueError(f"{fname}.{k} must be >= 0, got {v}")
        if not 0 <= self.nvls_efficiency <= 1:
            raise ValueError(f"nvls_efficiency must be in [0, 1], got {self.nvls_efficiency}")
        if not isinstance(self.nccl_sm_channels, int) or isinstance(self.nccl_sm_channels, bool) \
                or self.nccl_sm_channels < 0:
            raise ValueError(f"nccl_sm_channels must be an integer >= 0, got {self.nccl_sm_channels!r}")
        for n in ("host_dispatch_s", "simple_base_s", "nvls_half_size_bytes", "nvls_latency_s", "channel_bytes_per_s",
                  "ring_fill_bytes_per_s", "hbm_bytes_per_bus_byte", "overlap_comm_slowdown"):
            if getattr(self, n) < 0:
                raise ValueError(f"{n} must be >= 0, got {getattr(self, n)}")


def load_collective_profile(name: str, overrides: dict[str, Any] | None = None) -> CollectiveProfile:
    """Collective profile preset ``name`` (``presets/collectives``). Raises: PresetError."""
    data = {**presets.read("collectives", name), **(overrides or {})}
    data.pop("fit", None)
    return build_spec(CollectiveProfile, data, f"preset collectives/{name}")


@dataclass(frozen=True)
class NcclConfig:
    """NCCL overrides (``NCCL_ALGO``, ``NCCL_PROTO``, ``NCCL_NVLS_ENABLE``, channel count).

    ``interference`` (not an NCCL variable): whether the engine models compute/communication
    interference (SMs and HBM a collective takes from the kernels beside it, and its slowdown by
    them; the collective profile's ``nccl_sm_channels``, ``hbm_bytes_per_bus_byte``,
    ``overlap_comm_slowdown``); false prices both sides as if alone on the GPU.

    Raises:
        CollectiveError: an unknown algorithm/protocol name or ``nchannels < 1``.
    """

    algo: str | None = None
    proto: str | None = None
    nvls_enable: bool = True
    nchannels: int | None = None
    interference: bool = True

    def __post_init__(self) -> None:
        if self.algo is not None and self.algo.lower() not in ALGOS:
            raise CollectiveError(f"nccl.algo: {self.algo!r} is not modelled; allowed: "
                                  f"{', '.join(_ALGO_NAMES[a] for a in ALGOS if a != 'p2p')}")
        if self.proto is not None and self.proto.lower() not in PROTOS:
            raise CollectiveError(f"nccl.proto: {self.proto!r}; allowed: LL, LL128, Simple")
        if self.nchannels is not None and (not isinstance(self.nchannels, int) or self.nchannels < 1):
            raise CollectiveError(f"nccl.nchannels must be an integer >= 1, got {self.nchannels!r}")


@dataclass(frozen=True)
class CollectiveResult:
    """One priced collective (SI units).

    Attributes:
        op, ranks, ranks_per_node, nbytes: What was priced (``nbytes``: per-rank buffer, or the
            total array for reduce-scatter/all-gather, as nccl-tests sizes them).
        time_s: Device time of the collective.
        latency_s: Its latency term.
        host_dispatch_s: Host dispatch time of one call (separate term).
        eager_time_s: ``max(host_dispatch_s, time_s)``: one of many back-to-back eager calls.
        algbw_bytes_per_s, busbw_bytes_per_s: nccl-tests bandwidths of ``time_s``.
        algorithm, protocol: NCCL names of the chosen pair.
        bottleneck_tier: Tier of the link that bounds the bandwidth.
    """

    op: str
    ranks: int
    ranks_per_node: int
    nbytes: int
    time_s: float
    latency_s: float
    host_dispatch_s: float
    eager_time_s: float
    algbw_bytes_per_s: float
    busbw_bytes_per_s: float
    algorithm: str
    protocol: str
    bottleneck_tier: str

    def as_dict(self) -> dict[str, Any]:
        """The ``simulate collective --json`` object."""
        return {"op": self.op, "ranks": self.ranks, "ranks_per_node": self.ranks_per_node, "bytes": self.nbytes,
                "time_s": self.time_s, "algbw_bytes_per_s": self.algbw_bytes_per_s,
                "busbw_bytes_per_s": self.busbw_bytes_per_s, "algorithm": self.algorithm, "protocol": self.protocol,
                "latency_s": self.latency_s, "host_dispatch_s": self.host_dispatch_s,
                "eager_time_s": self.eager_time_s, "bottleneck_tier": self.bottleneck_tier}


def bus_factor(op: str, n: int) -> float:
    """nccl-tests busbw / algbw factor for ``op`` on ``n`` ranks."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    return 1.0


class CollectiveModel:
    """Prices collectives on ``topology`` with ``profile``.

    Args:
        topology: The cluster graph.
        profile: Its collective profile.

    Raises:
        CollectiveError: the profile lacks an efficiency for a tier the topology uses.
    """

    def __init__(self, topology: Topology, profile: CollectiveProfile):
        self.topo = topology
        self.profile = profile
        net = topology.network
        self._ring_eff = dict(profile.ring_efficiency)
        self._p2p_eff = dict(profile.p2p_efficiency)
        self._p2p_lat = dict(profile.p2p_latency_s)
        if net is not None:
            self._ring_eff.setdefault("net", net.busbw_efficiency)
            self._p2p_eff.setdefault("net", net.p2p_efficiency)
            self._p2p_lat.setdefault("net", net.p2p_latency_s)
        for tier in topology.tiers():
            for what, d in (("ring_efficiency", self._ring_eff), ("p2p_efficiency", self._p2p_eff),
                            ("p2p_latency_s", self._p2p_lat)):
                if tier not in d:
                    raise CollectiveError(f"collective profile {profile.name}: {what} has no value for tier "
                                          f"{tier!r}, which {topology.cluster.name} uses")
        self._cache: dict[tuple, Any] = {}

    # -- groups --------------------------------------------------------------------------------
    def check_group(self, ranks: Sequence[int]) -> tuple[int, ...]:
        """Validate a process group. Raises: CollectiveError: empty, duplicate or outside the world."""
        group = tuple(ranks)
        if not group:
            raise CollectiveError("process group is empty")
        for r in group:
            if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < self.topo.world_size:
                raise CollectiveError(f"process group names rank {r!r}, outside the world "
                                      f"(0..{self.topo.world_size - 1}, {self.topo.nodes} x "
                                      f"{self.topo.gpus_per_node} GPUs)")
        if len(set(group)) != len(group):
            raise CollectiveError(f"process group {list(group)} names a rank twice")
        return group

    def _by_node(self, group: tuple[int, ...]) -> list[list[int]]:
        """The group's ranks by node (nodes and ranks ascending), cached per group (callers do not modify it)."""
        key = ("by_node", group)
        hit = self._cache.get(key)
        if hit is None:
            nodes: dict[int, list[int]] = {}
            for r in sorted(group):
                nodes.setdefault(self.topo.node_of(r), []).append(r)
            hit = self._cache[key] = [nodes[k] for k in sorted(nodes)]
        return hit

    def _cap(self, link: str, eff: dict[str, float]) -> tuple[float, str]:
        d = self.topo.link(link)
        return d["capacity_bytes_per_s"] * eff[d["tier"]], d["tier"]

    def _bottleneck(self, coef: dict[str, float], eff: dict[str, float]) -> tuple[float, str]:
        best, tier = math.inf, "nvlink"
        for link, c in coef.items():
            cap, t = self._cap(link, eff)
            if cap / c < best:
                best, tier = cap / c, t
        return best, tier

    def ring_bandwidth(self, group: tuple[int, ...]) -> tuple[float, str, float]:
        """Achieved ring bus bandwidth (bytes/s), its bottleneck tier and the inter-node part.

        Intra-node hops load each link they cross by 1; each inter-node hop between consecutive
        nodes runs on ``rails = min(NICs, ranks per node)`` rails, loading its links by 1/rails.
        """
        key = ("ring", group)
        if key in self._cache:
            return self._cache[key]
        per_node = self._by_node(group)
        coef: dict[str, float] = {}
        inter: dict[str, float] = {}
        for members in per_node:
            if len(members) > 1:
                for a, b in zip(members, members[1:] + members[:1]):
                    for link in self.topo.rank_route(a, b):
                        coef[link] = coef.get(link, 0.0) + 1.0
        if len(per_node) > 1:
            rails = max(1, min(self.topo.cluster.nics_per_node, min(len(m) for m in per_node)))
            for k, members in enumerate(per_node):
                nxt = per_node[(k + 1) % len(per_node)]
                for r in range(rails):
                    for link in self.topo.rank_route(members[r], nxt[r]):
                        coef[link] = coef.get(link, 0.0) + 1.0 / rails
                        inter[link] = inter.get(link, 0.0) + 1.0 / rails
        if not coef:
            out = (math.inf, "nvlink", math.inf)
        else:
            b, tier = self._bottleneck(coef, self._ring_eff)
            bi = self._bottleneck(inter, self._ring_eff)[0] if inter else math.inf
            out = (b, tier, bi)
        self._cache[key] = out
        return out

    def _intra_tier(self, group: tuple[int, ...]) -> str:
        """Slowest tier of the group's intra-node ring hops (``host`` counts as ``pcie``), cached per group."""
        key = ("intra", group)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._intra_tier_uncached(group)
        return hit

    def _intra_tier_uncached(self, group: tuple[int, ...]) -> str:
        per_node = self._by_node(group)
        tiers = set()
        for members in per_node:
            for a, b in zip(members, members[1:] + members[:1]):
                tiers |= {self.topo.link(l)["tier"] for l in self.topo.rank_route(a, b)}
        for t in ("host", "pcie", "nvlink"):
            if t in tiers:
                return "pcie" if t == "host" else t
        return "nvlink"

    def _eff(self, nbytes: float, tier: str, half: float | None = None) -> float:
        h = self.profile.half_size_bytes.get(tier, 0.0) if half is None else half
        return nbytes / (nbytes + h) if nbytes > 0 else 1.0

    # -- candidates ----------------------------------------------------------------------------
    def _simple_hop(self, tier: str) -> float:
        return self.profile.simple_step_s.get(tier, _TUNING["hop"][("ring", "simple")]["pcie" if tier == "host" else tier])

    def _hop(self, algo: str, proto: str, tier: str) -> float:
        if proto == "simple" and algo == "ring":
            return self._simple_hop(tier)
        return _TUNING["hop"][(algo, proto)]["pcie" if tier == "host" else tier]

    def _base(self, algo: str, proto: str) -> float:
        return self.profile.simple_base_s if proto == "simple" else _TUNING["base"][(algo, proto)]

    def _net_wire_s(self, group: tuple[int, ...]) -> float:
        per_node = self._by_node(group)
        if len(per_node) < 2:
            return 0.0
        return self.topo.route_latency_s(self.topo.rank_route(per_node[0][0], per_node[1][0]))

    def candidates(self, op: str, group: tuple[int, ...], nvls_enable: bool = True, *,
                   ll128: bool = True) -> list[tuple[str, str]]:
        """(algorithm, protocol) pairs NCCL enables for ``op`` on ``group`` (internal names); ``ll128`` False
        leaves LL128 out without testing the group's intra-node links (for a check no protocol choice depends on)."""
        if op in ("all_to_all", "send_recv"):
            return [("p2p", "simple")]
        per_node = self._by_node(group)
        n_nodes = len(per_node)
        protos = ["ll", "simple"] + (["ll128"] if ll128 and self._intra_tier(group) == "nvlink" else [])
        out = [("ring", p) for p in protos]
        if op == "all_reduce":
            out += [("tree", p) for p in protos]
            if nvls_enable and self._nvls_ok(group):
                out.append(("nvlstree" if n_nodes > 1 else "nvls", "simple"))
        return out

    def _nvls_ok(self, group: tuple[int, ...]) -> bool:
        c = self.topo.cluster
        return (c.nvls and self.profile.nvls_efficiency > 0 and len(group) > 1
                and min(len(m) for m in self._by_node(group)) >= 2)

    def _time(self, op: str, group: tuple[int, ...], nbytes: float, algo: str, proto: str,
              nchannels: int | None) -> tuple[float, float, str]:
        """(time_s, latency_s, bottleneck tier) of one candidate."""
        n = len(group)
        per_node = self._by_node(group)
        n_nodes = len(per_node)
        ppn = max(len(m) for m in per_node)
        if n == 1 or nbytes <= 0:
            return 0.0, 0.0, "nvlink"
        if algo == "p2p":
            return self._p2p_time(op, group, nbytes)
        intra = self._intra_tier(group)
        bus = nbytes * bus_factor(op, n) if op != "broadcast" and op != "reduce" else float(nbytes)
        b_ring, tier, b_inter = self.ring_bandwidth(group)
        if nchannels is not None:
            self._check_nchannels()
            b_ring = min(b_ring, nchannels * self.profile.channel_bytes_per_s)
        wire = self._net_wire_s(group)
        if algo == "ring":
            steps = 2 * (n - 1) if op == "all_reduce" else n - 1
            inter_steps = (2 * (n_nodes - 1) if op == "all_reduce" else n_nodes - 1) if n_nodes > 1 else 0
            lat = (self._base("ring", proto) + (steps - inter_steps) * self._hop("ring", proto, intra)
                   + inter_steps * (self._hop("ring", proto, "net") + wire))
            bw = b_ring * _PROTO_BW["ring"][proto] * self._eff(bus, tier)
            fill = nbytes / n / self.profile.ring_fill_bytes_per_s if self.profile.ring_fill_bytes_per_s else 0.0
            return lat + bus / bw + fill, lat, tier
        if algo == "tree":
            lat = self._base("tree", proto) + 2 * ((ppn - 1) * self._hop("tree", proto, intra)
                                                 + math.log2(n_nodes) * (self._hop("tree", proto, "net") + wire))
            bw = _TREE_BW * b_ring * _PROTO_BW["tree"][proto] * self._eff(bus, tier)
            # tuning.cc: tree algorithm bandwidth = 0.5 x bus bandwidth (time = 2 S / busbw)
            return lat + 2 * nbytes / bw, lat, tier
        # NVLS (one node) / NVLSTree (across nodes): port-limited algorithm bandwidth
        port = min(self.topo.link(l)["capacity_bytes_per_s"] for r in group
                   for l in self.topo.route(self.topo.gpu(r), f"n{self.topo.node_of(r)}.nvswitch"))
        alg = port * self.profile.nvls_efficiency * self._eff(nbytes, "nvlink", self.profile.nvls_half_size_bytes)
        lat = self.profile.nvls_latency_s
        if algo == "nvlstree":
            alg = min(alg, 0.5 * _TREE_BW * b_inter * self._eff(bus, "net"))
            lat += 2 * math.log2(n_nodes) * (_TUNING["nvlstree_net_hop"] + wire)
        if nchannels is not None:
            alg = min(alg, nchannels * self.profile.channel_bytes_per_s / bus_factor(op, n))
        return lat + nbytes / alg, lat, "nvlink" if algo == "nvls" else "net"

    def _check_nchannels(self) -> None:
        """Raises: CollectiveError: ``nccl.nchannels`` set on a profile without ``channel_bytes_per_s``."""
        if self.profile.channel_bytes_per_s <= 0:
            raise CollectiveError(f"nccl.nchannels: collective profile {self.profile.name} has no "
                                  f"channel_bytes_per_s to scale")

    def _p2p_time(self, op: str, group: tuple[int, ...], nbytes: float) -> tuple[float, float, str]:
        n = len(group)
        pairs = [(group[0], group[1])] if op == "send_recv" else [(a, b) for a in group for b in group if a != b]
        share = float(nbytes) if op == "send_recv" else nbytes / n
        load: dict[str, float] = {}
        worst = "nvlink"
        order = {"nvlink": 0, "pcie": 1, "host": 2, "net": 3}
        for a, b in pairs:
            for link in self.topo.rank_route(a, b):
                load[link] = load.get(link, 0.0) + share
                t = self.topo.link(link)["tier"]
                if order[t] > order[worst]:
                    worst = t
        t_bw, tier = 0.0, worst
        for link, by in load.items():
            cap, t = self._cap(link, self._p2p_eff)
            if by / cap > t_bw:
                t_bw, tier = by / cap, t
        lat = self._p2p_lat[worst]
        return lat + t_bw, lat, tier

    # -- public --------------------------------------------------------------------------------
    def price(self, op: str, ranks: Sequence[int], nbytes: int, nccl: NcclConfig | None = None) -> CollectiveResult:
        """Price ``op`` of ``nbytes`` over the process group ``ranks`` (global ranks).

        Args:
            op: One of ``OPS``.
            ranks: Global ranks of the group (``send_recv``: exactly [src, dst]).
            nbytes: Per-rank buffer bytes (reduce-scatter/all-gather: the total array), >= 0.
            nccl: Overrides; ``None`` = NCCL's defaults.

        Raises:
            CollectiveError: unknown op, bad group or size, or an algorithm the fabric or op
                cannot run (NVLS without an NVSwitch that reduces in the switch).
        """
        group, cfg, cands = self._candidates_for(op, ranks, nbytes, nccl)
        best = None
        for algo, proto in cands:
            t, lat, tier = self._time(op, group, nbytes, algo, proto, cfg.nchannels)
            if best is None or t < best[0]:
                best = (t, lat, tier, algo, proto)
        assert best is not None
        t, lat, tier, algo, proto = best
        n = len(group)
        alg = nbytes / t if t > 0 else 0.0
        disp = self.profile.host_dispatch_s
        return CollectiveResult(op=op, ranks=n, ranks_per_node=max(len(m) for m in self._by_node(group)),
                                nbytes=int(nbytes), time_s=t, latency_s=lat, host_dispatch_s=disp,
                                eager_time_s=max(disp, t), algbw_bytes_per_s=alg,
                                busbw_bytes_per_s=alg * bus_factor(op, n), algorithm=_ALGO_NAMES[algo],
                                protocol=_PROTO_NAMES[proto], bottleneck_tier=tier)

    def check(self, op: str, ranks: Sequence[int], nbytes: int, nccl: NcclConfig | None = None) -> None:
        """Raise what ``price`` would raise for these arguments, without pricing (no ring or route search: a
        world-sized group is checked in the time of its candidate list).

        Raises:
            CollectiveError: as ``price``.
        """
        group, cfg, cands = self._candidates_for(op, ranks, nbytes, nccl, check_only=True)
        if (cfg.nchannels is not None and len(group) > 1 and nbytes > 0
                and any(algo != "p2p" for algo, _ in cands)):
            self._check_nchannels()  # the one error ``_time`` raises

    def _candidates_for(self, op: str, ranks: Sequence[int], nbytes: int, nccl: NcclConfig | None,
                        check_only: bool = False):
        """``(group, nccl config, [(algorithm, protocol)])`` ``price`` chooses among, after its checks.
        ``check_only``: for ``check``; without ``nccl.proto`` LL128 is left out untested (every algorithm that
        offers it offers LL and Simple too, so no check depends on it).

        Raises:
            CollectiveError: as ``price``.
        """
        if op not in OPS:
            raise CollectiveError(f"op {op!r} is not modelled; allowed: {', '.join(OPS)}")
        if not isinstance(nbytes, (int, float)) or isinstance(nbytes, bool) or nbytes < 0:
            raise CollectiveError(f"bytes must be >= 0, got {nbytes!r}")
        group = self.check_group(ranks)
        if op == "send_recv" and len(group) != 2:
            raise CollectiveError(f"send_recv needs exactly 2 ranks [src, dst], got {len(group)}")
        cfg = nccl or NcclConfig()
        cands = self.candidates(op, group, cfg.nvls_enable, ll128=not check_only or cfg.proto is not None)
        if cfg.algo is not None:
            want = cfg.algo.lower()
            if want in ("nvls", "nvlstree") and not self._nvls_ok(group):
                raise CollectiveError(f"nccl.algo: {_ALGO_NAMES[want]} needs an NVSwitch with in-switch reduction "
                                      f"and >= 2 GPUs per node; {self.topo.cluster.name} "
                                      f"{'has none' if not self.topo.cluster.nvls else 'group does not qualify'}")
            if want in ("nvls", "nvlstree") and not cfg.nvls_enable:
                raise CollectiveError("nccl.algo: NVLS requested with nccl.nvls_enable: false")
            if op not in ("all_to_all", "send_recv"):
                cands = [c for c in cands if c[0] == want]
                if not cands:
                    raise CollectiveError(f"nccl.algo: {_ALGO_NAMES[want]} cannot run {op} on this group")
        if cfg.proto is not None and op not in ("all_to_all", "send_recv"):
            want_p = cfg.proto.lower()
            cands = [c for c in cands if c[1] == want_p]
            if not cands:
                raise CollectiveError(f"nccl.proto: {_PROTO_NAMES[want_p]} is not available for {op} with "
                                      f"algo {cfg.algo or 'any'} on this fabric (LL128 needs NVLink; NVLS is Simple only)")
        return group, cfg, cands


def standard_group(topology: Topology, ranks: int, ranks_per_node: int | None = None) -> list[int]:
    """The first ``ranks_per_node`` GPUs of each of ``ranks / ranks_per_node`` nodes.

    Raises:
        CollectiveError: ``ranks`` or ``ranks_per_node`` not positive, more ranks per node than
            GPUs, ranks not a multiple of ranks_per_node, or more nodes than the topology has.
    """
    g = topology.gpus_per_node
    if not isinstance(ranks, int) or ranks < 1:
        raise CollectiveError(f"--ranks must be >= 1, got {ranks!r}")
    rpn = min(ranks, g) if ranks_per_node is None else ranks_per_node
    if not isinstance(rpn, int) or rpn < 1 or rpn > g:
        raise CollectiveError(f"--ranks-per-node must be in 1..{g} for {topology.cluster.name}, got {rpn!r}")
    if ranks % rpn:
        raise CollectiveError(f"--ranks {ranks} is not a multiple of --ranks-per-node {rpn}")
    nodes = ranks // rpn
    if nodes > topology.nodes:
        raise CollectiveError(f"--ranks {ranks} at {rpn} per node needs {nodes} nodes; the topology has {topology.nodes}")
    return [k * g + i for k in range(nodes) for i in range(rpn)]


def bandwidths(results: Iterable[CollectiveResult]) -> list[float]:
    """busbw of each result, bytes/s (helper for reports)."""
    return [r.busbw_bytes_per_s for r in results]
