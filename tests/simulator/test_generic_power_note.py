"""A run priced with the unfitted generic power model (``hardware_models.power.generic_power_model``: every GPU
without a power preset) says so: one warning naming the datasheet TDP, the idle power and the assumed activity
model, and how to fit one; the text report marks the energy line "(generic TDP model)". A GPU with a power preset
(the fitted H200) gets neither."""

from __future__ import annotations

import dataclasses

import pytest

from hardware_models.gpu import GpuSpec
from hardware_models.power import generic_power_model
from simulator import load_scenario, run_scenario
from simulator.cli import format_summary
from simulator.policies.power_meter import generic_model_note
from tests.conftest import ROOT

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

B16 = ROOT / "scenarios/h200/gpt_184m_b16.yaml"
A100 = ["hardware.gpu=a100-sxm4-80gb", "hardware.profile=null", "run.steps=2", "run.warmup_steps=1"]


def _generic_lines(summary) -> list[str]:
    return [w for w in summary["warnings"] if w.startswith("energy and power are from the generic power model")]


def test_generic_model_run_warns_once_and_marks_the_energy_line():
    s = run_scenario(load_scenario(B16, overrides=A100)).summary
    assert s["power_model"] == "NVIDIA A100 SXM4 80GB (generic)"
    (line,) = _generic_lines(s)
    # the A100 SXM4 preset: 400 W TDP; idle 15% of it (60 W) unless the preset gives one
    assert "its datasheet TDP (400 W)" in line
    assert "draws 95% of TDP" in line and "0.45x that SM power" in line and "30% of it" in line
    assert "scripts/fit_h200_power.py" in line and "dvfs.power_model" in line
    energy = [ln for ln in format_summary(s, "x").splitlines() if ln.startswith("energy")]
    assert len(energy) == 1 and energy[0].endswith("(generic TDP model)")


def test_fitted_preset_gets_no_generic_warning():
    s = run_scenario(load_scenario(B16, overrides=["run.steps=2", "run.warmup_steps=1"])).summary
    assert _generic_lines(s) == []
    energy = [ln for ln in format_summary(s, "x").splitlines() if ln.startswith("energy")]
    assert energy[0].endswith("(power model: NVIDIA H200 SXM 141GB)")


def test_note_names_the_assumed_tdp_and_idle_of_a_bare_spec():
    """A spec with neither TDP nor idle power: 400 W assumed, idle 15% of it = 60 W assumed."""
    gpu = GpuSpec(name="bare", peak_flops_per_s={"bf16": 1e15}, hbm_capacity_bytes=1e10,
                  hbm_bandwidth_bytes_per_s=1e12, max_sm_clock_mhz=1500.0, sm_count=100)
    model = generic_power_model(gpu)
    note = generic_model_note(model, gpu)
    assert "TDP (none given, 400 W assumed) and idle power (60 W assumed as 15% of TDP)" in note
    assert model.sm_w == pytest.approx(0.95 * 400 - 60)  # the figure the note's "95% of TDP" stands for
    assert generic_model_note(dataclasses.replace(model, provenance={"fitted": "x"}), gpu) is None
