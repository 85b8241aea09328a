"""Rendezvous between ranks simulated side by side (pipeline stages): an op that names a rendezvous
starts only when every party has reached it, as an NCCL send/recv or collective starts when its
last member arrives.
"""

from __future__ import annotations

import simpy


class RendezvousError(RuntimeError):
    """A rendezvous was joined by more parties than it names."""


class Rendezvous:
    """Meeting points keyed by ``(key, step)``.

    Args:
        env: The SimPy environment every party runs in.
    """

    def __init__(self, env: simpy.Environment):
        self.env = env
        self._open: dict[tuple, tuple[simpy.Event, list[float]]] = {}
        #: ``(key, step) -> (first arrival, last arrival)`` seconds, for the waits each rank saw
        self.arrivals: dict[tuple, tuple[float, float]] = {}

    def arrive(self, key, step: int, parties: int) -> simpy.Event:
        """Join meeting ``(key, step)`` of ``parties`` members now; the event fires when the last joins.

        Raises:
            RendezvousError: more than ``parties`` members joined.
        """
        k = (key, step)
        ev, times = self._open.get(k) or self._open.setdefault(k, (self.env.event(), []))
        times.append(self.env.now)
        if len(times) > parties:
            raise RendezvousError(f"rendezvous {key!r} of step {step} joined by {len(times)} > {parties} parties")
        if len(times) == parties:
            del self._open[k]
            self.arrivals[k] = (min(times), max(times))
            ev.succeed()
        return ev

    def pending(self) -> list[tuple]:
        """Meetings some party is still waiting at (a run that ends with these has deadlocked)."""
        return list(self._open)
