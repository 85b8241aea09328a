"""Predicted vs published: sharded data parallelism (FSDP FULL_SHARD, Megatron distributed optimizer).

Measured values: tests/data/paper/paper_cases.yaml (copied from the project's shared validation data).

* MOSAIC-MPT7B-8xH100-noAC (llm-foundry MPT benchmark table): MPT-7B, FSDP FULL_SHARD on 8x H100,
  micro-batch 6, seq 2048: 10,643 tokens/s/GPU. Scenario scenarios/validation/MOSAIC-MPT7B-8xH100-noAC.yaml.
* MCORE080-H100-weakscale-1.7B-48GPU (Megatron-Core 0.8 README): GPT 1.7B, DP48 on 6 DGX H100, 408.8
  TFLOP/s per GPU with Megatron's F72 convention (72 B s L h^2 (1 + s / 6h + V / 12 h L) per iteration;
  Narayanan et al., SC21, eq. 3), i.e. 0.452 s per iteration. Scenario
  scenarios/validation/MCORE080-H100-weakscale-1.7B-48GPU.yaml.

The predicted-vs-measured rows themselves are in ``simulate validate`` (``simulator.studies.validation``;
known gaps in ``KNOWN_GAPS``, checked by tests/validation/test_megatron_multi_gpu.py). Tolerance 10% (issue 11). The H100
profile's GEMMs are fitted on Vidur's H100 timings (scripts/build_h100_profile.py), its memory-bound rates are
the H200's; both cases are predicted too fast (errors at the time of writing: MPT +15.9%, Megatron-Core +10.5%);
nothing is tuned to these cases.
"""

from __future__ import annotations

import pytest
import yaml

from tests.conftest import ROOT
from tests.validation.common import scenario_summary

pytestmark = pytest.mark.validation
CASES = {c["id"]: c for c in yaml.safe_load((ROOT / "tests/data/paper/paper_cases.yaml").read_text())}
MPT = "MOSAIC-MPT7B-8xH100-noAC"
MCORE = "MCORE080-H100-weakscale-1.7B-48GPU"


def _f72_per_iteration(B: int, s: int, L: int, h: int, V: int) -> float:
    """Megatron's FLOPs per iteration without recompute (F72; ``analysis.metrics.megatron_flops_per_step``)."""
    from simulator.analysis.metrics import megatron_flops_per_step

    return megatron_flops_per_step(B, s, L, h, V, False)


@pytest.fixture(scope="module")
def mpt() -> dict:
    return scenario_summary(f"validation/{MPT}.yaml")


@pytest.fixture(scope="module")
def mcore() -> dict:
    return scenario_summary(f"validation/{MCORE}.yaml")


def test_mpt7b_fsdp_layout_and_memory(mpt):
    assert (mpt["world_size"], mpt["data_parallel_size"]) == (8, 8)
    assert set(mpt["comm_s_by_group"]) == {"dp"}
    assert mpt["oom"] is None  # llm-foundry ran micro-batch 6 on 80 GB
    # the FSDP gathers and reduce-scatters overlap the compute: little of them is exposed
    assert mpt["exposed_comm_s"] < 0.1 * mpt["comm_s_by_group"]["dp"]


def test_mpt7b_is_the_benchmarked_model(mpt):
    """The table's NumParams (6,658,859,008): MPTConfig's defaults, biases on every Linear and LayerNorm and a learned
    2048 x 4096 position table (the pretrain yaml sets neither no_bias nor alibi); bias-free with ALiBi it would be
    6,649,024,512 = 32 x 12 x 4096^2 + 50368 x 4096 + 65 x 4096."""
    assert mpt["num_parameters"] == CASES[MPT]["workload"]["params"] == 6_658_859_008
    assert 6_658_859_008 - (32 * 12 * 4096**2 + 50368 * 4096 + 65 * 4096) == 2048 * 4096 + 32 * (3 + 1 + 4 + 1) * 4096 + 65 * 4096


def test_mcore_f72_matches_the_cases_derived_iteration_time():
    F = _f72_per_iteration(192, 4096, 24, 2048, 131072)
    assert F / (408.8e12 * 48) == pytest.approx(CASES[MCORE]["derived_inferred"]["iteration_time_s_from_F72"],
                                                abs=5e-4)


def test_mcore_layout(mcore):
    assert (mcore["world_size"], mcore["data_parallel_size"]) == (48, 48)
    assert mcore["oom"] is None
