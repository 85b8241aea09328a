"""The result of one simulated run: DataFrames plus a summary dict. Touches no files."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd


@dataclass(frozen=True)
class SimulationResult:
    """Everything a run produced.

    Attributes:
        summary: Headline metrics (see ``simulator.analysis.summary.summarize``).
        spans: One row per op execution (``recording.recorder.SPAN_COLUMNS`` + ``duration_s``).
        counters: Level samples (memory bytes, clocks, power) with ``t_s, scope, metric, value``.
        steps: One row per step: ``step, start_s, end_s, step_time_s, warmup``.
        config: The resolved scenario as a plain dict.
        launches: One row per host kernel/copy launch: ``step, op_id, start_s, end_s`` (the host
            thread's busy interval; ``recording.recorder.launches_frame``).
        deps: The step graph's dependencies: ``op_id, dep_id, step_lag`` (0 same step, 1 previous).
    """

    summary: dict[str, Any]
    spans: pd.DataFrame
    counters: pd.DataFrame
    steps: pd.DataFrame
    config: dict[str, Any] = field(default_factory=dict)
    launches: pd.DataFrame | None = None
    deps: pd.DataFrame | None = None

    @property
    def ok(self) -> bool:
        """False when the run went out of memory."""
        return not self.summary.get("oom")
