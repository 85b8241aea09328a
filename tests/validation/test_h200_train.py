"""Predicted vs measured: GPU-resident training steps of gpt_184m on one H200.

Measurements: tests/data/h200/measurements.json (train.gpt_184m_b{4,8,16}), copied from the
maintainers' H200 run of 2026-11-29. Profile: h200-sxm-141gb-micro, fitted only from the
microbenchmarks of the same file (scripts/build_h200_profile.py); nothing here was fitted to these
training steps. Errors at the time of writing (predicted / measured - 1):

    case   step     fwd     bwd     opt     peak memory
    b4    -29.7%  -22.5%  -26.8%  -45.4%   +0.5%
    b8     -4.7%   -9.4%   +0.4%  -18.6%   +1.3%
    b16    +6.5%  +10.9%   +6.1%  -18.3%   +1.9%

b4 is host-bound on the real machine (per-op framework overhead of eager PyTorch, about 35-40 us
per graph op, larger than the 9.6 us tiny-op microbenchmark the profile uses), and the optimizer
phase runs a fused AdamW kernel at ~3.4 TB/s while the profile prices it at the elementwise-add
microbenchmark's 4.1 TB/s; both are marked as known failures (strict xfail) so a fix shows up.
"""

from __future__ import annotations

import json

import pytest

from simulator import load_scenario, run_scenario
from tests.conftest import ROOT

pytestmark = pytest.mark.validation
MEAS = json.loads((ROOT / "tests/data/h200/measurements.json").read_text())["train"]
_cache: dict[int, dict] = {}


def summary(b: int) -> dict:
    if b not in _cache:
        _cache[b] = run_scenario(load_scenario(ROOT / f"scenarios/h200/gpt_184m_b{b}.yaml")).summary
    return _cache[b]


def check(pred: float, meas: float, tol: float, what: str) -> None:
    err = pred / meas - 1
    assert abs(err) <= tol, f"{what}: measured {meas:.6g}, predicted {pred:.6g}, error {err:+.1%} (tolerance {tol:.0%})"


HOST_BOUND = pytest.mark.xfail(strict=True, reason="b4 is host-dispatch-bound; per-op host overhead under-modelled")
OPT_BW = pytest.mark.xfail(strict=True, reason="fused AdamW bandwidth taken from the elementwise microbenchmark")


@pytest.mark.parametrize("b", [pytest.param(4, marks=HOST_BOUND), 8, 16])
def test_step_time_within_10_percent(b):
    check(summary(b)["step_time_s"], MEAS[f"gpt_184m_b{b}"]["median_step_s"], 0.10, f"b{b} step time")


@pytest.mark.parametrize("b", [4, 8, 16])
def test_peak_memory_within_15_percent(b):
    check(summary(b)["peak_memory_bytes"], MEAS[f"gpt_184m_b{b}"]["peak_mem_bytes"], 0.15, f"b{b} peak memory")


@pytest.mark.parametrize("b,phase", [
    pytest.param(4, "fwd", marks=HOST_BOUND), pytest.param(4, "bwd", marks=HOST_BOUND),
    pytest.param(4, "opt", marks=HOST_BOUND),
    (8, "fwd"), (8, "bwd"), pytest.param(8, "opt", marks=OPT_BW),
    (16, "fwd"), (16, "bwd"), pytest.param(16, "opt", marks=OPT_BW),
])
def test_phase_split_within_15_percent(b, phase):
    check(summary(b)["phase_s"][f"{phase}_s"], MEAS[f"gpt_184m_b{b}"]["phase_median_s"][phase], 0.15, f"b{b} {phase}")


def test_mfu_formula():
    """MFU = model FLOPs per step / (step time x 989.4 TFLOP/s)."""
    s = summary(8)
    assert s["mfu"] == pytest.approx(s["model_flops_per_step"] / (s["step_time_s"] * 989.4e12))
