"""The cost-model interface."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from simulator.graph.ops import Op


@dataclass(slots=True)
class DeviceState:
    """The clocks an op runs at.

    Attributes:
        sm_clock_mhz: Current SM clock, MHz.
        mem_clock_mhz: Current memory clock, MHz.
    """

    sm_clock_mhz: float
    mem_clock_mhz: float


class CostModel(Protocol):
    """Prices GPU kernels and host work."""

    def duration_s(self, op: Op, state: DeviceState) -> float:
        """Seconds ``op`` takes at ``state`` (copies over links are priced by the engine)."""
        ...

    def split_s(self, op: Op, state: DeviceState) -> tuple[float, float, float]:
        """``(compute_s, memory_s, fixed_s)`` parts of the duration at ``state``."""
        ...
