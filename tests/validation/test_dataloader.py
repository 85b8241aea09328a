"""Predicted vs measured: gpt_184m at batch 8 on one H200 fed by a PyTorch DataLoader.

Measurements: tests/data/h200/measurements.json, section ``dataloader`` (maintainers' H200 run of
2026-11-29): a dataset whose ``__getitem__`` busy-loops 6 ms of CPU (measured 6.0553 ms per sample,
``setup.measured_sample_s``) and returns seq+1 int64 tokens; batch 8, pin_memory, prefetch_factor 2,
default collate; 16 host cores; ``mean_data_wait_s`` is the time spent in ``next(iterator)``.
Scenarios: scenarios/h200/dataloader_w0.yaml and dataloader_w8.yaml. Nothing is fitted to these
runs: the sample cost is the setup's measured per-sample time, the GPU step comes from the
simulator (profile h200-sxm-141gb), ``worker_startup_s`` only moves the first batch (warmup).

Errors at the time of writing (predicted / measured - 1):

    case  quantity                         measured    predicted   error
    w0    mean step time                   84.31 ms    78.88 ms    -6.4%
    w0    mean data wait                   49.14 ms    48.45 ms    -1.4%
    w0    step minus GPU-only step (*)     48.21 ms    48.45 ms    +0.5%
    w8    mean step time                   36.28 ms    30.43 ms   -16.1%   (known failure, see below)
    w8    mean data wait                    0.19 ms     0.00 ms   -100%    (0.5% of the step)
    w8    step minus GPU-only step (*)      0.18 ms     0.00 ms    n/a (0.5% of the step)

(*) measured: mean step minus the mean of ``setup.gpu_only_step.step_s`` (same session, no
loader); predicted: the scenario's step minus gpt_184m_b8.yaml's step.

* w8 step time misses because of the GPU step, not the loader: with 8 workers the loader adds
  nothing (measured wait 0.19 ms), and the same session's GPU-only step averaged 36.1 ms, 13% above
  the 32.0 ms of ``train.gpt_184m_b8`` (another session) that the simulator's 30.4 ms matches
  within 4.8%. Marked strict xfail so that a change shows up.
* w8 data wait: 0.19 ms is the multi-process hand-off in ``next()`` (queue get, unpickling the
  shared-memory handles), which nothing in the setup measures; ``handoff_s`` defaults to 0, so a
  relative error is meaningless. The check is on the stall as a share of the step instead
  (|predicted - measured| <= 10% of the measured step time).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.validation.common import check_rel, known_gap_xfail, scenario_summary

pytestmark = pytest.mark.validation
MEAS = json.loads((ROOT / "tests/data/h200/measurements.json").read_text())["dataloader"]
GPU_ONLY_MEAS_S = float(np.mean(MEAS["setup"]["gpu_only_step"]["step_s"]))


def summary(name: str) -> dict:
    return scenario_summary(f"h200/{name}.yaml")


def check(pred: float, meas: float, tol: float, what: str) -> None:
    check_rel(what, pred * 1e3, meas * 1e3, tol, " ms")


def check_abs(pred: float, meas: float, tol_s: float, what: str) -> None:
    msg = (f"{what}: measured {meas * 1e3:.3f} ms, predicted {pred * 1e3:.3f} ms, "
           f"difference {(pred - meas) * 1e3:+.3f} ms (tolerance {tol_s * 1e3:.2f} ms)")
    assert abs(pred - meas) <= tol_s, msg


def test_w0_step_time_within_10_percent():
    check(summary("dataloader_w0")["step_time_s"], MEAS["workers_0"]["mean_step_s"], 0.10, "w0 mean step time")


def test_w0_data_wait_within_10_percent():
    check(summary("dataloader_w0")["data_stall_s"], MEAS["workers_0"]["mean_data_wait_s"], 0.10, "w0 mean data wait")


@known_gap_xfail("dataloader_w8.step_time", "step_time_s")
def test_w8_step_time_within_10_percent():
    check(summary("dataloader_w8")["step_time_s"], MEAS["workers_8"]["mean_step_s"], 0.10, "w8 mean step time")


def test_w8_data_wait_within_10_percent_of_the_step():
    meas = MEAS["workers_8"]
    check_abs(summary("dataloader_w8")["data_stall_s"], meas["mean_data_wait_s"], 0.10 * meas["mean_step_s"],
              "w8 mean data wait")


@pytest.mark.parametrize("case, key", [("dataloader_w0", "workers_0"), ("dataloader_w8", "workers_8")])
def test_time_the_loader_adds_to_the_gpu_step(case, key):
    gpu_pred = summary("gpt_184m_b8")["step_time_s"]
    pred = summary(case)["step_time_s"] - gpu_pred
    meas = MEAS[key]["mean_step_s"] - GPU_ONLY_MEAS_S
    check_abs(pred, meas, 0.10 * MEAS[key]["mean_step_s"], f"{case} step minus GPU-only step")


def test_predictions_for_held_back_worker_counts():
    """w1..w4 are predictions (measurements held back): check they are ordered sensibly (the table
    is in the failure message)."""
    rows = []
    for w in (0, 1, 2, 3, 4, 8):
        s = summary(f"dataloader_w{w}")
        rows.append((w, s["step_time_s"], s["data_stall_s"]))
    table = "\n".join(["workers  step ms  data wait ms"] + [f"{w:>7d}  {st * 1e3:7.2f}  {dw * 1e3:12.2f}"
                                                            for w, st, dw in rows])
    steps = [r[1] for r in rows]
    assert all(a >= b - 1e-9 for a, b in zip(steps, steps[1:])), table
    # one worker builds a batch in 8 x 6.055 ms: the step becomes loader-bound at that rate
    assert rows[1][1] == pytest.approx(8 * MEAS["setup"]["measured_sample_s"], rel=0.02)
