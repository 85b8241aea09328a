"""Rank overrides: a data-parallel straggler (its own rank class, meeting the others at every DP collective)
and overridden pipeline stages, with values worked out by hand, and bad input."""

from __future__ import annotations

import pytest

from simulator.api import rank_classes, run_scenario
from simulator.config.loader import resolve_hardware, scenario_from_dict

BASE = {
    "name": "straggler",
    "hardware": {"gpu": "h100-sxm-80gb", "cluster": {"preset": "dgx-h100", "nodes": 1}, "launch_overhead_s": 0},
    "model": {"num_layers": 4, "hidden_size": 2048, "num_attention_heads": 16, "seq_length": 1024, "vocab_size": 1024},
    "training": {"micro_batch_size": 4, "precision": "bf16"},
    "ddp": {"overlap_grad_reduce": False},
    "nccl": {"interference": False},
    "run": {"steps": 3, "warmup_steps": 1},
}


def _run(**extra):
    return run_scenario(scenario_from_dict({**BASE, **extra})).summary


def test_one_slow_replica_raises_the_step_by_exactly_its_extra_compute():
    # no overlap, no launch cost, no interference: the step is the straggler's own, whose kernels all take
    # 1.2x: the step grows by 0.2 x the compute-stream busy time of a normal rank
    base = _run()
    slow = _run(rank_overrides=[{"dp_rank": 3, "slowdown": 1.2}])
    compute = base["utilisation"]["compute"] * base["step_time_s"]
    assert slow["step_time_s"] - base["step_time_s"] == pytest.approx(0.2 * compute, rel=1e-6)
    assert slow["straggler"] == "dp_rank 3"
    others, straggler = slow["rank_classes"]
    assert (others["replicas"], straggler["replicas"]) == (7, 1)
    assert straggler["compute_s"] == pytest.approx(1.2 * others["compute_s"], rel=1e-6)
    # the others wait for it: their wait grows by exactly its extra compute
    assert others["wait_s"] - straggler["wait_s"] == pytest.approx(0.2 * compute, rel=1e-6)


def test_rank_classes_split_only_what_is_overridden():
    cfg = scenario_from_dict({**BASE, "rank_overrides": [{"dp_rank": 1, "slowdown": 1.5}, {"dp_rank": 6,
                                                                                          "slowdown": 2.0}]})
    classes = rank_classes(cfg, resolve_hardware(cfg))
    assert [(c.label, c.replicas, c.hw.slowdown) for c in classes] == [
        ("dp ranks (others)", 6, 1.0), ("dp_rank 1", 1, 1.5), ("dp_rank 6", 1, 2.0)]


def test_a_slow_pipeline_stage_paces_the_pipeline():
    pp = {"pipeline_model_parallel_size": 4}
    d = {**BASE, "parallelism": pp, "training": {**BASE["training"], "global_batch_size": 32}}
    base = run_scenario(scenario_from_dict(d)).summary
    slow = run_scenario(scenario_from_dict({**d, "rank_overrides": [{"pp_rank": 2, "slowdown": 1.5}]})).summary
    stages = slow["pipeline"]["stages"]
    assert slow["step_time_s"] > base["step_time_s"]
    assert stages[2]["slowdown"] == 1.5 and stages[2]["pipeline_imbalance_s"] == 0.0  # the least idle stage
    assert slow["straggler"] == "pp_rank 2"


def test_a_power_capped_stage_draws_less():
    # the firmware's power controller acts over its own window, so a 3-step run is not held at the cap; the
    # capped stage draws less than the same stage without the override, and the other stage is unchanged
    pp = {"pipeline_model_parallel_size": 2}
    d = {**BASE, "parallelism": pp, "training": {**BASE["training"], "global_batch_size": 16}}
    free = run_scenario(scenario_from_dict(d)).summary["pipeline"]["stages"]
    cap = [{"pp_rank": 1, "dvfs": {"kind": "power_cap", "power_limit_w": 250}}]
    capped = run_scenario(scenario_from_dict({**d, "rank_overrides": cap})).summary["pipeline"]["stages"]
    assert capped[1]["avg_power_w"] < free[1]["avg_power_w"]
    assert capped[1]["energy_j_per_step"] < free[1]["energy_j_per_step"]


