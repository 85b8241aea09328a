"""Plot functions: each draws what its DataFrame holds (series, bars, labels, units) on the given
axes; the run's and the sweep's PNGs open; the step breakdown partitions a hand-made step."""

from __future__ import annotations

import json

import matplotlib.image
import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure

from simulator.analysis.results import SimulationResult
from simulator.cli import main
from simulator.recording import plots
from tests.conftest import ROOT

SCEN = str(ROOT / "scenarios/h200/gpt_184m_b4.yaml")
FAST = ["--set", "run.steps=2", "--set", "run.warmup_steps=1"]


def _ax():
    return Figure().add_subplot()


def _spans(rows):
    cols = ["step", "stream", "kind", "phase", "start_s", "end_s"]
    df = pd.DataFrame(rows, columns=cols)
    df["duration_s"] = df.end_s - df.start_s
    return df


# one measured step of 10 ms worked out by hand (times in ms), after a warmup step whose spans must not count
HAND = _spans([
    (0, "compute", "compute", "fwd", -5e-3, -1e-3),
    (1, "compute", "compute", "fwd", 0.0, 3e-3),
    (1, "compute", "compute", "bwd", 4e-3, 6e-3),
    (1, "comm.dp", "collective", "bwd", 2e-3, 5e-3),      # exposed 3-4 ms
    (1, "comm.tp", "collective", "bwd", 4.5e-3, 7e-3),    # exposed 6-7 ms
    (1, "compute", "compute", "opt", 7e-3, 8e-3),         # optimizer 1 ms
    (1, "h2d", "memcpy_h2d", "fwd", 8e-3, 8.5e-3),        # exposed copy 0.5 ms
    (1, "host", "dataloader", "data", 8.2e-3, 9.5e-3),    # data wait 8.5-9.5 ms (8.2-8.5 is the copy's)
    (1, "host", "sync", "other", 0.0, 10e-3),             # markers are not work
])
HAND_STEPS = pd.DataFrame({"step": [0, 1], "start_s": [-5e-3, 0.0], "end_s": [0.0, 10e-3],
                           "step_time_s": [5e-3, 10e-3], "warmup": [True, False]})


def test_breakdown_partitions_a_hand_made_step():
    res = SimulationResult(summary={}, spans=HAND, counters=pd.DataFrame(), steps=HAND_STEPS)
    got = dict(zip(res.breakdown().component, res.breakdown().seconds * 1e3))
    assert got == pytest.approx({"compute (fwd/bwd kernels)": 5.0, "optimizer": 1.0, "exposed comm (dp)": 1.0,
                                 "exposed comm (tp)": 1.0, "exposed copies": 0.5, "data wait": 1.0,
                                 "host-bound gaps / idle": 0.5}, abs=1e-9)
    assert list(res.breakdown().component)[:2] == ["compute (fwd/bwd kernels)", "optimizer"]


def test_breakdown_of_a_run_agrees_with_its_summary(tmp_path):
    from simulator import load_scenario, run_scenario

    r = run_scenario(load_scenario(ROOT / "scenarios/h200/dataloader_w0.yaml", ["run.steps=3", "run.warmup_steps=1"]))
    b = dict(zip(r.breakdown().component, r.breakdown().seconds))
    s = r.summary
    assert sum(b.values()) == pytest.approx(s["step_time_s"], rel=1e-9)
    assert b["data wait"] == pytest.approx(s["phase_s"]["data_s"], rel=1e-9)
    # compute stream busy = fwd/bwd kernels + optimizer kernels (no CPU optimizer here)
    assert b["compute (fwd/bwd kernels)"] + b["optimizer"] == pytest.approx(
        s["utilisation"]["compute"] * s["step_time_s"], rel=1e-9)


