"""FSDP2's CPU offload in the schema: ``fsdp.offload_policy`` (``fully_shard(offload_policy=CPUOffloadPolicy(
pin_memory=...))``, pytorch/pytorch@05f814fe torch/distributed/fsdp/_fully_shard/_fsdp_api.py) in the ways users
write it, torchtitan's ``training.enable_cpu_offload`` (pytorch/torchtitan@000204a4 torchtitan/config/job_config.py)
mapped to it, and every bad input refused in one line (issue 11)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from simulator.config.errors import ScenarioError
from simulator.config.loader import load_scenario
from tests.conftest import ROOT

DP8 = ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml"


@pytest.mark.parametrize("override,pinned", [
    ("fsdp={version: 2, offload_policy: {kind: cpu, pin_memory: true}}", True),
    ("fsdp={version: 2, offload_policy: {pin_memory: false}}", False),
    ("fsdp={version: 2, offload_policy: CPUOffloadPolicy}", True),
    ("fsdp={version: 2, offload_policy: 'CPUOffloadPolicy()'}", True),
    ("fsdp={version: 2, offload_policy: 'CPUOffloadPolicy(pin_memory=False)'}", False),
])
def test_offload_policy_as_users_write_it(override, pinned):
    f = load_scenario(DP8, [override]).fsdp
    assert f.offload_params and f.offload_pinned is pinned and f.offload_key == "fsdp.offload_policy"
    assert f.cpu_adam_impl("fused") == "torch_fused"  # torch AdamW(fused=True) over the CPU shards


def test_a_key_set_over_the_string_form():
    f = load_scenario(DP8, ["fsdp={version: 2, offload_policy: CPUOffloadPolicy}",
                            "fsdp.offload_policy.pin_memory=false"]).fsdp
    assert f.offload_policy is not None and not f.offload_pinned


def test_no_offload_policy_is_offloadpolicy():
    for v in ("OffloadPolicy", "'OffloadPolicy()'", "null"):
        assert not load_scenario(DP8, [f"fsdp={{version: 2, offload_policy: {v}}}"]).fsdp.offload_params


def test_torchtitan_enable_cpu_offload_is_cpuoffloadpolicy():
    f = load_scenario(DP8, ["fsdp={version: 2}", "training.enable_cpu_offload=true"]).fsdp
    assert f.offload_policy is not None and f.offload_policy.pin_memory
    same = load_scenario(DP8, ["fsdp={version: 2, offload_policy: CPUOffloadPolicy}",
                               "training.enable_cpu_offload=true"]).fsdp
    assert same == f


#: what the one line says -> the overrides that make it
BAD = {
    "fsdp.cpu_offload is FSDP1's (FullyShardedDataParallel); fsdp.version 2 (fully_shard) takes no such key: its "
    "counterpart is fsdp.offload_policy": ["fsdp={version: 2, cpu_offload: true}"],
    "fsdp.offload_policy.kind: Input should be 'cpu'": ["fsdp={version: 2, offload_policy: {kind: gpu}}"],
    "fsdp.offload_policy: True (allowed: {kind: cpu, pin_memory": ["fsdp={version: 2, offload_policy: true}"],
    "'CPUOffloadPolicy(pin_memory=maybe)' (allowed: {kind: cpu": [
        "fsdp={version: 2, offload_policy: 'CPUOffloadPolicy(pin_memory=maybe)'}"],
    "fsdp.offload_policy is FSDP2's": ["fsdp={version: 1, offload_policy: CPUOffloadPolicy}"],
    "training.enable_cpu_offload: true is torchtitan's FSDP2": ["training.enable_cpu_offload=true"],
    "it needs fsdp: {version: 2}": ["fsdp={version: 1}", "training.enable_cpu_offload=true"],
    "contradicts fsdp.offload_policy pin_memory false": [
        "fsdp={version: 2, offload_policy: {pin_memory: false}}", "training.enable_cpu_offload=true"],
    "contradicts fsdp.offload_policy given as no offload (OffloadPolicy / null)": [
        "fsdp={version: 2, offload_policy: OffloadPolicy}", "training.enable_cpu_offload=true"],
    "fsdp.offload_policy given as no offload": ["fsdp={version: 2, offload_policy: null}",
                                                "training.enable_cpu_offload=true"],
    "fsdp.offload_policy: OffloadPolicy (no offload) takes no pin_memory": [
        "fsdp={version: 2, offload_policy: OffloadPolicy}", "fsdp.offload_policy.pin_memory=false"],
    "fsdp.cpu_offload with gradient accumulation: FSDP1 does not accumulate": [
        "fsdp={version: 1, cpu_offload: true}", "training.micro_batch_size=1", "training.global_batch_size=16"],
}


@pytest.mark.parametrize("needle", BAD)
def test_bad_input_is_one_line(needle):
    with pytest.raises(ScenarioError) as e:
        load_scenario(DP8, BAD[needle])
    assert needle in str(e.value) and "\n" not in str(e.value).strip(), str(e.value)


def test_the_cli_refuses_it_in_one_line_with_exit_2():
    r = subprocess.run([sys.executable, "-m", "simulator", "run", str(DP8), "--set",
                        "fsdp={version: 2, offload_policy: {kind: gpu}}"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 2 and r.stdout == "" and "\n" not in r.stderr.strip()
    assert "fsdp.offload_policy.kind: Input should be 'cpu' (got 'gpu')" in r.stderr


def test_fsdp1_cpu_offload_still_builds():
    cfg = load_scenario(DP8, ["fsdp={version: 1, cpu_offload: true}"])
    assert cfg.fsdp.offload_params and cfg.fsdp.offload_key == "fsdp.cpu_offload" and cfg.fsdp.offload_pinned


def test_fsdp2_offload_with_gradient_accumulation_loads():
    """fully_shard accumulates on the CPU (foreach_reduce adds each later micro-batch's shard): not refused."""
    cfg = load_scenario(DP8, ["fsdp={version: 2, offload_policy: CPUOffloadPolicy}", "training.micro_batch_size=1",
                              "training.global_batch_size=16"])
    assert cfg.fsdp.offload_key == "fsdp.offload_policy" and cfg.training.global_batch_size == 16
