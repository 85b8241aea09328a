"""A phase_plan clock on a phase shorter than the clock switch latency is flagged (trial finding: on
gpt_184m_b16 the 1.26 ms optimizer phase at 1200 MHz with the 10 ms default switch changed nothing, silently)."""

from __future__ import annotations

from simulator.api import run_scenario
from simulator.config.loader import load_scenario
from tests.conftest import ROOT

ONE_GPU = ROOT / "scenarios/h200/gpt_184m_b16.yaml"


def _run(*sets):
    sets = ["run.steps=3", "run.warmup_steps=1", "dvfs.kind=phase_plan", *sets]
    s = run_scenario(load_scenario(ONE_GPU, sets)).summary
    return s, [w for w in s["warnings"] if w.startswith("dvfs.phase_clocks_mhz")]


def test_a_phase_shorter_than_the_switch_latency_is_named():
    s, lines = _run("dvfs.phase_clocks_mhz.opt=1200")  # default clock_switch_latency_s 10 ms
    assert len(lines) == 1 and lines[0].startswith("dvfs.phase_clocks_mhz.opt 1200 MHz cannot take effect"), lines
    assert "shorter than dvfs.clock_switch_latency_s 10 ms" in lines[0]
    base, _ = _run("dvfs.phase_clocks_mhz.fwd=1980")  # the maximum clock everywhere: the plan is a no-op
    assert s["energy_j_per_step"] == base["energy_j_per_step"]  # indeed nothing changed


def test_a_phase_longer_than_the_switch_latency_is_not_named_and_takes_effect():
    s, lines = _run("dvfs.phase_clocks_mhz.opt=1200", "dvfs.clock_switch_latency_s=0.0002")  # 0.2 ms < 1.26 ms
    base, _ = _run("dvfs.phase_clocks_mhz.fwd=1980", "dvfs.clock_switch_latency_s=0.0002")
    assert lines == [] and s["energy_j_per_step"] != base["energy_j_per_step"]
    s, lines = _run("dvfs.phase_clocks_mhz.bwd=1200")  # backward: 36 ms > 10 ms
    assert lines == []