def test_breakdown_bars_one_bar_per_component_in_ms():
    bd = pd.DataFrame({"component": ["compute", "exposed comm (dp)", "data wait"], "seconds": [0.004, 0.001, 0.0005]})
    ax = plots.breakdown_bars(bd, _ax(), title="t")
    assert ax.get_xlabel() == "time per step (ms)" and ax.get_title() == "t"
    assert [p.get_width() for p in ax.patches] == pytest.approx([4.0, 1.0, 0.5])
    assert [t.get_text() for t in ax.get_yticklabels()] == list(bd.component)
    assert [t.get_text() for t in ax.texts] == ["4.00 ms (73 %)", "1.00 ms (18 %)", "0.50 ms (9 %)"]


def test_timeline_one_row_per_resource_one_bar_per_span():
    ax = plots.timeline(HAND[HAND.step == 1], _ax())
    assert [t.get_text() for t in ax.get_yticklabels()] == ["comm.dp", "comm.tp", "compute", "h2d", "host"]
    assert ax.get_xlabel() == "time (ms)" and ax.get_ylabel() == "resource"
    bars = sum(len(c.get_paths()) for c in ax.collections)
    assert bars == 8  # every span of step 1
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == \
        ["collective", "compute", "dataloader", "memcpy_h2d", "sync"]
    # the compute bars (fwd 0-3, bwd 4-6, opt 7-8 ms) span 0-8 ms
    comp = next(c for c in ax.collections if c.get_label() == "compute")
    xs = np.concatenate([p.vertices[:, 0] for p in comp.get_paths()])
    assert xs.min() == pytest.approx(0.0) and xs.max() == pytest.approx(8.0)
    ax = plots.timeline(HAND, _ax(), streams=["compute"], t0_s=0.0, t1_s=3.5e-3)
    assert sum(len(c.get_paths()) for c in ax.collections) == 1


def test_memory_over_time_one_line_per_pool_and_category_in_gb():
    c = pd.DataFrame({"t_s": [0.0, 1e-3, 0.0, 2e-3, 0.0], "scope": ["gpu0.hbm"] * 5,
                      "metric": ["memory_bytes", "memory_bytes", "memory_bytes.params", "memory_bytes.params",
                                 "memory_bytes.optimizer"],
                      "value": [1e9, 3e9, 1e9, 2e9, 5e8]})
    ax = plots.memory_over_time(c, _ax())
    assert ax.get_xlabel() == "time (ms)" and ax.get_ylabel() == "memory (GB)"
    lines = {l.get_label(): l for l in ax.get_lines()}
    assert sorted(lines) == ["gpu0.hbm optimizer", "gpu0.hbm params", "gpu0.hbm total"]
    total = lines["gpu0.hbm total"]
    assert list(total.get_xdata()) == pytest.approx([0.0, 1.0, 2.0]) and list(total.get_ydata()) == [1.0, 3.0, 3.0]
    assert list(lines["gpu0.hbm optimizer"].get_xdata()) == pytest.approx([0.0, 2.0])  # held to the end
    with pytest.raises(ValueError, match="no memory counters"):
        plots.memory_over_time(c.assign(metric="power_w"), _ax())


def test_power_and_clock_two_axes_with_units():
    c = pd.DataFrame({"t_s": [0.0, 1e-3, 0.0, 1.5e-3, 3e-3], "scope": ["gpu0"] * 5,
                      "metric": ["power_w", "power_w", "sm_clock_mhz", "sm_clock_mhz", "power_w"],
                      "value": [100.0, 500.0, 1980.0, 1410.0, 200.0]})
    fig = Figure()
    ax = plots.power_and_clock(c, fig.add_subplot())
    assert len(fig.axes) == 2
    twin = fig.axes[1]
    assert ax.get_ylabel() == "power (W)" and twin.get_ylabel() == "SM clock (MHz)" and ax.get_xlabel() == "time (ms)"
    (p,), (k,) = ax.get_lines(), twin.get_lines()
    assert list(p.get_ydata()) == [100.0, 500.0, 200.0, 200.0] and list(k.get_ydata()) == [1980.0, 1410.0, 1410.0]
    assert list(k.get_xdata()) == pytest.approx([0.0, 1.5, 3.0])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["gpu0 power", "gpu0 SM clock"]
    assert not plots.has_power(c[c.metric != "power_w"])
    with pytest.raises(ValueError, match="no power counters"):
        plots.power_and_clock(c[c.metric != "power_w"], _ax())


