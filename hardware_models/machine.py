"""A whole machine as specs: one GPU with its efficiency profile, its host link and its host."""

from __future__ import annotations

from dataclasses import dataclass, field

from hardware_models.fabrics import LinkSpec
from hardware_models.gpu import GpuSpec
from hardware_models.host import HostCpuSpec, HostMemorySpec
from hardware_models.profile import EfficiencyProfile


@dataclass
class Hardware:
    """Specs of the simulated machine (one representative GPU and its host).

    Attributes:
        gpu: GPU spec.
        profile: Achieved-efficiency profile of that GPU and its host link.
        pcie: Host link spec (its bandwidths are used when the profile has none).
        host_cpu: Host CPU spec.
        host_memory: Host memory spec.
        launch_overhead_s: Host time per eager op launch, s (profile value unless overridden).
    """

    gpu: GpuSpec
    profile: EfficiencyProfile
    pcie: LinkSpec
    host_cpu: HostCpuSpec
    host_memory: HostMemorySpec
    launch_overhead_s: float | None = None
    extra: dict = field(default_factory=dict)

    def link_rate(self, kind: str, pinned: bool) -> tuple[float, float]:
        """``(bandwidth_bytes_per_s, cap_bytes_per_s)`` of a copy (``kind`` "memcpy_h2d" or "memcpy_d2h").

        Pinned copies run at the link rate (profile's measured rate, else the link spec);
        pageable copies are capped by the driver's staging rate.
        """
        p, link = self.profile, self.pcie
        if kind in ("h2d", "memcpy_h2d"):
            bw = p.h2d_bytes_per_s or link.bandwidth_bytes_per_s
            pg = p.pageable_h2d_bytes_per_s or link.pageable_h2d_bytes_per_s
        else:
            bw = p.d2h_bytes_per_s or link.bandwidth_bytes_per_s
            pg = p.pageable_d2h_bytes_per_s or link.pageable_d2h_bytes_per_s
        return bw, (0.0 if pinned or not pg else pg)


