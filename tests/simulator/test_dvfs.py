"""DVFS policies end to end: bad input, outputs in the summary and the Perfetto trace, phase plans."""

from __future__ import annotations

import pytest

from simulator import ScenarioError, load_scenario, run_scenario
from simulator.policies.registry import PolicyError
from simulator.recording.chrome_trace import to_chrome_trace
from tests.conftest import ROOT

B8 = ROOT / "scenarios/h200/gpt_184m_b8.yaml"


def test_unsupported_clock_snaps_with_warning():
    cfg = load_scenario(B8, overrides=["dvfs.kind=locked_clock", "dvfs.locked_clocks_mhz=1412"])
    with pytest.warns(UserWarning, match="1412 MHz is not a supported SM clock; using the nearest supported clock 1410"):
        s = run_scenario(cfg).summary
    assert s["avg_sm_clock_mhz"] == pytest.approx(1410)


def test_power_cap_out_of_range_is_one_line_error():
    cfg = load_scenario(B8, overrides=["dvfs.kind=power_cap", "dvfs.power_limit_w=150 W"])
    with pytest.raises(PolicyError, match=r"^dvfs.power_limit_w 150 W is outside the settable range .*200-700 W$"):
        run_scenario(cfg)


def test_unknown_phase_lists_allowed_phases():
    with pytest.raises(ScenarioError, match="unknown phase.*warmup.*allowed: data, fwd, bwd, opt, other"):
        load_scenario(B8, overrides=["dvfs.kind=phase_plan", "dvfs.phase_clocks_mhz={warmup: 1200}"])


def test_kind_without_its_parameter_is_rejected():
    with pytest.raises(ScenarioError, match="locked_clock needs locked_clocks_mhz"):
        load_scenario(B8, overrides=["dvfs.kind=locked_clock"])


def test_energy_outputs_and_counters_in_summary_and_trace():
    r = run_scenario(load_scenario(B8))
    s = r.summary
    for k in ("energy_j_per_step", "avg_power_w", "energy_per_token_j", "host_energy_j_per_step"):
        assert s[k] > 0
    assert s["energy_per_token_j"] == pytest.approx(s["energy_j_per_step"] / (8 * 1024), rel=1e-6)
    gpu = r.counters[r.counters.scope == "gpu0"]
    assert {"sm_clock_mhz", "power_w"} <= set(gpu.metric)
    names = {e["name"] for e in to_chrome_trace(r.spans, r.counters)["traceEvents"] if e["ph"] == "C"}
    assert {"gpu0.sm_clock_mhz", "gpu0.power_w"} <= names


def test_lower_locked_clock_slower_and_less_power():
    hi = run_scenario(load_scenario(B8, overrides=["dvfs.kind=locked_clock", "dvfs.locked_clocks_mhz=1980"])).summary
    lo = run_scenario(load_scenario(B8, overrides=["dvfs.kind=locked_clock", "dvfs.locked_clocks_mhz=990"])).summary
    assert lo["step_time_s"] > hi["step_time_s"]
    assert lo["avg_power_w"] < hi["avg_power_w"]


def test_power_cap_holds_average_power_near_the_cap():
    cfg = load_scenario(B8, overrides=["dvfs.kind=power_cap", "dvfs.power_limit_w=400", "run.steps=8"])
    s = run_scenario(cfg).summary
    assert s["avg_power_w"] == pytest.approx(400, rel=0.06)
    assert s["clock_switches"] >= 1 and s["avg_sm_clock_mhz"] < 1980


def test_phase_plan_switches_with_latency_and_costs_time():
    base = run_scenario(load_scenario(B8)).summary
    plan = ["dvfs.kind=phase_plan", "dvfs.phase_clocks_mhz={fwd: 1980, bwd: 1980, opt: 990}"]
    fast = run_scenario(load_scenario(B8, overrides=plan + ["dvfs.clock_switch_latency_s=0.2 ms"])).summary
    assert fast["clock_switches"] >= 2                   # down for opt, up again for the next fwd
    assert fast["step_time_s"] > base["step_time_s"]     # opt runs slower
    # with the default 10 ms latency the ~1 ms optimizer phase is over before its clock arrives,
    # and the next request (back to 1980 MHz for fwd) supersedes it: no switch lands at all
    slow = run_scenario(load_scenario(B8, overrides=plan)).summary
    assert slow["clock_switches"] == 0
    assert slow["step_time_s"] == pytest.approx(base["step_time_s"], rel=1e-9)
