"""Predicted vs measured GPU energy per step and average power: gpt_184m on one H200.

Measured: tests/data/h200/measurements.json train.gpt_184m_b{4,8,16}.energy_j_per_step and
avg_power_w (NVML total-energy counter over the measured steps). Predicted: the default scenarios
(max clock, 700 W default power limit) with the power model
hardware_models/presets/power/h200-sxm-141gb.yaml written by scripts/fit_h200_power.py.

What was fitted: the idle terms (two idle points, env.txt and the NVML energy counter before the
load) and ONE dynamic coefficient, ``sm_w``, on **b16 only**. b4 and b8 are predictions. At the time
of writing (predicted / measured - 1; the step-time column is the simulator's, not fitted here):

    case   energy/step          avg power            step time
    b4     10.43 vs 13.15 J  -20.7%   483 vs 577 W  -16.3%   -8.9%   (predicted, FAILS: xfail)
    b8     18.34 vs 18.72 J   -2.0%   603 vs 579 W   +4.1%   -4.8%   (predicted)
    b16    35.35 vs 34.37 J   +2.8%   609 vs 629 W   -3.2%   +6.3%   (fitted)

b4 fails: the simulated b4 step is host-launch bound, so ~20% of it is GPU gaps priced at idle power
(120 W at 1980 MHz), while the measured 577 W says the real GPU does not fall to idle power in
gaps of microseconds. Modelling that needs a gap-power term we have no data to fit without using b4.
"""

from __future__ import annotations

import json

import pytest

from simulator import load_scenario, run_scenario
from tests.conftest import ROOT
from tests.validation.common import gap_marks

pytestmark = pytest.mark.validation
MEAS = json.loads((ROOT / "tests/data/h200/measurements.json").read_text())["train"]
_cache: dict[int, dict] = {}
TOL = 0.10


def summary(b: int) -> dict:
    if b not in _cache:
        _cache[b] = run_scenario(load_scenario(ROOT / f"scenarios/h200/gpt_184m_b{b}.yaml")).summary
    return _cache[b]


# b16 is the fitted case; b4 is a known gap (module doc)
CASES = [pytest.param(b, m, marks=gap_marks(f"gpt_184m_b{b}.{m}", m))
         for b in (4, 8, 16) for m in ("energy_j_per_step", "avg_power_w")]


@pytest.mark.parametrize("batch,metric", CASES)
def test_energy_within_10_percent(batch, metric):
    measured = MEAS[f"gpt_184m_b{batch}"][metric]
    predicted = summary(batch)[metric]
    err = predicted / measured - 1
    assert abs(err) <= TOL, f"gpt_184m_b{batch} {metric}: measured {measured:.3f}, predicted {predicted:.3f}, error {err:+.1%}"


def test_power_model_fitted_on_b16_only():
    from hardware_models.power import load_power_model

    prov = load_power_model("h200-sxm-141gb").provenance
    assert "gpt_184m_b16 only" in prov["fitted"]["sm_w"]
