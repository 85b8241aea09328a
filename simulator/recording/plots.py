"""Matplotlib figures of a run or a sweep, drawn from DataFrames only.

Every function takes a DataFrame (spans, counters, a step breakdown, a sweep table) and a
matplotlib ``Axes``, draws on it and returns it; none calls ``plt.show`` or ``matplotlib.use``
and none touches pyplot's global state, so they work in notebooks, scripts and headless writers
alike. ``render_png`` draws one of them on a fresh ``matplotlib.figure.Figure`` and returns PNG
bytes. This module sits below ``simulator.analysis`` (import-linter layers): anything derived
from a run's summary (e.g. ``SimulationResult.breakdown()``) is computed by the caller.

Times are drawn in ms, memory in GB (1e9 bytes), power in W, clocks in MHz.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

#: Gantt colour per span kind (``simulator.graph.ops.OpKind`` values); others grey
KIND_COLOURS = {"compute": "tab:blue", "collective": "tab:red", "memcpy_h2d": "tab:green",
                "memcpy_d2h": "tab:olive", "memcpy_d2d": "tab:cyan", "dataloader": "tab:orange",
                "host": "tab:purple", "sync": "lightgrey"}
_UNITS = (("_bytes_per_s", "B/s"), ("_per_s", "1/s"), ("_bytes", "bytes"), ("_mhz", "MHz"), ("_w", "W"),
          ("_j", "J"), ("_s", "s"))
_UNIT_OF = {"s": "s", "j": "J", "w": "W", "bytes": "bytes"}
_PER_UNIT = re.compile(r"^(?P<stem>.+)_(?P<unit>s|j|w|bytes)_per_(?P<per>step|token|sample)$")


def metric_label(name: str) -> str:
    """Axis label of a metric column, its unit taken from the name's suffix:
    ``step_time_s`` -> ``"step time (s)"``, ``tokens_per_s`` -> ``"tokens (1/s)"``,
    ``energy_j_per_step`` -> ``"energy per step (J)"``, ``phase_s.fwd_s`` -> ``"phase_s.fwd (s)"``
    (no recognised suffix: the name with spaces, no unit)."""
    prefix, _, base = name.rpartition(".")
    prefix = prefix + "." if prefix else ""
    m = _PER_UNIT.match(base)
    if m:
        return f"{prefix}{m['stem'].replace('_', ' ')} per {m['per']} ({_UNIT_OF[m['unit']]})"
    for suffix, unit in _UNITS:
        if base.endswith(suffix) and len(base) > len(suffix):
            return f"{prefix}{base[: -len(suffix)].replace('_', ' ')} ({unit})"
    return prefix + base.replace("_", " ")


def timeline(spans: pd.DataFrame, ax, streams: Sequence[str] | None = None,
             t0_s: float | None = None, t1_s: float | None = None):
    """Gantt chart: one row per resource (span ``stream``), one bar per span, coloured by ``kind``.

    Args:
        spans: Span frame (``stream, kind, start_s, end_s``; ``SimulationResult.spans``).
        ax: Axes to draw on.
        streams: Rows to draw, top to bottom (default: every stream, sorted).
        t0_s, t1_s: Time window (s); spans outside it are not drawn.

    Returns:
        ``ax``: y ticks = the streams, x = time (ms), one legend entry per kind drawn.
    """
    d = spans
    if t0_s is not None:
        d = d[d.end_s > t0_s]
    if t1_s is not None:
        d = d[d.start_s < t1_s]
    rows = list(streams) if streams is not None else sorted(d.stream.unique())
    for y, stream in enumerate(rows):
        s = d[d.stream == stream]
        for kind, k in s.groupby("kind", sort=True):
            bars = list(zip(k.start_s.to_numpy() * 1e3, (k.end_s - k.start_s).to_numpy() * 1e3))
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=KIND_COLOURS.get(kind, "grey"), label=kind)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("resource")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    if uniq:
        ax.legend(uniq.values(), uniq.keys(), loc="upper right", fontsize="small")
    return ax


def breakdown_bars(breakdown: pd.DataFrame, ax, title: str | None = None):
    """Horizontal bars of where a step's time goes.

    Args:
        breakdown: ``component, seconds`` rows (``SimulationResult.breakdown()``), seconds per step.
        ax: Axes to draw on.
        title: Optional title.

    Returns:
        ``ax``: one bar per component (top to bottom in row order), x = time per step (ms), each
        bar labelled with its ms and share of the total.
    """
    comps = list(breakdown.component)
    ms = breakdown.seconds.to_numpy(float) * 1e3
    total = ms.sum()
    ax.barh(range(len(comps)), ms, color=[_component_colour(c) for c in comps])
    ax.set_yticks(range(len(comps)), comps)
    ax.set_ylim(len(comps) - 0.5, -0.5)
    for y, v in enumerate(ms):
        ax.annotate(f"{v:.2f} ms ({100 * v / total if total > 0 else 0:.0f} %)", (v, y), xytext=(3, 0),
                    textcoords="offset points", va="center", fontsize="small")
    ax.set_xlim(0, max(total, 1e-9) * 1.25 if len(ms) else 1)
    ax.set_xlabel("time per step (ms)")
    if title:
        ax.set_title(title)
    return ax


def _component_colour(name: str) -> str:
    for key, colour in (("compute", "tab:blue"), ("optimizer", "tab:purple"), ("comm", "tab:red"),
                        ("cop", "tab:green"), ("data", "tab:orange"), ("other stages", "tab:brown")):
        if key in name:
            return colour
    return "lightgrey"


def _level_series(counters: pd.DataFrame, metric_filter: Callable[[str], bool]):
    d = counters[counters.metric.map(metric_filter)]
    for (scope, metric), g in d.groupby(["scope", "metric"], sort=True):
        g = g.sort_values("t_s", kind="stable")
        yield scope, metric, g.t_s.to_numpy(float), g.value.to_numpy(float)


def memory_over_time(counters: pd.DataFrame, ax):
    """Device/host memory over time: one step line per pool (``memory_bytes``) and, when the
    counters carry them, per category (``memory_bytes.<category>``, e.g. ``params``).

    Args:
        counters: Counter frame (``t_s, scope, metric, value``; ``SimulationResult.counters``).
        ax: Axes to draw on.

    Returns:
        ``ax``: x = time (ms), y = memory (GB), one labelled line per (pool, category), each held
        at its last level until the last memory sample.

    Raises:
        ValueError: no memory counter in ``counters``.
    """
    n = 0
    series = list(_level_series(counters, lambda m: m == "memory_bytes" or m.startswith("memory_bytes.")))
    t_end = max((float(t[-1]) for *_, t, _ in series), default=0.0)
    for scope, metric, t, v in series:  # a level holds until the next sample: extend each to the end
        cat = metric.partition(".")[2]
        ax.step(np.append(t, t_end) * 1e3, np.append(v, v[-1]) / 1e9, where="post",
                label=f"{scope} {cat}" if cat else f"{scope} total")
        n += 1
    if not n:
        raise ValueError("no memory counters (metric memory_bytes) to plot")
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("memory (GB)")
    ax.legend(loc="best", fontsize="small")
    return ax


def has_power(counters: pd.DataFrame) -> bool:
    """True when ``counters`` hold power samples (metric ``power_w``)."""
    return bool((counters.metric == "power_w").any())


def power_and_clock(counters: pd.DataFrame, ax):
    """Power (W, left axis) and SM clock (MHz, right axis, a twin of ``ax``) over time.

    Args:
        counters: Counter frame with ``power_w`` and optionally ``sm_clock_mhz`` samples.
        ax: Axes to draw power on; the clock goes on ``ax.twinx()`` (found again as
            ``ax.figure.axes``), extended to the end of the power samples.

    Returns:
        ``ax``: x = time (ms), y = power (W), one line per power scope.

    Raises:
        ValueError: no ``power_w`` counter.
    """
    if not has_power(counters):
        raise ValueError("no power counters (metric power_w) to plot")
    t_end = float(counters.t_s.max()) * 1e3
    for scope, _, t, v in _level_series(counters, lambda m: m == "power_w"):
        ax.step(np.append(t * 1e3, t_end), np.append(v, v[-1]), where="post", label=f"{scope} power")
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("power (W)")
    clocks = list(_level_series(counters, lambda m: m == "sm_clock_mhz"))
    handles, labels = ax.get_legend_handles_labels()
    if clocks:
        tw = ax.twinx()
        for scope, _, t, v in clocks:
            tw.step(np.append(t * 1e3, t_end), np.append(v, v[-1]), where="post", color="tab:gray",
                    linestyle="--", label=f"{scope} SM clock")
        tw.set_ylabel("SM clock (MHz)")
        lo = min(float(v.min()) for *_, v in clocks)
        tw.set_ylim(0, max(float(v.max()) for *_, v in clocks) * 1.1 if lo >= 0 else None)
        h2, l2 = tw.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.set_ylim(bottom=0)
    ax.legend(handles, labels, loc="lower right", fontsize="small")
    return ax


def sweep_curves(table: pd.DataFrame, x: str, metric: str, ax, by: Sequence[str] = ()):
    """A metric against one swept factor, one line per combination of the other factors.

    Args:
        table: Sweep table (``simulator.studies.sweep.run_sweep``); rows with an ``error`` or a
            missing metric are left out.
        x: Factor column on the x axis (numbers: a numeric axis; otherwise categorical).
        metric: Column to plot.
        ax: Axes to draw on.
        by: Other factor columns; each distinct combination is one series (legend ``k=v``).

    Returns:
        ``ax``: one line (with markers) per series, x labelled with the factor, y with
        ``metric_label(metric)``.

    Raises:
        KeyError: ``x``, ``metric`` or a ``by`` column is not in ``table``.
    """
    for col in (x, metric, *by):
        if col not in table:
            raise KeyError(f"column {col!r} not in the sweep table")
    d = table
    if "error" in d:
        d = d[d["error"].isna()]
    d = d[pd.to_numeric(d[metric], errors="coerce").notna()]
    numeric = pd.api.types.is_numeric_dtype(pd.to_numeric(table[x], errors="coerce").dropna()) and \
        pd.to_numeric(table[x], errors="coerce").notna().all()
    cats = list(dict.fromkeys(table[x]))
    groups = d.groupby(list(by), sort=False) if by else [((), d)]
    for key, g in groups:
        key = key if isinstance(key, tuple) else (key,)
        xs = pd.to_numeric(g[x]) if numeric else g[x].map(cats.index)
        order = np.argsort(xs.to_numpy(), kind="stable")
        label = ", ".join(f"{b.split('.')[-1]}={v}" for b, v in zip(by, key)) or metric
        ax.plot(xs.to_numpy()[order], pd.to_numeric(g[metric]).to_numpy()[order], marker="o", label=label)
    if not numeric:
        ax.set_xticks(range(len(cats)), [str(c) for c in cats])
    ax.set_xlabel(x)
    ax.set_ylabel(metric_label(metric))
    if by:
        ax.legend(loc="best", fontsize="small")
    return ax


def pareto_front(table: pd.DataFrame, ax, time: str = "step_time_s", energy: str = "energy_j_per_step",
                 front: str = "pareto", label: str | None = None):
    """Time-energy trade-off: every point as a dot, the non-dominated ones joined by a line.

    Args:
        table: One row per configuration with ``time``, ``energy`` and a boolean ``front`` column
            (computed by the caller, e.g. ``simulator.studies.pareto.pareto_mask``).
        ax: Axes to draw on.
        time, energy: Column names (s, J).
        front: Boolean column marking the Pareto-optimal rows.
        label: Optional column whose values annotate the points (e.g. the clock).

    Returns:
        ``ax``: two series, "all points" (scatter) and "Pareto front" (line through the front,
        sorted by time); x = time in ms, y = energy in J.

    Raises:
        KeyError: a named column is missing.
    """
    for col in (time, energy, front) + ((label,) if label else ()):
        if col not in table:
            raise KeyError(f"column {col!r} not in the table")
    d = table[pd.to_numeric(table[time], errors="coerce").notna() & pd.to_numeric(table[energy], errors="coerce").notna()]
    ax.scatter(d[time].astype(float) * 1e3, d[energy].astype(float), color="tab:gray", label="all points")
    f = d[d[front].astype(bool)].sort_values(time)
    ax.plot(f[time].astype(float) * 1e3, f[energy].astype(float), color="tab:red", marker="o", label="Pareto front")
    if label:
        for _, r in d.iterrows():
            ax.annotate(str(r[label]), (float(r[time]) * 1e3, float(r[energy])), xytext=(3, 3),
                        textcoords="offset points", fontsize="small")
    ax.set_xlabel(f"{metric_label(time).rsplit(' (', 1)[0]} (ms)")
    ax.set_ylabel(metric_label(energy))
    ax.legend(loc="best", fontsize="small")
    return ax


def render(draw: Callable, *args, fmt: str = "png", figsize=(8.0, 4.0), dpi: int = 100, **kwargs) -> bytes:
    """``draw(*args, ax=ax, **kwargs)`` on a new ``matplotlib.figure.Figure`` (no pyplot), saved
    as ``fmt`` (``"png"`` or ``"svg"``); returns the file's bytes."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=dpi)
    ax = fig.add_subplot()
    draw(*args, ax=ax, **kwargs)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt)
    return buf.getvalue()


def render_png(draw: Callable, *args, **kwargs) -> bytes:
    """PNG bytes of ``render(draw, *args, **kwargs)``."""
    return render(draw, *args, fmt="png", **kwargs)


__all__ = [
    "breakdown_bars",
    "has_power",
    "memory_over_time",
    "metric_label",
    "pareto_front",
    "power_and_clock",
    "render",
    "render_png",
    "sweep_curves",
    "timeline",
]
