"""Keys a user sets that nothing reads on one GPU are named in the run warnings (trial finding: on
scenarios/h200/gpt_184m_b16.yaml each of these was accepted with no effect and no warning)."""

from __future__ import annotations

import pytest

from simulator.api import ineffective_setting_warnings
from simulator.config.loader import load_scenario
from tests.conftest import ROOT

ONE_GPU = ROOT / "scenarios/h200/gpt_184m_b16.yaml"
OFFLOAD = ROOT / "scenarios/h200/gpt_184m_b16_offload_overlap.yaml"


def _lines(path, *sets):
    return ineffective_setting_warnings(load_scenario(path, list(sets)))


@pytest.mark.parametrize("setting, line", [
    ("hardware.host.threads=2", "hardware.host.threads has no effect: nothing in this run runs on host threads"),
    ("hardware.host.numa_node=0", "hardware.host.numa_node has no effect: nothing in this run runs on host threads"),
    ("ddp.bucket_cap_mb=1", "ddp.bucket_cap_mb has no effect with data_parallel_size 1"),
    ("ddp.overlap_grad_reduce=false", "ddp.overlap_grad_reduce has no effect with data_parallel_size 1"),
    ("nccl.algo=Tree", "nccl.algo has no effect on one GPU"),
    ("zero_optimization.offload_optimizer.pin_memory=false",
     "zero_optimization.offload_optimizer.pin_memory has no effect with device none"),
])
def test_a_set_key_nothing_reads_on_one_gpu_is_named(setting, line):
    assert _lines(ONE_GPU) == []
    got = _lines(ONE_GPU, setting)
    assert len(got) == 1 and got[0].startswith(line), got


def test_keys_the_run_reads_are_not_named():
    # the offload scenario's CPU step runs on the host threads and pins its buffers: both take effect
    got = _lines(OFFLOAD, "hardware.host.threads=2", "hardware.host.numa_node=0",
                 "zero_optimization.offload_optimizer.pin_memory=false")
    assert not [g for g in got if g.startswith(("hardware.host", "zero_optimization.offload_optimizer"))], got
