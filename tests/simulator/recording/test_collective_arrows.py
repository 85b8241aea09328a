"""Perfetto flow arrows between the members of a collective that several simulated ranks meet at."""

from __future__ import annotations

import pytest

from simulator.api import run_scenario
from simulator.config.loader import scenario_from_dict
from simulator.recording.chrome_trace import result_trace
from tests.simulator.graph.test_pipeline_parallel import BASE

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _arrows(r):
    ev = [e for e in result_trace(r)["traceEvents"] if e.get("cat") == "collective"]
    starts = [e for e in ev if e["ph"] == "s"]
    assert len(starts) * 2 == len(ev) and {e["id"] for e in starts} == {e["id"] for e in ev if e["ph"] == "f"}
    return starts, ev


def test_cross_stage_all_reduces_link_every_stage_to_the_first():
    # PP4, 3 steps: per step the grad-norm all-reduce of 4 stages (3 arrows) and the tied-embedding all-reduce of
    # the first and last stage (1 arrow): 12 arrows, every one from stage 0's GPU (pid 1)
    r = run_scenario(scenario_from_dict(BASE))
    starts, _ = _arrows(r)
    assert len(starts) == 3 * (3 + 1)
    assert {e["pid"] for e in starts} == {1}


def test_data_parallel_collectives_link_the_rank_classes():
    # TP2 x DP4 on one DGX, every replica simulated (rank_folding none): 3 data-parallel collectives per step
    # met by 4 classes -> 3 arrows each; 2 steps: 18 arrows
    d = {**BASE, "parallelism": {"pipeline_model_parallel_size": 1, "tensor_model_parallel_size": 2},
         "run": {"steps": 2, "warmup_steps": 1, "rank_folding": "none"}}
    r = run_scenario(scenario_from_dict(d))
    sp = r.spans
    per_step = len(sp[(sp.stream == "comm.dp") & (sp.rank_class == 0) & (sp.step == 0)])
    starts, _ = _arrows(r)
    assert per_step == 3 and len(starts) == 2 * per_step * 3
