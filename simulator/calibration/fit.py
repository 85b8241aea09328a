"""Fit an efficiency profile to real traces (``simulate calibrate``).

Method. For each trace, the scenario that describes the traced run is simulated with the base
profile, and the GPU kernel time of one step is summed per kernel class on both sides (trace
kernels are classified from their names by ``graph.importers.kineto.classify_kernel``; the
optimizer kernels are those of the ``opt`` phase). For each class ``c`` the fit finds the scale
``k_c`` that minimises ``sum_traces (log measured_c - log (k_c * simulated_c))^2`` with
``scipy.optimize.least_squares`` (one trace gives the plain ratio; several give the geometric
mean). A class's achieved rate is then divided by ``k_c``: GEMM and attention efficiencies, the
memory-bound bandwidth of each class, and the optimizer bandwidth. The host dispatch time per op
is refitted from the trace's CPU timeline (``calibration.host_overhead``), and the device-side
idle time between back-to-back kernels is spread over the graph's kernels (``kernel_fixed_s``). Classes with less
than ``min_share`` of the step's kernel time keep their base values.

What stays measured and what is re-costed: the profile only rescales the cost model; scenarios
that use it re-cost every kernel from its FLOPs and bytes, so other batch sizes, models and
policies are predictions.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from hardware_models.machine import LaunchOverhead, resolve_launch_overhead
from hardware_models.profile import EfficiencyProfile
from simulator.graph.ops import OpKind

#: Classes fitted; memory-bound classes map to keys of ``memory_bandwidth_bytes_per_s``.
MEMORY_CLASSES = ("elementwise", "cast", "norm", "softmax", "reduction", "copy", "memset", "embedding")
COMPUTE_CLASSES = ("gemm", "attention_fwd", "attention_bwd")


def measured_class_times(imp) -> pd.Series:
    """Mean GPU kernel seconds per step and class of an imported trace (``optimizer`` = opt phase)."""
    g = imp.graph
    rows = []
    for op in g.ops:
        if op.kind != OpKind.COMPUTE or op.meta.get("gap") or op.meta.get("marker"):
            continue
        cls = "optimizer" if op.phase.value == "opt" else op.cost_class.value
        rows.append((cls, float(op.meta.get("dur_us", (op.fixed_duration_s or 0) * 1e6)) * 1e-6))
    df = pd.DataFrame(rows, columns=["cls", "dur_s"])
    nsteps = max(len(imp.step_times_s), 1)
    return df.groupby("cls").dur_s.sum() / nsteps


def simulated_class_times(result) -> pd.Series:
    """Mean GPU kernel seconds per measured step and class of a simulation result."""
    s = result.spans
    s = s[(s.kind == "compute") & s.step.isin(result.steps.step[~result.steps.warmup])]
    cls = np.where(s.phase == "opt", "optimizer", s.cost_class)
    n = max(int((~result.steps.warmup).sum()), 1)
    return s.assign(cls=cls).groupby("cls").duration_s.sum() / n


def backlogged_gap_s(imp, max_gap_us: float = 20.0) -> float:
    """GPU idle time per step between back-to-back kernels on a stream (gaps under ``max_gap_us``).

    Those gaps are the device-side cost of starting the next kernel while the queue is full
    (longer gaps mean the GPU waited for the host, which the host model covers).
    """
    by_stream: dict[str, list] = {}
    for op in imp.graph.ops:
        if op.kind == OpKind.COMPUTE and "ts_us" in op.meta and not op.meta.get("gap"):
            by_stream.setdefault(op.stream, []).append((op.meta["ts_us"], op.meta["dur_us"]))
    total = 0.0
    for evs in by_stream.values():
        evs.sort()
        for (t0, d0), (t1, _) in zip(evs, evs[1:]):
            gap = t1 - t0 - d0
            if 0 <= gap < max_gap_us:
                total += gap
    return total * 1e-6 / max(len(imp.step_times_s), 1)


def fit_scales(pairs: list[tuple[pd.Series, pd.Series]], min_share: float = 0.005) -> dict[str, float]:
    """Per-class scale ``k`` (measured / simulated) by least squares in log space over traces."""
    classes = sorted(set().union(*[set(m.index) & set(s.index) for m, s in pairs]))
    scales = {}
    for c in classes:
        logs = [(np.log(m[c]), np.log(s[c])) for m, s in pairs
                if m.get(c, 0) > 0 and s.get(c, 0) > 0 and m[c] >= min_share * m.sum()]
        if not logs:
            continue
        res = least_squares(lambda x: np.array([lm - (x[0] + ls) for lm, ls in logs]), [0.0])
        scales[c] = float(np.exp(res.x[0]))
    return scales


def apply_scales(base: EfficiencyProfile, scales: dict[str, float]) -> EfficiencyProfile:
    """A profile whose class rates are divided by the fitted scales (efficiencies capped at 1)."""
    gemm = dict(base.gemm)
    if "gemm" in scales:
        for k, g in gemm.items():
            gemm[k] = dataclasses.replace(g, efficiency=min(1.0, g.efficiency / scales["gemm"]),
                                          wave_overhead_s=g.wave_overhead_s * scales["gemm"])
    att = dict(base.attention_efficiency)
    for which in ("fwd", "bwd"):
        if f"attention_{which}" in scales:
            att[which] = min(1.0, att.get(which, 0.35) / scales[f"attention_{which}"])
    bw = dict(base.memory_bandwidth_bytes_per_s)
    default_bw = bw.get("elementwise")
    for c in MEMORY_CLASSES + ("optimizer",):
        if c in scales:
            bw[c] = bw.get(c, default_bw) / scales[c]
    return dataclasses.replace(base, gemm=gemm, attention_efficiency=att, memory_bandwidth_bytes_per_s=bw)


def eager_op_time(hw) -> LaunchOverhead:
    """The un-profiled host time of one eager op the trace fit divides by (``fit_launch_overhead``'s
    ``eager_tiny_op_s``), s: the machine's own (the host preset's microbenchmark, ``micro.memory.tiny_kernel_us_eager``
    on the measured H200 host; else the profile's, else the generic 10 us; ``source`` says which), never the
    scenario's ``hardware.launch_overhead_s`` override, which is a what-if of the simulated run, not a measurement
    of the traced host (it moved the profiler inflation and every fitted per-op time)."""
    return resolve_launch_overhead(None, hw.host_cpu, hw.profile)


def calibrate(traces: list[str | Path], scenario_paths: list[str | Path], out_name: str = "calibrated") -> tuple[dict, pd.DataFrame]:
    """Fit a profile to traces of runs described by scenarios.

    Args:
        traces: Kineto trace files.
        scenario_paths: One scenario per trace (or one for all) describing the traced run.
        out_name: Name of the written profile.

    Returns:
        ``(profile_dict, report)``: the profile as a YAML-ready dict with provenance, and a
        DataFrame ``trace, class, measured_s, simulated_before_s, simulated_after_s``.

    Raises:
        ScenarioError / TraceImportError: unreadable inputs.
    """
    from simulator.calibration.host_overhead import fit_launch_overhead
    from simulator.config.loader import load_scenario, resolve_hardware
    from simulator.api import build_graph, run_scenario, simulate_graph
    from simulator.graph.importers.kineto import load_kineto

    if len(scenario_paths) == 1:
        scenario_paths = list(scenario_paths) * len(traces)
    if len(scenario_paths) != len(traces):
        from simulator.config.errors import ScenarioError

        raise ScenarioError("give one --scenario for all traces or one per trace")
    cfgs = [load_scenario(p, ["run.steps=3", "run.warmup_steps=1"]) for p in scenario_paths]
    hws = [resolve_hardware(c, str(p)) for c, p in zip(cfgs, scenario_paths)]  # once per scenario
    base_hw = hws[0]
    base = base_hw.profile
    imports = [load_kineto(t, steps=-1) for t in traces]
    measured = [measured_class_times(i) for i in imports]
    before = [simulated_class_times(run_scenario(c, hw)) for c, hw in zip(cfgs, hws)]
    scales = fit_scales(list(zip(measured, before)))
    prof = apply_scales(base, scales)
    # device-side gap per graph kernel: backlogged idle time per step / kernels per step in the graph
    n_kernels = sum(op.kind == OpKind.COMPUTE for op in build_graph(cfgs[0]).ops)
    gap_per_kernel = float(np.mean([backlogged_gap_s(i) for i in imports])) / max(n_kernels, 1)
    prof = dataclasses.replace(prof, kernel_fixed_s=base.kernel_fixed_s + gap_per_kernel)
    host = {}
    try:
        graph = build_graph(cfgs[0])
        eager = eager_op_time(base_hw)
        fit = fit_launch_overhead(imports[0], graph, eager.per_op_s)
        prof = dataclasses.replace(prof, launch_overhead_by_phase_s=fit["launch_overhead_by_phase_s"],
                                   host_phase_fixed_s=fit["host_phase_fixed_s"])
        host = {"profiler_inflation": round(fit["profiler_inflation"], 4), "eager_op_s": eager.per_op_s,
                "eager_op_source": eager.source}
    except ValueError as exc:
        host = {"skipped": str(exc)}
    after = []
    for c, hw0 in zip(cfgs, hws):
        hw = dataclasses.replace(hw0, profile=prof)
        after.append(simulated_class_times(simulate_graph(build_graph(c), hw, 3, 1)))
    rows = []
    for t, m, b, a in zip(traces, measured, before, after):
        for cls in sorted(set(m.index) | set(b.index)):
            rows.append({"trace": Path(t).name, "class": cls, "measured_s": float(m.get(cls, 0.0)),
                         "simulated_before_s": float(b.get(cls, 0.0)), "simulated_after_s": float(a.get(cls, 0.0))})
    report = pd.DataFrame(rows)
    out = profile_to_dict(prof, out_name)
    fitted = report["class"].isin(list(scales))

    def rel(col: str) -> float:
        r = report[fitted]
        return float(np.sqrt(np.mean(((r[col] - r.measured_s) / r.measured_s) ** 2))) if len(r) else float("nan")

    out["provenance"] = {
        "base_profile": base.name,
        "traces": [str(t) for t in traces],
        "scenarios": [str(p) for p in scenario_paths],
        "date": dt.date.today().isoformat(),
        "method": "simulator.calibration.fit (per-class log least squares)",
        "class_scales": {k: round(v, 4) for k, v in scales.items()},
        "rms_relative_class_error_fitted_classes": {"before": round(rel("simulated_before_s"), 4),
                                     "after": round(rel("simulated_after_s"), 4)},
        "host_overhead": host,
        "kernel_gap_per_graph_kernel_s": gap_per_kernel,
    }
    return out, report


def profile_to_dict(p: EfficiencyProfile, name: str) -> dict:
    """A profile as a YAML-ready dict (the format ``hardware_models.presets`` reads)."""
    d = dataclasses.asdict(p)
    d["name"] = name
    d["cpu_adam_params_per_s"] = {k: [list(x) for x in v] for k, v in p.cpu_adam_params_per_s.items()}
    return d


def plot_report(report: pd.DataFrame, ax=None):
    """Bar chart of measured vs simulated kernel time per class (before and after the fit)."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(8, 3.5))[1]
    r = report.groupby("class")[["measured_s", "simulated_before_s", "simulated_after_s"]].sum() * 1e3
    r.plot.bar(ax=ax)
    ax.set_ylabel("ms per step")
    ax.set_title("Kernel time per class: measured vs simulated")
    return ax
