"""The result of one simulated run: DataFrames plus a summary dict. Touches no files."""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from simulator.analysis.metrics import COLLECTIVE_KIND, COMPUTE_KIND, DATA_PHASE, GPU_KINDS, _codes, _merge, _rows_in, \
    comm_group
from simulator.recording.deferred import DeferredField, build_fields
from simulator.recording.recorder import RANK_COLUMNS, rank_column

#: ``SimulationResult.breakdown`` components, in priority order (an instant counts once, for the
#: first that applies); exposed communication has one row per process group, after optimizer
BREAKDOWN_COMPUTE = "compute (fwd/bwd kernels)"
BREAKDOWN_OPTIMIZER = "optimizer"
BREAKDOWN_COPIES = "exposed copies"
BREAKDOWN_DATA = "data wait"
BREAKDOWN_IDLE = "host-bound gaps / idle"
#: a pipeline stage's idle time while its compute stream holds a launched kernel that waits for another stage
BREAKDOWN_PIPELINE_WAIT = "waiting for other stages (bubble + imbalance)"
#: summary rows of the HTML representation: (label, summary key, scale, unit)
_HTML_ROWS = (("step time", "step_time_s", 1e3, "ms"), ("throughput", "samples_per_s", 1, "samples/s"),
              ("tokens", "tokens_per_s", 1, "tokens/s"), ("MFU", "mfu", 100, "%"),
              ("GPU busy", ("utilisation", "compute"), 100, "%"),
              ("peak GPU memory", "peak_device_memory_bytes", 1e-9, "GB"),
              ("GPU memory capacity", "gpu_memory_capacity_bytes", 1e-9, "GB"),
              ("exposed communication", "exposed_comm_s", 1e3, "ms"), ("data stall", "data_stall_s", 1e3, "ms"),
              ("energy", "energy_j_per_step", 1, "J/step"), ("average power", "avg_power_w", 1, "W"))


def _covered(iv: np.ndarray, mid: np.ndarray) -> np.ndarray:
    """Which points ``mid`` lie inside the disjoint sorted intervals ``iv`` (shape ``(n, 2)``)."""
    if len(iv) == 0:
        return np.zeros(len(mid), dtype=bool)
    j = np.searchsorted(iv[:, 0], mid, side="right") - 1
    return (j >= 0) & (mid < iv[np.clip(j, 0, None), 1])


