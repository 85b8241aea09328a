"""``dvfs`` settings that change nothing are flagged (they gave the same result without a word): a power limit that
never binds (with the peak draw the firmware read), one equal to the board's default limit, a locked clock or a
phase plan at the maximum clock. Each claim is checked against the run without the setting."""

from __future__ import annotations

import re

import numpy as np
import pytest

from simulator import load_scenario, run_scenario
from tests.conftest import ROOT

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

B8 = ROOT / "scenarios/h200/gpt_184m_b8.yaml"
TDP_500 = "hardware.gpu={preset: h200-sxm-141gb, overrides: {tdp_w: 500}}"  # H200 settable range 200-700 W


def _run(*sets):
    return run_scenario(load_scenario(B8, overrides=list(sets)))


def _dvfs_notes(r) -> list[str]:
    return [w for w in r.summary["warnings"] if w.startswith("dvfs.")]


def _window_peak_w(counters, period_s=0.01, window_s=0.02) -> tuple[float, float]:
    """From the run's ``power_w`` counter (piecewise constant from t = 0): the highest average over
    ``[max(0, t - window_s), t]`` at t = period, 2 period, ... up to the last sample, and the highest level."""
    c = counters[(counters.metric == "power_w") & (counters.scope == "gpu0")].sort_values("t_s", kind="stable")
    c = c.drop_duplicates("t_s", keep="last")
    t, p = c.t_s.to_numpy(float), c.value.to_numpy(float)
    e = np.concatenate(([0.0], np.cumsum(p[:-1] * np.diff(t))))

    def energy(x):
        i = np.maximum(np.searchsorted(t, x, side="right") - 1, 0)
        return e[i] + p[i] * (x - t[i])

    tk = np.arange(1, int(t[-1] // period_s) + 1) * period_s
    lo = np.maximum(0.0, tk - window_s)
    return float(((energy(tk) - energy(lo)) / (tk - lo)).max()), float(p.max())


def test_a_power_limit_that_never_binds_says_so_with_the_peak_draw():
    """690 W on the 184M b8 step: the firmware's readings peak below it, so the step is the uncapped one (same step
    time to the bit) and the note gives that peak (recomputed here from the power counter) and the instantaneous
    one; a 400 W limit binds (a slower step) and gets no such note."""
    free, capped = _run(), _run("dvfs.kind=power_cap", "dvfs.power_limit_w=690")
    assert capped.summary["step_time_s"] == free.summary["step_time_s"]
    notes = _dvfs_notes(capped)
    assert len(notes) == 1 and notes[0].startswith("dvfs.power_limit_w 690 W never binds: peak draw ")
    peak, inst = _window_peak_w(capped.counters)
    said = [float(x) for x in re.findall(r"peak draw (\d+) W .*instantaneous peak (\d+) W", notes[0])[0]]
    assert said == [round(peak), round(inst)] and peak < 690
    assert notes[0].endswith("the run is the same as without it")
    low = _run("dvfs.kind=power_cap", "dvfs.power_limit_w=400")
    assert low.summary["step_time_s"] > free.summary["step_time_s"] and not _dvfs_notes(low)


def test_a_limit_above_a_binding_default_says_it_lifts_it():
    """TDP 500 W (the default limit) binds on this step; an explicit 690 W never binds, so it is not a cap but
    lifts the default: the note says so, and the run without it is indeed slower (the default limit binds)."""
    default, lifted = _run(TDP_500), _run(TDP_500, "dvfs.kind=power_cap", "dvfs.power_limit_w=690")
    assert default.summary["step_time_s"] > lifted.summary["step_time_s"]
    notes = _dvfs_notes(lifted)
    assert len(notes) == 1 and "never binds" in notes[0]
    assert notes[0].endswith("without it the default limit 500 W (TDP) would bind, so it lifts that limit rather "
                             "than capping")


def test_a_binding_limit_equal_to_the_default_says_it_is_the_default():
    """TDP 500 W binds; an explicit 500 W is that limit: the same step time as without it, and a note."""
    default, same = _run(TDP_500), _run(TDP_500, "dvfs.kind=power_cap", "dvfs.power_limit_w=500")
    assert same.summary["step_time_s"] == pytest.approx(default.summary["step_time_s"], rel=1e-12)
    assert same.summary["avg_sm_clock_mhz"] < 1980  # it binds
    assert _dvfs_notes(same) == ["dvfs.power_limit_w 500 W is the default power limit of NVIDIA H200 SXM 141GB (its "
                                 "TDP), which the firmware holds without it: the run is the same as without it"]


def test_a_clock_locked_at_the_maximum_changes_nothing_and_says_so():
    """1980 MHz is the H200's maximum SM clock, where it runs unlocked: same step as without a lock, one note;
    1395 MHz (a supported lower clock) is slower and gets none."""
    free, locked = _run(), _run("dvfs.kind=locked_clock", "dvfs.locked_clocks_mhz=1980")
    assert locked.summary["step_time_s"] == free.summary["step_time_s"]
    assert _dvfs_notes(locked) == ["dvfs.locked_clocks_mhz 1980 MHz is the maximum SM clock of NVIDIA H200 SXM 141GB, "
                                   "the clock it runs at without a lock (the model's default clock): the lock changes "
                                   "nothing"]
    slow = _run("dvfs.kind=locked_clock", "dvfs.locked_clocks_mhz=1395")
    assert slow.summary["step_time_s"] > free.summary["step_time_s"] and not _dvfs_notes(slow)


def test_a_phase_plan_at_the_maximum_clock_changes_nothing_and_says_so():
    """Every named phase at 1980 MHz: the clock never moves, the same step as without a plan, one note; a plan with
    one phase lower gets none."""
    free = _run()
    flat = _run("dvfs={kind: phase_plan, phase_clocks_mhz: {fwd: 1980, opt: 1980}}")
    assert flat.summary["step_time_s"] == free.summary["step_time_s"] and flat.summary["clock_switches"] == 0
    assert _dvfs_notes(flat) == ["dvfs.phase_clocks_mhz puts every phase it names (fwd, opt) at the maximum SM clock "
                                 "1980 MHz, the clock every phase runs at without a plan: the plan changes nothing"]
    real = _run("dvfs={kind: phase_plan, phase_clocks_mhz: {fwd: 1980, opt: 1200}}")
    assert not any(n.startswith("dvfs.phase_clocks_mhz puts") for n in _dvfs_notes(real))


def test_a_line_every_rank_class_has_is_given_once():
    """``class_warnings``: the Perseus A100 pipeline's 300 W limit (its TDP) is the same note on all four stages: one
    line, no label; a line of one class only keeps its label, in class order."""
    from simulator.api import class_warnings

    tdp = "dvfs.power_limit_w 300 W is the default power limit"
    assert class_warnings([("pp_rank 0", [tdp, "a"]), ("pp_rank 1", [tdp]), ("pp_rank 2", ["b", tdp])]) == [
        tdp, "pp_rank 0: a", "pp_rank 2: b"]
    assert class_warnings([("dp_rank 3", [tdp])]) == [f"dp_rank 3: {tdp}"]  # one class: labelled as before
    s = run_scenario(load_scenario(ROOT / "scenarios/validation/PERSEUS-ZEUSGLOBAL-GPT3XL-PP4-4xA100PCIe-powercap.yaml",
                                   ["training.global_batch_size=32"])).summary  # 4 micro-batches
    assert [w for w in s["warnings"] if "dvfs.power_limit_w" in w] == [
        f"{tdp} of NVIDIA A100 PCIe 80GB (its TDP), which the firmware holds without it: the run is the same as "
        "without it"]


def test_the_summary_names_the_power_cap_it_ran_under(capsys):
    """The human summary printed no cap, only the clocks it caused (fresh-user trial): the energy line names it."""
    from simulator.cli import main

    b8 = str(ROOT / "scenarios/h200/gpt_184m_b8.yaml")
    assert main(["run", b8, "--set", "dvfs.kind=power_cap", "--set", "dvfs.power_limit_w=400"]) == 0
    energy = [x for x in capsys.readouterr().out.splitlines() if x.startswith("energy")]
    assert len(energy) == 1 and energy[0].endswith("; power cap 400 W per GPU (dvfs)  (power model: NVIDIA H200 SXM "
                                                   "141GB)"), energy
    assert main(["run", b8]) == 0
    assert "power cap" not in capsys.readouterr().out
