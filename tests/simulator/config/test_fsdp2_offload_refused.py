"""FSDP2's CPU offload (``fully_shard(offload_policy=CPUOffloadPolicy(pin_memory=True))``, pytorch/pytorch@05f814fe
torch/distributed/fsdp/_fully_shard/_fsdp_api.py) is not modelled: every way a user would write it is refused in one
line that says so, never built as FSDP1's flat-parameter offload (issue 11)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from simulator.config.errors import ScenarioError
from simulator.config.loader import load_scenario
from tests.conftest import ROOT

DP8 = ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml"


@pytest.mark.parametrize("override,key", [
    ("fsdp={version: 2, cpu_offload: true}", "fsdp.cpu_offload is FSDP1's"),
    ("fsdp={version: 2, cpu_offload: {offload_params: true}}", "fsdp.cpu_offload is FSDP1's"),
    ("fsdp={version: 2, offload_policy: CPUOffloadPolicy}", "fsdp.offload_policy: unknown key"),
    ("training.enable_cpu_offload=true", "training.enable_cpu_offload: unknown key"),
])
def test_fsdp2_cpu_offload_is_refused_naming_cpuoffloadpolicy(override, key):
    with pytest.raises(ScenarioError) as e:
        load_scenario(DP8, [override])
    msg = str(e.value)
    assert key in msg and "CPUOffloadPolicy" in msg and "not modelled" in msg
    assert "has none" not in msg  # fully_shard has an offload policy; the old message said it had none


def test_the_cli_refuses_it_in_one_line_with_exit_2():
    r = subprocess.run([sys.executable, "-m", "simulator", "run", str(DP8), "--set",
                        "fsdp={version: 2, cpu_offload: true}"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stdout == "" and "\n" not in r.stderr.strip()


def test_fsdp1_cpu_offload_still_builds():
    cfg = load_scenario(DP8, ["fsdp={version: 1, cpu_offload: true}"])
    assert cfg.fsdp.offload_params
