"""The CPU step's threads per rank on a shared host, when ``hardware.host.threads`` is not given, are named with the
launchers' own defaults (ARCHITECTURE.md decision 13: a default that changes the answer is printed).

DGX H100, 8 ranks: 112 cores / 8 = 14 threads per rank (DeepSpeed's ``--bind_cores_to_rank``); torchrun's default
``OMP_NUM_THREADS=1`` is ``hardware.host.threads=1``, which prices the FSDP2 scenario's CPU step 5x slower (75.7 ->
375.6 ms), so the default is not a detail.
"""

from __future__ import annotations

import pytest

from simulator import load_scenario, run_scenario
from tests.conftest import ROOT

FSDP2 = str(ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_fsdp2_offload.yaml")
ONE_GPU = str(ROOT / "scenarios/h200/gpt_184m_b16_offload_overlap.yaml")
FRAGMENT = "hardware.host.threads not set"


def _run(path: str, *sets: str) -> dict:
    return run_scenario(load_scenario(path, ["run.steps=2", "run.warmup_steps=1", *sets])).summary


def test_default_threads_on_a_shared_host_are_named_with_the_launchers_defaults():
    s = _run(FSDP2)
    notes = [w for w in s["warnings"] if FRAGMENT in w]
    assert notes == ["hardware.host.threads not set: each rank's FSDP2 offload_policy CPU step is priced on 112 physical "
                     "cores / 8 ranks = 14 thread(s), as DeepSpeed's launcher sets with --bind_cores_to_rank "
                     "(OMP_NUM_THREADS=14); torchrun sets OMP_NUM_THREADS=1 per process when it is unset (set "
                     "hardware.host.threads=1 and bind_cores_to_rank=false for that), and DeepSpeed's launcher without "
                     "the flag leaves every rank's pool on all 112 (hardware.host.bind_cores_to_rank=false: "
                     "oversubscribed, priced time-sliced at the same 14-core share without NUMA locality)"]
    one = _run(FSDP2, "hardware.host.threads=1")
    assert not [w for w in one["warnings"] if FRAGMENT in w]
    assert one["offload_cpu_optimizer_s"] > 4 * s["offload_cpu_optimizer_s"]
    # all 112 per rank: the same 14-core share as the default (and the oversubscription note instead)
    full = _run(FSDP2, "hardware.host.threads=112")
    assert full["offload_cpu_optimizer_s"] == pytest.approx(s["offload_cpu_optimizer_s"], rel=1e-12)
    assert any("oversubscribed" in w for w in full["warnings"])
    # DeepSpeed's launcher without --bind_cores_to_rank: 8 pools of 112 threads on 112 cores, time-sliced to 14
    # cores' worth each; 8 ranks spread evenly over the 2 sockets, so the interleaved memory gives the same share
    unbound = _run(FSDP2, "hardware.host.bind_cores_to_rank=false")
    assert unbound["offload_cpu_optimizer_s"] == pytest.approx(s["offload_cpu_optimizer_s"], rel=1e-12)
    assert not [w for w in unbound["warnings"] if FRAGMENT in w]
    assert any(w.startswith("hardware.host.bind_cores_to_rank false with threads not set (112, torch's default "
                            "pool) x 8 ranks = 896 CPU-step threads on 112 cores: oversubscribed")
               for w in unbound["warnings"])


def test_one_gpu_has_the_host_to_itself():
    assert not [w for w in _run(ONE_GPU)["warnings"] if FRAGMENT in w]


CLUSTER = "FSDP2 offload_policy on a cluster: the host is shared by 8 ranks per node"
TORCHRUN = "torchrun sets OMP_NUM_THREADS=1 per process instead: hardware.host.threads=1"


@pytest.mark.parametrize("sets, threads", [
    ((), "14 threads (cores / ranks, the OMP_NUM_THREADS DeepSpeed's launcher sets with --bind_cores_to_rank; "
         f"{TORCHRUN})"),
    (("hardware.host.bind_cores_to_rank=false",),
     "14 threads (torch's pool on every core, OMP_NUM_THREADS unset as DeepSpeed's launcher without "
     f"--bind_cores_to_rank leaves it, time-sliced to cores / ranks' worth; {TORCHRUN})"),
    (("hardware.host.threads=1",), "1 thread (hardware.host.threads; at most cores / ranks' worth when oversubscribed)"),
])
def test_the_shared_host_note_says_where_its_thread_count_comes_from(sets, threads):
    """The FSDP2 offload note on a cluster gave the threads per rank "as DeepSpeed's --bind_cores_to_rank" only, for
    a job torchrun launches, where OMP_NUM_THREADS=1 (pytorch/pytorch@010929fd torch/distributed/run.py
    config_from_args): it now names the source of its count, and torchrun's default with the key that sets it."""
    notes = [w for w in _run(FSDP2, *sets)["warnings"] if w.startswith(CLUSTER)]
    assert len(notes) == 1 and f"on its 1/8 partition with {threads} and a max-min share" in notes[0], notes
