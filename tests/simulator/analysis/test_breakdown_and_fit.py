"""Temporal breakdown and per-class calibration scales on data worked out by hand."""

from __future__ import annotations

import pandas as pd
import pytest

from simulator.analysis.breakdown import temporal_breakdown
from simulator.calibration.fit import fit_scales


def test_breakdown_by_hand():
    """Window 0-10: compute 0-4 and 3-6 (union 6), memcpy 5-8 (2 beyond compute), idle 2."""
    spans = pd.DataFrame({
        "step": [0, 0, 0, 0], "kind": ["compute", "compute", "memcpy_h2d", "host"],
        "cost_class": ["gemm", "norm", "copy", "other"],
        "start_s": [0.0, 3.0, 5.0, 0.0], "end_s": [4.0, 6.0, 8.0, 10.0],
    })
    spans.loc[len(spans)] = [0, "compute", "memset", 9.0, 10.0]  # memsets count as non-compute, as in HTA
    row = temporal_breakdown(spans).iloc[0]
    assert row.window_s == 10.0
    assert row.compute_s == 6.0
    assert row.non_compute_s == 3.0  # memcpy 6-8 and memset 9-10
    assert row.idle_s == 1.0


def test_fit_scales_is_the_geometric_mean_of_ratios():
    m1, s1 = pd.Series({"gemm": 2.0, "norm": 1.0}), pd.Series({"gemm": 1.0, "norm": 1.0})
    m2, s2 = pd.Series({"gemm": 8.0, "norm": 1.0}), pd.Series({"gemm": 1.0, "norm": 2.0})
    k = fit_scales([(m1, s1), (m2, s2)])
    assert k["gemm"] == pytest.approx(4.0)      # sqrt(2 * 8)
    assert k["norm"] == pytest.approx(0.5**0.5)  # sqrt(1 * 0.5)
