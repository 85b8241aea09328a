"""The simulated machine: one GPU's compute and copy engines, its PCIe link, host CPU and memory.

``System`` instantiates the runtime objects the executor needs from the specs: the cost model,
the fluid network of links (PCIe per direction plus the shared duplex limit), memory pools
(HBM, pinned and pageable host memory) and the current device clocks.
"""

from __future__ import annotations

import simpy

from hardware_models.fabrics import FluidNetwork
from hardware_models.machine import Hardware
from simulator.cost.base import DeviceState
from simulator.cost.roofline import RooflineCostModel
from simulator.engine.memory import MemoryPool
from simulator.graph.ops import OpKind

#: Links crossed by each copy direction.
COPY_PATHS = {
    OpKind.MEMCPY_H2D: ("pcie.h2d", "pcie.duplex"),
    OpKind.MEMCPY_D2H: ("pcie.d2h", "pcie.duplex"),
}


class System:
    """Runtime objects of one simulated run.

    Args:
        env: SimPy environment.
        hw: Hardware specs.
        recorder: The run's recorder (runtime components record counters through it).
    """

    def memory_counters(self) -> list[tuple[float, str, str, int]]:
        """Memory timelines of all pools as counter rows ``(t_s, scope, "memory_bytes", bytes)``."""
        return [(t, pool.name, "memory_bytes", v) for pool in self.memory.values() for t, v in pool.timeline]

    def __init__(self, env: simpy.Environment, hw: Hardware, recorder):
        self.env = env
        self.hw = hw
        self.recorder = recorder
        self.cost = RooflineCostModel(hw.gpu, hw.profile)
        c = hw.copy  # profile's measured rates > link preset (hardware_models.machine.resolve_copy_rates)
        self.network = FluidNetwork(env, {"pcie.h2d": c.h2d_bytes_per_s, "pcie.d2h": c.d2h_bytes_per_s,
                                          "pcie.duplex": c.duplex_bytes_per_s})
        self.copy_latency_s = c.latency_s
        launch = hw.launch  # scenario > calibrated profile > host > generic (hardware_models.machine)
        self.launch_overhead_s = launch.per_op_s
        #: host time per launched op by phase (a scenario override applies to every phase)
        self.launch_overhead_by_phase_s = launch.by_phase_s
        self.state = DeviceState(hw.gpu.max_sm_clock_mhz, hw.gpu.mem_clock_mhz or 1.0)
        self._collective_s: dict[tuple[str, str, int], float] = {}
        clock = lambda: env.now  # noqa: E731
        self.memory = {
            "gpu": MemoryPool("gpu0.hbm", hw.gpu.hbm_capacity_bytes, clock),
            "host_pinned": MemoryPool("host.pinned", hw.host_memory.pinned_capacity_bytes, clock),
            "host_pageable": MemoryPool("host.pageable", hw.host_memory.capacity_bytes, clock),
        }

    def collective_model(self, op) -> bool:
        """Whether ``op`` is a collective this machine prices with its NCCL model (``meta["collective"]``)."""
        return self.hw.collectives is not None and bool(op.meta) and "collective" in op.meta

    def collective_s(self, op) -> float:
        """Device time of collective ``op`` over its group (``meta``: ``collective``, ``bytes``, ``group``), s.

        Priced once per (collective, group, bytes) by ``hw.collectives.price(...).time_s`` with the
        scenario's NCCL settings; the group ``"dp"`` is ``hw.dp_group``, ``"tp"`` is ``hw.tp_group``.

        Raises:
            CollectiveError: an unknown group name or an op/size the model cannot price.
        """
        m = op.meta
        key = (m["collective"], m.get("group", "dp"), int(m["bytes"]))
        t = self._collective_s.get(key)
        if t is None:
            from hardware_models.collectives import CollectiveError

            groups = {"dp": self.hw.dp_group, "tp": self.hw.tp_group}
            if key[1] not in groups:
                raise CollectiveError(f"op {op.name}: process group {key[1]!r} is not modelled (allowed: dp, tp)")
            t = self._collective_s[key] = self.hw.collectives.price(key[0], groups[key[1]], key[2],
                                                                      self.hw.nccl).time_s
        return t

    @property
    def collective_dispatch_s(self) -> float:
        """Host time of one eager collective call (the collective profile's ``host_dispatch_s``), s."""
        return self.hw.collectives.profile.host_dispatch_s if self.hw.collectives is not None else 0.0
