"""Trace replay: step period vs latency, host what-if direction, GPU presets, loader workers, GPU busy."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulator.calibration.replay import (
    UnknownGpuError,
    gpu_busy_fraction,
    gpu_preset_for,
    replay,
    replay_import,
    step_period,
)
from simulator.graph.importers.kineto import load_kineto, read_trace_json
from tests.conftest import ROOT

TRACES = ROOT / "tests/data/traces"
B16 = ROOT / "tests/data/h200/trace_gpt_184m_b16.json.gz"
NS_RES = TRACES / "HolisticTraceAnalysis/tests/data/ns_resolution_trace/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz"
RESNET_W0 = TRACES / "kineto/tb_plugin/samples/resnet50_num_workers_0/worker0.1623143089861.pt.trace.json.gz"
CONTROL = TRACES / "HolisticTraceAnalysis/tests/data/trace_diff/control/control.json.gz"
MI300X = TRACES / "TraceLens/tests/traces/mi300/resnet_act_checkpoint.json.gz"


@pytest.fixture(scope="module")
def b16():
    return load_kineto(B16)


def test_step_period_by_hand():
    # ends 10, 25, 35, 45, 80: distances 15, 10, 10, 35 -> median 12.5; the first step has none
    assert step_period([10.0, 25.0, 35.0, 45.0, 80.0]) == pytest.approx(12.5)
    assert step_period([3.0]) is None and step_period([]) is None


def test_gpu_busy_fraction_by_hand():
    # [0,2] and [1,3] overlap -> 3; [5,6] -> 1; [9,12] clipped to [9,10] -> 1: 5 of 10
    assert gpu_busy_fraction([(0, 2), (1, 3), (5, 6), (9, 12)], 0.0, 10.0) == pytest.approx(0.5)
    assert gpu_busy_fraction([(0, 1)], 1.0, 1.0) is None


def test_ns_resolution_trace_reports_the_period_not_the_latency():
    """HTA V100 trace: 5 steps whose latency is 163.6 ms while the step ends come every ~95.6 ms."""
    out = replay(NS_RES)
    assert out["step_time_basis"] == "period"
    assert out["measured_step_time_s"] == pytest.approx(0.09562, abs=2e-4)
    assert out["measured_step_latency_s"] == pytest.approx(0.16363, abs=2e-4)
    assert out["warmup_steps"] == out["step_labels"][:1]
    assert abs(out["error"]) < 1e-3


def test_b16_period_is_the_gpu_step(b16):
    """GPU-bound b16 trace: the period equals the GPU-side step (54.2 ms), not the 90.3 ms latency."""
    out = replay_import(b16)
    assert out["measured_step_time_s"] == pytest.approx(0.0542, abs=2e-4)
    assert out["measured_step_latency_s"] == pytest.approx(0.0903, abs=2e-4)
    assert out["measured_step_time_s"] == pytest.approx(b16.gpu_step_times_s[1], rel=2e-3)


def test_faster_host_does_not_slow_the_b16_step(b16):
    """Issue 9 item 2: host_speedup=2 gave +10.5% (a latency artefact); the GPU-bound period stays put."""
    base = replay_import(b16)["simulated_step_time_s"]
    fast = replay_import(b16, host_speedup=2.0)["simulated_step_time_s"]
    assert fast <= base * (1 + 1e-6)
    assert fast == pytest.approx(base, rel=1e-3)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lo=st.floats(0.25, 8.0), factor=st.floats(1.05, 4.0))
def test_faster_host_never_makes_a_step_slower(b16, lo, factor):
    slow = replay_import(b16, host_speedup=lo)["simulated_step_time_s"]
    fast = replay_import(b16, host_speedup=lo * factor)["simulated_step_time_s"]
    assert fast <= slow * (1 + 1e-6)


@pytest.mark.parametrize(("device", "preset"), [
    ("NVIDIA H200", "h200-sxm-141gb"), ("NVIDIA H100 80GB HBM3", "h100-sxm-80gb"),
    ("Tesla V100-SXM2-32GB", "v100-sxm2-32gb"), ("Tesla V100-DGXS-32GB", "v100-sxm2-32gb"),
    ("AMD Instinct MI300X", "mi300x-192gb"), ("AMD Instinct MI210", "mi210-64gb"),
    ("NVIDIA GeForce RTX 2080 Ti", "rtx-2080-ti-11gb"), ("NVIDIA B200", "b200-180gb"),
])
def test_traced_device_names_map_to_their_presets(device, preset):
    assert gpu_preset_for(device) == preset


@pytest.mark.parametrize("device", ["NVIDIA GeForce RTX 4090", "NVIDIA H100 PCIe", None, ""])
def test_unknown_device_is_refused_with_its_name(device):
    with pytest.raises(UnknownGpuError, match=repr(device) if device else "names no GPU"):
        gpu_preset_for(device)


def test_gpu_what_if_on_an_unknown_device_is_refused(b16):
    import dataclasses

    other = dataclasses.replace(b16, device_name="NVIDIA GeForce RTX 4090")
    with pytest.raises(UnknownGpuError, match="RTX 4090"):
        replay_import(other, gpu="h100-sxm-80gb")
    assert replay_import(other)["gpu_preset"] is None  # a plain replay needs no GPU numbers


def test_json_reports_the_traced_device_and_its_preset(capsys):
    from simulator.cli import main

    assert main(["replay", str(MI300X), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["device"], out["gpu_preset"]) == ("AMD Instinct MI300X", "mi300x-192gb")


def test_dataloader_workers_refused_on_a_multi_worker_trace():
    """HTA control trace: _MultiProcessingDataLoaderIter; the what-if models num_workers=0 traces only."""
    assert load_kineto(CONTROL).uses_worker_processes
    with pytest.raises(ValueError, match="already uses worker processes"):
        replay(CONTROL, dataloader_workers=4)
    assert not load_kineto(RESNET_W0).uses_worker_processes


def test_gpu_busy_excludes_gap_ops_and_matches_the_raw_trace():
    """ResNet50 V100 trace: GPU busy from the raw kernel/copy events over the traced steps is ~56.6%."""
    imp = load_kineto(RESNET_W0)
    out = replay_import(imp)
    t = read_trace_json(RESNET_W0)
    origin = imp.graph.meta["time_origin_ts_us"]
    iv = [((e["ts"] - origin) * 1e-6, (e["ts"] + e["dur"] - origin) * 1e-6) for e in t["traceEvents"]
          if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset")]
    raw = gpu_busy_fraction(iv, imp.step_starts_s[0], imp.step_ends_s[-1])
    assert out["gpu_busy"]["measured"] == pytest.approx(raw, abs=1e-3)
    assert out["gpu_busy"]["simulated"] == pytest.approx(raw, abs=5e-3)
    assert raw == pytest.approx(0.566, abs=0.01)


def test_single_step_trace_says_the_basis_is_latency():
    out = replay(TRACES / "TraceLens/tests/traces/h100/gaunernst_bert-small-uncased__1016001.json.gz")
    assert out["step_time_basis"] == "latency" and out["warmup_steps"] == []
    assert out["measured_step_time_s"] == out["measured_step_latency_s"] > 0
    assert any("no steady-state period" in w for w in out["warnings"])


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0.0, -1.0])
def test_non_finite_speedups_are_refused(b16, bad):
    with pytest.raises(ValueError, match="finite number > 0"):
        replay_import(b16, host_speedup=bad)
