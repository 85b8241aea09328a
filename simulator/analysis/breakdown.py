"""GPU temporal breakdown (compute / non-compute / idle), defined as Holistic Trace Analysis does.

For each step, the window runs from the first GPU op's start to the last GPU op's end; *compute*
is the time covered by compute kernels, *non-compute* the time covered only by communication
(NCCL) kernels, memory copies and memsets, *idle* the rest (HTA ``get_temporal_breakdown``,
facebookresearch/HolisticTraceAnalysis, docs "Temporal Breakdown").
"""

from __future__ import annotations

import numpy as np
import pandas as pd

GPU_COMPUTE = ("compute",)
GPU_OTHER = ("collective", "memcpy_h2d", "memcpy_d2h", "memcpy_d2d")


def _union(intervals: np.ndarray) -> float:
    """Total length covered by ``[[start, end], ...]`` (seconds)."""
    if len(intervals) == 0:
        return 0.0
    iv = intervals[np.argsort(intervals[:, 0])]
    total, cs, ce = 0.0, iv[0, 0], iv[0, 1]
    for s, e in iv[1:]:
        if s > ce:
            total += ce - cs
            cs, ce = s, e
        else:
            ce = max(ce, e)
    return total + ce - cs


def temporal_breakdown(spans: pd.DataFrame, step_col: str = "step") -> pd.DataFrame:
    """Per step: ``window_s, compute_s, non_compute_s, idle_s`` and their percentages.

    Args:
        spans: Span DataFrame (``kind``, ``start_s``, ``end_s`` and ``step_col``); gap/marker ops
            (kind ``sync``) and host ops are ignored.
        step_col: Column that names the step.
    """
    rows = []
    gpu = spans[spans.kind.isin(GPU_COMPUTE + GPU_OTHER)]
    for step, d in gpu.groupby(step_col):
        t0, t1 = float(d.start_s.min()), float(d.end_s.max())
        is_comp = d.kind.isin(GPU_COMPUTE) & (d.cost_class != "memset")
        comp = d[is_comp][["start_s", "end_s"]].to_numpy()
        allv = d[["start_s", "end_s"]].to_numpy()
        c, a = _union(comp), _union(allv)
        rows.append({step_col: step, "window_s": t1 - t0, "compute_s": c, "non_compute_s": a - c,
                     "idle_s": (t1 - t0) - a})
    df = pd.DataFrame(rows)
    for k in ("compute", "non_compute", "idle"):
        df[f"{k}_pct"] = 100 * df[f"{k}_s"] / df.window_s.where(df.window_s > 0, np.nan)
    return df
