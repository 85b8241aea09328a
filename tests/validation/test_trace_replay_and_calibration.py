"""Replay real traces on the engine, calibrate on one H200 trace and predict other batch sizes.

Replay (``simulate replay``) keeps measured durations and re-derives the timing from the
dependencies; with the importer's default ``gpu_gaps="all"`` unexplained GPU idle is kept as
measured gap ops, so the replay reproduces the trace (errors below 0.01%); ``"boundary"`` keeps
only the gaps at orphan kernels and stream starts, which measures how much the dependencies alone
explain (errors in the importer's tests and the closing note: 0-3% on NVIDIA traces).

Calibration: profile fitted to tests/data/h200/trace_gpt_184m_b16.json.gz only, then compared with
measurements.json train.gpt_184m_b{4,8} (median step). At the time of writing: b4 -7.7%, b8 -8.4%
(target 5%: strict xfail), b16 -1.2% (in sample).
"""

from __future__ import annotations

import json

import pytest
import yaml

from simulator import load_scenario, run_scenario
from simulator.calibration.fit import calibrate
from simulator.calibration.replay import replay
from simulator.cli import main
from tests.conftest import ROOT

pytestmark = pytest.mark.validation
TRACES = ROOT / "tests/data/traces"
REPLAY_CASES = {
    "h200_gpt_b16": ROOT / "tests/data/h200/trace_gpt_184m_b16.json.gz",
    "h200_gpt_offload": ROOT / "tests/data/h200/trace_gpt_184m_b16_offload_overlap.json.gz",
    "h100_bert": TRACES / "TraceLens/tests/traces/h100/gaunernst_bert-small-uncased__1016001.json.gz",
    "a100_alexnet": TRACES / "HolisticTraceAnalysis/tests/data/critical_path/alexnet/benchmark_result_2869224_1695835535_trace.json.gz",
}
MEAS = json.loads((ROOT / "tests/data/h200/measurements.json").read_text())["train"]


@pytest.mark.parametrize("name", list(REPLAY_CASES))
def test_replay_error_below_2_percent(name):
    out = replay(REPLAY_CASES[name])
    assert abs(out["error"]) < 0.02, (f"{name}: measured {out['measured_step_time_s']:.6g} s, "
                                      f"replayed {out['simulated_step_time_s']:.6g} s, error {out['error']:+.2%}")


