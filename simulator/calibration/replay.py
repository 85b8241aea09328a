"""Replay an imported trace on the engine, compare with its measured step time, and ask what-ifs.

Step time (a definition change: it used to be the latency). The measured and the replayed step
time are the steady-state *period*: the median distance between consecutive step ends, a step's
end being the last end of any CPU or GPU op attributed to it. The first traced step has no
predecessor and is dropped as warm-up (named in ``warmup_steps``). The step *latency* (step start
to its last end, i.e. including the GPU's lag behind the CPU) is reported as its own field; it is
what a step looks like from one profiler annotation, and it grows when the CPU runs further ahead,
so it must not be compared across what-ifs. A one-step trace has no period; its latency is used
and the result says so (``step_time_basis == "latency"``).

Replay keeps every measured duration (kernels, copies, CPU runtime calls and the gaps between
them) and re-derives only the *timing* from the dependencies (stream order, launch links, event
waits, synchronisations). What-ifs rewrite the graph before replay:

* ``gpu``: needs a preset for the traced GPU (``gpu_preset_for``; an unknown device is refused by
  name, never replaced by another GPU's numbers). GPU kernels are re-costed by the ratio of the
  two GPUs' peaks: GEMM and attention
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
  A trace whose loader already uses worker processes (``KinetoImport.uses_worker_processes``) is
  refused: its main-thread wait is not the loading time.

GPU busy (``gpu_busy``): the fraction of the window in which a traced GPU op runs; the gap ops
the importer inserts to reproduce unexplained idle time are not counted as busy.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from hardware_models import presets
from hardware_models.gpu import GpuSpec
from hardware_models.machine import Hardware
from simulator.graph.op_graph import OpGraph
from simulator.graph.ops import CostClass, OpKind

_COMPUTE_BOUND = (CostClass.GEMM, CostClass.ATTENTION_FWD, CostClass.ATTENTION_BWD)


class UnknownGpuError(ValueError):
    """The traced device has no GPU preset (the message names the device and the known ones)."""


#: Traced ``deviceProperties`` names -> GPU preset, first match wins (lower-cased regex search).
#: Variants with different peaks or bandwidth (H100 PCIe/NVL, A100 40 GB PCIe) match no rule.
_GPU_RULES: tuple[tuple[str, str], ...] = (
    (r"h200", "h200-sxm-141gb"),
    (r"h100(?!.*(pcie|nvl))", "h100-sxm-80gb"),
    (r"a100.*pcie.*80", "a100-pcie-80gb"),
    (r"a100-sxm4-40", "a100-sxm4-40gb"),
    (r"a100(?!.*pcie)", "a100-sxm4-80gb"),
    (r"v100-sxm2-16", "v100-sxm2-16gb"),
    (r"v100-(sxm2|dgxs)-32", "v100-sxm2-32gb"),
    (r"\ba40\b", "a40-48gb"),
    (r"\bb200\b", "b200-180gb"),
    (r"mi300x", "mi300x-192gb"),
    (r"mi210", "mi210-64gb"),
    (r"rtx 2080 ti", "rtx-2080-ti-11gb"),
)


def gpu_preset_for(device_name: str | None) -> str:
    """The GPU preset of a trace's ``deviceProperties`` name.

    Raises:
        UnknownGpuError: no name, or a name no preset describes (never a silent default).
    """
    import re

    if not device_name:
        raise UnknownGpuError("the trace names no GPU (no deviceProperties): a GPU what-if needs the traced GPU's peaks")
    name = device_name.lower()
    for rx, preset in _GPU_RULES:
        if re.search(rx, name):
            return preset
    known = ", ".join(sorted({p for _, p in _GPU_RULES}))
    raise UnknownGpuError(f"traced GPU {device_name!r} has no preset (known: {known}); add one under "
                          "hardware_models/presets/gpus/ to re-cost its kernels")


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


def step_period(ends_s: Sequence[float]) -> float | None:
    """Steady-state step period: the median distance between consecutive step ends, seconds.

    The first step has no predecessor, so it is dropped as warm-up (its duration holds the GPU's
    lag behind the CPU and the start-up of the profiled window); the median of the remaining
    ``len(ends_s) - 1`` distances discards the odd slow step. ``None`` with fewer than 2 steps.
    """
    if len(ends_s) < 2:
        return None
    return float(np.median(np.diff(np.asarray(ends_s, dtype=float))))


def simulated_step_bounds(spans: pd.DataFrame, graph: OpGraph) -> tuple[list[float], list[float]]:
    """Per traced step: ``(starts_s, ends_s)``, first start and last end of its ops in a replay."""
    step_of = np.array([op.meta.get("step", -1) for op in graph.ops])
    s = spans.assign(trace_step=step_of[spans.op_id.to_numpy()])
    s = s[s.trace_step >= 0]
    g = s.groupby("trace_step")
    return list(g.start_s.min().to_numpy()), list(g.end_s.max().to_numpy())


def gpu_busy_fraction(intervals: Sequence[tuple[float, float]], t0: float, t1: float) -> float | None:
    """Union length of ``(start, end)`` intervals clipped to ``[t0, t1]``, over ``t1 - t0``."""
    if not t1 > t0:
        return None
    total, cur_s, cur_e = 0.0, None, None
    for a, b in sorted((max(a, t0), min(b, t1)) for a, b in intervals):
        if b <= a:
            continue
        if cur_e is None or a > cur_e:
            total += (cur_e - cur_s) if cur_e is not None else 0.0
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    total += (cur_e - cur_s) if cur_e is not None else 0.0
    return float(total / (t1 - t0))


def _is_real_gpu_op(op) -> bool:
    """A traced GPU op (kernel, copy, memset, collective), not an inserted gap or marker."""
    return op.stream.startswith("gpu") and not op.meta.get("gap") and not op.meta.get("marker")


def _measured_gpu_busy(imp) -> float | None:
    """Measured busy fraction of the GPU (all streams together) from the first step start to the last end."""
    t_origin_us = imp.graph.meta.get("time_origin_ts_us", 0.0)
    iv = [((op.meta["ts_us"] - t_origin_us) * 1e-6, (op.meta["ts_us"] - t_origin_us + op.meta.get("dur_us", 0.0)) * 1e-6)
          for op in imp.graph.ops if _is_real_gpu_op(op) and "ts_us" in op.meta]
    return gpu_busy_fraction(iv, imp.step_starts_s[0], imp.step_ends_s[-1]) if imp.step_ends_s else None


def _simulated_gpu_busy(spans: pd.DataFrame, graph: OpGraph, t0: float, t1: float) -> float | None:
    real = np.array([_is_real_gpu_op(op) for op in graph.ops])
    d = spans[real[spans.op_id.to_numpy()]]
    return gpu_busy_fraction(list(zip(d.start_s.to_numpy(), d.end_s.to_numpy())), t0, t1)


def _check_speedup(name: str, x: float) -> None:
    if not (isinstance(x, (int, float)) and math.isfinite(x) and x > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {x!r}")


def replay(path: str | Path, steps="all", gpu: str | None = None, pcie_speedup: float = 1.0,
           host_speedup: float = 1.0, dataloader_workers: int | None = None, gpu_gaps: str = "all") -> dict:
    """Import, (rewrite,) replay and compare a Kineto trace (or replay a Chakra one).

    Step time. ``measured_step_time_s`` / ``simulated_step_time_s`` are the steady-state step
    *period* (``step_period``: median distance between consecutive step ends; the first step is
    dropped as warm-up and named in ``warmup_steps``). The per-step latency (step start to the
    last end of its ops, the GPU's lag behind the CPU included) is kept as
    ``measured_step_latency_s`` / ``simulated_step_latency_s`` (means). With a single step no
    period can be measured: ``step_time_basis`` is then ``"latency"`` and the step times are the
    latency (stated in ``warnings``).

    Returns:
        ``{"trace", "device", "gpu_preset", "step_time_basis", "measured_step_time_s",
        "simulated_step_time_s", "error", "measured_step_latency_s", "simulated_step_latency_s",
        "steps", "step_labels", "warmup_steps", "gpu_busy", "what_if", "warnings"}``. With a
        what-if, ``error`` compares the what-if with the measurement (a predicted change, not an
        error). ``gpu_busy`` is ``{"measured", "simulated"}``, the fraction of the window (first
        step start to last step end) in which a traced GPU op runs; inserted gap ops are not
        counted. ``gpu_preset`` is the preset of the traced GPU (``None`` when no GPU what-if
        needs it and the device has no preset).

    Raises:
        TraceImportError: unreadable or unsupported trace, or no measurable step.
        UnknownGpuError: a ``gpu`` what-if on a trace whose GPU has no preset.
        ValueError: a speed-up that is not a finite number > 0; ``dataloader_workers`` on a
            trace that already uses worker processes or has no DataLoader annotations.
    """
    from simulator.graph.importers.kineto import load_kineto

    _check_speedup("pcie_speedup", pcie_speedup)
    _check_speedup("host_speedup", host_speedup)
    if str(path).endswith((".et", ".et.gz")):
        return _replay_chakra(path)
    imp = load_kineto(path, steps=steps, gpu_gaps=gpu_gaps)
    return replay_import(imp, gpu, pcie_speedup, host_speedup, dataloader_workers)


def replay_import(imp, gpu: str | None = None, pcie_speedup: float = 1.0, host_speedup: float = 1.0,
                  dataloader_workers: int | None = None) -> dict:
    """``replay`` of an already imported ``KinetoImport`` (same result and errors)."""
    from simulator.api import simulate_graph
    from simulator.graph.importers.kineto import TraceImportError

    _check_speedup("pcie_speedup", pcie_speedup)
    _check_speedup("host_speedup", host_speedup)
    path = imp.path
    name = str(path)  # as typed (the folder too)
    try:
        src_name: str | None = gpu_preset_for(imp.device_name)
    except UnknownGpuError:
        if gpu:
            raise
        src_name = None
    graph = imp.graph
    whatif: dict = {}
    if dataloader_workers is not None:
        if imp.uses_worker_processes:
            raise ValueError(f"{name}: the traced DataLoader already uses worker processes; --dataloader-workers "
                             "models replacing a single-process loader (num_workers=0) only")
        graph = with_dataloader_workers(graph, imp.dataloader_intervals_us, imp.step_times_s, dataloader_workers)
        whatif["dataloader_workers"] = dataloader_workers
    if gpu or pcie_speedup != 1.0 or host_speedup != 1.0:
        src = presets.get("gpus", src_name) if gpu else None
        dst = presets.get("gpus", gpu) if gpu else None
        graph = what_if(graph, src, dst, pcie_speedup, host_speedup)
        whatif |= {"gpu": gpu or src_name, "pcie_speedup": pcie_speedup, "host_speedup": host_speedup,
                   "recosted": "GPU kernels (peak ratios)" if gpu else "", "kept": "CPU-side measured durations"}
    res = simulate_graph(graph, replay_hardware(gpu or src_name or "h200-sxm-141gb"), steps=1)
    sim_starts, sim_ends = simulated_step_bounds(res.spans, imp.graph)
    meas_lat = [e - s for s, e in zip(imp.step_starts_s, imp.step_ends_s)]
    sim_lat = [e - s for s, e in zip(sim_starts, sim_ends)]
    warnings = list(imp.warnings[:5])
    meas_p, sim_p = step_period(imp.step_ends_s), step_period(sim_ends)
    if meas_p is not None and sim_p is not None and meas_p > 0:
        basis, meas, simulated, warm = "period", meas_p, sim_p, imp.step_labels[:1]
    else:
        basis, warm = "latency", []
        meas = float(np.mean(meas_lat)) if meas_lat else 0.0
        simulated = float(np.mean(sim_lat)) if sim_lat else 0.0
        warnings.insert(0, "one step: no steady-state period measurable; step times are the step latency "
                           "(GPU lag and warm-up included)")
    if not (meas > 0 and math.isfinite(meas) and math.isfinite(simulated)):
        raise TraceImportError(f"{name}: no measurable step (measured step time {meas!r} s)")
    return {
        "trace": str(path), "device": imp.device_name, "gpu_preset": src_name,
        "step_time_basis": basis,
        "measured_step_time_s": meas, "simulated_step_time_s": simulated, "error": simulated / meas - 1,
        "measured_step_latency_s": float(np.mean(meas_lat)), "simulated_step_latency_s": float(np.mean(sim_lat)),
        "steps": len(imp.step_times_s), "step_labels": list(imp.step_labels), "warmup_steps": warm,
        "gpu_busy": {"measured": _measured_gpu_busy(imp),
                     "simulated": _simulated_gpu_busy(res.spans, imp.graph, min(sim_starts, default=0.0),
                                                      max(sim_ends, default=0.0))},
        "what_if": whatif or None, "warnings": warnings,
    }


def _replay_chakra(path: str | Path) -> dict:
    """Replay a Chakra execution trace: nodes keep their ``duration_micros``; there is no measured step."""
    from simulator.api import simulate_graph
    from simulator.graph.importers.chakra import load_chakra

    imp = load_chakra(path)
    res = simulate_graph(imp.graph, replay_hardware("h200-sxm-141gb"), steps=1)
    return {
        "trace": str(path), "device": None, "gpu_preset": None, "step_time_basis": None,
        "measured_step_time_s": None, "simulated_step_time_s": float(res.summary["step_time_s"]), "error": None,
        "serial_sum_s": imp.total_duration_s, "steps": 1, "what_if": None, "warnings": imp.warnings[:5],
    }
