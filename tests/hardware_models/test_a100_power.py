"""The A100 PCIe 80GB power preset (scripts/fit_a100_power.py): what the script derives is what ships, its numbers
worked by hand, and the power-limit firmware settling where the model says a cap is held."""

from __future__ import annotations

import importlib.util
import warnings

import numpy as np
import pytest

from hardware_models import presets
from hardware_models.power import GpuPowerModel, load_power_model
from simulator.api import simulate_graph
from simulator.config.loader import resolve_hardware, scenario_from_dict
from simulator.graph.op_graph import GraphBuilder
from simulator.graph.ops import CostClass, OpKind, Phase
from tests.conftest import ROOT


def _script():
    spec = importlib.util.spec_from_file_location("fit_a100_power", ROOT / "scripts" / "fit_a100_power.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FIT = _script()
MODEL = load_power_model("a100-pcie-80gb")


def test_shipped_preset_is_what_the_script_derives():
    df = FIT.pd.read_csv(FIT.DATA)
    preset, _ = FIT.model_from(FIT.fit_series(df, 1410.0))
    for key, value in preset.items():
        got = getattr(MODEL, key)
        assert got == pytest.approx(value) if isinstance(value, float) else got == value, key


def test_vf_fit_is_consistent_across_the_four_series():
    """GPT-3 175B / BLOOM 176B x forward / backward each give V/Vmax 0.79-0.84 below a knee of 1,090-1,110 MHz
    (the assumed H200 curve is 0.7 below 900 MHz), each within 1% rms of the measured stage power."""
    fits = FIT.fit_series(FIT.pd.read_csv(FIT.DATA), 1410.0)
    assert len(fits) == 4
    assert fits.v_min_rel.between(0.79, 0.84).all() and fits.voltage_knee_mhz.between(1090, 1110).all()
    assert (fits.rms < 0.01).all()
    # the top clocks did not hold (power-throttled stage): dropped before the fit
    assert (fits.held_max_mhz < 1410).all()


def test_held_clocks_drop_the_throttled_top():
    """t = 100 / f exactly up to 1200 MHz, then the GPU stays at 1200 MHz: 1215+ MHz run at 1200 MHz's time."""
    f = np.arange(900.0, 1411.0, 15.0)
    t = 100.0 / np.minimum(f, 1200.0)
    assert FIT.held_clocks(f, t).tolist() == (f < 1215).tolist()


def test_numbers_by_hand():
    """sm_w = 0.95 x 400 W (SXM4 TDP) - 40 W idle = 340 W; static 0.7 x 40 = 28 W, clock 12 W; mem 0.45 x 340 = 153.
    At 870 MHz (below the knee) phi = 870 / 1410 x v_min^2; a compute-bound kernel draws 28 + (12 + 340) phi."""
    assert (MODEL.sm_w, MODEL.static_w, MODEL.clock_w, MODEL.mem_w) == (340.0, 28.0, 12.0, 153.0)
    v = MODEL.v_min_rel
    phi = 870 / 1410 * v * v
    assert MODEL.clock_factor(870) == pytest.approx(phi)
    assert MODEL.power_w(870, busy=1, compute=1) == pytest.approx(28.0 + 352.0 * phi)
    assert MODEL.power_w(1410, busy=1, compute=1) == pytest.approx(380.0)
    # halfway between the knee and 1410 MHz the voltage is halfway between v_min and 1
    mid = (MODEL.voltage_knee_mhz + 1410) / 2
    assert MODEL.voltage_rel(mid) == pytest.approx((v + 1) / 2)


def test_capped_clock_by_hand():
    """A toy model, phi = f / 1000 (flat voltage): P = 100 + 200 f / 1000 on a compute-bound kernel; a 250 W cap is
    held at f <= 750 MHz, so among 600/700/800/900/1000 MHz the highest is 700."""
    m = GpuPowerModel(name="toy", max_sm_clock_mhz=1000, max_mem_clock_mhz=1, static_w=100, clock_w=0, sm_w=200,
                      v_min_rel=1.0, voltage_knee_mhz=0)
    assert FIT.capped_clock(m, 250, [1000, 900, 800, 700, 600], busy=1, compute=1) == 700
    assert FIT.capped_clock(m, 50, [1000, 900], busy=1, compute=1) == 900  # none holds it: the lowest


def _gemms(n: int = 120):
    b, prev, m = GraphBuilder(), [], 8192
    for i in range(n):
        prev = [b.add(f"g{i}", OpKind.COMPUTE, "compute", deps=prev, phase=Phase.FWD, cost_class=CostClass.GEMM,
                      shape=(m, m, m), flops=2.0 * m**3, bytes_read=4.0 * m * m, bytes_written=2.0 * m * m)]
    return b.build(samples_per_step=1, tokens_per_step=1)


@pytest.mark.parametrize("cap", [300, 175])
def test_firmware_settles_at_the_clock_that_holds_the_cap(cap):
    """Back-to-back 8192^3 bf16 GEMMs on the A100 PCIe under a power limit: after the first step the firmware's
    clock stays at or below one 15 MHz bin above the highest supported clock whose compute-bound power is at or below
    the cap (the preset's own numbers: 1275 MHz at 300 W, 885 MHz at 175 W) and no lower than the lowest clock whose
    power is inside the firmware's dead band (``power_firmware.HYSTERESIS``: it raises the clock only below
    ``cap x (1 - 3%)``; at 175 W 855 MHz draws 169.8 W, inside it), and the measured steps average at most the cap
    plus that dead band."""
    cfg = scenario_from_dict({"name": "a100-gemms", "hardware": {"gpu": "a100-pcie-80gb"},
                              "model": {"num_layers": 1, "hidden_size": 256, "num_attention_heads": 4,
                                        "seq_length": 128, "vocab_size": 512},
                              "training": {"micro_batch_size": 1, "precision": "bf16"},
                              "dvfs": {"kind": "power_cap", "power_limit_w": cap}})
    g = _gemms()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = simulate_graph(g, resolve_hardware(cfg), steps=3, warmup_steps=1, cfg=cfg)
    sup = presets.get("gpus", "a100-pcie-80gb").supported_sm_clocks_mhz
    want = FIT.capped_clock(MODEL, cap, sup, busy=1, compute=1)
    c = r.counters[(r.counters.scope == "gpu0") & (r.counters.metric == "sm_clock_mhz")]
    t0 = r.steps.end_s.iloc[0]
    late = [c[c.t_s <= t0].value.iloc[-1], *c[c.t_s > t0].value]
    from simulator.policies.power_firmware import HYSTERESIS
    floor = min(f for f in sup if MODEL.power_w(f, busy=1, compute=1) >= cap * (1 - HYSTERESIS))
    assert min(floor, want - 15) <= min(late) and max(late) <= want + 15, (want, floor, sorted(set(late)))
    assert r.summary["avg_power_w"] <= cap * 1.03
