"""Predicted vs measured: GPU-resident training steps of gpt_184m on one H200.

Measurements: tests/data/h200/measurements.json (train.gpt_184m_b{4,8,16}), copied from the
maintainers' H200 run of 2026-11-29. Profile: h200-sxm-141gb, built by scripts/build_h200_profile.py
from the microbenchmarks of the same file (GEMM, memory-bound kernels, launch, PCIe) plus the host
dispatch time per op fitted from the CPU timeline of the batch-16 trace
(tests/data/h200/trace_gpt_184m_b16.json.gz). No training-step time was fitted; batch 4 and 8 are
out-of-sample for every parameter. Errors at the time of writing (predicted / measured - 1):

    case   step     fwd     bwd     opt     peak memory
    b4     -8.9%  +13.3%  -14.5%  -12.9%   +0.5%
    b8     -4.8%   -8.6%   -0.4%  -18.6%   +1.3%
    b16    +6.3%  +11.1%   +5.7%  -18.3%   +1.9%

Peak memory compares like with like: ``peak_mem_bytes`` in measurements.json is taken to be
``torch.cuda.max_memory_allocated()`` (tensor bytes; the file records no reserved or nvidia-smi
figure, and a device-level reading would hold the ~0.4 GB CUDA context, which the +0.5% match of
the tensor count leaves no room for), so the test checks ``peak_memory_allocated_bytes``. The
device-level ``peak_device_memory_bytes`` (context + allocator reserve, the OOM check) is
+7.8% / +6.3% / +5.2% above that figure.

The optimizer phase runs PyTorch's fused AdamW kernel at ~3.4 TB/s while the profile prices it at
the 4.1 TB/s of the elementwise-add microbenchmark; that case is a known failure (strict xfail) so
that a fix shows up. With the microbenchmark-only profile (h200-sxm-141gb-micro) b4 is -29.7%:
the real step is bound by eager PyTorch's per-op host time there.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import ROOT
from tests.validation.common import check_rel, gap_marks, scenario_summary

pytestmark = pytest.mark.validation
MEAS = json.loads((ROOT / "tests/data/h200/measurements.json").read_text())["train"]


def summary(b: int) -> dict:
    return scenario_summary(f"h200/gpt_184m_b{b}.yaml")


def check(pred: float, meas: float, tol: float, what: str) -> None:
    check_rel(what, pred, meas, tol)


@pytest.mark.parametrize("b", [4, 8, 16])
def test_step_time_within_10_percent(b):
    check(summary(b)["step_time_s"], MEAS[f"gpt_184m_b{b}"]["median_step_s"], 0.10, f"b{b} step time")


@pytest.mark.parametrize("b", [4, 8, 16])
def test_peak_memory_within_15_percent(b):
    """Allocated tensor bytes vs the measured max_memory_allocated (see the module docstring)."""
    s = summary(b)
    check(s["peak_memory_allocated_bytes"], MEAS[f"gpt_184m_b{b}"]["peak_mem_bytes"], 0.15, f"b{b} peak memory")
    assert s["peak_device_memory_bytes"] > s["peak_memory_reserved_bytes"] > s["peak_memory_allocated_bytes"]


@pytest.mark.parametrize("b,phase", [pytest.param(b, ph, marks=gap_marks(f"gpt_184m_b{b}.{ph}", f"phase_s.{ph}_s"))
                                     for b in (4, 8, 16) for ph in ("fwd", "bwd", "opt")])
def test_phase_split_within_15_percent(b, phase):
    check(summary(b)["phase_s"][f"{phase}_s"], MEAS[f"gpt_184m_b{b}"]["phase_median_s"][phase], 0.15, f"b{b} {phase}")


def test_mfu_formula():
    """MFU = model FLOPs per step / (step time x 989.4 TFLOP/s)."""
    s = summary(8)
    assert s["mfu"] == pytest.approx(s["model_flops_per_step"] / (s["step_time_s"] * 989.4e12))
