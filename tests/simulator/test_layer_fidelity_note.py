"""At ``run.fidelity: layer`` the run's warnings state the block approximations that apply to it: a clock that moves
during the step changes at the next block, and a collective's interference is spread evenly over a block; one
line, only at layer fidelity and only when one applies."""

import warnings

from simulator import load_scenario, run_scenario
from simulator.api import run_warnings
from simulator.config.loader import resolve_hardware
from tests.conftest import ROOT

CAPPED = ROOT / "scenarios/cluster/gpt_6p7b_2x_dgx_h200_vpp2_powercap.yaml"
ONE_GPU = ROOT / "scenarios/h200/gpt_184m_b8.yaml"
CLOCK = "a clock change ({}) lands at the next block, not the next kernel"
SPREAD = "a collective's interference slows a block's kernels evenly over the whole block"


def _notes(path, over):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = load_scenario(path, over)
        return [w for w in run_warnings(resolve_hardware(cfg), cfg) if w.startswith("run.fidelity layer")]


def test_power_capped_pipeline_at_layer_fidelity_names_both():
    """The 500 W capped 6.7B TP2 x PP2 x DP4 run: 507.46 ms at kernel fidelity, 501.58 ms at layer (-1.16 %, the cap:
    0.44986 s at both without it); its summary's warnings carry the one line. Before, nothing was said."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = run_scenario(load_scenario(CAPPED, ["run.fidelity=layer"]))
    notes = [w for w in r.summary["warnings"] if w.startswith("run.fidelity layer")]
    assert notes == ["run.fidelity layer: each block (a layer's run of kernels) is priced as one op, so "
                     f"{CLOCK.format('power cap')}; {SPREAD} (run.fidelity kernel prices them kernel by kernel)"]
    assert abs(r.summary["step_time_s"] - 0.50158) < 5e-5


def test_only_what_applies_and_only_at_layer():
    assert _notes(CAPPED, ["run.fidelity=kernel"]) == []
    assert _notes(CAPPED, ["run.fidelity=layer", "dvfs=null"]) == [
        f"run.fidelity layer: each block (a layer's run of kernels) is priced as one op, so {SPREAD} "
        "(run.fidelity kernel prices them kernel by kernel)"]
    assert _notes(ONE_GPU, ["run.fidelity=layer"]) == []  # one GPU, no DVFS: nothing approximated that way
    assert _notes(ONE_GPU, ["run.fidelity=layer", "dvfs={kind: locked_clock, locked_clocks_mhz: 1410}"]) == []
    assert _notes(ONE_GPU, ["run.fidelity=layer", "dvfs={kind: phase_plan, phase_clocks_mhz: {fwd: 1980, bwd: 1980, "
                            "opt: 1200}}"]) == [
        f"run.fidelity layer: each block (a layer's run of kernels) is priced as one op, so "
        f"{CLOCK.format('per-phase clock plan')} (run.fidelity kernel prices them kernel by kernel)"]
