"""Host CPU and host memory specifications.

The host matters to training when work crosses to it: ZeRO-Offload's CPU Adam step, dataloader
workers, pinned-buffer staging. Pageable host memory is copied to the GPU through a pinned bounce
buffer by the CUDA driver, which is why it is slower than pinned memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class HostCpuSpec:
    """The host CPU.

    Attributes:
        name: Model name.
        cores: Physical cores available to the job.
        memory_bandwidth_bytes_per_s: Achievable DRAM bandwidth (read + write), bytes/s.
        first_touch_bytes_per_s: Write bandwidth into freshly allocated host memory, bytes/s: the
            bytes a pass writes into pages it is the first to touch (``malloc``/``mmap``-backed
            tensors allocated anew each step), each of which takes a page fault and is zeroed by
            the kernel before the write. Charged instead of ``memory_bandwidth_bytes_per_s`` for
            those bytes only (reads and in-place writes keep the memory bandwidth). 0 (default):
            no separate rate, fresh writes cost the same as in-place ones (the old behaviour).
        launch_overhead_s: Host CPU time to dispatch one eager PyTorch op (framework + CUDA launch)
            on this host, s; None (default): not measured (the machine falls back on a documented
            generic value, see ``hardware_models.machine.resolve_launch_overhead``). A property of
            the host CPU and software stack, not of the GPU: it moves with the host when the GPU is
            swapped.
        launch_overhead_by_phase_s: Per step phase (``fwd``/``bwd``/``opt``), host time per launched
            graph op, s, when fitted from a profiler trace taken on this host (used instead of
            ``launch_overhead_s`` for those phases); empty: none.
        adam_params_per_s: CPU AdamW throughput with all cores, parameters/s, by implementation
            (``torch_foreach``, ``torch_single``, ``deepspeed_cpu_adam``); a list of
            ``(params, params_per_s)`` points to interpolate, smallest first.
        sources: Citation per field.
    """

    name: str
    cores: int
    memory_bandwidth_bytes_per_s: float
    adam_params_per_s: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    first_touch_bytes_per_s: float = 0.0
    launch_overhead_s: float | None = None
    launch_overhead_by_phase_s: dict[str, float] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Raises: ValueError: non-positive cores or bandwidth, a negative first-touch bandwidth or launch time."""
        if self.cores <= 0:
            raise ValueError(f"cores must be > 0, got {self.cores}")
        if self.memory_bandwidth_bytes_per_s <= 0:
            raise ValueError("memory_bandwidth_bytes_per_s must be > 0")
        if self.first_touch_bytes_per_s < 0:
            raise ValueError("first_touch_bytes_per_s must be >= 0 (0: same as memory_bandwidth_bytes_per_s)")
        if (self.launch_overhead_s or 0) < 0 or any(v < 0 for v in self.launch_overhead_by_phase_s.values()):
            raise ValueError("launch_overhead_s and launch_overhead_by_phase_s must be >= 0 (None: not measured)")


@dataclass(frozen=True, slots=True)
class HostMemorySpec:
    """Host DRAM.

    Attributes:
        capacity_bytes: Total host memory, bytes.
        pinned_limit_bytes: Most memory that may be page-locked, bytes (default: all of it).
        sources: Citation per field.
    """

    capacity_bytes: float
    pinned_limit_bytes: float = 0.0
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Raises: ValueError: non-positive capacity or a pinned limit above capacity."""
        if self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {self.capacity_bytes}")
        if self.pinned_limit_bytes > self.capacity_bytes:
            raise ValueError("pinned_limit_bytes exceeds capacity_bytes")

    @property
    def pinned_capacity_bytes(self) -> float:
        """Most memory that may be page-locked, bytes: ``pinned_limit_bytes``, or all of it when 0."""
        return self.pinned_limit_bytes or self.capacity_bytes
