"""Efficiency profile: how close a real GPU (and its host link) gets to its datasheet peaks.

A roofline needs, besides peaks, the *achieved* fraction for each kind of kernel. The profile
holds those numbers, fitted by a script from microbenchmarks (``scripts/build_h200_profile.py``)
or by ``simulate calibrate`` from profiler traces, and records where they came from.

GEMM model (per dtype): cuBLAS tiles the output ``m x n`` into ``tile_m x tile_n`` tiles that run
one per SM in *waves*; a GEMM takes ``fixed_s + waves * (wave_overhead_s + tile_flops /
(peak / sm_count * efficiency))`` with ``waves = tiles / sm_count`` (fractional waves: cuBLAS
picks tiles and split-K to fill the machine). This is the wave-quantisation view of NVIDIA's
*Matrix Multiplication Background User's Guide* (docs.nvidia.com/deeplearning/performance).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class GemmEfficiency:
    """Fitted GEMM parameters for one dtype.

    Attributes:
        efficiency: Fraction of peak FLOP/s reached inside a full wave (0-1].
        wave_overhead_s: Fixed time per wave (prologue/epilogue), s.
        fixed_s: Fixed time per GEMM kernel, s.
        tile_m: Output tile rows.
        tile_n: Output tile columns.
    """

    efficiency: float
    wave_overhead_s: float = 0.0
    fixed_s: float = 0.0
    tile_m: int = 128
    tile_n: int = 256

    def __post_init__(self) -> None:
        """Raises: ValueError: efficiency outside (0, 1] or negative times."""
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1], got {self.efficiency}")
        if self.wave_overhead_s < 0 or self.fixed_s < 0:
            raise ValueError("GEMM overheads must be >= 0")


@dataclass(frozen=True, slots=True)
class EfficiencyProfile:
    """Achieved-performance parameters of one GPU + host link.

    Attributes:
        name: Profile name.
        gpu: GPU preset this profile belongs to.
        gemm: dtype -> GEMM parameters.
        attention_efficiency: ``"fwd"`` / ``"bwd"`` -> fraction of the bf16 peak reached by fused
            (flash) attention kernels.
        memory_bandwidth_bytes_per_s: Kernel class (``elementwise``, ``norm``, ``softmax``,
            ``cast``, ``optimizer``, ``copy``, ``reduction``, ``embedding``) -> achieved device
            memory bandwidth counting bytes read + written, bytes/s.
        kernel_fixed_s: GPU-side fixed time per kernel (launch latency on the device), s.
        reference_hbm_bandwidth_bytes_per_s: The GPU's peak HBM bandwidth when the memory
            bandwidths were measured; a GPU spec with another peak (an override, a what-if)
            scales them in proportion (0 = use them as they are).
        launch_overhead_s: Host CPU time to dispatch one eager PyTorch op, s, or None (default).
            A host property: shipped GPU profiles leave it unset and the host preset carries it
            (``HostCpuSpec.launch_overhead_s``); a profile file written by ``simulate calibrate``
            may carry a value fitted on the traced host, which then takes precedence
            (``hardware_models.machine.resolve_launch_overhead``).
        launch_overhead_by_phase_s: Per step phase (``fwd``/``bwd``/``opt``), host time per
            launched graph op, s, when fitted from a trace by ``simulate calibrate`` (same rule).
        host_phase_fixed_s: Per step phase, host time once per occurrence of the phase besides its
            launches, s (``HostCpuSpec.host_phase_fixed_s``), fitted with the above (same rule).
        h2d_bytes_per_s / d2h_bytes_per_s: Pinned copy bandwidth, bytes/s.
        pageable_h2d_bytes_per_s / pageable_d2h_bytes_per_s: Pageable copy bandwidth, bytes/s.
        duplex_bytes_per_s: Both directions together, bytes/s.
        copy_latency_s: Fixed time per host<->device copy, s.
        copy_link: The ``links`` preset naming the host link the copy rates were measured over ("" when
            none is recorded); a scenario naming another ``hardware.pcie`` gets that link's rates instead
            (``hardware_models.machine.resolve_copy_rates``).
        host_memcpy_bytes_per_s: Host DRAM copy bandwidth (read + write), bytes/s.
        cpu_adam_params_per_s: Implementation -> ((params, params/s), ...) points.
        provenance: Source files, date, script and fit residuals.
    """

    name: str
    gpu: str
    gemm: dict[str, GemmEfficiency]
    attention_efficiency: dict[str, float]
    memory_bandwidth_bytes_per_s: dict[str, float]
    kernel_fixed_s: float = 0.0
    reference_hbm_bandwidth_bytes_per_s: float = 0.0
    launch_overhead_s: float | None = None
    launch_overhead_by_phase_s: dict[str, float] = field(default_factory=dict)
    host_phase_fixed_s: dict[str, float] = field(default_factory=dict)
    h2d_bytes_per_s: float = 0.0
    d2h_bytes_per_s: float = 0.0
    pageable_h2d_bytes_per_s: float = 0.0
    pageable_d2h_bytes_per_s: float = 0.0
    duplex_bytes_per_s: float = 0.0
    copy_latency_s: float = 0.0
    copy_link: str = ""
    host_memcpy_bytes_per_s: float = 0.0
    cpu_adam_params_per_s: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Raises: ValueError: an efficiency outside (0, 1] or a non-positive bandwidth."""
        for k, v in self.attention_efficiency.items():
            if not 0 < v <= 1:
                raise ValueError(f"attention_efficiency.{k} must be in (0, 1], got {v}")
        for k, v in self.memory_bandwidth_bytes_per_s.items():
            if v <= 0:
                raise ValueError(f"memory_bandwidth_bytes_per_s.{k} must be > 0, got {v}")
        if self.kernel_fixed_s < 0 or (self.launch_overhead_s or 0) < 0 or self.copy_latency_s < 0:
            raise ValueError("overheads must be >= 0")

    @classmethod
    def from_dict(cls, d: dict) -> "EfficiencyProfile":
        """Build from a plain dict (as read from a profile YAML file).

        Raises:
            ValueError / TypeError: a missing or unknown field, or an invalid value.
        """
        d = dict(d)
        d["gemm"] = {k: GemmEfficiency(**v) for k, v in d.get("gemm", {}).items()}
        d["cpu_adam_params_per_s"] = {
            k: tuple(tuple(map(float, p)) for p in v) for k, v in d.get("cpu_adam_params_per_s", {}).items()
        }
        return cls(**d)
