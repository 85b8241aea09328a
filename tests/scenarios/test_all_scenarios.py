"""Every bundled scenario validates and runs a short horizon."""

from __future__ import annotations

import pytest

from simulator import load_scenario, run_scenario
from tests.conftest import ROOT

SCENARIOS = sorted(p for p in (ROOT / "scenarios").rglob("*.yaml"))


@pytest.mark.parametrize("path", SCENARIOS, ids=[str(p.relative_to(ROOT)) for p in SCENARIOS])
def test_scenario_runs(path):
    cfg = load_scenario(path, ["run.steps=2", "run.warmup_steps=1"])
    r = run_scenario(cfg)
    s = r.summary
    assert s["step_time_s"] > 0 and s["samples_per_s"] > 0
    assert 0 < s["mfu"] < 1
    assert s["peak_memory_bytes"] > 0
