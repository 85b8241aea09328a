"""Host (CPU) dispatch time per launched op, fitted from a profiler trace's CPU timeline.

Eager PyTorch is host-bound when kernels are short: the Python thread spends tens of
microseconds per op in nn.Module calls, autocast, the dispatcher and the autograd engine. A
profiler trace shows that time, inflated by the profiler's own per-op cost. We fit:

* per phase, the host time of one step: forward = main-thread span from the step start to the
  first autograd-engine event (``autograd::engine::evaluate_function``) on the backward thread,
  backward = busy time of the top-level events on the autograd thread, optimizer = the
  ``Optimizer.step`` (+ ``zero_grad``) annotations;
* the profiler inflation: the median top-level ``aten::add`` time in the trace divided by the
  un-profiled eager tiny-op time of the profile's microbenchmark (``launch_overhead_s``); both
  dispatch one elementwise kernel, so their ratio is the profiler's overhead factor;
* per phase, ``launch_overhead_s = host time / inflation / launched ops of that phase`` in the
  simulator's graph of the same configuration.

The result depends on the program's structure, not on the batch size, so a trace at one batch
size predicts the host-bound regime at another.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from simulator.graph.op_graph import OpGraph


def _top_level(events: list[dict]) -> list[dict]:
    """Events not nested inside an earlier event of the same list (sorted by start)."""
    out, end = [], -1.0
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def _annotations(trace) -> list[dict]:
    """The validated CPU annotation records of a ``KinetoImport`` or of a raw trace dict."""
    from simulator.graph.importers.kineto import annotation_events

    if hasattr(trace, "cpu_annotations"):
        return trace.cpu_annotations
    return annotation_events(trace.get("traceEvents") if isinstance(trace, dict) else trace)


def host_phase_times(trace, step_index: int = -1) -> dict:
    """Host seconds per phase of one ``ProfilerStep`` and the profiled ``aten::add`` median.

    Args:
        trace: A ``KinetoImport`` (its ``cpu_annotations``: the file is not parsed again), or a
            Kineto trace dict (``traceEvents``...), whose events are validated the same way.
        step_index: Which ``ProfilerStep`` (default: the last, usually the steadiest).

    Returns:
        ``{"fwd_s", "bwd_s", "opt_s", "aten_add_s"}``.

    Raises:
        ValueError: no ProfilerStep annotation, no autograd events or no top-level aten::add.
    """
    ev = [e for e in _annotations(trace) if e["cat"] in ("cpu_op", "user_annotation")]
    steps = sorted((e for e in ev if e["name"].startswith("ProfilerStep")), key=lambda e: e["ts"])
    if not steps:
        raise ValueError("trace has no ProfilerStep annotation")
    s = steps[step_index]
    t0, t1 = s["ts"], s["ts"] + s["dur"]
    cpu = [e for e in ev if t0 <= e["ts"] <= t1 and not e["name"].startswith("ProfilerStep")]
    by_tid: dict = defaultdict(list)
    for e in cpu:
        by_tid[e["tid"]].append(e)
    bwd_tid = next((t for t, l in by_tid.items() if any("autograd::engine" in e["name"] for e in l)), None)
    if bwd_tid is None:
        raise ValueError("trace has no autograd::engine events (no backward thread)")
    bwd_top = _top_level(by_tid[bwd_tid])
    main_top = _top_level(by_tid.get(s["tid"], []))
    bwd_start = bwd_top[0]["ts"]
    opt = [e for e in main_top if e["name"].startswith(("Optimizer.step", "Optimizer.zero_grad"))]
    fwd_events = [e for e in main_top if e["ts"] < bwd_start and e not in opt]
    adds = [e["dur"] for e in main_top if e["name"] == "aten::add"]
    if not adds or not statistics.median(adds) > 0:
        raise ValueError("trace has no top-level aten::add of non-zero duration to estimate the profiler overhead")
    return {
        "fwd_s": (max(e["ts"] + e["dur"] for e in fwd_events) - t0) * 1e-6 if fwd_events else 0.0,
        "bwd_s": sum(e["dur"] for e in bwd_top) * 1e-6,
        "opt_s": sum(e["dur"] for e in opt) * 1e-6,
        "aten_add_s": statistics.median(adds) * 1e-6,
    }


def fit_launch_overhead(trace: dict, graph: OpGraph, eager_tiny_op_s: float) -> dict:
    """Per-phase host time per launched graph op, seconds, corrected for profiler overhead.

    Args:
        trace: The calibration trace (a ``KinetoImport``, or a trace dict; see ``host_phase_times``).
        graph: The simulator's step graph of the traced configuration.
        eager_tiny_op_s: Un-profiled host time of one eager elementwise op (microbenchmark), s.

    Returns:
        ``{"launch_overhead_by_phase_s": {...}, "profiler_inflation": float, "host_phase_s": {...}}``.
    """
    h = host_phase_times(trace)
    inflation = max(h["aten_add_s"] / eager_tiny_op_s, 1.0)
    counts: dict[str, int] = defaultdict(int)
    for op in graph.ops:
        if op.launch:
            counts[op.phase.value] += 1
    per = {}
    for phase in ("fwd", "bwd", "opt"):
        if counts[phase]:
            per[phase] = h[f"{phase}_s"] / inflation / counts[phase]
    return {"launch_overhead_by_phase_s": per, "profiler_inflation": inflation,
            "host_phase_s": {k: h[f"{k}_s"] for k in ("fwd", "bwd", "opt")}}
