"""Roofline cost model with calibrated efficiency tables.

A kernel's duration is ``fixed + max(compute, memory)`` where

* ``compute = flops / (peak(dtype) * efficiency)``; GEMMs use the wave-quantised tile model of
  ``hardware_models.profile`` (batched GEMMs, 4-d shapes, with their tiles summed over the batch and
  their memory traffic kept in the max) and attention the fitted flash-attention efficiency;
* ``memory = (bytes_read + bytes_written) / achieved_bandwidth(kernel class)``;
* ``fixed`` is the device-side per-kernel time (``kernel_fixed_s``).

Clock scaling (DVFS): the compute part scales with ``max_sm_clock / sm_clock``, the memory part
with ``max_mem_clock / mem_clock``; fixed time does not scale. This is the standard split of
DVFS-aware GPU performance models (e.g. Guerreiro et al., *GPU Static Modeling Using PTX and
Deep Structured Learning*, and the compute/memory-bound split used by Zeus, NSDI'23, section 2).

Interference (``interfered_split_s``): while collectives are in flight on the GPU they hold
``sm_held`` SMs (one NCCL thread block per channel) and ``hbm_bytes_per_s`` of HBM traffic; the
kernel beside them is priced by ``simulator.cost.interference``'s rules (GEMM waves re-quantised on
the SMs left, other compute scaled by ``sm_count / (sm_count - sm_held)``, memory traffic at the
HBM share left).

Blocks (layer fidelity, ``simulator.policies.fidelity``): an op whose ``meta["fused"]`` holds the kernels
it replaces is priced as the sum of their times at the same clocks and interference (``fused_s``), cached
by the parts' signature ``meta["fused_key"]``.
"""

from __future__ import annotations

import math

from hardware_models.gpu import GpuSpec
from hardware_models.profile import EfficiencyProfile
from simulator.cost.base import DeviceState
from simulator.graph.ops import CostClass, Op, OpKind

_MEMORY_CLASSES = {
    CostClass.ELEMENTWISE: "elementwise",
    CostClass.NORM: "norm",
    CostClass.SOFTMAX: "softmax",
    CostClass.REDUCTION: "reduction",
    CostClass.CAST: "cast",
    CostClass.OPTIMIZER: "optimizer",
    CostClass.EMBEDDING: "embedding",
    CostClass.MEMSET: "memset",
    CostClass.COPY: "copy",
    CostClass.OTHER: "elementwise",
}