def test_replay_json_cli(capsys):
    assert main(["replay", str(REPLAY_CASES["h100_bert"]), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"measured_step_time_s", "simulated_step_time_s", "error"} <= set(out)


def test_slower_gpu_what_if_is_slower():
    """H200 -> A100 re-costs kernels by peak ratios: the step can only get longer."""
    base = replay(REPLAY_CASES["h200_gpt_b16"])
    a100 = replay(REPLAY_CASES["h200_gpt_b16"], gpu="a100-sxm4-80gb")
    assert a100["simulated_step_time_s"] > 1.5 * base["simulated_step_time_s"]


def test_dataloader_workers_what_if_removes_the_loading_time():
    """ResNet50 on a V100 with a single-process loader (~69 ms of each ~188 ms step in __next__)."""
    path = TRACES / "kineto/tb_plugin/samples/resnet50_num_workers_0/worker0.1623143089861.pt.trace.json.gz"
    base = replay(path)
    four = replay(path, dataloader_workers=4)
    assert four["simulated_step_time_s"] < base["measured_step_time_s"] - 0.05


def test_truncated_trace_is_one_line_exit_2(tmp_path, capsys):
    bad = tmp_path / "broken.json"
    bad.write_text('{"traceEvents": [{"ph": "X", "name": "k"')
    assert main(["replay", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "broken.json" in err


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    prof, report = calibrate([ROOT / "tests/data/h200/trace_gpt_184m_b16.json.gz"],
                             [ROOT / "scenarios/h200/gpt_184m_b16.yaml"], "h200-trace-b16")
    path = tmp_path_factory.mktemp("cal") / "h200-trace-b16.yaml"
    path.write_text(yaml.safe_dump(prof, sort_keys=False))
    return path, prof, report


def _predict(path, b):
    cfg = load_scenario(ROOT / f"scenarios/h200/gpt_184m_b{b}.yaml", [f"hardware.profile={path}"])
    return run_scenario(cfg).summary["step_time_s"]


def test_calibration_fits_the_trace_classes(calibrated):
    _, prof, report = calibrated
    rms = prof["provenance"]["rms_relative_class_error_fitted_classes"]
    assert rms["after"] < 0.05 < rms["before"]
    assert prof["provenance"]["traces"] and prof["provenance"]["date"]


def test_readme_states_the_bundled_profiles_class_errors_on_the_b16_trace(calibrated):
    """README's Accuracy section gives the per-class errors of the bundled H200 profile against the b16 trace (the
    report's ``simulated_before_s``) and the rms before / after: each figure is the report's, to its last digit."""
    import re

    _, prof, report = calibrated
    text = re.sub(r"\s+", " ", (ROOT / "README.md").read_text())
    para = text[text.index("Per kernel class the bundled profile"):]
    para = para[:para.index("in sample)")]
    by = report.groupby("class")[["measured_s", "simulated_before_s"]].sum()
    err = (by.simulated_before_s / by.measured_s - 1) * 100
    named = {"gemm": "gemm", "softmax": "softmax", "cast": "cast", "norm": "norm", "elementwise": "elementwise",
             "copy": "copy", "optimizer": "optimizer", "reduction": "reduction"}
    for word, cls in named.items():
        assert f"{word} {err[cls]:+.1f}%" in para, (cls, f"{err[cls]:+.1f}%")
    assert f"attention forward / backward {err['attention_fwd']:+.1f}% / {err['attention_bwd']:+.1f}%" in para
    rms = prof["provenance"]["rms_relative_class_error_fitted_classes"]
    assert f"rms {rms['before']:.1%} over the fitted classes" in para and f"{rms['after']:.1%} rms" in para


def test_calibrated_in_sample_b16_within_3_percent(calibrated):
    pred, meas = _predict(calibrated[0], 16), MEAS["gpt_184m_b16"]["median_step_s"]
    assert abs(pred / meas - 1) < 0.03, f"b16: measured {meas:.5f}, predicted {pred:.5f}, error {pred / meas - 1:+.1%}"


@pytest.mark.xfail(strict=True, reason="b4 -7.7%, b8 -8.4% against a 5% target (see module docstring)")
@pytest.mark.parametrize("b", [4, 8])
def test_calibrated_predicts_other_batches_within_5_percent(calibrated, b):
    pred, meas = _predict(calibrated[0], b), MEAS[f"gpt_184m_b{b}"]["median_step_s"]
    assert abs(pred / meas - 1) < 0.05, f"b{b}: measured {meas:.5f}, predicted {pred:.5f}, error {pred / meas - 1:+.1%}"


@pytest.mark.parametrize("b", [4, 8])
def test_calibrated_predicts_other_batches_within_10_percent(calibrated, b):
    pred, meas = _predict(calibrated[0], b), MEAS[f"gpt_184m_b{b}"]["median_step_s"]
    assert abs(pred / meas - 1) < 0.10, f"b{b}: measured {meas:.5f}, predicted {pred:.5f}, error {pred / meas - 1:+.1%}"


def test_a_scenario_launch_overhead_override_is_not_taken_as_the_hosts_eager_op_time(tmp_path):
    """``hardware.launch_overhead_s: 30 us`` in the traced run's scenario is a what-if of the simulation: the fit
    divides by the host's measured eager-op time (9.555 us, ``micro.memory.tiny_kernel_us_eager``) all the same.
    It used the override: profiler inflation 1.0 instead of 1.7598 and forward 53.9 instead of 30.6 us per op."""
    src = ROOT / "scenarios/h200/gpt_184m_b16.yaml"
    (tmp_path / "b16.yaml").write_text(src.read_text().replace("\nhardware:\n", "\nhardware:\n  launch_overhead_s: 30 us\n"))
    trace = [ROOT / "tests/data/h200/trace_gpt_184m_b16.json.gz"]
    plain, _ = calibrate(trace, [src])
    over, _ = calibrate(trace, [tmp_path / "b16.yaml"])
    assert load_scenario(tmp_path / "b16.yaml").hardware.launch_overhead_s == pytest.approx(30e-6)
    host = over["provenance"]["host_overhead"]
    assert host["eager_op_s"] == pytest.approx(9.5553e-6, rel=1e-4) and host["eager_op_source"] == "host"
    assert host["profiler_inflation"] == plain["provenance"]["host_overhead"]["profiler_inflation"] == 1.7598
    assert over["launch_overhead_by_phase_s"] == plain["launch_overhead_by_phase_s"]
    assert over["host_phase_fixed_s"] == plain["host_phase_fixed_s"]
