"""Optional cross-check with Holistic Trace Analysis (runs when ``pip install HolisticTraceAnalysis``).

The replayed breakdown (compute / non-compute / idle per step, ``analysis.breakdown``) must agree
with HTA's ``get_temporal_breakdown`` on the same trace within 2% of the kernel window.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from simulator.analysis.breakdown import temporal_breakdown
from simulator.calibration.replay import replay_hardware
from simulator.api import simulate_graph
from simulator.graph.importers.kineto import load_kineto
from tests.conftest import ROOT

hta = pytest.importorskip("hta.trace_analysis")

CASES = [
    ROOT / "tests/data/traces/TraceLens/tests/traces/h100/gaunernst_bert-small-uncased__1016001.json.gz",
    ROOT / "tests/data/traces/param/et_replay/tests/inputs/dlrm_kineto/worker0_step_12.1694128201545.pt.trace.json.gz",
]


@pytest.mark.parametrize("path", CASES, ids=[p.name for p in CASES])
def test_breakdown_matches_hta(tmp_path, path):
    shutil.copy(path, tmp_path / path.name)
    ref = hta.TraceAnalysis(trace_dir=str(tmp_path)).get_temporal_breakdown(visualize=False).iloc[0]
    imp = load_kineto(path)
    res = simulate_graph(imp.graph, replay_hardware("h100-sxm-80gb"), steps=1)
    step_of = np.array([op.meta.get("step", -1) for op in imp.graph.ops])
    spans = res.spans.assign(trace_step=step_of[res.spans.op_id.to_numpy()])
    ours = temporal_breakdown(spans[spans.trace_step >= 0], step_col="trace_step").sum(numeric_only=True)
    window = ref["kernel_time(us)"] * 1e-6
    for ours_key, hta_key in (("compute_s", "compute_time(us)"), ("non_compute_s", "non_compute_time(us)"),
                              ("idle_s", "idle_time(us)")):
        diff = abs(ours[ours_key] - ref[hta_key] * 1e-6)
        assert diff <= 0.02 * window, f"{ours_key}: ours {ours[ours_key]:.6f} s, HTA {ref[hta_key] * 1e-6:.6f} s"