@dataclass(frozen=True)
class SimulationResult:
    """Everything a run produced.

    Attributes:
        summary: Headline metrics (see ``simulator.analysis.summary.summarize``).
        spans: One row per op execution (``recording.recorder.SPAN_COLUMNS`` + ``duration_s``).
        counters: Level samples (memory bytes, clocks, power) with ``t_s, scope, metric, value``; may be given as a
            ``recording.deferred.Deferred``, built when first read (the summary does not read it).
        steps: One row per step: ``step, start_s, end_s, step_time_s, warmup``.
        config: The resolved scenario as a plain dict.
        launches: One row per host kernel/copy launch: ``step, op_id, start_s, end_s`` (the host
            thread's busy interval; ``recording.recorder.launches_frame``; may be given as a ``Deferred``).
        deps: The step graph's dependencies: ``op_id, dep_id, step_lag`` (0 same step, 1 previous); may be given
            as a ``Deferred`` (the summary does not read it).
    """

    summary: dict[str, Any]
    spans: pd.DataFrame
    counters: pd.DataFrame = DeferredField()
    steps: pd.DataFrame
    config: dict[str, Any] = field(default_factory=dict)
    launches: pd.DataFrame | None = DeferredField(None)
    deps: pd.DataFrame | None = DeferredField(None)

    def __getstate__(self) -> dict:
        """Pickled with every frame built (a ``Deferred``'s builder does not pickle)."""
        build_fields(self)
        return self.__dict__

    @property
    def ok(self) -> bool:
        """False when the run went out of memory."""
        return not self.summary.get("oom")

    def breakdown(self) -> pd.DataFrame:
        """Where the time of a measured step goes, as a partition of each step's window.

        Each instant of a measured step's ``[start_s, end_s]`` counts once, for the first of:
        ``compute`` (a compute kernel of phase fwd/bwd runs), ``optimizer`` (any op of phase
        ``opt`` but its collectives: GPU kernels, or a CPU optimizer while the GPU computes nothing else),
        ``exposed comm (<group>)`` (a collective of that process group is in flight and no kernel
        runs, in any phase: the summary's ``exposed_comm_s`` split by group, so a ZeRO parameter
        all-gather after the optimizer step counts here, not as optimizer; where groups overlap the time goes
        to the first in name order), ``exposed copies`` (a memory copy runs and nothing above),
        ``data wait`` (the training thread is in ``next(iterator)`` and the GPU runs nothing: the
        summary's ``phase_s.data_s``), on a pipeline stage ``waiting for other stages (bubble +
        imbalance)`` (nothing above runs but the compute stream's next kernel is already launched
        (``launches``): it waits for data of another stage, a receive or send its peer has not posted yet),
        and ``host-bound gaps / idle`` (the rest: the GPU waits for kernel launches or other host work).

        Returns:
            ``component, seconds`` (mean per measured step, s); the seconds sum to the mean step
            window, which is ``step_time_s`` unless steps overlap (then ``step_latency_s``).
            Components that are zero in every step are left out, except compute. A result of several
            ranks (spans with ``pp_rank`` or ``rank_class``: ``rank_column``) gives the mean over them (each
            one's partition of the job's step windows); over rank classes, the mean over every data-parallel
            replica (each class weighted by its ``replicas``, the summary's ``rank_classes``), so that
            ``run.rank_folding`` classes and none give the same breakdown.
        """
        col = rank_column(self.spans)
        if col:  # pipeline stages or rank classes: the mean over them of each one's partition
            rows = (self.summary.get("rank_classes") or []) if col == "rank_class" else []
            weight = {i: r["replicas"] for i, r in enumerate(rows)}  # rank_class i is the summary's row i
            parts, total = [], 0
            for key, d in self.spans.groupby(col):
                part = rank_partition(d, _rank_rows(self.launches, col, key), self.steps, pipeline="pp_rank" in d)
                n = weight.get(key, 1)
                parts.append(part.assign(seconds=part.seconds * n) if n != 1 else part)
                total += n
            return pd.concat(parts).groupby("component", sort=False, as_index=False)["seconds"].sum().assign(
                seconds=lambda d: d.seconds / total)
        return rank_partition(self.spans, None, self.steps, pipeline=False)

    def _repr_html_(self) -> str:
        """Jupyter's rich display: a summary table and the step breakdown as an inline PNG."""
        from simulator.recording.plots import breakdown_bars, render_png

        s = self.summary
        name = html.escape(str(self.config.get("name") or "simulation result"))
        rows = []
        for label, key, scale, unit in _HTML_ROWS:
            v = (s.get(key[0]) or {}).get(key[1]) if isinstance(key, tuple) else s.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                rows.append(f"<tr><th style='text-align:left'>{label}</th><td>{v * scale:,.4g} {unit}</td></tr>")
        for label, key in (("GPU / profile", None), ("out of memory", "oom")):
            if key is None:
                rows.insert(0, f"<tr><th style='text-align:left'>{label}</th><td>"
                               f"{html.escape(str(s.get('gpu')))} / {html.escape(str(s.get('profile')))}</td></tr>")
            elif s.get(key):
                rows.append(f"<tr><th style='text-align:left'>{label}</th><td style='color:#b00'>"
                            f"{html.escape(str(s[key]))}</td></tr>")
        rows += [f"<tr><th style='text-align:left'>warning</th><td>{html.escape(str(w))}</td></tr>"
                 for w in s.get("warnings") or []]
        img = ""
        if len(self.spans):
            png = render_png(breakdown_bars, self.breakdown(), title="step time breakdown", figsize=(7.0, 3.0))
            img = (f"<img alt='step time breakdown' src='data:image/png;base64,"
                   f"{base64.b64encode(png).decode()}'/>")
        return (f"<div><h4>{name}</h4><table>{''.join(rows)}</table>{img}</div>")


def _rank_rows(frame: pd.DataFrame | None, col: str, key) -> pd.DataFrame | None:
    """The rows of ``frame`` (a result's ``launches``) of one simulated rank (``col == key``); None without."""
    return None if frame is None or col not in frame else frame[frame[col] == key]


