"""Links (PCIe, NVLink, network) and max-min fair bandwidth sharing over them.

A *link* is one direction of a physical connection with a capacity in bytes/s, plus optional
shared constraints (a PCIe x16 slot carries both directions but not at twice the one-way rate).
Transfers are *fluid flows*: every flow crossing a set of links gets a rate from max-min fair
progressive filling (Bertsekas & Gallager, *Data Networks*, 2nd ed., section 6.5.2), re-computed
whenever a flow starts or ends. A flow crossing several links gets its bottleneck rate; a flow
may also carry its own rate cap (pageable copies are limited by the driver's staging copy).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import simpy


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
        """Raises: ValueError: non-positive bandwidth or negative latency."""
        if self.bandwidth_bytes_per_s <= 0:
            raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s}")
        if self.latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s}")
        for name in ("duplex_bandwidth_bytes_per_s", "pageable_h2d_bytes_per_s", "pageable_d2h_bytes_per_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")


class _Flow:
    __slots__ = ("remaining", "links", "cap", "rate", "done", "id")

    def __init__(self, fid: int, nbytes: float, links: tuple[str, ...], cap: float, done: simpy.Event):
        self.id = fid
        self.remaining = float(nbytes)
        self.links = links
        self.cap = cap
        self.rate = 0.0
        self.done = done


class FluidNetwork:
    """Max-min fair sharing of link capacities among concurrent transfers.

    Args:
        env: The SimPy environment.
        capacities: Link name -> capacity in bytes/s.

    Example:
        Two 1 GB flows on one 1 GB/s link both finish at t = 2 s; one alone finishes at 1 s.
    """

    _EPS = 1e-12

    def __init__(self, env: simpy.Environment, capacities: dict[str, float]):
        for name, c in capacities.items():
            if c <= 0:
                raise ValueError(f"link {name!r} capacity must be > 0, got {c}")
        self.env = env
        self.capacities = dict(capacities)
        self._flows: dict[int, _Flow] = {}
        self._ids = itertools.count()
        self._last_t = 0.0
        self._generation = 0
        #: bytes carried per link (for utilisation).
        self.bytes_carried: dict[str, float] = {k: 0.0 for k in capacities}

    def transfer(self, nbytes: float, links: tuple[str, ...], latency_s: float = 0.0, cap_bytes_per_s: float = 0.0):
        """SimPy process body: move ``nbytes`` over ``links`` after ``latency_s``.

        Args:
            nbytes: Bytes to move (>= 0).
            links: Link names the flow crosses (all must exist).
            latency_s: Fixed delay before the data starts flowing, s.
            cap_bytes_per_s: Per-flow rate cap (0 = none).

        Raises:
            KeyError: an unknown link name.
        """
        for name in links:
            if name not in self.capacities:
                raise KeyError(f"unknown link {name!r}; known: {sorted(self.capacities)}")
        if latency_s > 0:
            yield self.env.timeout(latency_s)
        if nbytes <= 0:
            return
        done = self.env.event()
        self._advance()
        fid = next(self._ids)
        self._flows[fid] = _Flow(fid, nbytes, tuple(links), cap_bytes_per_s or float("inf"), done)
        for name in links:
            self.bytes_carried[name] += nbytes
        self._reschedule()
        yield done

    # -- internals -------------------------------------------------------------------------
    def _advance(self) -> None:
        dt = self.env.now - self._last_t
        if dt > 0:
            for f in self._flows.values():
                f.remaining -= f.rate * dt
        self._last_t = self.env.now

    def _rates(self) -> None:
        """Progressive filling: raise all unfrozen flows' rates together until a link or cap binds."""
        flows = list(self._flows.values())
        for f in flows:
            f.rate = 0.0
        active = set(range(len(flows)))
        residual = dict(self.capacities)
        while active:
            users: dict[str, int] = {}
            for i in active:
                for name in flows[i].links:
                    users[name] = users.get(name, 0) + 1
            inc = min((residual[n] / k for n, k in users.items()), default=float("inf"))
            inc = min(inc, min(flows[i].cap - flows[i].rate for i in active))
            for i in active:
                flows[i].rate += inc
            for n, k in users.items():
                residual[n] -= inc * k
            frozen = {
                i
                for i in active
                if flows[i].cap - flows[i].rate <= self._EPS * max(1.0, flows[i].cap if flows[i].cap != float("inf") else 1.0)
                or any(residual[n] <= self._EPS * self.capacities[n] for n in flows[i].links)
            }
            if not frozen:  # numerical safety
                break
            active -= frozen

    def _reschedule(self) -> None:
        self._rates()
        self._generation += 1
        gen = self._generation
        if not self._flows:
            return
        t_next = min(
            (f.remaining / f.rate if f.rate > 0 else float("inf")) for f in self._flows.values()
        )
        if t_next == float("inf"):
            return
        self.env.process(self._wake(max(t_next, 0.0), gen))

    def _wake(self, delay: float, gen: int):
        yield self.env.timeout(delay)
        if gen != self._generation:
            return
        self._advance()
        finished = [f for f in self._flows.values() if f.remaining <= 1e-6 * max(1.0, f.rate * 1e-9) or f.remaining <= 1e-3]
        for f in finished:
            del self._flows[f.id]
            f.done.succeed()
        self._reschedule()
