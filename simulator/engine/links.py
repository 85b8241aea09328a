"""The links the simulated ranks of one run load, and the calls they share.

``Fabric`` owns one ``hardware_models.fabrics.FluidNetwork`` (max-min fair sharing) for every simulated
rank of a run (``engine.run.run_ranks``): each rank's ``System`` adds its own links to it under a prefix
(``""`` for the first rank, ``"r1."``, ``"r2."``, ... after), so that a transfer between two simulated
ranks (a pipeline send/recv) is one set of flows over both ranks' links.

A call shared by several simulated ranks (``SharedCall``: a pipeline send/recv or cross-stage
all-reduce, met at a rendezvous) starts once every party has joined and ends at the same time for all
of them: each party adds the flows over its own links, the flows start together after the call's
latency, and the call is done when the last of them ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

import simpy

from hardware_models.fabrics import FluidNetwork


@dataclass
class SharedCall:
    """One collective call that several simulated ranks run together.

    Attributes:
        parties: Members that must join before it starts.
        latency_s: Fixed latency before the data moves, s (the NCCL model's, the same for every party).
        done: Fires when the last flow of every party has ended.
        flows: ``(links, bytes, cap_bytes_per_s)`` added by the parties so far.
        alone_s: Time the flows take alone after the latency (the longest any party gave), s: the
            call takes this when it has no flow (nothing crosses a modelled link).
        joined: Parties joined so far.
    """

    parties: int
    latency_s: float
    done: simpy.Event
    flows: list = field(default_factory=list)
    alone_s: float = 0.0
    joined: int = 0


class Fabric:
    """The run's network of links and its open shared calls.

    Args:
        env: The SimPy environment every simulated rank runs in.
    """

    def __init__(self, env: simpy.Environment):
        self.env = env
        #: every simulated rank's links (``System`` adds them, prefixed)
        self.network = FluidNetwork(env, {})
        self._calls: dict[Hashable, SharedCall] = {}
        self._ranks = 0

    def new_prefix(self) -> str:
        """The link-name prefix of the next simulated rank: ``""`` for the first, ``"r<k>."`` after."""
        k, self._ranks = self._ranks, self._ranks + 1
        return "" if k == 0 else f"r{k}."

    def join(self, key: Hashable, parties: int, latency_s: float, flows: list, alone_s: float, run) -> simpy.Event:
        """Join shared call ``key`` of ``parties`` members with this party's ``flows``; the last to join
        starts ``run(call)`` (a SimPy process body that moves the flows and succeeds ``call.done``).
        Returns ``call.done``."""
        call = self._calls.get(key)
        if call is None:
            call = self._calls[key] = SharedCall(parties, latency_s, self.env.event())
        call.flows.extend(flows)
        call.alone_s = max(call.alone_s, alone_s)
        call.joined += 1
        if call.joined >= parties:
            del self._calls[key]
            self.env.process(run(call))
        return call.done