def _dependency_waits(spans: pd.DataFrame, launches: pd.DataFrame | None, compute: np.ndarray) -> np.ndarray:
    """Intervals ``(n, 2)``, s, in which one rank's compute stream holds a launched kernel that has not started:
    from the kernel's launch end (or the previous compute kernel's end, if later) to its start (``compute``: which
    rows of ``spans`` are compute kernels). Empty without ``launches``."""
    if launches is None or launches.empty:
        return np.zeros((0, 2))
    comp = spans[compute][["step", "op_id", "start_s", "end_s"]].merge(
        launches[["step", "op_id", "end_s"]].rename(columns={"end_s": "launched_s"}), on=["step", "op_id"])
    comp = comp.sort_values("start_s", kind="stable")
    prev_end = np.concatenate([[-np.inf], np.maximum.accumulate(comp.end_s.to_numpy(dtype=float))[:-1]])
    lo = np.maximum(comp.launched_s.to_numpy(dtype=float), prev_end)
    hi = comp.start_s.to_numpy(dtype=float)
    return _merge(np.stack([lo, hi], axis=1)[hi > lo])


#: the span columns ``rank_partition`` reads (``_dependency_waits`` the step and op ids)
_PARTITION_COLUMNS = ("step", "op_id", "stream", "kind", "phase", "start_s", "end_s")


def rank_partition(spans: pd.DataFrame, launches: pd.DataFrame | None, steps: pd.DataFrame, *,
               pipeline: bool) -> pd.DataFrame:
    """``SimulationResult.breakdown`` of one rank (``component, seconds`` per measured step): ``spans`` its spans,
    ``launches`` its host launches (used on a pipeline stage only), ``steps`` the steps whose windows are
    partitioned (``start_s, end_s``, optional ``warmup``); ``pipeline`` adds the waits for other stages."""
    steps = steps[~steps.warmup] if "warmup" in steps else steps
    sp = spans[[c for c in _PARTITION_COLUMNS if c in spans]]  # the columns read here (no copy of the names)
    kind = _codes(sp.kind)
    keep = ~_rows_in(kind, "sync")
    sp, kind, phase = sp[keep], (kind[0][keep], kind[1]), _codes(sp.phase[keep])
    iv = sp[["start_s", "end_s"]].to_numpy(dtype=float)  # each category's rows taken from it (no frame copies)
    coll = _rows_in(kind, COLLECTIVE_KIND)
    codes, uniq = pd.factorize(comm_group(sp.stream[coll]).to_numpy(object))
    groups = sorted(uniq)
    comp, opt = _rows_in(kind, COMPUTE_KIND), _rows_in(phase, "opt")
    ivs = [(BREAKDOWN_COMPUTE, iv[comp & ~opt]), (BREAKDOWN_OPTIMIZER, iv[opt & ~coll])]
    ivs += [(f"exposed comm ({g})", iv[coll][codes == list(uniq).index(g)]) for g in groups]
    ivs += [(BREAKDOWN_COPIES, iv[_rows_in(kind, *(k for k in GPU_KINDS if k.startswith("memcpy")))]),
            (BREAKDOWN_DATA, iv[_rows_in(phase, DATA_PHASE)])]
    if pipeline:
        ivs.append((BREAKDOWN_PIPELINE_WAIT, _dependency_waits(sp, launches, comp)))
    totals = dict.fromkeys([n for n, _ in ivs] + [BREAKDOWN_IDLE], 0.0)
    for t0, t1 in steps[["start_s", "end_s"]].to_numpy(dtype=float):
        clipped = []
        for name, x in ivs:
            x = x[(x[:, 1] > t0) & (x[:, 0] < t1)]
            clipped.append((name, _merge(np.clip(x, t0, t1))))
        edges = np.unique(np.concatenate([[t0, t1]] + [iv.ravel() for _, iv in clipped]))
        mid, width = (edges[:-1] + edges[1:]) / 2, np.diff(edges)
        free = np.ones(len(mid), dtype=bool)
        for name, iv in clipped:
            hit = free & _covered(iv, mid)
            totals[name] += float(width[hit].sum())
            free &= ~hit
        totals[BREAKDOWN_IDLE] += float(width[free].sum())
    n = max(len(steps), 1)
    rows = [(k, v / n) for k, v in totals.items() if v > 0 or k == BREAKDOWN_COMPUTE]
    return pd.DataFrame(rows, columns=["component", "seconds"])
