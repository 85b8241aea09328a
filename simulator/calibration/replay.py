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
* ``dataloader_workers``: a trace of a single-process loader (``num_workers=0``), replayed as if
  ``N`` worker processes loaded batches in the background. The main thread's time inside the
  ``enumerate(DataLoader)`` annotations (``T_load`` per step) becomes the steady-state wait of
  PyTorch's round-robin workers: ``max(0, T_load / N - T_rest)``, where ``T_rest`` is the rest of
  the step (each worker needs ``T_load`` per batch; ``N`` of them deliver one every ``T_load / N``).
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


def dataloader_intervals_us(trace_path: str | Path) -> list[tuple[float, float]]:
    """``(start_us, end_us)`` of the trace's ``enumerate(DataLoader)...__next__`` annotations."""
    from simulator.graph.importers.kineto import read_trace_json

    t = read_trace_json(trace_path)
    return sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in t.get("traceEvents", [])
                  if e.get("ph") == "X" and "DataLoader" in str(e.get("name", "")) and "__next__" in str(e.get("name", "")))


def _host_op_times_us(graph: OpGraph) -> dict[int, tuple[float, float]]:
    """Measured ``(start_us, end_us)`` of every CPU-side op, inferring gap ops from their neighbours.

    Gap ops carry no timestamp; on a thread they are contiguous with the ops around them, so a
    backward pass from the next timed op and a forward pass from the previous one place them.
    """
    out: dict[int, tuple[float, float]] = {}
    by_stream: dict[str, list] = {}
    for op in graph.ops:
        if op.stream.startswith("cpu"):
            by_stream.setdefault(op.stream, []).append(op)
    for ops in by_stream.values():
        starts: list[float | None] = [op.meta.get("ts_us") for op in ops]
        durs = [(op.fixed_duration_s or 0.0) * 1e6 for op in ops]
        for i in range(len(ops) - 2, -1, -1):  # backward fill: end at the next op's start
            if starts[i] is None and starts[i + 1] is not None:
                starts[i] = starts[i + 1] - durs[i]
        for i in range(1, len(ops)):  # forward fill
            if starts[i] is None and starts[i - 1] is not None:
                starts[i] = starts[i - 1] + durs[i - 1]
        for op, st, d in zip(ops, starts, durs):
            if st is not None:
                out[op.id] = (st, st + d)
    return out


def with_dataloader_workers(graph: OpGraph, intervals: list[tuple[float, float]], step_times_s: list[float],
                            workers: int) -> OpGraph:
    """Shrink the host time spent loading batches to the wait ``N`` background workers would leave.

    Raises:
        ValueError: ``workers`` < 1 or no DataLoader annotations.
    """
    if workers < 1:
        raise ValueError(f"dataloader_workers must be >= 1, got {workers}")
    if not intervals:
        raise ValueError("the trace has no enumerate(DataLoader)...__next__ annotations to rewrite")
    times = _host_op_times_us(graph)

    def overlap_s(op) -> float:
        t = times.get(op.id)
        if t is None:
            return 0.0
        return sum(max(0.0, min(t[1], b) - max(t[0], a)) for a, b in intervals) * 1e-6

    load_by_step: dict[int, float] = {}
    for op in graph.ops:
        if op.id in times:
            st = op.meta.get("step", -1)
            load_by_step[st] = load_by_step.get(st, 0.0) + overlap_s(op)
    keep: dict[int, float] = {}  # fraction of the loading time left per step
    for step, t_load in load_by_step.items():
        if 0 <= step < len(step_times_s) and t_load > 0:
            t_rest = step_times_s[step] - t_load
            keep[step] = max(0.0, t_load / workers - t_rest) / t_load
    ops = []
    for op in graph.ops:
        st = op.meta.get("step", -1)
        ov = overlap_s(op) if st in keep else 0.0
        if ov > 0:
            op = dataclasses.replace(op, fixed_duration_s=max(0.0, (op.fixed_duration_s or 0.0) - ov * (1 - keep[st])))
        ops.append(op)
    return dataclasses.replace(graph, ops=tuple(ops))


def simulated_step_times(spans: pd.DataFrame, graph: OpGraph) -> list[float]:
    """Per traced step: first start to last end of the ops the importer attributed to it, seconds."""
    step_of = np.array([op.meta.get("step", -1) for op in graph.ops])
    s = spans.assign(trace_step=step_of[spans.op_id.to_numpy()])
    s = s[s.trace_step >= 0]
    g = s.groupby("trace_step")
    return list((g.end_s.max() - g.start_s.min()).to_numpy())


def replay(path: str | Path, steps="all", gpu: str | None = None, pcie_speedup: float = 1.0,
           host_speedup: float = 1.0, dataloader_workers: int | None = None, gpu_gaps: str = "all") -> dict:
    """Import, (rewrite,) replay and compare.

    Returns:
        ``{"trace", "device", "measured_step_time_s", "simulated_step_time_s", "error", "steps",
        "what_if", "warnings"}``; with a what-if, ``error`` compares the what-if with the
        measurement (it is then a predicted change, not an error).

    Raises:
        TraceImportError: unreadable or unsupported trace.
    """
    from simulator.api import simulate_graph
    from simulator.graph.importers.kineto import load_kineto

    if str(path).endswith((".et", ".et.gz")):
        return _replay_chakra(path)
    imp = load_kineto(path, steps=steps, gpu_gaps=gpu_gaps)
    src_name = gpu_preset_for(imp.device_name)
    graph = imp.graph
    whatif = {}
    if dataloader_workers is not None:
        graph = with_dataloader_workers(graph, dataloader_intervals_us(path), imp.step_times_s, dataloader_workers)
        whatif["dataloader_workers"] = dataloader_workers
    if gpu or pcie_speedup != 1.0 or host_speedup != 1.0:
        src = presets.get("gpus", src_name)
        dst = presets.get("gpus", gpu) if gpu else None
        graph = what_if(graph, src, dst, pcie_speedup, host_speedup)
        whatif |= {"gpu": gpu or src_name, "pcie_speedup": pcie_speedup, "host_speedup": host_speedup,
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


def _replay_chakra(path: str | Path) -> dict:
    """Replay a Chakra execution trace: nodes keep their ``duration_micros``; there is no measured step."""
    from simulator.api import simulate_graph
    from simulator.graph.importers.chakra import load_chakra

    imp = load_chakra(path)
    res = simulate_graph(imp.graph, replay_hardware("h200-sxm-141gb"), steps=1)
    return {
        "trace": str(path), "device": None, "gpu_preset": None, "measured_step_time_s": None,
        "simulated_step_time_s": float(res.summary["step_time_s"]), "error": None,
        "serial_sum_s": imp.total_duration_s, "steps": 1, "what_if": None, "warnings": imp.warnings[:5],
    }
