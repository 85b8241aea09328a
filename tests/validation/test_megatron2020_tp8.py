"""Predicted vs published: Megatron-LM 2020 tensor-parallel (TP8) iteration time of the "8B" GPT-2 case.

Measured: tests/data/paper/paper_cases.yaml (copied from the project's shared validation data),
MLM20-GPT2-8.7B-TP8-8xA100: 42 layers, h 4096, 32 heads, seq 1024, batch 16, fp16, full recompute,
TP8 on one DGX A100, 1343 ms per iteration (109.3 TFLOP/s per GPU, F96). Tolerance 10% (issue 11).
The weak-scaling pair: the 1.2B model on one A100 (MLM20-GPT2-1.2B-1xA100, 1076 ms, 149.8 TFLOP/s);
its per-GPU efficiency 109.3 / 149.8 = 73.0% must be predicted within 5 percentage points.
No profile is fitted for the A100: the generic profile (70% GEMM, 80% HBM) is used for both. Both run
Megatron 2020's unfused attention with its default dropouts (``model.attention_backend: unfused``).
Errors at the time of writing: TP8 -3.9% (was -11.8% with flash attention), the 1.2B case +0.8%, and
the efficiency 76.6% vs 73.0% (+3.6 points; +5.8 points before the GEMM tile model priced both tile
orientations: the head-dim-128 ``probs @ V`` GEMMs were padded to a 256-wide tile, and the unfused core
weighs twice as much on the 1-GPU run).
"""

from __future__ import annotations

import pytest
import yaml

from simulator import load_scenario, run_scenario
from simulator.studies.validation import validation_table
from tests.conftest import ROOT

pytestmark = pytest.mark.validation
CASES = {c["id"]: c for c in yaml.safe_load((ROOT / "tests/data/paper/paper_cases.yaml").read_text())}
TP8 = "MLM20-GPT2-8.7B-TP8-8xA100"
ONE = "MLM20-GPT2-1.2B-1xA100"


@pytest.fixture(scope="module")
def predicted() -> dict:
    return {cid: run_scenario(load_scenario(ROOT / path)).summary for cid, path in (
        (TP8, "scenarios/validation/MLM20-GPT2-8.7B-TP8-8xA100.yaml"),
        (ONE, "scenarios/validation/MLM20-GPT2-1.2B-1xA100.yaml"))}


def test_tp8_iteration_time_within_10_percent(predicted):
    meas = CASES[TP8]["measured"]["value"] / 1e3
    pred = predicted[TP8]["step_time_s"]
    err = pred / meas - 1
    assert abs(err) <= 0.10, f"{TP8}: measured {meas:.3f} s, predicted {pred:.3f} s, error {err:+.1%}"


def test_tp8_structure_tp_comm_is_exposed_and_layout(predicted):
    s = predicted[TP8]
    assert (s["world_size"], s["tensor_parallel_size"], s["data_parallel_size"]) == (8, 8, 1)
    # Megatron 2020 does not overlap TP all-reduces: every microsecond of them is exposed
    assert s["exposed_comm_s"] == pytest.approx(s["comm_s_by_group"]["tp"], rel=1e-9)
    assert set(s["comm_s_by_group"]) == {"tp"}


def test_weak_scaling_efficiency_within_5_points():
    # per-GPU F96 throughput of TP8 / of one GPU: simulator.studies.validation._weak_scaling (one copy)
    row = validation_table([f"{TP8}-weak-scaling"]).iloc[0]
    assert row.tolerance_of == "difference"  # 5 points, not 5 % of the ratio
    assert row.measured == pytest.approx(109.3 / 149.8)
    assert abs(row.predicted - row.measured) <= 0.05, (f"weak-scaling efficiency TP8 8.7B vs 1 GPU 1.2B: measured "
                                                       f"{row.measured:.1%}, predicted {row.predicted:.1%}")
