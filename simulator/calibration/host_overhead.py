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
* forward and backward, ``launch_overhead_s = host time / inflation / launched ops of that phase``
  in the simulator's graph of the same configuration: their host time is per-op work (the
  measured H200 trace, tests/data/h200/trace_gpt_184m_b16.json.gz, last ProfilerStep: 252
  ``cudaLaunchKernel`` on the main thread before the backward for the graph's 213 forward ops,
  467 on the autograd thread for its 361 backward ops), so each graph op carries its share;
* the optimizer, a fixed host time per ``optimizer.step()`` plus one eager dispatch per launched
  op (``OPT_PHASE_METHOD``). Its host time is not per-op work: in that trace ``Optimizer.step#AdamW.step``
  takes 1200.4 us, of which 721 us is Python before its first op (``_init_group``'s loop over the
  parameter tensors), then ``aten::_foreach_add_`` (the step counters, 2 ``cudaLaunchKernel``)
  and ``aten::_fused_adamw_`` (155.8 us, 10 ``cudaLaunchKernel`` of 4.8-10.9 us, the
  multi-tensor chunks); ``Optimizer.zero_grad#AdamW.zero_grad`` takes 245.6 us and launches
  nothing (``set_to_none``). The graph's one ``adamw`` op stands for those 12 launches; dividing
  the 1.446 ms by it made every further optimizer-phase op (Megatron's grad-buffer memset,
  clip_grad's l2-norm, the main -> model copy, FSDP's norm and ``mul_``, the ``foreach`` and
  ``single`` AdamW passes) cost 0.82 ms of host time. So per launch the un-profiled eager time of
  one op (the microbenchmark's ``eager_tiny_op_s``, which the profiler inflation is measured
  against), and the rest is the phase's fixed time:
  ``fixed = host time / inflation - launched ops x eager_tiny_op_s``.

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


#: How the optimizer phase's host time is split (module docstring): fixed per step + eager dispatch per launch.
OPT_PHASE_METHOD = "fixed per optimizer.step() + eager_tiny_op_s per launched op"


def fit_launch_overhead(trace: dict, graph: OpGraph, eager_tiny_op_s: float) -> dict:
    """Per-phase host time per launched graph op and per phase occurrence, seconds, corrected for profiler overhead.

    Args:
        trace: The calibration trace (a ``KinetoImport``, or a trace dict; see ``host_phase_times``).
        graph: The simulator's step graph of the traced configuration.
        eager_tiny_op_s: Un-profiled host time of one eager elementwise op (microbenchmark), s.

    Returns:
        ``{"launch_overhead_by_phase_s": {...}, "host_phase_fixed_s": {...}, "profiler_inflation": float,
        "host_phase_s": {...}}``: forward and backward per launched op only; the optimizer
        ``eager_tiny_op_s`` per launched op plus ``host_phase_fixed_s["opt"]`` once per step. Where
        the optimizer's launches alone take longer than its measured host time, the fixed part is 0
        and its per-launch time the measured time / its launches (the forward and backward rule).
    """
    h = host_phase_times(trace)
    inflation = max(h["aten_add_s"] / eager_tiny_op_s, 1.0)
    counts: dict[str, int] = defaultdict(int)
    for op in graph.ops:
        if op.launch:
            counts[op.phase.value] += 1
    per, fixed = {}, {}
    for phase in ("fwd", "bwd", "opt"):
        if counts[phase]:
            per[phase] = h[f"{phase}_s"] / inflation / counts[phase]
    rest = h["opt_s"] / inflation - counts["opt"] * eager_tiny_op_s
    if counts["opt"] and rest > 0:
        per["opt"], fixed["opt"] = eager_tiny_op_s, rest
    return {"launch_overhead_by_phase_s": per, "host_phase_fixed_s": fixed, "profiler_inflation": inflation,
            "host_phase_s": {k: h[f"{k}_s"] for k in ("fwd", "bwd", "opt")}}