@pytest.mark.parametrize("overrides,msg", [
    ([{"dp_rank": 8, "slowdown": 1.2}], "rank_overrides[0].dp_rank: 8 is outside the 8 data-parallel replicas"),
    ([{"dp_rank": 1}], "changes nothing"),
    ([{"dp_rank": 1, "pp_rank": 0, "slowdown": 2}], "give exactly one of pp_rank or dp_rank"),
    ([{"dp_rank": 1, "slowdown": 2}, {"dp_rank": 1, "slowdown": 3}], "overridden twice"),
    ([{"dp_rank": 1, "slowdown": 0}], "greater than 0"),
    ([{"dp_rank": True, "slowdown": 1.2}], "valid integer"),
    ([{"dp_rank": 1, "slowdown": True}], "valid number"),
    ([{"dp_rank": 1, "slowdown": "1.2"}], "valid number"),
])
def test_bad_overrides_are_one_line(overrides, msg):
    from simulator.config.errors import ScenarioError
    from simulator.config.loader import format_validation_error
    from simulator.config.schema import ScenarioConfig
    from pydantic import ValidationError

    try:
        scenario_from_dict({**BASE, "rank_overrides": overrides})
    except ScenarioError as exc:
        line = str(exc)
    except ValidationError as exc:
        line = format_validation_error(exc, "s.yaml", ScenarioConfig)
    else:
        raise AssertionError("accepted")
    assert msg in line and "\n" not in line


def test_overrides_need_a_cluster():
    from simulator.config.errors import ScenarioError

    with pytest.raises(ScenarioError, match="needs hardware.cluster"):
        scenario_from_dict({**BASE, "hardware": {"gpu": "h100-sxm-80gb"}, "rank_overrides": [{"pp_rank": 0,
                                                                                               "slowdown": 2}]})


PIPE = {**BASE, "parallelism": {"pipeline_model_parallel_size": 2},
        "training": {**BASE["training"], "global_batch_size": 32}}


@pytest.mark.parametrize("extra,interference", [({}, False), ({}, True),
                                               ({"parallelism": {"pipeline_model_parallel_size": 2}}, False),
                                               ({"parallelism": {"pipeline_model_parallel_size": 2}}, True)])
def test_unfolded_ranks_give_the_folded_answer(extra, interference):
    # run.rank_folding none simulates every data-parallel replica (4 x 2 or 8 executors): symmetric ranks, so
    # the step and memory are the folded run's, with and without compute/communication interference
    d = {**(PIPE if extra else BASE), **extra, "nccl": {"interference": interference}}
    folded = run_scenario(scenario_from_dict(d)).summary
    full = run_scenario(scenario_from_dict({**d, "run": {**d["run"], "rank_folding": "none"}})).summary
    assert full["step_time_s"] == pytest.approx(folded["step_time_s"], rel=1e-9)
    assert full["peak_device_memory_bytes"] == folded["peak_device_memory_bytes"]
    n = 8 // (2 if extra else 1)
    assert len(full["rank_classes"]) == (2 * n if extra else n)
    assert full["straggler"] is None  # identical ranks: nobody is the slowest


def test_a_slow_replica_in_a_pipeline_is_one_class_per_stage():
    base = run_scenario(scenario_from_dict(PIPE)).summary
    slow = run_scenario(scenario_from_dict({**PIPE, "rank_overrides": [{"dp_rank": 2, "slowdown": 1.3}]})).summary
    labels = [r["label"] for r in slow["rank_classes"]]
    assert labels == ["pp_rank 0 / dp ranks (others)", "pp_rank 0 / dp_rank 2", "pp_rank 1 / dp ranks (others)",
                      "pp_rank 1 / dp_rank 2"]
    assert slow["straggler"].endswith("dp_rank 2") and slow["step_time_s"] > base["step_time_s"]
    # the stage rows are each stage's first class (not the straggler's): named so, in the rows and the busy line
    from simulator.cli import format_summary
    assert [st["rank_class"] for st in slow["pipeline"]["stages"]] == ["dp ranks (others)"] * 2
    text = format_summary(slow, "pipe")
    top = slow["peak_memory_pp_rank"]
    assert f"of the step on stage {top} / dp ranks (others) (the peak-memory stage)" in text
    assert "  stage 0           " in text and "layers, dp ranks (others): compute" in text
    assert "rank_class" not in base["pipeline"]["stages"][0]


