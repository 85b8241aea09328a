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
        self.spans: list[tuple] = []
        self.counters: list[tuple] = []

    def span(self, step: int, op, start_s: float, end_s: float, stream: str | None = None) -> None:
        """Record that ``op`` ran from ``start_s`` to ``end_s`` (seconds) in ``step``."""
        self.spans.append((
            step, op.id, op.name, stream or op.stream, op.kind.value, op.phase.value, op.layer,
            op.cost_class.value, start_s, end_s, op.flops, op.bytes_moved,
        ))

    def counter(self, t_s: float, scope: str, metric: str, value: float) -> None:
        """Record a level sample (the value holds from ``t_s`` until the next sample)."""
        self.counters.append((t_s, scope, metric, value))

    def spans_frame(self) -> pd.DataFrame:
        """Spans as a DataFrame with ``SPAN_COLUMNS`` (times in seconds)."""
        df = pd.DataFrame(self.spans, columns=SPAN_COLUMNS)
        df["duration_s"] = df["end_s"] - df["start_s"]
        return df

    def counters_frame(self) -> pd.DataFrame:
        """Counter samples as a DataFrame with ``COUNTER_COLUMNS``."""
        return pd.DataFrame(self.counters, columns=COUNTER_COLUMNS)