def test_sweep_curves_one_series_per_other_factor_and_failed_points_left_out():
    t = pd.DataFrame({"training.micro_batch_size": [1, 2, 4, 1, 2, 4],
                      "hardware.gpu": ["h200", "h200", "h200", "h100", "h100", "h100"],
                      "step_time_s": [0.01, 0.02, 0.04, 0.011, None, 0.05],
                      "error": [None, None, None, None, "boom", None]})
    ax = plots.sweep_curves(t, "training.micro_batch_size", "step_time_s", _ax(), by=["hardware.gpu"])
    assert ax.get_xlabel() == "training.micro_batch_size" and ax.get_ylabel() == "step time (s)"
    lines = {l.get_label(): l for l in ax.get_lines()}
    assert sorted(lines) == ["gpu=h100", "gpu=h200"]
    assert list(lines["gpu=h100"].get_xdata()) == [1, 4] and list(lines["gpu=h100"].get_ydata()) == [0.011, 0.05]
    # a categorical factor on x: one tick per value, in grid order
    ax = plots.sweep_curves(t, "hardware.gpu", "step_time_s", _ax(), by=["training.micro_batch_size"])
    assert [x.get_text() for x in ax.get_xticklabels()] == ["h200", "h100"] and len(ax.get_lines()) == 3
    assert plots.metric_label("tokens_per_s") == "tokens (1/s)"
    assert plots.metric_label("energy_j_per_step") == "energy per step (J)"
    with pytest.raises(KeyError, match="nope"):
        plots.sweep_curves(t, "training.micro_batch_size", "nope", _ax())


def test_pareto_front_points_and_front_line():
    t = pd.DataFrame({"step_time_s": [0.010, 0.012, 0.011, 0.020], "energy_j_per_step": [10.0, 8.0, 12.0, 7.0],
                      "pareto": [True, True, False, True], "value": [1980, 1410, 1600, 900]})
    ax = plots.pareto_front(t, _ax(), label="value")
    assert ax.get_xlabel() == "step time (ms)" and ax.get_ylabel() == "energy per step (J)"
    (front,) = ax.get_lines()
    assert front.get_label() == "Pareto front"
    assert list(front.get_xdata()) == pytest.approx([10.0, 12.0, 20.0]) and list(front.get_ydata()) == [10.0, 8.0, 7.0]
    assert len(ax.collections[0].get_offsets()) == 4 and len(ax.texts) == 4
    assert [x.get_text() for x in ax.get_legend().get_texts()] == ["all points", "Pareto front"]


def test_run_out_writes_pngs_that_open(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", SCEN, *FAST, "--out", str(out)]) == 0
    capsys.readouterr()
    for name in ("breakdown.png", "memory.png", "power.png"):
        img = matplotlib.image.imread(out / name)
        assert img.ndim == 3 and img.shape[0] >= 300 and img.shape[1] >= 700, name
    assert {"breakdown.png", "memory.png", "power.png"} <= set(json.loads((out / "manifest.json").read_text())["files"])
    # memory by category comes with the run's counters
    c = pd.read_csv(out / "counters.csv")
    assert {"memory_bytes.params", "memory_bytes.activations"} <= set(c.metric)


def test_html_repr_has_the_summary_table_and_an_inline_breakdown():
    import base64
    import io
    import re

    from simulator import load_scenario, run_scenario

    r = run_scenario(load_scenario(SCEN, ["run.steps=2", "run.warmup_steps=1"]))
    html = r._repr_html_()
    assert "<h4>gpt_184m_b4</h4>" in html
    assert f"{r.summary['step_time_s'] * 1e3:,.4g} ms" in html and "NVIDIA H200 SXM 141GB" in html
    png = base64.b64decode(re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)", html).group(1))
    assert matplotlib.image.imread(io.BytesIO(png), format="png").ndim == 3
