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
        cores: Physical cores available to the job (a virtual machine's vCPUs where ``vcpus`` is true).
        vcpus: ``cores`` counts a virtual machine's vCPUs (logical CPUs as the guest's ``lscpu`` lists them; each
            may be one hyperthread of a host core), not physical cores; only the wording of messages changes.
        memory_bandwidth_bytes_per_s: Achievable DRAM bandwidth (read + write), bytes/s.
        launch_overhead_s: Host CPU time to dispatch one eager PyTorch op (framework + CUDA launch)
            on this host, s; None (default): not measured (the machine falls back on a documented
            generic value, see ``hardware_models.machine.resolve_launch_overhead``). A property of
            the host CPU and software stack, not of the GPU: it moves with the host when the GPU is
            swapped.
        launch_overhead_by_phase_s: Per step phase (``fwd``/``bwd``/``opt``), host time per launched
            graph op, s, when fitted from a profiler trace taken on this host (used instead of
            ``launch_overhead_s`` for those phases); empty: none.
        host_phase_fixed_s: Per step phase, host time spent once per occurrence of the phase besides
            its launches, s (the optimizer: ``optimizer.step()``'s Python loop over the parameter
            tensors and ``zero_grad``), fitted with ``launch_overhead_by_phase_s``
            (``simulator.calibration.host_overhead``); empty: none.
        sockets: CPU sockets (packages) of the host.
        numa_nodes: NUMA nodes of the host; 0 (default): one per socket. Memory bandwidth is split
            evenly between nodes, cores too.
        numa_node: Bind the optimizer's threads and memory to this node (0-based, as ``numactl
            --cpunodebind=N --membind=N``); -1 (default): not bound, threads on every node.
        threads_used: Intra-op threads of the CPU optimizer step; 0 (default): all physical cores
            of the nodes in use, as ``torch.get_num_threads()`` defaults to (and DeepSpeed's
            CPUAdam, which runs OpenMP on the same pool). Must not exceed those cores.
        bind_cores_to_rank: Several ranks of one node each bound to their own ``cores / ranks`` cores and the
            NUMA node those lie on (True, default: DeepSpeed's launcher ``--bind_cores_to_rank``, which runs each
            rank under ``numactl -C <its cores> [-m <their node>]`` and sets ``OMP_NUM_THREADS`` to its core
            count; microsoft/DeepSpeed@048b0d50 deepspeed/launcher/launch.py ``main``, deepspeed/utils/numa.py
            ``get_numactl_cmd``). False: not bound (the launcher without the flag, or torchrun): every rank's
            threads float over all the cores and its memory over all the nodes, and a rank whose pool is not set
            (``threads_used`` 0) runs as many threads as the host has cores (``hardware_models.host_kernels``
            ``shared_stream_bandwidth``; ``simulator.policies.offload_optimizer.cpu_threads``). One rank: no effect.
        simd_width_bits: Widest vector unit the optimizer kernels use (256: AVX2, 512: AVX-512,
            128: NEON; SVE: the implementation's vector length).
        fma_units_per_core: Vector FMA pipes per core.
        base_clock_mhz: Base clock, MHz (0: unknown).
        all_core_clock_mhz: All-core turbo clock under vector load, MHz (0: ``base_clock_mhz``).
        memory_channels_per_socket: DRAM channels per socket (0: unknown; then the sustained
            bandwidth is ``stream_bandwidth_bytes_per_s`` or ``memory_bandwidth_bytes_per_s``).
        memory_rate_mt_per_s: DRAM transfer rate, MT/s (8 bytes per transfer per channel).
        sustained_bandwidth_fraction: STREAM-sustained fraction of the channels x rate peak
            (default 0.8; see ``hardware_models.host_kernels``).
        stream_bandwidth_bytes_per_s: Measured or fitted sustained DRAM bandwidth of the whole host
            for streaming kernels, bytes/s (0: from channels x rate x fraction).
        per_core_bandwidth_bytes_per_s: Most DRAM bandwidth one core sustains, bytes/s (0: the
            default of ``hardware_models.host_kernels``).
        page_fault_s: Time one thread spends on the first touch of one 4 KiB page of a fresh
            allocation (fault + zeroing), s (0: the default of ``hardware_models.host_kernels``).
        sources: Citation per field.
    """

    name: str
    cores: int
    memory_bandwidth_bytes_per_s: float
    launch_overhead_s: float | None = None
    launch_overhead_by_phase_s: dict[str, float] = field(default_factory=dict)
    host_phase_fixed_s: dict[str, float] = field(default_factory=dict)
    sockets: int = 1
    numa_nodes: int = 0
    numa_node: int = -1
    threads_used: int = 0
    bind_cores_to_rank: bool = True
    simd_width_bits: int = 256
    fma_units_per_core: int = 2
    base_clock_mhz: float = 0.0
    all_core_clock_mhz: float = 0.0
    memory_channels_per_socket: int = 0
    memory_rate_mt_per_s: float = 0.0
    sustained_bandwidth_fraction: float = 0.8
    stream_bandwidth_bytes_per_s: float = 0.0
    per_core_bandwidth_bytes_per_s: float = 0.0
    page_fault_s: float = 0.0
    vcpus: bool = False
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Raises: ValueError: non-positive cores or bandwidth, a negative launch time, more threads than cores, a NUMA node that does not exist, bad CPU specs."""
        if self.cores <= 0:
            raise ValueError(f"cores must be > 0, got {self.cores}")
        if self.memory_bandwidth_bytes_per_s <= 0:
            raise ValueError("memory_bandwidth_bytes_per_s must be > 0")
        if (self.launch_overhead_s or 0) < 0 or any(v < 0 for v in (*self.launch_overhead_by_phase_s.values(),
                                                                     *self.host_phase_fixed_s.values())):
            raise ValueError("launch_overhead_s, launch_overhead_by_phase_s and host_phase_fixed_s must be >= 0 "
                             "(None: not measured)")
        if self.sockets <= 0 or self.cores % self.sockets:
            raise ValueError(f"sockets must be > 0 and divide cores ({self.cores}), got {self.sockets}")
        nodes = self.nodes
        if self.numa_nodes < 0 or self.cores % nodes:
            raise ValueError(f"numa_nodes must be >= 0 (0: one per socket) and divide cores ({self.cores}), "
                             f"got {self.numa_nodes}")
        if not -1 <= self.numa_node < nodes:
            raise ValueError(f"numa_node {self.numa_node} does not exist: this host has {nodes} NUMA node(s), "
                             f"allowed 0..{nodes - 1} (leave it out: not bound)")
        avail = self.cores_available
        if self.threads_used < 0 or self.threads_used > avail:
            where = f"NUMA node {self.numa_node}" if self.numa_node >= 0 else "the host"
            raise ValueError(f"threads {self.threads_used} exceeds the {avail} {self.core_noun} of {where} "
                             f"({self.name}); allowed 1..{avail}")
        if self.simd_width_bits not in (128, 256, 512) or self.fma_units_per_core <= 0:
            raise ValueError(f"simd_width_bits must be 128, 256 or 512 and fma_units_per_core > 0, got "
                             f"{self.simd_width_bits}, {self.fma_units_per_core}")
        if min(self.base_clock_mhz, self.all_core_clock_mhz, self.memory_channels_per_socket,
               self.memory_rate_mt_per_s, self.stream_bandwidth_bytes_per_s, self.per_core_bandwidth_bytes_per_s,
               self.page_fault_s) < 0:
            raise ValueError("clocks, memory channels/rate, bandwidths and page_fault_s must be >= 0 (0: unknown)")
        if not 0 < self.sustained_bandwidth_fraction <= 1:
            raise ValueError(f"sustained_bandwidth_fraction must be in (0, 1], got {self.sustained_bandwidth_fraction}")

    @property
    def core_noun(self) -> str:
        """What ``cores`` counts, for messages: ``vCPUs`` (``vcpus``: a virtual machine's logical CPUs) or
        ``physical cores``."""
        return "vCPUs" if self.vcpus else "physical cores"

    @property
    def nodes(self) -> int:
        """NUMA nodes (``numa_nodes``, else one per socket)."""
        return self.numa_nodes or self.sockets

    @property
    def cores_available(self) -> int:
        """Physical cores the optimizer may use: those of the bound node, else all."""
        return self.cores // self.nodes if self.numa_node >= 0 else self.cores

    @property
    def threads(self) -> int:
        """Intra-op threads of the CPU step (``threads_used``, else every available core)."""
        return self.threads_used or self.cores_available

    @property
    def peak_memory_bandwidth_bytes_per_s(self) -> float:
        """Theoretical DRAM peak of the whole host, bytes/s: sockets x channels x MT/s x 8 B (0: unknown)."""
        return self.sockets * self.memory_channels_per_socket * self.memory_rate_mt_per_s * 1e6 * 8.0

    @property
    def sustained_bandwidth_bytes_per_s(self) -> float:
        """Sustained DRAM bandwidth of the whole host for streaming kernels, bytes/s.

        ``stream_bandwidth_bytes_per_s`` (measured/fitted) if set, else the peak x
        ``sustained_bandwidth_fraction``, else ``memory_bandwidth_bytes_per_s``.
        """
        if self.stream_bandwidth_bytes_per_s:
            return self.stream_bandwidth_bytes_per_s
        peak = self.peak_memory_bandwidth_bytes_per_s
        return peak * self.sustained_bandwidth_fraction if peak else self.memory_bandwidth_bytes_per_s

    @property
    def vector_clock_hz(self) -> float:
        """All-core clock under vector load, Hz (0: unknown)."""
        return (self.all_core_clock_mhz or self.base_clock_mhz) * 1e6


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
