"""Predicted vs published: sharded data parallelism (FSDP FULL_SHARD, Megatron distributed optimizer).

Measured values: tests/data/paper/paper_cases.yaml (copied from the project's shared validation data).

* MOSAIC-MPT7B-8xH100-noAC (llm-foundry MPT benchmark table): MPT-7B, FSDP FULL_SHARD on 8x H100,
  micro-batch 6, seq 2048: 10,643 tokens/s/GPU. Scenario scenarios/validation/MOSAIC-MPT7B-8xH100-noAC.yaml.
* MCORE080-H100-weakscale-1.7B-48GPU (Megatron-Core 0.8 README): GPT 1.7B, DP48 on 6 DGX H100, 408.8
  TFLOP/s per GPU with Megatron's F72 convention (72 B s L h^2 (1 + s / 6h + V / 12 h L) per iteration;
  Narayanan et al., SC21, eq. 3), i.e. 0.452 s per iteration. Scenario
  scenarios/validation/MCORE080-H100-weakscale-1.7B-48GPU.yaml.

Tolerance 10% (issue 11). No efficiency profile is fitted for the H100: the generic one (70% of the GEMM
peak, 80% of HBM) is used, and both are predicted too fast (errors at the time of writing: MPT +19.0%,
Megatron-Core +20.4%); the constants are not tuned to these cases.
"""

from __future__ import annotations

import pytest
import yaml

from tests.conftest import ROOT
from tests.validation.common import check_rel, scenario_summary

pytestmark = pytest.mark.validation
CASES = {c["id"]: c for c in yaml.safe_load((ROOT / "tests/data/paper/paper_cases.yaml").read_text())}
MPT = "MOSAIC-MPT7B-8xH100-noAC"
MCORE = "MCORE080-H100-weakscale-1.7B-48GPU"


def _f72_per_iteration(B: int, s: int, L: int, h: int, V: int) -> float:
    """Megatron's FLOPs per iteration with full (non-causal) attention and the LM head (F72)."""
    return 72.0 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))


@pytest.fixture(scope="module")
def mpt() -> dict:
    return scenario_summary(f"validation/{MPT}.yaml")


@pytest.fixture(scope="module")
def mcore() -> dict:
    return scenario_summary(f"validation/{MCORE}.yaml")


@pytest.mark.xfail(strict=True, reason="generic H100 profile (70% GEMM efficiency; no fitted H100 profile): predicted "
                   "12,666 vs 10,643 tokens/s/GPU (+19.0%); ALiBi approximated by a learned position table")
def test_mpt7b_fsdp_tokens_per_gpu_within_10_percent(mpt):
    check_rel(MPT, mpt["tokens_per_s"] / mpt["data_parallel_size"], CASES[MPT]["measured"]["value"], 0.10,
              " tokens/s/GPU")


def test_mpt7b_fsdp_layout_and_memory(mpt):
    assert (mpt["world_size"], mpt["data_parallel_size"]) == (8, 8)
    assert set(mpt["comm_s_by_group"]) == {"dp"}
    assert mpt["oom"] is None  # llm-foundry ran micro-batch 6 on 80 GB
    # the FSDP gathers and reduce-scatters overlap the compute: little of them is exposed
    assert mpt["exposed_comm_s"] < 0.1 * mpt["comm_s_by_group"]["dp"]


@pytest.mark.xfail(strict=True, reason="generic H100 profile (70% GEMM efficiency; no fitted H100 profile): predicted "
                   "492 vs 408.8 TFLOP/s/GPU (+20.4%); micro-batch, recompute and MLP not stated in the source")
def test_mcore_1p7b_dp48_tflops_within_10_percent(mcore):
    F = _f72_per_iteration(192, 4096, 24, 2048, 131072)
    check_rel(MCORE, F / (mcore["step_time_s"] * 48) / 1e12, CASES[MCORE]["measured"]["value"], 0.10, " TFLOP/s")


def test_mcore_f72_matches_the_cases_derived_iteration_time():
    F = _f72_per_iteration(192, 4096, 24, 2048, 131072)
    assert F / (408.8e12 * 48) == pytest.approx(CASES[MCORE]["derived_inferred"]["iteration_time_s_from_F72"],
                                                abs=5e-4)


def test_mcore_layout(mcore):
    assert (mcore["world_size"], mcore["data_parallel_size"]) == (48, 48)
    assert mcore["oom"] is None