@pytest.mark.parametrize("override,msg", [
    ("{dp_rank: 9, slowdown: 2}", "s.yaml: rank_overrides[0].dp_rank: 9 is outside the 8 data-parallel replicas"),
    ("{dp_rank: 0, dvfs: {kind: power_cap, power_limit_w: 5000}}",
     "rank_overrides (dp_rank 0): dvfs.power_limit_w 5000 W is outside the settable range"),
])
def test_override_errors_name_the_override(tmp_path, override, msg):
    import subprocess
    import sys

    import yaml

    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(BASE))
    out = subprocess.run([sys.executable, "-m", "simulator", "run", str(p), "--set", f"rank_overrides=[{override}]"],
                         capture_output=True, text=True, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and msg in lines[0] and "(top level)" not in lines[0], out.stderr


def test_a_replica_on_another_gpu_is_its_own_class_priced_on_that_gpu():
    """``{dp_rank: 3, gpu: a100-sxm4-80gb}`` in a DGX H100 (no overlap, no launch cost, no interference): replica 3
    computes exactly as one A100 alone runs the same step's kernels (its compute-stream time equals the single-GPU
    A100 run's), the others as one H100, and the step grows by exactly the A100's extra compute (the others wait
    for it at the gradient all-reduce). The per-rank results name it, with its GPU."""
    def compute(s):
        return s["utilisation"]["compute"] * s["step_time_s"]

    base = _run()
    mixed = _run(rank_overrides=[{"dp_rank": 3, "gpu": "a100-sxm4-80gb"}])
    one = {g: run_scenario(scenario_from_dict({**BASE, "hardware": {"gpu": g, "launch_overhead_s": 0}})).summary
           for g in ("h100-sxm-80gb", "a100-sxm4-80gb")}
    others, a100 = mixed["rank_classes"]
    assert mixed["straggler"] == "dp_rank 3"
    assert (others["gpu"], a100["gpu"]) == ("NVIDIA H100 SXM5 80GB", "NVIDIA A100 SXM4 80GB")
    assert a100["compute_s"] == pytest.approx(compute(one["a100-sxm4-80gb"]), rel=1e-6)
    assert others["compute_s"] == pytest.approx(compute(one["h100-sxm-80gb"]), rel=1e-6)
    assert mixed["step_time_s"] - base["step_time_s"] == pytest.approx(a100["compute_s"] - others["compute_s"],
                                                                       rel=1e-6)


@pytest.mark.parametrize("overrides,msg", [
    ([{"dp_rank": 1, "gpu": "h900-imaginary"}], "rank_overrides[0].gpu"),
    ([{"dp_rank": 1, "gpu": "v100-sxm2-32gb"}], "rank_overrides[0].gpu: v100-sxm2-32gb has no bf16 rate"),
    ([{"pp_rank": 0, "gpu": "a100-sxm4-80gb"}, {"dp_rank": 1, "gpu": "a100-sxm4-80gb"}],
     "a replica's and a stage's gpu would both apply"),
])
def test_bad_gpu_override_is_one_line(overrides, msg):
    from simulator.config.errors import ScenarioError

    d = {**BASE, "rank_overrides": overrides}
    if any(o.get("pp_rank") is not None for o in overrides):
        d = {**d, "parallelism": {"pipeline_model_parallel_size": 2}, "training": {**BASE["training"],
                                                                                 "global_batch_size": 16}}
    with pytest.raises(ScenarioError) as e:
        scenario_from_dict(d)
    assert msg in str(e.value) and "\n" not in str(e.value)


HYBRID = {**BASE, "hardware": {**BASE["hardware"], "cluster": {"preset": "dgx-h100", "nodes": 2}},
          "training": {"micro_batch_size": 4, "precision": "amp_fp32_params"}, "ddp": {},
          "fsdp": {"sharding_strategy": "HYBRID_SHARD"}}


def test_a_straggler_with_hybrid_shard_splits_only_its_shard_group():
    """FSDP HYBRID_SHARD on 2 DGX H100 (shard groups of 8 ranks per node, replicated twice) with replica 3 1.2x
    slower (was refused: "with fsdp HYBRID_SHARD is not modelled yet"). Folding splits only what it touches: the
    8 replicas of node 1, the 7 peers of node 0 (which wait for it at every dp_shard collective) and replica 3;
    the dp_shard collectives meet only inside node 0 (2 classes), the dp_replicate all-reduces meet all 3. No launch
    cost or interference: the straggler arrives last at every collective, so the step is exactly that of every rank
    1.2x slower, and the per-rank results name it."""
    import dataclasses

    from simulator.api import _meet_across_classes, build_graph

    cfg = scenario_from_dict({**HYBRID, "rank_overrides": [{"dp_rank": 3, "slowdown": 1.2}]})
    classes = rank_classes(cfg, resolve_hardware(cfg))
    assert [(c.label, c.replicas, c.shard_group) for c in classes] == [
        ("dp ranks (others)", 8, None), ("dp ranks (others, shard group 0)", 7, 0), ("dp_rank 3", 1, 0)]
    g = build_graph(cfg)
    for c, parties in zip(classes, (1, 2, 2)):
        met = _meet_across_classes(g, 0, c.dp_class, 3, c.shard_group, parties)
        shard = [o.meta for o in met.ops if o.meta and o.meta.get("group") == "dp_shard"]
        rep = [o.meta for o in met.ops if o.meta and o.meta.get("group") == "dp_replicate"]
        assert shard and rep and {m["parties"] for m in rep} == {3}
        assert {m.get("parties") for m in shard} == ({None} if c.shard_group is None else {2})
    mixed = run_scenario(cfg).summary
    base = scenario_from_dict(HYBRID)
    uniform = run_scenario(base, hw=dataclasses.replace(resolve_hardware(base), slowdown=1.2)).summary
    assert mixed["step_time_s"] == pytest.approx(uniform["step_time_s"], rel=1e-9)
    assert mixed["straggler"] == "dp_rank 3"
    assert mixed["rank_classes"][2]["compute_s"] == pytest.approx(1.2 * mixed["rank_classes"][0]["compute_s"],
                                                                  rel=1e-6)


def test_unfolded_hybrid_shard_gives_the_folded_answer():
    """run.rank_folding none with HYBRID_SHARD on 2 nodes: 16 replicas in 2 shard groups of 8 meeting at their own
    dp_shard collectives and all together at dp_replicate give the folded run's step and memory exactly."""
    small = {**HYBRID, "model": {**HYBRID["model"], "num_layers": 2, "hidden_size": 1024, "seq_length": 512},
             "run": {"steps": 2, "warmup_steps": 1}}
    folded = run_scenario(scenario_from_dict(small)).summary
    unfolded = run_scenario(scenario_from_dict({**small, "run": {**small["run"], "rank_folding": "none"}})).summary
    assert unfolded["step_time_s"] == pytest.approx(folded["step_time_s"], rel=1e-12)
    assert unfolded["peak_device_memory_bytes"] == folded["peak_device_memory_bytes"]
    assert len(unfolded["rank_classes"]) == 16


def test_straggler_is_the_class_that_gates_the_step_over_all_stages():
    """The trial's case by hand: stage 0 slowed 1.5x, replica 0 1.1x; per stage the replica-0 class computes the
    most, but pp_rank 0 / dp_rank 0 (1.65x, 0.617 s) gates the step, not pp_rank 1 / dp_rank 0 (0.436 s), whose
    margin within its stage (1.1x beside 0.387 s) is the larger one. Symmetric classes: no straggler."""
    from simulator.analysis.pipeline import straggler

    rows = [{"label": lab, "compute_s": c} for lab, c in [
        ("pp_rank 0 / dp ranks (others)", 0.5517), ("pp_rank 0 / dp_rank 0", 0.6172),
        ("pp_rank 1 / dp ranks (others)", 0.3868), ("pp_rank 1 / dp_rank 0", 0.4358)]]
    assert straggler(rows, [0, 0, 1, 1]) == "pp_rank 0 / dp_rank 0"
    same = [{"label": "a", "compute_s": 0.5}, {"label": "b", "compute_s": 0.5}, {"label": "c", "compute_s": 0.3},
            {"label": "d", "compute_s": 0.3}]
    assert straggler(same, [0, 0, 1, 1]) is None  # stages differ in work only: no straggler


def test_stage_and_replica_slowdowns_compound_and_are_flagged():
    cfg = scenario_from_dict({**PIPE, "rank_overrides": [{"pp_rank": 0, "slowdown": 1.5},
                                                          {"dp_rank": 0, "slowdown": 1.1}]})
    classes = rank_classes(cfg, resolve_hardware(cfg))
    assert [(c.label, c.hw.slowdown) for c in classes] == [
        ("pp_rank 0 / dp ranks (others)", 1.5), ("pp_rank 0 / dp_rank 0", pytest.approx(1.65)),
        ("pp_rank 1 / dp ranks (others)", 1.0), ("pp_rank 1 / dp_rank 0", 1.1)]
    s = run_scenario(cfg).summary
    assert s["straggler"] == "pp_rank 0 / dp_rank 0"
    assert [w for w in s["warnings"] if "compound" in w] == [
        ("rank_overrides: pp_rank 0 slowdown 1.5 and dp_rank 0 slowdown 1.1 compound on pp_rank 0 / dp_rank 0: its "
         "kernels run 1.5 x 1.1 = 1.65x slower")]


def test_a_replica_on_a_gpu_without_a_fitted_profile_says_so():
    """An A100 replica (no shipped A100 profile) is priced with the generic one: flagged like a generic hardware.gpu,
    naming the GPUs that have a fitted profile."""
    from simulator.api import run_warnings

    cfg = scenario_from_dict({**BASE, "rank_overrides": [{"dp_rank": 2, "gpu": "a100-sxm4-80gb"}]})
    w = [x for x in run_warnings(resolve_hardware(cfg), cfg) if "generic GPU profile" in x]
    assert len(w) == 1 and w[0].startswith("rank_overrides: replica 2: generic GPU profile 'generic:a100-sxm4-80gb'")
    assert "(h100-sxm-80gb, h200-sxm-141gb)" in w[0]


def test_an_out_of_memory_replica_is_named():
    """Micro-batch 48 needs 18.6 GB (Megatron fp16 DDP, gradients in its fp16 grad buffer: 18.58 GB, 18.56 before the
    norms' statistics and the flash log-sum-exp were kept for backward; 18.98 with the fp32 buffer of
    --accumulate-allreduce-grads-in-fp32, 19.02 while a separate .grad was counted): it fits the H100s (85.5 GB) but not replica 1's V100 16 GB (16.94 GB): the out-of-memory
    line names the replica whose GPU overflows."""
    d = {**BASE, "training": {**BASE["training"], "precision": "fp16", "micro_batch_size": 48},
         "rank_overrides": [{"dp_rank": 1, "gpu": "v100-sxm2-16gb"}]}
    s = run_scenario(scenario_from_dict(d)).summary
    assert s["oom"].startswith("dp_rank 1: out of memory on gpu0.hbm: peak demand 18.58 GB exceeds the capacity "
                               "16.94 GB")


def test_a_stage_override_warns_only_what_it_changes():
    """A stage moved to another GPU with no slowdown: no "runs with slowdown 1" line; a slowdown is named."""
    from simulator.api import run_warnings

    d = {**BASE, "parallelism": {"pipeline_model_parallel_size": 2},
         "training": {**BASE["training"], "global_batch_size": 16}}
    cfg = scenario_from_dict({**d, "rank_overrides": [{"pp_rank": 1, "gpu": "a100-sxm4-80gb"}]})
    assert not [w for w in run_warnings(resolve_hardware(cfg), cfg) if "runs with" in w]
    cfg = scenario_from_dict({**d, "rank_overrides": [{"pp_rank": 1, "slowdown": 1.5}]})
    assert [w for w in run_warnings(resolve_hardware(cfg), cfg) if "runs with" in w] == [
        "rank_overrides: pipeline stage 1 (all its ranks) runs with slowdown 1.5"]


def test_the_summary_memory_is_the_tightest_class_when_gpus_differ_in_memory():
    """A replica on an A100 40GB in a DGX H100 job: the same model states and activations on every replica, so the
    peak is the same, and the class that binds is the one with 40 GiB; the summary's capacity is that class's (not
    the main GPU's 81559 MiB) and names it; every class reports its own GPU's memory."""
    s = _run(rank_overrides=[{"dp_rank": 3, "gpu": "a100-sxm4-40gb"}])
    others, small = s["rank_classes"]
    assert (others["gpu_memory_capacity_bytes"], small["gpu_memory_capacity_bytes"]) == (85_520_809_984.0,
                                                                                         42_949_672_960.0)
    assert s["gpu_memory_capacity_bytes"] == 42_949_672_960.0 and s["memory_binding_class"] == "dp_rank 3"
    assert s["peak_device_memory_bytes"] == small["peak_device_memory_bytes"]
    assert "memory_binding_class" not in _run(rank_overrides=[{"dp_rank": 3, "slowdown": 1.2}])


def test_symmetric_folding_is_one_representative_per_stage():
    # run.rank_folding symmetric: every data-parallel replica identical, one rank class per pipeline stage; a stage
    # override keeps the replicas identical, so it is allowed and gives the classes mode's answer exactly
    d = {**PIPE, "rank_overrides": [{"pp_rank": 1, "slowdown": 1.5}]}
    cfg = scenario_from_dict({**d, "run": {**d["run"], "rank_folding": "symmetric"}})
    classes = rank_classes(cfg, resolve_hardware(cfg))
    assert [(c.label, c.replicas, c.hw.slowdown) for c in classes] == [("pp_rank 0", 4, 1.0), ("pp_rank 1", 4, 1.5)]
    sym = run_scenario(cfg).summary
    folded = run_scenario(scenario_from_dict(d)).summary
    assert sym["step_time_s"] == folded["step_time_s"] and sym["straggler"] == folded["straggler"] == "pp_rank 1"


@pytest.mark.parametrize("folding,rc", [("symmetric", 2), ("classes", 0)])
def test_symmetric_folding_refuses_a_replica_override(capsys, tmp_path, folding, rc):
    import yaml

    from simulator.cli import main

    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump({**BASE, "run": {"steps": 2, "warmup_steps": 1, "rank_folding": folding}}))
    assert main(["run", str(p), "--json", "--set", "rank_overrides=[{dp_rank: 3, slowdown: 1.2}]"]) == rc
    err = capsys.readouterr().err.strip()
    if rc:
        assert err == (f"error: {p}: rank_overrides[0].dp_rank: a replica override breaks run.rank_folding symmetric "
                       "(every data-parallel replica identical) (allowed: pp_rank overrides, or run.rank_folding "
                       "classes or none) (from the command line: rank_overrides=...)")


def test_a_slowdown_only_replica_shares_its_stages_graph(monkeypatch):
    # a slowdown is read by the engine's cost model only: the slow replica's classes run the graph built for their
    # stage (PP builds, not 2 x PP); another GPU on the replica is built for that GPU
    import simulator.api as api

    built = []
    real = api.policy_graph
    monkeypatch.setattr(api, "policy_graph", lambda cfg, r, hw: built.append((r, hw.gpu.name)) or real(cfg, r, hw))
    slow = run_scenario(scenario_from_dict({**PIPE, "rank_overrides": [{"dp_rank": 2, "slowdown": 1.3}]})).summary
    assert len(slow["rank_classes"]) == 4 and sorted(r for r, _ in built) == [0, 1]
    built.clear()
    run_scenario(scenario_from_dict({**PIPE, "rank_overrides": [{"dp_rank": 2, "gpu": "a100-sxm4-80gb"}]}))
    assert sorted(built) == sorted([(0, "NVIDIA H100 SXM5 80GB"), (1, "NVIDIA H100 SXM5 80GB"),
                                    (0, "NVIDIA A100 SXM4 80GB"), (1, "NVIDIA A100 SXM4 80GB")])
