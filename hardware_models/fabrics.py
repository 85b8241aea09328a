"""Links (PCIe, NVLink, network) and max-min fair bandwidth sharing over them.

A *link* is one direction of a physical connection with a capacity in bytes/s, plus optional
shared constraints (a PCIe x16 slot carries both directions but not at twice the one-way rate).
Transfers are *fluid flows*: every flow crossing a set of links gets a rate from max-min fair
progressive filling (Bertsekas & Gallager, *Data Networks*, 2nd ed., section 6.5.2), re-computed
whenever a flow starts or ends (solver and time stepping: ``hardware_models.fluid``). A flow crossing several links gets its bottleneck rate; a flow
may also carry its own rate cap (pageable copies are limited by the driver's staging copy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import simpy

from hardware_models.fluid import FluidFlow, FluidScheduler, maxmin_rates, weighted_maxmin_rates

#: most entries of ``FluidNetwork``'s memo of shared rates before it starts afresh
_MEMO_MAX = 4096


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """A link product (per direction).

    Attributes:
        name: Product name (``"PCIe Gen5 x16"``).
        bandwidth_bytes_per_s: Achievable one-direction bandwidth, bytes/s.
        duplex_bandwidth_bytes_per_s: Achievable sum of both directions when both are busy,
            bytes/s (0 = twice the one-way rate).
        latency_s: Per-transfer fixed latency, s.
        pageable_h2d_bytes_per_s: Host-to-device rate from pageable memory (0 = same as pinned).
        pageable_d2h_bytes_per_s: Device-to-host rate to pageable memory (0 = same as pinned).
        sources: Citation per field.
    """

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float = 0.0
    duplex_bandwidth_bytes_per_s: float = 0.0
    pageable_h2d_bytes_per_s: float = 0.0
    pageable_d2h_bytes_per_s: float = 0.0
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Raises: ValueError: non-positive or infinite bandwidth, negative or infinite latency."""
        if not (self.bandwidth_bytes_per_s > 0 and math.isfinite(self.bandwidth_bytes_per_s)):
            raise ValueError(f"bandwidth_bytes_per_s must be a positive finite number, got {self.bandwidth_bytes_per_s}")
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"latency_s must be >= 0 and finite, got {self.latency_s}")
        for name in ("duplex_bandwidth_bytes_per_s", "pageable_h2d_bytes_per_s", "pageable_d2h_bytes_per_s"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be >= 0 and finite, got {v}")


class FluidNetwork:
    """Max-min fair sharing of link capacities among concurrent transfers.

    Args:
        env: The SimPy environment.
        capacities: Link name -> capacity in bytes/s (> 0).

    Raises:
        ValueError: a capacity that is not a positive finite number.

    The time stepping (and its termination for any finite input) is ``hardware_models.fluid``'s.

    Example:
        Two 1 GB flows on one 1 GB/s link both finish at t = 2 s; one alone finishes at 1 s.
    """

    def __init__(self, env: simpy.Environment, capacities: dict[str, float]):
        self.env = env
        self.capacities: dict[str, float] = {}
        self._fluid = FluidScheduler(env, self._rates)
        #: bytes carried per link (for utilisation).
        self.bytes_carried: dict[str, float] = {}
        #: weighted names of links: name -> (link, weight) (``add_weighted_name``; empty: the unweighted solver)
        self.weighted: dict[str, tuple[str, float]] = {}
        #: link tuples found to exist (``_check``; links are only ever added, so a tuple stays valid)
        self._known: set[tuple] = set()
        #: ``_rates`` of several flows by their ``(links, cap)``s: a pure function of them and the capacities (emptied
        #: when links are added)
        self._memo: dict[tuple, tuple] = {}
        self.add_links(capacities)

    def add_links(self, capacities: dict[str, float]) -> None:
        """Add links (name -> capacity, bytes/s). Raises: ValueError: a capacity that is not a positive
        finite number, or a name that exists already."""
        for name, c in capacities.items():
            if not (c > 0 and math.isfinite(c)):
                raise ValueError(f"link {name!r} capacity must be a positive finite number, got {c}")
            if name in self.capacities:
                raise ValueError(f"link {name!r} exists already")
        self.capacities.update(capacities)
        self.bytes_carried.update({k: 0.0 for k in capacities})
        self._memo.clear()

    def add_weighted_name(self, name: str, link: str, weight: float) -> None:
        """Let flows cross ``link`` under the name ``name`` loading it by ``weight`` x their rate (a drive's writes,
        which take ``read_bw / write_bw`` of its time per byte). Once a network has one, its rates come from
        ``fluid.weighted_maxmin_rates``.

        Raises:
            KeyError: ``link`` unknown. ValueError: ``name`` taken, or ``weight`` not a positive finite number.
        """
        if link not in self.capacities:
            raise KeyError(f"unknown link {link!r}; known: {sorted(self.capacities)}")
        if name in self.capacities or name in self.weighted:
            raise ValueError(f"link {name!r} exists already")
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"weight of {name!r} must be a positive finite number, got {weight!r}")
        self.weighted[name] = (link, float(weight))
        self._memo.clear()

    def _count(self, links, nbytes: float) -> None:
        """Add ``nbytes`` to ``bytes_carried`` of each link crossed (a weighted name: its link, weighted).
        Raises: KeyError: an unknown link name."""
        for name in links:
            if name in self.capacities:
                continue
            if name not in self.weighted:
                raise KeyError(f"unknown link {name!r}; known: {sorted(self.capacities)}")
        for name in links:
            if name in self.capacities:
                self.bytes_carried[name] += nbytes
            else:
                link, w = self.weighted[name]
                self.bytes_carried[link] += w * nbytes

    def _check(self, links: tuple) -> None:
        """Raises: KeyError: a link of ``links`` that does not exist."""
        if links in self._known:
            return
        for name in links:
            if name not in self.capacities and name not in self.weighted:
                raise KeyError(f"unknown link {name!r}; known: {sorted(self.capacities)}")
        self._known.add(links)

    def _carried(self, links: tuple, nbytes: float) -> None:
        """Add a flow's ``nbytes`` to ``bytes_carried`` of the links it crosses."""
        if self.weighted:
            self._count(links, nbytes)
        else:
            carried = self.bytes_carried
            for name in links:
                carried[name] += nbytes

    @staticmethod
    def _check_transfer(nbytes: float, cap_bytes_per_s: float) -> None:
        """Raises: ValueError: ``nbytes`` NaN or infinite, ``cap_bytes_per_s`` negative (``transfer``)."""
        if not math.isfinite(nbytes):
            raise ValueError(f"transfer size must be finite, got {nbytes!r} bytes")
        if cap_bytes_per_s < 0:
            raise ValueError(f"cap_bytes_per_s must be >= 0, got {cap_bytes_per_s!r}")

    def transfer(self, nbytes: float, links: tuple[str, ...], latency_s: float = 0.0, cap_bytes_per_s: float = 0.0):
        """SimPy process body: move ``nbytes`` over ``links`` after ``latency_s``.

        Args:
            nbytes: Bytes to move (>= 0, finite).
            links: Link names the flow crosses (all must exist).
            latency_s: Fixed delay before the data starts flowing, s.
            cap_bytes_per_s: Per-flow rate cap (0 = none).

        Raises:
            KeyError: an unknown link name.
            ValueError: ``nbytes`` is NaN or infinite, or ``cap_bytes_per_s`` is negative.
        """
        links = tuple(links)
        self._check(links)
        self._check_transfer(nbytes, cap_bytes_per_s)
        if latency_s > 0:
            yield self.env.timeout(latency_s)
        if nbytes <= 0:
            return
        if not links and not cap_bytes_per_s:
            return  # crosses nothing and has no cap: instantaneous
        done = self._fluid.add(nbytes, links, cap_bytes_per_s or math.inf)
        self._carried(links, nbytes)
        yield done

    def moves(self, nbytes: float, links: tuple[str, ...], cap_bytes_per_s: float = 0.0) -> bool:
        """Whether ``transfer(nbytes, links, latency, cap_bytes_per_s)`` moves anything after its latency (False: it
        ends then). Raises: as ``transfer``."""
        self._check(links)
        self._check_transfer(nbytes, cap_bytes_per_s)
        return nbytes > 0 and bool(links or cap_bytes_per_s)

    def move(self, nbytes: float, links: tuple[str, ...], cap_bytes_per_s: float = 0.0) -> simpy.Event | None:
        """Start ``transfer``'s flow now (``moves`` true; after its latency), for a caller that may move the clock
        (``FluidScheduler.run``): None when it was the first to end, before anything else is due, and has been run
        to its end (the clock is there; the same end to the last bit, the same ``bytes_carried`` and the same state
        of the flows beside it), else its end event."""
        done = self._fluid.run(nbytes, links, cap_bytes_per_s or math.inf)
        self._carried(links, nbytes)
        return done

    def start(self, nbytes: float, links: tuple[str, ...], cap_bytes_per_s: float = math.inf) -> FluidFlow:
        """Start moving ``nbytes`` (> 0, finite) over ``links`` now, at most at ``cap_bytes_per_s``; returns
        the flow (``flow.done`` fires at its end; ``set_caps`` changes its cap).

        Raises:
            KeyError: an unknown link name.
            ValueError: as ``FluidScheduler.add``, or no link and no cap.
        """
        links = tuple(links)
        self._check(links)
        if not links and cap_bytes_per_s == math.inf:
            raise ValueError("a flow that crosses no link needs a rate cap")
        flow = self._fluid.add_flow(nbytes, links, cap_bytes_per_s)
        self._carried(links, nbytes)
        return flow

    def set_caps(self, caps: list[tuple[FluidFlow, float]]) -> None:
        """Change the rate caps of live flows (``(flow, cap)``, cap > 0) now; every rate is recomputed.

        Raises:
            ValueError: a cap that is not > 0.
        """
        for _, c in caps:
            if not c > 0:
                raise ValueError(f"flow rate cap must be > 0, got {c!r}")
        self._fluid.advance()
        for f, c in caps:
            f.cap = c
        self._fluid.reschedule()

    def _rates(self, flows: list[FluidFlow]) -> None:
        caps = self.capacities
        if self.weighted:  # a network with weighted names (NVMe offload): the weighted solver for every flow
            wn = self.weighted
            spec = [(tuple(wn[k] if k in wn else (k, 1.0) for k in f.links), f.cap) for f in flows]
            for f, r in zip(flows, weighted_maxmin_rates(spec, caps)):
                f.rate = r
            return
        if len(flows) == 1:  # a lone flow gets its bottleneck (``maxmin_rates`` of one flow, without the lists)
            f = flows[0]
            level = f.cap
            for k in f.links:
                if caps[k] < level:
                    level = caps[k]
            if level == math.inf:
                maxmin_rates([(f.links, f.cap)], caps)  # raises: unbounded
            f.rate = level
            return
        key = tuple([(f.links, f.cap) for f in flows])
        rates = self._memo.get(key)
        if rates is None:
            if len(self._memo) >= _MEMO_MAX:  # (flows re-capped by interference give ever new caps)
                self._memo.clear()
            rates = self._memo[key] = self._shared_rates(flows, caps)
        for f, r in zip(flows, rates):
            f.rate = r

    @staticmethod
    def _shared_rates(flows: list[FluidFlow], caps: dict) -> tuple:
        """Max-min rates of several unweighted flows over links of capacities ``caps``."""
        seen: set = set()  # fast path: no link carries two flows -> each flow gets its own bottleneck
        shared = False
        for f in flows:
            for k in f.links:
                if k in seen:
                    shared = True
                    break
                seen.add(k)
            if shared:
                break
        if not shared:
            return tuple([min(f.cap, min((caps[k] for k in f.links), default=math.inf)) for f in flows])
        return tuple(maxmin_rates([(f.links, f.cap) for f in flows], caps))
