"""Record spans and counters during a run as plain tuples; build DataFrames once at the end."""

from __future__ import annotations

import pandas as pd

SPAN_COLUMNS = [
    "step", "op_id", "name", "stream", "kind", "phase", "layer", "cost_class",
    "start_s", "end_s", "flops", "bytes",
]
COUNTER_COLUMNS = ["t_s", "scope", "metric", "value"]


class Recorder:
    """Collects spans (op executions) and counter samples (memory, clock, power levels)."""

    def __init__(self) -> None:
        self._spans: list[tuple] = []
        self.counters: list[tuple] = []
        self._last: dict[tuple[str, str], int] = {}

    def span(self, step: int, op, start_s: float, end_s: float, stream: str | None = None) -> None:
        """Record that ``op`` ran from ``start_s`` to ``end_s`` (seconds) in ``step``."""
        self._spans.append((step, op, start_s, end_s, stream))

    @property
    def spans(self) -> list[tuple]:
        """Spans as tuples in ``SPAN_COLUMNS`` order."""
        return [
            (step, op.id, op.name, stream or op.stream, op.kind.value, op.phase.value, op.layer,
             op.cost_class.value, s, e, op.flops, op.bytes_moved)
            for step, op, s, e, stream in self._spans
        ]

    def drop_rows(self) -> None:
        """Forget the recorded spans and counter samples (once ``spans_frame`` and ``counters_frame`` are built)."""
        self._spans = []
        self.counters = []
        self._last = {}

    def counter(self, t_s: float, scope: str, metric: str, value: float) -> None:
        """Record a level sample (the value holds from ``t_s`` until the next sample).

        Several samples of one counter at the same instant keep only the last.
        """
        key = (scope, metric)
        i = self._last.get(key)
        if i is not None and self.counters[i][0] == t_s:
            self.counters[i] = (t_s, scope, metric, value)
            return
        self._last[key] = len(self.counters)
        self.counters.append((t_s, scope, metric, value))

    def spans_frame(self) -> pd.DataFrame:
        """Spans as a DataFrame with ``SPAN_COLUMNS`` (times in seconds).

        Built column by column: an op's attributes are read once however many steps it ran in.
        """
        if not self._spans:
            df = pd.DataFrame(self.spans, columns=SPAN_COLUMNS)
            df["duration_s"] = df["end_s"] - df["start_s"]
            return df
        steps, ops, starts, ends, streams = zip(*self._spans)
        attrs: dict[int, tuple] = {}
        for op in ops:
            if id(op) not in attrs:
                attrs[id(op)] = (op.id, op.name, op.stream, op.kind.value, op.phase.value, op.layer,
                                 op.cost_class.value, op.flops, op.bytes_moved)
        rows = [attrs[id(op)] for op in ops]
        op_id, name, op_stream, kind, phase, layer, cost_class, flops, nbytes = zip(*rows)
        cols = {"step": steps, "op_id": op_id, "name": name,
                "stream": [s or d for s, d in zip(streams, op_stream)], "kind": kind, "phase": phase,
                "layer": layer, "cost_class": cost_class, "start_s": starts, "end_s": ends, "flops": flops,
                "bytes": nbytes}
        df = pd.DataFrame({k: list(v) for k, v in cols.items()}, columns=SPAN_COLUMNS)
        df["duration_s"] = df["end_s"] - df["start_s"]
        return df

    def counters_frame(self) -> pd.DataFrame:
        """Counter samples as a DataFrame with ``COUNTER_COLUMNS``, in time order."""
        if not self.counters:
            return pd.DataFrame(self.counters, columns=COUNTER_COLUMNS)
        df = pd.DataFrame(dict(zip(COUNTER_COLUMNS, map(list, zip(*self.counters)))), columns=COUNTER_COLUMNS)
        return df.sort_values("t_s", kind="stable", ignore_index=True)


LAUNCH_COLUMNS = ["step", "op_id", "start_s", "end_s"]
#: columns a run of several simulated ranks adds to its frames: the rank's index (several classes), its
#: pipeline stage, its data-parallel class
RANK_COLUMNS = ("rank_class", "pp_rank", "dp_class")


def rank_column(frame) -> str | None:
    """The column naming which simulated rank a row belongs to: ``rank_class`` (several classes: the rank's
    index), ``pp_rank`` (one class per pipeline stage), or None (one rank)."""
    return next((c for c in RANK_COLUMNS[:2] if c in frame), None)
DEPENDENCY_COLUMNS = ["op_id", "dep_id", "step_lag"]


def launches_frame(graph, launch_time: list[list[float | None]], launch_cost_s: list[float] | None) -> pd.DataFrame:
    """Host launch intervals of the launched ops (``LAUNCH_COLUMNS``, seconds).

    Args:
        graph: The step graph (its ops' ``launch`` flags).
        launch_time: ``[step][op_id]`` time the host finished launching the op (None: never launched).
        launch_cost_s: ``[op_id]`` host time one launch takes; None gives an empty frame.
    """
    if launch_cost_s is None:
        return pd.DataFrame(columns=LAUNCH_COLUMNS)
    launched = [op.id for op in graph.ops if op.launch]
    rows = [(step, i, t - launch_cost_s[i], t) for step, lt in enumerate(launch_time) for i in launched
            if (t := lt[i]) is not None]
    if not rows:
        return pd.DataFrame(rows, columns=LAUNCH_COLUMNS)
    return pd.DataFrame(dict(zip(LAUNCH_COLUMNS, map(list, zip(*rows)))), columns=LAUNCH_COLUMNS)


def dependencies_frame(graph) -> pd.DataFrame:
    """The graph's dependency edges (``DEPENDENCY_COLUMNS``): ``dep_id`` must finish before ``op_id``
    starts, in the same step (``step_lag`` 0) or the previous one (1, ``meta["prev_step_deps"]``)."""
    rows = [(op.id, d, 0) for op in graph.ops for d in op.deps]
    rows += [(op.id, d, 1) for op in graph.ops for d in ((op.meta or {}).get("prev_step_deps") or ())]
    return pd.DataFrame(rows, columns=DEPENDENCY_COLUMNS)