class RooflineCostModel:
    """Roofline x efficiency-table cost model.

    Args:
        gpu: GPU spec (peaks, clocks).
        profile: Achieved-efficiency profile.
        slowdown: Multiplier on every kernel's duration (a straggler: ``rank_overrides``), 1 by default.
    """

    def __init__(self, gpu: GpuSpec, profile: EfficiencyProfile, slowdown: float = 1.0):
        self.gpu = gpu
        self.profile = profile
        self.slowdown = slowdown
        self._cache: dict[tuple, tuple[float, float, float]] = {}
        self._fused: dict[tuple, tuple[float, float, float]] = {}
        ref = profile.reference_hbm_bandwidth_bytes_per_s
        #: achieved memory bandwidths follow the GPU's peak when it differs from the profile's
        self._bw_scale = gpu.hbm_bandwidth_bytes_per_s / ref if ref else 1.0

    def memory_bandwidth(self, cost_class: CostClass) -> float:
        """Achieved bandwidth for a memory-bound kernel class, bytes/s (falls back on ``elementwise``)."""
        key = _MEMORY_CLASSES.get(cost_class, "elementwise")
        table = self.profile.memory_bandwidth_bytes_per_s
        bw = table.get(key) or table.get("elementwise")
        return bw * self._bw_scale if bw else self.gpu.hbm_bandwidth_bytes_per_s

    def gemm_compute_s(self, m: int, n: int, k: int, dtype: str, sm_held: int = 0, batch: int = 1) -> float:
        """GEMM time at the maximum clock from the tile/wave model, seconds (without fixed time).

        ``batch`` > 1: a strided batched GEMM (``torch.bmm`` / ``baddbmm``; cuBLAS ``gemmStridedBatched``) of
        ``batch`` independent ``m x n x k`` products, whose ``batch x ceil(m / tile_m) x ceil(n / tile_n)``
        tiles fill the waves together (one kernel, one ``fixed_s``).

        ``sm_held`` SMs taken by collectives (0..sm_count-1) leave ``sm_count - sm_held`` SMs: the
        fitted (fractional) wave count is multiplied by ``ceil(tiles / (sm_count - sm_held)) /
        ceil(tiles / sm_count)``, the quantised waves on the SMs left over those on all of them.
        A full wave that no longer fits takes two (NVIDIA developer forum thread 337991: a
        132-block H100 GEMM nearly doubles beside an all-gather holding 24 SMs); ``sm_held = 0``
        is the baseline exactly. Without a tile model (no GEMM entry) the time scales by
        ``sm_count / (sm_count - sm_held)``.

        Tile orientation: the output is tiled ``tile_m x tile_n`` or ``tile_n x tile_m``, whichever takes fewer
        tiles (the first on a tie), so ``m x n`` and ``n x m`` cost the same. ``C^T = B^T A^T`` is the same
        product with ``m`` and ``n`` exchanged, and cuBLAS / CUTLASS ship both orientations of their tensor-core
        tiles (a CUTLASS fp16 tensor-op GEMM with a 256 x 128 threadblock tile, ``--cta_m=256 --cta_n=128``, is
        profiled in NVIDIA/cutlass#956), picking one per shape. Used one way round only, a 128 x 256 tile padded a
        ``1024 x 128`` output (unfused attention's ``probs @ V``, ``n`` = head dim 128) to ``1024 x 256`` and
        priced it at twice its FLOPs. Shapes whose ``m`` and ``n`` are both multiples of the larger tile side
        take the same tiles either way: every GEMM the shipped H200 profiles and the H100 profile's fit set were
        fitted on (``scripts/build_h{100,200}_profile.py`` count tiles the same way); only the H100's held-out TP 4
        up-projections (``n`` = 5,504) take 2-3% fewer tiles (held-out RMS error 0.1461 -> 0.1462).
        """
        g = self.profile.gemm.get(dtype) or self.profile.gemm.get("bf16")
        peak = self.gpu.peak(dtype)
        sms = self.gpu.sm_count
        if g is None:
            return 2.0 * batch * m * n * k / peak * sms / (sms - sm_held)
        tiles = batch * min(math.ceil(m / g.tile_m) * math.ceil(n / g.tile_n),
                            math.ceil(m / g.tile_n) * math.ceil(n / g.tile_m))
        waves = tiles / sms
        if sm_held:
            waves *= math.ceil(tiles / (sms - sm_held)) / math.ceil(tiles / sms)
        tile_flops = 2.0 * g.tile_m * g.tile_n * k
        return g.fixed_s + waves * (g.wave_overhead_s + tile_flops / (peak / self.gpu.sm_count * g.efficiency))

    def split_s(self, op: Op, state: DeviceState | None = None) -> tuple[float, float, float]:
        """``(compute_s, memory_s, fixed_s)`` at the maximum clocks.

        Raises:
            ValueError: the op is a copy or host op (priced elsewhere).
        """
        if op.meta and "fused" in op.meta:  # a block: its parts' sums, the fixed part making up their total time
            c, m, d = self.fused_s(op)
            return c, m, d - max(c, m)
        key = (op.cost_class, op.shape, op.flops, op.bytes_read, op.bytes_written, op.dtype)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if op.kind != OpKind.COMPUTE and op.kind != OpKind.COLLECTIVE:
            raise ValueError(f"roofline prices GPU kernels, not {op.kind.value} ops ({op.name})")
        fixed = self.profile.kernel_fixed_s
        memory = op.bytes_moved / self.memory_bandwidth(op.cost_class)
        compute = 0.0
        if op.cost_class == CostClass.GEMM and len(op.shape) == 3:
            compute = self.gemm_compute_s(*op.shape, op.dtype)
            # the operands still cross HBM once: a floor for skinny GEMMs (m or n of a few rows: a GEMV bound by
            # the weight read; the tile model alone priced m = 1 x 8192 x 8192 on an H100 at 5.5 TB/s of operand
            # traffic against 3.35 TB/s of HBM). Where the tile model is slower it covers the traffic (it was
            # fitted so), and the memory part stays 0 there, for the time and for the power meter's activity
            if memory <= compute:
                memory = 0.0
        elif op.cost_class == CostClass.GEMM and len(op.shape) == 4:  # batched (m, n, k, batch): unfused attention
            compute = self.gemm_compute_s(*op.shape[:3], op.dtype, batch=op.shape[3])
            # k = head dim <= 128: the [batch, s, s] scores it writes or reads dominate, so its traffic stays
            # in the roofline (the tile model was fitted on large-k GEMMs whose traffic it covers)
        elif op.cost_class in (CostClass.ATTENTION_FWD, CostClass.ATTENTION_BWD):
            which = "fwd" if op.cost_class == CostClass.ATTENTION_FWD else "bwd"
            eff = self.profile.attention_efficiency.get(which, 0.5)
            compute = op.flops / (self.gpu.peak("bf16") * eff)
            memory = op.bytes_moved / self.gpu.hbm_bandwidth_bytes_per_s
        elif op.flops:
            compute = op.flops / self.gpu.peak("fp32")
        out = (compute, memory, fixed)
        self._cache[key] = out
        return out

    def interfered_split_s(self, op: Op, sm_held: int, hbm_share: float) -> tuple[float, float, float]:
        """``(compute_s, memory_s, fixed_s)`` at the maximum clocks beside in-flight collectives.

        Args:
            op: A GPU kernel.
            sm_held: SMs the collectives hold, 0..sm_count-1.
            hbm_share: Fraction of its isolated memory bandwidth the kernel keeps, (0, 1].

        GEMMs (3-d shape) re-quantise their waves on the SMs left (``gemm_compute_s``); other
        compute parts scale by ``sm_count / (sm_count - sm_held)``; memory parts divide by
        ``hbm_share``; the fixed part is unchanged.

        Raises:
            ValueError: the op is a copy or host op; ``sm_held`` or ``hbm_share`` out of range.
        """
        sms = self.gpu.sm_count
        if not 0 <= sm_held < sms or not 0 < hbm_share <= 1:
            raise ValueError(f"interference: sm_held {sm_held} must be in 0..{sms - 1} and hbm_share {hbm_share} "
                             "in (0, 1]")
        key = (op.cost_class, op.shape, op.flops, op.bytes_read, op.bytes_written, op.dtype, sm_held, hbm_share)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        compute, memory, fixed = self.split_s(op)
        if op.cost_class == CostClass.GEMM and len(op.shape) == 3:
            compute = self.gemm_compute_s(*op.shape, op.dtype, sm_held)
        elif op.cost_class == CostClass.GEMM and len(op.shape) == 4:
            compute = self.gemm_compute_s(*op.shape[:3], op.dtype, sm_held, batch=op.shape[3])
        else:
            compute *= sms / (sms - sm_held)
        out = (compute, memory / hbm_share, fixed)
        self._cache[key] = out
        return out

    def duration_s(self, op: Op, state: DeviceState | None = None, sm_held: int = 0, hbm_share: float = 1.0) -> float:
        """Kernel duration in seconds at ``state`` (``None`` = maximum clocks).

        ``sm_held`` / ``hbm_share``: SMs taken by in-flight collectives and the fraction of HBM
        bandwidth left (``interfered_split_s``); the defaults price the kernel alone on the GPU.
        """
        if op.meta and "fused" in op.meta:
            d = self.fused_s(op, state, sm_held, hbm_share)[2]
            return d * self.slowdown if self.slowdown != 1.0 else d
        if sm_held or hbm_share != 1.0:
            compute, memory, fixed = self.interfered_split_s(op, sm_held, hbm_share)
        else:
            compute, memory, fixed = self.split_s(op)
        if state is not None:
            compute *= self.gpu.max_sm_clock_mhz / state.sm_clock_mhz
            if self.gpu.mem_clock_mhz:
                memory *= self.gpu.mem_clock_mhz / state.mem_clock_mhz
        d = fixed + max(compute, memory)
        return d * self.slowdown if self.slowdown != 1.0 else d

    def fused_s(self, op: Op, state: DeviceState | None = None, sm_held: int = 0,
                hbm_share: float = 1.0) -> tuple[float, float, float]:
        """``(compute_s, memory_s, duration_s)`` of a block (``meta["fused"]``: the kernels it replaces), each
        summed over the parts at ``state`` beside collectives holding ``sm_held`` SMs and leaving
        ``hbm_share`` of the HBM bandwidth (``duration_s`` of each part); cached by ``meta["fused_key"]``.
        """
        sm = state.sm_clock_mhz if state is not None else None
        mem = state.mem_clock_mhz if state is not None else None
        key = (op.meta["fused_key"], sm, mem, sm_held, hbm_share)
        hit = self._fused.get(key)
        if hit is not None:
            return hit
        c_scale = self.gpu.max_sm_clock_mhz / sm if sm else 1.0
        m_scale = self.gpu.mem_clock_mhz / mem if mem and self.gpu.mem_clock_mhz else 1.0
        c_sum = m_sum = d_sum = 0.0
        for p in op.meta["fused"]:
            if sm_held or hbm_share != 1.0:
                c, m, f = self.interfered_split_s(p, sm_held, hbm_share)
            else:
                c, m, f = self.split_s(p)
            c, m = c * c_scale, m * m_scale
            c_sum += c
            m_sum += m
            d_sum += f + max(c, m)
        out = self._fused[key] = (c_sum, m_sum, d_sum)
        return out
