"""Phase times with a straggler replica (``rank_overrides`` ``dp_rank``) under ``run.rank_folding`` classes and
none: the stages' ``phase_compute_s`` and the run's ``phase_s`` are the mean over every data-parallel replica,
each rank class weighted by the replicas it stands for (they were the first class's alone, the fast replicas)."""

from __future__ import annotations

import pytest

from simulator.analysis.pipeline import replica_mean, replica_mean_phases
from simulator.api import run_scenario
from simulator.config.loader import scenario_from_dict

BASE = {
    "name": "straggler-phases",
    "hardware": {"gpu": "h100-sxm-80gb", "cluster": {"preset": "dgx-h100", "nodes": 1}, "launch_overhead_s": 0},
    "model": {"num_layers": 4, "hidden_size": 2048, "num_attention_heads": 16, "seq_length": 1024, "vocab_size": 1024},
    "training": {"micro_batch_size": 4, "precision": "bf16", "global_batch_size": 32},
    "ddp": {"overlap_grad_reduce": False},
    "nccl": {"interference": False},
    "run": {"steps": 3, "warmup_steps": 1},
}
PHASES = ("fwd_s", "bwd_s", "opt_s")


def _summary(parallelism: dict, folding: str, overrides: list[dict]) -> dict:
    d = {**BASE, "parallelism": parallelism, "run": {**BASE["run"], "rank_folding": folding},
         "rank_overrides": overrides}
    return run_scenario(scenario_from_dict(d)).summary


def test_replica_mean_weights_each_class_by_its_replicas():
    # 3 replicas at 1 s and one at 2 s: (3 x 1 + 2) / 4; equal classes give their value to the last bit
    assert replica_mean([1.0, 2.0], [3, 1]) == 1.25
    x = 0.1 + 0.2
    assert replica_mean([x] * 7, [1] * 7) == x
    assert replica_mean_phases([{"fwd_s": 1.0, "bwd_s": 2.0}, {"fwd_s": 3.0, "bwd_s": 2.0}], [1, 1]) == {
        "fwd_s": 2.0, "bwd_s": 2.0}


@pytest.mark.parametrize("folding", ["classes", "none"])
def test_pp2_dp2_one_replica_2x_slow_gives_stage_phases_1_5x(folding):
    # PP2 x DP2 (TP2 on 8 GPUs); dp_rank 1's GPU runs every kernel 2x as long (slowdown 2). A phase's compute time
    # (the union of its compute kernels, no waits) is each replica's own: the fast replica's is the run's without
    # the override (its kernels are unchanged; it only waits more), the slow one's exactly 2x. Replicas 1 + 1:
    # each stage's mean is (1 + 2) / 2 = 1.5x the fast one's in every phase, and the run's phase_s (the mean over
    # the two stages) 1.5x the symmetric run's. On main the override changed neither (the fast replica only).
    par = {"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": 2}
    fast = _summary(par, folding, [])
    slow = _summary(par, folding, [{"dp_rank": 1, "slowdown": 2.0}])
    assert slow["data_parallel_size"] == 2
    for st_fast, st_slow in zip(fast["pipeline"]["stages"], slow["pipeline"]["stages"]):
        for ph in PHASES:
            assert st_fast["phase_compute_s"][ph] > 0
            assert st_slow["phase_compute_s"][ph] == pytest.approx(1.5 * st_fast["phase_compute_s"][ph], rel=1e-9)
    for ph in PHASES:
        assert slow["phase_s"][ph] == pytest.approx(1.5 * fast["phase_s"][ph], rel=1e-9)
    # each class keeps its own figure in its row: the fast one's unchanged, the slow one's 2x
    rows = {r["label"]: r["phase_compute_s"] for r in slow["rank_classes"]}
    fast_label = "dp ranks (others)" if folding == "classes" else "dp_rank 0"
    for r, st in enumerate(fast["pipeline"]["stages"]):
        for ph in PHASES:
            assert rows[f"pp_rank {r} / {fast_label}"][ph] == pytest.approx(st["phase_compute_s"][ph], rel=1e-9)
            assert rows[f"pp_rank {r} / dp_rank 1"][ph] == pytest.approx(2 * st["phase_compute_s"][ph], rel=1e-9)


def _result(parallelism: dict, folding: str, overrides: list[dict]):
    d = {**BASE, "parallelism": parallelism, "run": {**BASE["run"], "rank_folding": folding},
         "rank_overrides": overrides}
    return run_scenario(scenario_from_dict(d))


def test_pp2_dp4_classes_weight_the_folded_replicas():
    # PP2 x DP4 (TP1), dp_rank 2 2x slow: under classes one class stands for the 3 others, under none each replica
    # is its own; both give (3 x 1 + 2) / 4 = 1.25x the symmetric run's per-stage phase compute times, and the same
    # step breakdown (the mean over every replica of each one's partition of the job's step windows; it was the
    # unweighted mean over the simulated ranks, 4 under classes, 8 under none: fwd/bwd kernels 15.8 against 13.3 ms)
    par = {"pipeline_model_parallel_size": 2}
    fast = _summary(par, "classes", [])
    over = [{"dp_rank": 2, "slowdown": 2.0}]
    folded_r, full_r = _result(par, "classes", over), _result(par, "none", over)
    folded, full = folded_r.summary, full_r.summary
    b_c, b_n = (dict(r.breakdown().itertuples(index=False)) for r in (folded_r, full_r))
    assert set(b_c) == set(b_n) and b_c["compute (fwd/bwd kernels)"] > 0
    for k in b_c:
        assert b_c[k] == pytest.approx(b_n[k], rel=1e-9, abs=1e-15), k
    assert [r["replicas"] for r in folded["rank_classes"]] == [3, 1, 3, 1]
    assert len(full["rank_classes"]) == 8
    for st, st_c, st_n in zip(fast["pipeline"]["stages"], folded["pipeline"]["stages"], full["pipeline"]["stages"]):
        for ph in PHASES:
            assert st_c["phase_compute_s"][ph] == pytest.approx(1.25 * st["phase_compute_s"][ph], rel=1e-9)
            assert st_n["phase_compute_s"][ph] == pytest.approx(st_c["phase_compute_s"][ph], rel=1e-9)


def test_one_stage_phase_split_is_the_mean_over_the_replicas():
    # no pipeline (DP8, TP1), dp_rank 3 2x slow: phase_s is the CUDA-event split (metrics.phase_split), whose fwd
    # and opt hold only compute kernels here (no TP, the gradient all-reduce is the backward's): the mean over 7
    # fast replicas and the slow one, (7 x 1 + 2) / 8 = 1.125x the symmetric run's; each replica's split fills the
    # job's step (they meet at the all-reduce), so the mean does too
    fast = _summary({}, "classes", [])
    for folding in ("classes", "none"):
        slow = _summary({}, folding, [{"dp_rank": 3, "slowdown": 2.0}])
        for ph in ("fwd_s", "opt_s"):
            assert slow["phase_s"][ph] == pytest.approx(1.125 * fast["phase_s"][ph], rel=1e-9)
        assert sum(slow["phase_s"].values()) == pytest.approx(slow["step_time_s"], rel=1e-9)
