"""Device and host memory accounting: live bytes, peak, and out-of-memory detection.

Allocation never blocks (the simulator reports out-of-memory instead of deadlocking): an
allocation that takes the live total above capacity is recorded as an ``OomEvent`` naming the
tensor, the live total and the capacity, and the run goes on so that the peak is still known.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class OomEvent:
    """The first allocation that did not fit.

    Attributes:
        pool: ``"gpu"``, ``"host_pinned"``...
        tensor: Tensor that did not fit.
        t_s: Simulated time, s.
        requested_bytes: Size of that tensor.
        live_bytes: Live bytes including it.
        capacity_bytes: Capacity of the pool.
        top_consumers: Largest live categories at that moment, ``[(category, bytes)]``.
    """

    pool: str
    tensor: str
    t_s: float
    requested_bytes: int
    live_bytes: int
    capacity_bytes: float
    top_consumers: tuple[tuple[str, int], ...]

    @property
    def shortfall_bytes(self) -> float:
        """Bytes over capacity."""
        return self.live_bytes - self.capacity_bytes

    def message(self) -> str:
        """One-line description."""
        top = ", ".join(f"{c} {b / 1e9:.2f} GB" for c, b in self.top_consumers[:4])
        return (f"out of memory on {self.pool}: needs {self.live_bytes / 1e9:.2f} GB, capacity "
                f"{self.capacity_bytes / 1e9:.2f} GB (short by {self.shortfall_bytes / 1e9:.2f} GB) "
                f"allocating {self.tensor}; largest: {top}")


@lru_cache(maxsize=65536)
def category(tensor: str) -> str:
    """Memory category of a tensor from its name (``params``, ``grad``, ``optimizer``, ``activations``...)."""
    head = tensor.split(".", 1)[0].split("#", 1)[0]
    if head in ("params", "grad", "optimizer", "workspace", "input"):
        return {"input": "activations"}.get(head, head)
    if head.startswith(("offload", "host")):
        return "offload_buffers"
    return "activations"


class MemoryPool:
    """Live-byte accounting for one memory (HBM, pinned host, pageable host).

    Args:
        name: Pool name.
        capacity_bytes: Capacity, bytes.
        clock: Callable returning the current simulated time, s (for the memory timeline).
    """

    def __init__(self, name: str, capacity_bytes: float, clock=None):
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.live = 0
        self.peak = 0
        self.by_category: dict[str, int] = defaultdict(int)
        self.peak_by_category: dict[str, int] = {}
        self.sizes: dict[str, int] = {}
        self.oom: OomEvent | None = None
        self._clock = clock
        #: ``(t_s, live_bytes)`` after every change; changes at one instant keep the last value
        self.timeline: list[tuple[float, int]] = []

    def alloc(self, tensor: str, nbytes: int, t_s: float) -> None:
        """Allocate ``nbytes`` for ``tensor`` (records the first out-of-memory)."""
        self.sizes[tensor] = nbytes
        self.live += nbytes
        self.by_category[category(tensor)] += nbytes
        if self.live > self.peak:
            self.peak = self.live
            self.peak_by_category = dict(self.by_category)
        if self.live > self.capacity_bytes and self.oom is None:
            top = tuple(sorted(self.by_category.items(), key=lambda kv: -kv[1]))
            self.oom = OomEvent(self.name, tensor, t_s, nbytes, self.live, self.capacity_bytes, top)
        self._sample()

    def _sample(self) -> None:
        if self._clock is None:
            return
        t = self._clock()
        tl = self.timeline
        if tl and tl[-1][0] == t:
            tl[-1] = (t, self.live)
        else:
            tl.append((t, self.live))

    def oom_message(self) -> str | None:
        """One line for the out-of-memory result, or None if everything fitted.

        States the peak demand against the capacity (the shortfall to remove), the first tensor
        that did not fit, and the largest consumers at the peak.
        """
        if self.oom is None:
            return None
        top = sorted(self.peak_by_category.items(), key=lambda kv: -kv[1])
        cats = ", ".join(f"{c} {b / 1e9:.2f} GB" for c, b in top[:4] if b > 0)
        return (f"out of memory on {self.name}: peak demand {self.peak / 1e9:.2f} GB exceeds the capacity "
                f"{self.capacity_bytes / 1e9:.2f} GB by {(self.peak - self.capacity_bytes) / 1e9:.2f} GB; "
                f"first allocation over capacity: {self.oom.tensor} ({self.oom.requested_bytes / 1e9:.3f} GB) "
                f"at t={self.oom.t_s * 1e3:.3f} ms; largest at peak: {cats}")

    def free(self, tensor: str) -> None:
        """Free a tensor allocated earlier (unknown names are ignored)."""
        nbytes = self.sizes.pop(tensor, None)
        if nbytes is None:
            return
        self.live -= nbytes
        self.by_category[category(tensor)] -= nbytes
        self._sample()
