"""DataLoader workers beside an offloaded CPU optimizer step: the run says they are not priced against each other.

The workers run on the host's CPU pool, the CPU step on its own threads (``offload_optimizer.cpu_threads``); nothing
shares cores or DRAM bandwidth between them, so the run names it (ARCHITECTURE.md decision 13, no silent
approximation). ``num_workers`` 0 loads on the training thread, serially with the step: no warning.
"""

from __future__ import annotations

import copy

import pytest
import yaml

from simulator import run_scenario, scenario_from_dict
from tests.conftest import ROOT

OFFLOAD = yaml.safe_load((ROOT / "scenarios/h200/gpt_184m_b16_offload_overlap.yaml").read_text())
LOADER = {"pin_memory": True, "sample": {"cost": {"distribution": "constant", "mean_s": "6 ms"}, "bytes": "8200 B"}}
FRAGMENT = "beside the CPU optimizer step"


def _warnings(workers: int | None, **host) -> list[str]:
    d = copy.deepcopy(OFFLOAD)
    d["run"] = {"steps": 2, "warmup_steps": 1}
    if workers is not None:
        d["dataloader"] = {**LOADER, "num_workers": workers}
    if host:
        d["hardware"]["host"] = {"preset": "h200-measured-host", **host}
    return run_scenario(scenario_from_dict(d)).summary["warnings"]


def test_workers_beside_the_cpu_step_are_named():
    """The measured host: 16 vCPUs, the CPU step on all 16 (its default threads)."""
    notes = [w for w in _warnings(8) if FRAGMENT in w]
    assert notes == ["dataloader.num_workers 8 beside the CPU optimizer step (ZeRO-Offload): the workers run on the "
                     "host's 16 vCPUs, the CPU step on its own 16 thread(s), and neither takes cores or memory "
                     "bandwidth from the other (not modelled), so where workers build batches during the CPU step it "
                     "is a lower bound"]


def test_the_note_gives_the_threads_in_use():
    assert "the CPU step on its own 6 thread(s)" in next(w for w in _warnings(4, threads=6) if FRAGMENT in w)


@pytest.mark.parametrize("workers", [None, 0])
def test_no_workers_no_note(workers):
    assert not [w for w in _warnings(workers) if FRAGMENT in w]
