"""Predicted vs measured: ZeRO-Offload on the H200 host, and the ZeRO-Offload tutorial case.

Measured: tests/data/h200/measurements.json ``offload.gpt_184m_b16_offload_overlap`` (median of 6
steps; notes.offload) and tests/data/paper/zerooffload_gpt2_10b_v100.yaml (DeepSpeed tutorial log).
The CPU time comes from micro.cpu_adam (AdamW throughput), micro.host_memcpy_GBps_rw (casts), the
profile's per-op launch time and ONE PARAMETER FITTED TO THIS RUN: the H200 host's
``first_touch_bytes_per_s`` = 16.63 GB/s (bandwidth of writes into freshly allocated host memory),
fitted by scripts/fit_host_first_touch.py from the grad cast and ``_foreach_sqrt`` passes of this
run's own Kineto trace (tests/data/h200/trace_gpt_184m_b16_offload_overlap.json.gz). The overlap
case's ``cpu_adam`` and ``step`` are therefore IN-SAMPLE for that parameter (not a validation of
it); ``gpu_fwd_bwd`` and ``h2d`` do not depend on it. The copies come from micro.pcie. Errors
(predicted / measured - 1):

    H200 overlap   step -12.8%   gpu_fwd_bwd +8.3%   cpu_adam -20.0%   h2d -5.9%
    (before the first-touch term: step -27.6%, cpu_adam -36.0%)
    V100 10B       fwd -58%      bwd -34%            optimizer -60%

Predictions for the held-back modes (no measurement; the same fitted parameter):
scenarios/h200/gpt_184m_b16_offload_serial.yaml 0.404 s per step (was 0.337 s),
scenarios/h200/gpt_184m_b16_offload_dpu.yaml 0.337 s per step (was 0.270 s); CPU step 0.337 s.

Known misses (strict xfail, so that a fix shows up):

* cpu_adam (and so step): even with the fitted first-touch bandwidth the model is 20% short. The
  traced steps' CPU passes add up to ~0.36 s (grad casts 39-47 ms, ``Optimizer.step`` 294-295 ms,
  param casts 19-31 ms) against the 0.421 s median of the measured part: ~30 ms per step inside
  ``Optimizer.step`` is Python between the foreach ops (list grouping, 296 ``.item()`` calls) and
  the grad casts are spread over ~55 ms of wall time. Neither is modelled (the dispatch term is
  148 x 9 x 9.6 us = 13 ms).
* the 10B V100 case: no V100 efficiency profile exists (generic 70% GEMM efficiency), the host is
  inferred, and the log's forward runs at ~35 TFLOP/s, half the backward's rate.
"""

from __future__ import annotations

import json

import pytest
import yaml

from simulator import load_scenario, run_scenario
from tests.conftest import ROOT
from tests.validation.common import check_rel

pytestmark = pytest.mark.validation

MEASURED = json.loads((ROOT / "tests/data/h200/measurements.json").read_text())["offload"]["gpt_184m_b16_offload_overlap"]
PAPER = yaml.safe_load((ROOT / "tests/data/paper/zerooffload_gpt2_10b_v100.yaml").read_text())


@pytest.fixture(scope="module")
def overlap():
    return run_scenario(load_scenario(ROOT / "scenarios/h200/gpt_184m_b16_offload_overlap.yaml")).summary


@pytest.fixture(scope="module")
def paper():
    return run_scenario(load_scenario(ROOT / "scenarios/paper/zerooffload_gpt2_10b_v100.yaml")).summary


def _check(what: str, predicted: float, measured: float, tol: float) -> None:
    check_rel(what, predicted, measured, tol, " s")


CPU_XFAIL = pytest.mark.xfail(strict=True, reason="CPU step short even with first-touch bandwidth fitted in-sample to "
                              "this run's trace (module docstring): cpu_adam measured 0.421 s, predicted 0.337 s, -20%; "
                              "step measured 0.4545 s, predicted 0.396 s, -12.8%")


@CPU_XFAIL
def test_step_time(overlap):
    """Step time within 10%. Measured 0.4545 s, predicted 0.396 s, error -12.8%.

    In-sample: uses the host's first_touch_bytes_per_s fitted to this run's own trace.
    """
    _check("step (in-sample for first_touch_bytes_per_s)", overlap["step_time_s"], MEASURED["median_step_s"], 0.10)


def test_gpu_fwd_bwd(overlap):
    """GPU forward + backward incl. gradient-copy sync within 15%. Measured 0.0485 s, predicted 0.0525 s, +8.3%."""
    _check("gpu_fwd_bwd", overlap["offload_gpu_fwd_bwd_s"], MEASURED["part_median_s"]["gpu_fwd_bwd"], 0.15)


@CPU_XFAIL
def test_cpu_adam(overlap):
    """Grad cast + AdamW + param cast within 15%. Measured 0.4213 s, predicted 0.3369 s, error -20.0%.

    In-sample: uses the host's first_touch_bytes_per_s fitted to this run's own trace.
    """
    _check("cpu_adam (in-sample for first_touch_bytes_per_s)", overlap["offload_cpu_optimizer_s"],
           MEASURED["part_median_s"]["cpu_adam"], 0.15)


def test_h2d(overlap):
    """Parameter upload within 15%. Measured 7.37 ms, predicted 6.93 ms, error -5.9%."""
    _check("h2d", overlap["offload_h2d_s"], MEASURED["part_median_s"]["h2d"], 0.15)


def test_d2h_mostly_hidden(overlap):
    """Gradient copies overlap backward: what is left after backward is small (measured 19 us)."""
    assert overlap["offload_d2h_wait_s"] < 0.05 * overlap["offload_gpu_fwd_bwd_s"]


def _mean(v):
    return sum(v) / len(v)


PAPER_XFAIL = pytest.mark.xfail(strict=True, reason="no V100 profile, inferred host (module docstring)")


@PAPER_XFAIL
def test_paper_forward(paper):
    """ZeRO-Offload 10B fwd within 20%. Measured 6.20 s, predicted 2.63 s, error -58%."""
    _check("forward", paper["phase_s"]["fwd_s"], _mean(PAPER["forward_time_s"]), 0.20)


@PAPER_XFAIL
def test_paper_backward(paper):
    """ZeRO-Offload 10B bwd within 20%. Measured 12.07 s, predicted 7.95 s, error -34%."""
    _check("backward", paper["phase_s"]["bwd_s"], _mean(PAPER["backward_time_s"]), 0.20)


@PAPER_XFAIL
def test_paper_optimizer(paper):
    """ZeRO-Offload 10B optimizer within 20%. Measured 7.80 s, predicted 3.09 s, error -60%."""
    _check("optimizer", paper["phase_s"]["opt_s"], _mean(PAPER["optimizer_time_s"]), 0.20)


def test_paper_fits_on_32gb(paper):
    """The 10B model with ZeRO-Offload and full checkpointing ran on a 32 GB V100: it must fit."""
    assert paper["oom"] is None and paper["peak_memory_bytes"] <= paper["gpu_memory_capacity_bytes"]
