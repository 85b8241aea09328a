"""Metrics derived from a run's spans: step time, phase split, throughput, MFU, utilisation."""

from __future__ import annotations

import numpy as np
import pandas as pd

PHASES = ("fwd", "bwd", "opt")


def phase_split(spans: pd.DataFrame, steps: pd.DataFrame) -> dict[str, float]:
    """Mean forward / backward / optimizer time per measured step, seconds.

    Boundaries are taken on the device timeline, as CUDA events recorded between the phases
    measure them: forward runs from the step start to the end of the last forward op, backward
    from there to the end of the last backward op, optimizer from there to the end of the last
    optimizer op.
    """
    out = {p: [] for p in PHASES}
    last_end = spans.groupby(["step", "phase"]).end_s.max()
    for row in steps[~steps.warmup].itertuples():
        t = row.start_s
        for p in PHASES:
            e = last_end.get((row.step, p))
            if e is not None:
                out[p].append(max(float(e) - t, 0.0))
                t = max(t, float(e))
    return {f"{p}_s": float(np.mean(v)) if v else 0.0 for p, v in out.items()}


def busy_time(spans: pd.DataFrame, stream: str) -> float:
    """Union of busy intervals of one stream, seconds."""
    d = spans[spans.stream == stream].sort_values("start_s")
    total, cur_s, cur_e = 0.0, None, None
    for s, e in zip(d.start_s.to_numpy(), d.end_s.to_numpy()):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def utilisation(spans: pd.DataFrame, steps: pd.DataFrame) -> dict[str, float]:
    """Busy fraction of each stream over the measured steps (0-1)."""
    m = steps[~steps.warmup]
    if m.empty:
        return {}
    t0, t1 = float(m.start_s.min()), float(m.end_s.max())
    d = spans[(spans.step.isin(m.step))]
    return {s: busy_time(d, s) / (t1 - t0) for s in sorted(d.stream.unique())} if t1 > t0 else {}


def mfu(model_flops_per_step: float, step_time_s: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation.

    ``MFU = model_flops_per_step / (step_time_s * peak_flops_per_s)``, where model FLOPs count
    forward + backward (3x forward) without recompute (Chowdhery et al., *PaLM*, 2022, appendix B;
    Korthikanti et al., 2023, section 6 use the same definition), and the peak is the GPU's dense
    bf16 tensor-core rate at the maximum clock.
    """
    if step_time_s <= 0 or peak_flops_per_s <= 0:
        return 0.0
    return model_flops_per_step / (step_time_s * peak_flops_per_s)
