"""GPU specification: peak throughput, memory, clocks and power limits of one GPU product.

Peak FLOP/s are dense (no sparsity) at the maximum SM clock. Power-related fields describe the
board's settable range (``nvidia-smi -pl``) and its idle draw.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU product.

    Attributes:
        name: Product name (``"NVIDIA H200 SXM 141GB"``).
        peak_flops_per_s: Dense peak FLOP/s by dtype at ``max_sm_clock_mhz`` (keys ``bf16``,
            ``fp16``, ``fp32``, ``tf32``, ``fp8``; ``fp32`` is the non-tensor-core rate).
        hbm_capacity_bytes: Device memory capacity in bytes.
        hbm_bandwidth_bytes_per_s: Peak device-memory bandwidth in bytes/s.
        sm_count: Number of streaming multiprocessors.
        max_sm_clock_mhz: Maximum (boost) SM clock in MHz.
        mem_clock_mhz: Memory clock in MHz.
        supported_sm_clocks_mhz: SM clocks the driver accepts for locking, descending.
        tdp_w: Board power limit default, W.
        min_power_limit_w: Lowest settable power limit, W.
        max_power_limit_w: Highest settable power limit, W.
        idle_power_w: Draw when idle at the maximum clocks, W.
        l2_bytes: L2 cache size, bytes.
        fp8_gemm_tn_only: Whether the GPU's fp8 GEMMs (cuBLASLt; hipBLASLt on ROCm) take only the TN layout,
            both operands K-major, so that a GEMM reading a weight the other way round (the input-gradient GEMM)
            needs a transposed fp8 copy of it: Transformer Engine's rule, ``is_non_tn_fp8_gemm_supported`` false
            (NVIDIA/TransformerEngine@0139fa57 transformer_engine/pytorch/utils.py: non-TN from compute capability
            10.0 below 12.0 and from 13.0; ROCm/TransformerEngine@07f3c6a5 the same file: never on ROCm). True on
            Ada (8.9) and Hopper (9.0), false on datacenter Blackwell (10.x). ``None``: not known (no fp8, or not
            given).
        sources: Source of each number (field name -> citation).
    """

    name: str
    peak_flops_per_s: dict[str, float]
    hbm_capacity_bytes: float
    hbm_bandwidth_bytes_per_s: float
    sm_count: int
    max_sm_clock_mhz: float
    mem_clock_mhz: float = 0.0
    supported_sm_clocks_mhz: tuple[float, ...] = ()
    tdp_w: float = 0.0
    min_power_limit_w: float = 0.0
    max_power_limit_w: float = 0.0
    idle_power_w: float = 0.0
    l2_bytes: float = 0.0
    fp8_gemm_tn_only: bool | None = None
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Check invariants.

        Raises:
            ValueError: a non-positive size, bandwidth, clock or peak, an empty peak table, or a
                maximum clock that is not the highest supported clock.
        """
        if not self.peak_flops_per_s:
            raise ValueError("peak_flops_per_s must list at least one dtype")
        for k, v in self.peak_flops_per_s.items():
            if v <= 0:
                raise ValueError(f"peak_flops_per_s.{k} must be > 0, got {v}")
        for name in ("hbm_capacity_bytes", "hbm_bandwidth_bytes_per_s", "sm_count", "max_sm_clock_mhz"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_power_limit_w and self.min_power_limit_w > self.max_power_limit_w:
            raise ValueError("min_power_limit_w exceeds max_power_limit_w")
        top = max(self.supported_sm_clocks_mhz, default=self.max_sm_clock_mhz)
        if top != self.max_sm_clock_mhz:  # the clock controller moves within the list, up to the max clock
            raise ValueError(f"max_sm_clock_mhz {self.max_sm_clock_mhz:g} MHz must be the highest of "
                             f"supported_sm_clocks_mhz (highest {top:g} MHz); override both together")

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (bf16 and fp16 fall back on each other).

        Raises:
            KeyError: the GPU has no rate for that dtype.
        """
        table = self.peak_flops_per_s
        if dtype in table:
            return table[dtype]
        alias = {"bf16": "fp16", "fp16": "bf16", "tf32": "fp32"}.get(dtype)
        if alias in table:
            return table[alias]
        raise KeyError(f"{self.name} has no peak FLOP/s for dtype {dtype!r}")
