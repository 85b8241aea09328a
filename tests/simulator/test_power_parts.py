"""The DVFS runtime's parts, each alone: the energy ledger's level bookkeeping and the firmware's window rule,
by hand; the runtime creates the firmware only where the limit can bind and a clock policy only with a
``dvfs`` section."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from simulator import load_scenario, run_scenario
from simulator.policies import dvfs as dvfs_mod
from simulator.policies.power_firmware import window_over
from simulator.policies.power_ledger import PowerLedger
from simulator.recording.recorder import Recorder
from tests.conftest import ROOT

B8 = ROOT / "scenarios/h200/gpt_184m_b8.yaml"


class _Env:
    now = 0.0


def test_ledger_defers_a_level_until_time_moves_on():
    """100 W from 0 s; an op ends at 1 s and the next starts at 1 s (300 W): the idle level in between lasts no
    time and is never recorded; an end at 2 s with nothing after it commits 50 W from 2 s once time moves on."""
    env, rec, power = _Env(), Recorder(), [100.0]
    led = PowerLedger(env, rec, lambda: power[0])
    env.now, power[0] = 1.0, 50.0
    led.defer()  # the op ended: 50 W if nothing starts now
    led.flush()  # the next op starts at the same instant: nothing committed
    power[0] = 300.0
    led.update()
    env.now, power[0] = 2.0, 50.0
    led.defer()
    env.now = 3.0
    led.flush()
    assert (led.t, led.p) == ([0.0, 1.0, 2.0], [100.0, 300.0, 50.0])
    assert led.energy_at(3.0) == 100.0 + 300.0 + 50.0
    assert [(t, v) for t, _, m, v in rec.counters if m == "power_w"] == [(1.0, 300.0), (2.0, 50.0)]


def test_window_rule_by_hand():
    """Evaluations every 10 ms of the 20 ms window average against 700 W. 800 W from the start: over at the first
    (10 ms). 100 W for 5 ms, then 800 W: 450 W at 10 ms, (0.5 J + 12 J) / 20 ms = 625 W at 20 ms, 800 W at 30 ms."""
    grid = dict(t0=0.0, period_s=0.010, window_s=0.020)
    at_once = (np.array([0.0]), np.array([800.0]), np.array([0.0]))
    assert window_over(*at_once, 0.015, 700.0, **grid)
    assert not window_over(*at_once, 0.009, 700.0, **grid)  # no evaluation yet
    late = (np.array([0.0, 0.005]), np.array([100.0, 800.0]), np.array([0.0, 0.5]))
    assert not window_over(*late, 0.025, 700.0, **grid)
    assert window_over(*late, 0.025, 624.0, **grid)
    assert window_over(*late, 0.035, 700.0, **grid)


@pytest.mark.parametrize("over, firmware, policy", [
    ([], True, False),  # the board's default limit (700 W) can bind: the firmware runs, no clock policy
    (["dvfs.kind=locked_clock", "dvfs.locked_clocks_mhz=1410"], True, True),
    (["hardware.gpu.overrides.tdp_w=5000", "hardware.gpu.overrides.max_power_limit_w=5000"], False, False),
])
def test_firmware_and_policy_only_where_they_apply(monkeypatch, over, firmware, policy):
    made, init = [], dvfs_mod.DvfsRuntime.__init__

    def capture(self, *a, **k):
        init(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(dvfs_mod.DvfsRuntime, "__init__", capture)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = run_scenario(load_scenario(B8, over + ["run.steps=2", "run.warmup_steps=1"])).summary
    rt = made[-1]
    assert (rt.firmware is not None, rt.policy is not None) == (firmware, policy)
    assert s["energy_j_per_step"] > 0
    if not firmware:
        assert rt.firmware_ticks == 0 and s["clock_switches"] == 0
