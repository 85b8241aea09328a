"""Replay an imported trace on the engine, compare with its measured step time, and ask what-ifs.

Replay keeps every measured duration (kernels, copies, CPU runtime calls and the gaps between
them) and re-derives only the *timing* from the dependencies (stream order, launch links, event
waits, synchronisations). What-ifs rewrite the graph before replay:

* ``gpu``: GPU kernels are re-costed by the ratio of the two GPUs' peaks: GEMM and attention
  kernels by the dense bf16 (or fp16) FLOP/s ratio, all other kernels by the HBM bandwidth ratio
  (the roofline's two regimes); CPU-side ops keep their measured durations.
* ``pcie_speedup``: host<->device copies get ``1 / pcie_speedup`` of their measured time.
* ``host_speedup``: CPU-side ops (runtime calls and the host gaps between them) get
  ``1 / host_speedup`` of their measured time (e.g. a faster host, or fewer Python overheads).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd

from hardware_models import presets
from hardware_models.gpu import GpuSpec
from hardware_models.machine import Hardware
from simulator.graph.op_graph import OpGraph
from simulator.graph.ops import CostClass, OpKind

_COMPUTE_BOUND = (CostClass.GEMM, CostClass.ATTENTION_FWD, CostClass.ATTENTION_BWD)


def gpu_preset_for(device_name: str | None) -> str:
    """Best-matching GPU preset for a trace's ``deviceProperties`` name (default h200-sxm-141gb)."""
    name = (device_name or "").lower()
    rules = [("h200", "h200-sxm-141gb"), ("h100", "h100-sxm-80gb"), ("a100-pcie", "a100-pcie-80gb"),
             ("a100-sxm4-40", "a100-sxm4-40gb"), ("a100", "a100-sxm4-80gb"), ("v100", "v100-sxm2-32gb"),
             ("a40", "a40-48gb")]
    return next((preset for key, preset in rules if key in name), "h200-sxm-141gb")


def replay_hardware(gpu_preset: str) -> Hardware:
    """A machine for replay: the GPU preset, its shipped or a generic profile, the measured host."""
    from simulator.config.loader import generic_profile

    gpu = presets.get("gpus", gpu_preset)
    pcie = presets.get("links", "pcie-gen5-x16")
    cpu, mem = presets.get("hosts", "h200-measured-host")
    return Hardware(gpu, generic_profile(gpu, pcie, gpu_preset), pcie, cpu, mem)


def _ratio(src: GpuSpec, dst: GpuSpec, op) -> float:
    if op.cost_class in _COMPUTE_BOUND:
        dtype = "bf16" if "bf16" in dst.peak_flops_per_s or "fp16" in dst.peak_flops_per_s else "fp32"
        return src.peak(dtype) / dst.peak(dtype)
    return src.hbm_bandwidth_bytes_per_s / dst.hbm_bandwidth_bytes_per_s


def what_if(graph: OpGraph, src: GpuSpec | None = None, dst: GpuSpec | None = None, pcie_speedup: float = 1.0,
            host_speedup: float = 1.0) -> OpGraph:
    """Rewrite measured durations for a what-if (see the module docstring).

    Raises:
        ValueError: a non-positive speed-up.
    """
    if pcie_speedup <= 0 or host_speedup <= 0:
        raise ValueError("speed-ups must be > 0")
    ops = []
    for op in graph.ops:
        d = op.fixed_duration_s
        if d is not None:
            if op.kind == OpKind.COMPUTE and src is not None and dst is not None:
                d = d * _ratio(src, dst, op)
            elif op.kind in (OpKind.MEMCPY_H2D, OpKind.MEMCPY_D2H):
                d = d / pcie_speedup
            elif op.kind in (OpKind.HOST, OpKind.SYNC) and op.stream.startswith("cpu"):
                d = d / host_speedup
        ops.append(dataclasses.replace(op, fixed_duration_s=d))
    return dataclasses.replace(graph, ops=tuple(ops))


def simulated_step_times(spans: pd.DataFrame, graph: OpGraph) -> list[float]:
    """Per traced step: first start to last end of the ops the importer attributed to it, seconds."""
    step_of = np.array([op.meta.get("step", -1) for op in graph.ops])
    s = spans.assign(trace_step=step_of[spans.op_id.to_numpy()])
    s = s[s.trace_step >= 0]
    g = s.groupby("trace_step")
    return list((g.end_s.max() - g.start_s.min()).to_numpy())


def replay(path: str | Path, steps="all", gpu: str | None = None, pcie_speedup: float = 1.0,
           host_speedup: float = 1.0) -> dict:
    """Import, (rewrite,) replay and compare.

    Returns:
        ``{"trace", "device", "measured_step_time_s", "simulated_step_time_s", "error", "steps",
        "what_if", "warnings"}``; with a what-if, ``error`` compares the what-if with the
        measurement (it is then a predicted change, not an error).

    Raises:
        TraceImportError: unreadable or unsupported trace.
    """
    from simulator.engine.run import simulate_graph
    from simulator.graph.importers.kineto import load_kineto

    imp = load_kineto(path, steps=steps)
    src_name = gpu_preset_for(imp.device_name)
    graph = imp.graph
    whatif = {}
    if gpu or pcie_speedup != 1.0 or host_speedup != 1.0:
        src = presets.get("gpus", src_name)
        dst = presets.get("gpus", gpu) if gpu else None
        graph = what_if(graph, src, dst, pcie_speedup, host_speedup)
        whatif = {"gpu": gpu or src_name, "pcie_speedup": pcie_speedup, "host_speedup": host_speedup,
                  "recosted": "GPU kernels (peak ratios)" if gpu else "", "kept": "CPU-side measured durations"}
    res = simulate_graph(graph, replay_hardware(gpu or src_name), steps=1)
    sim = simulated_step_times(res.spans, imp.graph)
    meas = float(np.mean(imp.step_times_s))
    simulated = float(np.mean(sim)) if sim else float(res.summary["step_time_s"])
    return {
        "trace": str(path), "device": imp.device_name, "gpu_preset": src_name,
        "measured_step_time_s": meas, "simulated_step_time_s": simulated,
        "error": simulated / meas - 1 if meas else float("nan"),
        "steps": len(imp.step_times_s), "what_if": whatif or None, "warnings": imp.warnings[:5],
    }
