"""The calls the simulated ranks of one run share.

Each simulated rank's ``System`` owns the ``hardware_models.fabrics.FluidNetwork`` of its own links (its
NVLink port, NIC rail and PCIe link; max-min fair sharing among its flows). A call shared by several simulated ranks (``SharedCall``: a pipeline send/recv or cross-stage
all-reduce, met at a rendezvous) starts once every party has joined and ends at the same time for all
of them: each party adds the flows over its own links, the flows start together after the call's
latency, and the call is done when the last of them ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

import simpy


@dataclass
class SharedCall:
    """One collective call that several simulated ranks run together.

    Attributes:
        parties: Members that must join before it starts.
        latency_s: Fixed latency before the data moves, s (the NCCL model's, the same for every party).
        done: Fires when the last flow of every party has ended.
        flows: ``(network, links, bytes, cap_bytes_per_s)`` added by the parties so far (each on its party's
            network: the parties' links are disjoint).
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
    """The run's open shared calls.

    Args:
        env: The SimPy environment every simulated rank runs in.
    """

    def __init__(self, env: simpy.Environment):
        self.env = env
        self._calls: dict[Hashable, SharedCall] = {}

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
