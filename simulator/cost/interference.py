"""Compute/communication interference on one GPU: what in-flight collectives take from kernels.

Model (research/MULTI_GPU.md section 5; factors per collective profile, with their sources, in
``hardware_models/presets/collectives/*.yaml``):

1. **SM stealing.** A collective holds one SM per NCCL channel (one thread block per channel):
   ``nccl.nchannels`` when the scenario sets it, else the profile's ``nccl_sm_channels`` (24 on
   H100/H200: NVIDIA developer forum thread 337991). Kernels beside it see ``sm_count - held``
   SMs; GEMMs re-quantise their waves (``RooflineCostModel.gemm_compute_s``).
2. **HBM share.** A collective moves ``beta x busbw`` bytes/s through each GPU's HBM
   (``hbm_bytes_per_bus_byte`` = beta = 3: per bus byte a ring step writes the received chunk
   into the FIFO, reads it, and writes the result; busbw = the collective's achieved nccl-tests
   bus bandwidth in isolation). Memory-bound kernels keep ``1 - sum(beta x busbw) / HBM peak`` of
   their bandwidth (MULTI_GPU.md section 5, item 2), floored at ``MIN_HBM_SHARE``.
3. **Collective slowed by compute.** While any compute kernel runs, a collective progresses at
   ``1 / (1 + gamma)`` of its isolated rate (``overlap_comm_slowdown`` = gamma = 0.3: vTrain
   about 30 %, Daydream about 34 %).

Published targets: overlapped compute 18.9 % slower on average, up to 40 % (Lee et al. 2025,
arXiv 2507.03114); a one-wave H100 GEMM nearly doubles beside an all-gather holding 24 SMs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

#: Smallest HBM share a kernel keeps beside collectives (the formula would reach 0 when the
#: collectives' traffic equals the HBM peak; no measurement goes that far, so it is a guard).
MIN_HBM_SHARE = 0.1


@dataclass(frozen=True, slots=True)
class InterferenceFactors:
    """The factors one run uses (reported in the summary's warnings).

    Attributes:
        sm_per_collective: SMs one in-flight collective holds.
        hbm_bytes_per_bus_byte: beta: HBM bytes per bus byte of a collective.
        comm_slowdown: gamma: a collective takes ``1 + gamma`` times longer while compute runs.
        profile: Name of the collective profile they come from.
        sm_source: Where ``sm_per_collective`` comes from (``nccl.nchannels`` or the profile).
    """

    sm_per_collective: int
    hbm_bytes_per_bus_byte: float
    comm_slowdown: float
    profile: str
    sm_source: str

    @classmethod
    def from_profile(cls, profile, nchannels: int | None) -> InterferenceFactors:
        """Factors of a ``CollectiveProfile``; ``nchannels`` (``nccl.nchannels``) overrides its channel count."""
        if nchannels is not None:
            sm, src = int(nchannels), "nccl.nchannels"
        else:
            sm, src = int(profile.nccl_sm_channels), "nccl_sm_channels"
        return cls(sm, float(profile.hbm_bytes_per_bus_byte), float(profile.overlap_comm_slowdown), profile.name, src)

    def describe(self, sm_count: int) -> str:
        """One line naming the factors (for the run's warnings)."""
        return (f"compute/communication interference modelled with collective profile {self.profile!r}: each "
                f"collective holds {self.sm_per_collective} of {sm_count} SMs ({self.sm_source}; GEMM waves "
                f"re-quantised on the rest) and {self.hbm_bytes_per_bus_byte:g} x its bus bandwidth of HBM traffic; "
                f"it runs {1 + self.comm_slowdown:.2f}x slower while compute overlaps it (published: overlapped "
                "compute 19% slower on average, up to 40%, Lee et al. 2025, arXiv 2507.03114); set "
                "nccl.interference: false to compare without it")


@dataclass(frozen=True, slots=True)
class CommLoad:
    """What one in-flight collective takes from the GPU: SMs and HBM traffic in bytes/s."""

    sm_held: int
    hbm_bytes_per_s: float


def comm_load(factors: InterferenceFactors, busbw_bytes_per_s: float) -> CommLoad:
    """Load of a collective of achieved bus bandwidth ``busbw_bytes_per_s`` (isolated), bytes/s."""
    return CommLoad(factors.sm_per_collective, factors.hbm_bytes_per_bus_byte * max(busbw_bytes_per_s, 0.0))


def kernel_share(loads: Iterable[CommLoad], sm_count: int, hbm_bytes_per_s: float) -> tuple[int, float]:
    """``(sm_held, hbm_share)`` a kernel sees beside the collectives ``loads``.

    SMs held add up, capped at ``sm_count - 1``; the HBM share is
    ``max(1 - sum(hbm_bytes_per_s) / hbm_bytes_per_s, MIN_HBM_SHARE)``.
    """
    sm, hbm = 0, 0.0
    for ld in loads:
        sm += ld.sm_held
        hbm += ld.hbm_bytes_per_s
    return min(sm, sm_count - 1), max(1.0 - hbm / hbm_bytes_per_s, MIN_HBM_SHARE) if hbm else 1.0
