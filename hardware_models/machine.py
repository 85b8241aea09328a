"""A whole machine as specs: one GPU with its efficiency profile, its host link and its host."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from hardware_models.collectives import CollectiveModel, NcclConfig
from hardware_models.fabrics import LinkSpec
from hardware_models.gpu import GpuSpec
from hardware_models.host import HostCpuSpec, HostMemorySpec
from hardware_models.profile import EfficiencyProfile


#: Host time per eager PyTorch op when neither the scenario nor the host gives one, s. Assumed:
#: PyTorch eager dispatch plus ``cudaLaunchKernel`` costs ~5-20 us per op on server CPUs; the measured
#: H200 host takes 9.6 us for a tiny eager kernel (tests/data/h200/measurements.json
#: micro.memory.tiny_kernel_us_eager). Generic: calibrate the host (``simulate calibrate``).
GENERIC_LAUNCH_OVERHEAD_S = 10e-6


class LaunchOverhead(NamedTuple):
    """Host dispatch time per op in force, and where it came from.

    Attributes:
        per_op_s: Host time per launched op, s (phases not in ``by_phase_s``).
        by_phase_s: Phase (``fwd``/``bwd``/``opt``) -> host time per launched op, s.
        source: ``"scenario"``, ``"profile"`` (a trace-calibrated profile file), ``"host"`` or ``"generic"``.
    """

    per_op_s: float
    by_phase_s: dict
    source: str


def resolve_launch_overhead(override_s: float | None, host: HostCpuSpec, profile: EfficiencyProfile) -> LaunchOverhead:
    """The host dispatch time per op, chosen in one place.

    Order: the scenario's ``hardware.launch_overhead_s`` (every phase) > a trace fit carried by the
    profile (a file written by ``simulate calibrate`` on the traced host; shipped GPU profiles carry
    none) > the host preset's ``launch_overhead_s`` / ``launch_overhead_by_phase_s`` >
    ``GENERIC_LAUNCH_OVERHEAD_S``. The dispatch time is the host's: swapping the GPU keeps it.
    """
    if override_s is not None:
        return LaunchOverhead(float(override_s), {}, "scenario")
    def first(*values):
        return next((float(v) for v in values if v is not None), GENERIC_LAUNCH_OVERHEAD_S)

    if profile.launch_overhead_s is not None or profile.launch_overhead_by_phase_s:
        return LaunchOverhead(first(profile.launch_overhead_s, host.launch_overhead_s),
                              dict(profile.launch_overhead_by_phase_s), "profile")
    if host.launch_overhead_s is not None or host.launch_overhead_by_phase_s:
        return LaunchOverhead(first(host.launch_overhead_s), dict(host.launch_overhead_by_phase_s), "host")
    return LaunchOverhead(GENERIC_LAUNCH_OVERHEAD_S, {}, "generic")


@dataclass
class Hardware:
    """Specs of the simulated machine (one representative GPU and its host).

    Attributes:
        gpu: GPU spec.
        profile: Achieved-efficiency profile of that GPU and its host link.
        pcie: Host link spec (its bandwidths are used when the profile has none).
        host_cpu: Host CPU spec.
        host_memory: Host memory spec.
        launch_overhead_s: Scenario override of the host time per eager op launch, s (None: the
            host's, see ``launch``).
        collectives: NCCL cost model over the cluster topology (None: one GPU, no cluster).
        world_size: Ranks in the cluster (1 without one).
        dp_group: Global ranks of the representative rank's data-parallel group.
        nccl: NCCL overrides for every collective (None: NCCL's tuner).
    """

    gpu: GpuSpec
    profile: EfficiencyProfile
    pcie: LinkSpec
    host_cpu: HostCpuSpec
    host_memory: HostMemorySpec
    launch_overhead_s: float | None = None
    collectives: CollectiveModel | None = None
    world_size: int = 1
    dp_group: tuple[int, ...] = (0,)
    nccl: NcclConfig | None = None
    extra: dict = field(default_factory=dict)

    @property
    def launch(self) -> LaunchOverhead:
        """Host dispatch time per op in force (``resolve_launch_overhead``)."""
        return resolve_launch_overhead(self.launch_overhead_s, self.host_cpu, self.profile)

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


