"""Whom a step's idle time is blamed on, on hand-built spans where the answer is known exactly: a pipeline
stage waiting for a slower stage (not the host), a ZeRO parameter all-gather exposed after the optimizer
(data-parallel communication, not optimizer compute), and the summary lines built from them."""

from __future__ import annotations

import pandas as pd
import pytest

from simulator.analysis.results import BREAKDOWN_IDLE, BREAKDOWN_OPTIMIZER, BREAKDOWN_PIPELINE_WAIT, SimulationResult
from simulator.cli import _busy_line
from simulator.studies import search

STEPS = pd.DataFrame({"step": [0], "start_s": [0.0], "end_s": [10.0], "step_time_s": [10.0], "warmup": [False]})


def _spans(rows: list[tuple]) -> pd.DataFrame:
    """``(pp_rank, op_id, stream, kind, phase, start_s, end_s)`` rows -> a spans frame of step 0."""
    d = pd.DataFrame(rows, columns=["pp_rank", "op_id", "stream", "kind", "phase", "start_s", "end_s"])
    return d.assign(step=0, duration_s=d.end_s - d.start_s)


def _bd(result: SimulationResult) -> dict:
    return dict(result.breakdown().itertuples(index=False))


def test_pp2_stage_waiting_for_the_slow_last_stage_is_the_pipeline_not_the_host():
    # stage 0: fwd [0, 1]; its next kernel (backward) is launched at 1.2 (host gap 1.0-1.2) but waits for the
    # gradient from stage 1, whose recv runs [8.5, 9] (exposed pp comm); the backward then runs [9, 10].
    # stage 1 (the slow last stage): computes [0, 8.5] after a 0.5 host gap at the start, then sends.
    spans = _spans([(0, 1, "compute", "compute", "fwd", 0.0, 1.0),
                    (0, 2, "comm.pp.recv_next", "collective", "bwd", 8.5, 9.0),
                    (0, 3, "compute", "compute", "bwd", 9.0, 10.0),
                    (1, 1, "compute", "compute", "fwd", 0.5, 8.5),
                    (1, 2, "comm.pp.send_prev", "collective", "bwd", 8.5, 9.0)])
    launches = pd.DataFrame({"pp_rank": [0, 0, 0, 1, 1], "step": 0, "op_id": [1, 2, 3, 1, 2],
                             "start_s": [0.0, 0.9, 1.1, 0.4, 8.4], "end_s": [0.0, 1.0, 1.2, 0.5, 8.5]})
    b = _bd(SimulationResult({}, spans, pd.DataFrame(), STEPS, launches=launches))
    # the mean of the two stages' partitions of [0, 10]: stage 0 waits 1.2-8.5 = 7.3 for stage 1, host 0.2;
    # stage 1 has host 0.5 (before its first kernel) and 9-10 = 1.0 idle with nothing launched
    assert b[BREAKDOWN_PIPELINE_WAIT] == pytest.approx(7.3 / 2, abs=1e-12)
    assert b[BREAKDOWN_IDLE] == pytest.approx((0.2 + 1.5) / 2, abs=1e-12)
    assert b["exposed comm (pp)"] == pytest.approx(0.5, abs=1e-12)
    assert sum(b.values()) == pytest.approx(10.0, abs=1e-12)


def test_one_gpu_keeps_its_idle_as_host_gaps():
    # no pipeline: the same queued kernel waiting is not blamed on another stage (no such component)
    spans = _spans([(0, 1, "compute", "compute", "fwd", 0.0, 1.0), (0, 3, "compute", "compute", "bwd", 9.0, 10.0)])
    b = _bd(SimulationResult({}, spans.drop(columns="pp_rank"), pd.DataFrame(), STEPS))
    assert BREAKDOWN_PIPELINE_WAIT not in b and b[BREAKDOWN_IDLE] == pytest.approx(8.0, abs=1e-12)


def test_zero1_exposed_parameter_all_gather_is_dp_comm_not_optimizer():
    # Adam [6, 7] then the ZeRO-1 parameter all-gather [7, 10] with nothing else running: 1 s optimizer, 3 s dp
    spans = _spans([(0, 1, "compute", "compute", "bwd", 0.0, 6.0), (0, 2, "compute", "compute", "opt", 6.0, 7.0),
                    (0, 3, "comm.dp", "collective", "opt", 7.0, 10.0)]).drop(columns="pp_rank")
    b = _bd(SimulationResult({}, spans, pd.DataFrame(), STEPS))
    assert b[BREAKDOWN_OPTIMIZER] == pytest.approx(1.0, abs=1e-12)
    assert b["exposed comm (dp)"] == pytest.approx(3.0, abs=1e-12)
    row = {"step_time_s": 10.0, "pipeline_parallel_size": 1,
           **{f"breakdown_s.{k}": v for k, v in (("compute", 6.0), ("optimizer", 1.0), ("exposed_comm_dp", 3.0))}}
    assert search.bounds(row)["bound"] == "dp comm 30%"


def test_search_names_the_pipeline_wait_and_the_host_apart():
    row = {"step_time_s": 1.0, "pipeline_parallel_size": 2, "breakdown_s.compute": 0.5,
           "breakdown_s.pipeline_wait": 0.4, "breakdown_s.idle": 0.1}
    b = search.bounds(row)
    assert (b["pipeline_wait_share"], b["idle_share"], b["bound"]) == (0.4, 0.1, "pipeline bubble 40%")
    assert search.bounds({**row, "breakdown_s.pipeline_wait": 0.05, "breakdown_s.idle": 0.45})["bound"] == \
        "host-bound / idle 45%"


def _pipe_summary(busy: list[float], bubbles: list[float]) -> dict:
    low = min(bubbles)
    return {"step_time_s": 0.1, "utilisation": {"compute": busy[0]}, "peak_memory_pp_rank": 0,
            "pipeline_bubble_s": low,
            "pipeline": {"stages": [{"pp_rank": r, "step_time_s": 0.1, "gpu_busy": b, "pipeline_bubble_s": w,
                                     "pipeline_imbalance_s": w - low, "exposed_comm_s": 0.001}
                                    for r, (b, w) in enumerate(zip(busy, bubbles))]}}


def test_busy_line_of_a_pipeline_names_the_stage_and_blames_the_wait():
    # stage 0 (peak memory) 40 % busy, idles 60 ms: 59 ms waiting (bubble 9 + imbalance 50), 1 ms collectives
    line = _busy_line(_pipe_summary([0.40, 0.90], [0.059, 0.009]))[0]
    assert line.startswith("GPU busy            40 % of the step on stage 0 (the peak-memory stage); "
                           "stages 40-90 %, mean 65 %")
    assert ("waiting for the other stages 59.00 ms, collectives 1.00 ms; its 59.00 ms without compute or collectives "
            "= 9.00 ms of stage 1 (the least idle stage: the schedule's bubble) + imbalance 50.00 ms;") in line
    assert "stage 1 gates the step" in line and "host" not in line
    # with the stage's idle split (stage_idle_split): 20 ms waiting for stage 1, 39 ms host gaps -> the host
    s = _pipe_summary([0.40, 0.90], [0.059, 0.009])
    s["pipeline"]["stages"][0].update(pipeline_wait_s=0.020, host_idle_s=0.039)
    line = _busy_line(s)[0]
    assert line.endswith("(host-bound: stage 0 idles 60.00 ms/step, waiting for kernel launches or host work, "
                         "host-bound gaps 39.00 ms; for the other stages 20.00 ms)")
    # the peak-memory stage busy, another idle: the figure is named and the idle stage still explained
    s = _pipe_summary([0.97, 0.50], [0.002, 0.049])
    s["utilisation"]["compute"] = 0.97
    line = _busy_line(s)[0]
    assert "97 % of the step on stage 0" in line and "stage 1 idles 50.00 ms/step" in line


def test_busy_line_names_the_stage_of_every_figure():
    # three stages whose roles differ: stage 0 holds the peak memory (busy 95 %), stage 1 is the least busy (busy
    # 30 %: idles 0.7 x 100 = 70 ms, of which 62 ms waiting, 5 ms host gaps, 3 ms collectives: its 67 ms without
    # compute or collectives), stage 2 the least idle (busy 60 %, 7 ms without compute or collectives: the
    # schedule's bubble); stage 1's imbalance is 67 - 7 = 60 ms > 7 ms, so stage 2 gates the step
    s = _pipe_summary([0.95, 0.30, 0.60], [0.020, 0.067, 0.007])
    s["pipeline"]["stages"][1].update(pipeline_wait_s=0.062, host_idle_s=0.005, exposed_comm_s=0.003)
    line = _busy_line(s)[0]
    assert line.startswith("GPU busy            95 % of the step on stage 0 (the peak-memory stage); "
                           "stages 30-95 %, mean 62 %")
    assert ("(pipeline: stage 1 idles 70.00 ms/step: waiting for the other stages 62.00 ms, collectives 3.00 ms, "
            "host-bound gaps 5.00 ms; its 67.00 ms without compute or collectives = 7.00 ms of stage 2 (the least idle "
            "stage: the schedule's bubble) + imbalance 60.00 ms; stage 2 gates the step: balance the stages' work)") in line
    # the least busy stage is also the least idle one (its idle is mostly exposed communication): stage 1 idles
    # 40 ms, 10 without compute or collectives (stage 0: 30 ms, 29): its bubble is the schedule's, no other stage named
    s = _pipe_summary([0.70, 0.60], [0.029, 0.010])
    s["pipeline"]["stages"][1]["exposed_comm_s"] = 0.030
    line = _busy_line(s)[0]
    assert ("stage 1 idles 40.00 ms/step: waiting for the other stages 10.00 ms, collectives 30.00 ms; its 10.00 ms "
            "without compute or collectives is the schedule's bubble (it is the least idle stage); more micro-batches"
            ) in line and "stage 0" not in line.split("(pipeline:")[1]


def test_busy_line_names_the_rank_class_of_the_stage_figures():
    # data-parallel rank classes: a stage's figures are its first class's, and every stage named says so
    s = _pipe_summary([0.95, 0.30, 0.60], [0.020, 0.067, 0.007])
    for st in s["pipeline"]["stages"]:
        st["rank_class"] = "dp ranks (others)"
    line = _busy_line(s)[0]
    assert "on stage 0 / dp ranks (others) (the peak-memory stage)" in line
    assert "(pipeline: stage 1 / dp ranks (others) idles 70.00 ms/step" in line
    assert "= 7.00 ms of stage 2 / dp ranks (others) (the least idle stage" in line
    assert "stage 2 / dp ranks (others) gates the step" in line


def test_pipeline_summary_splits_each_stage_idle_by_the_breakdown_rule():
    from simulator.api import run_scenario
    from simulator.config.loader import scenario_from_dict
    cfg = scenario_from_dict({
        "name": "pp2", "hardware": {"gpu": "h100-sxm-80gb", "cluster": {"preset": "dgx-h100", "nodes": 1}},
        "model": {"num_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "seq_length": 256, "vocab_size": 1024},
        "training": {"micro_batch_size": 2, "global_batch_size": 16, "precision": "bf16"},
        "parallelism": {"pipeline_model_parallel_size": 2, "pipeline_layers_per_stage": [1, 3]},
        "run": {"steps": 2, "warmup_steps": 1}})
    r = run_scenario(cfg)
    stages = r.summary["pipeline"]["stages"]
    assert "pipeline_wait_s" not in r.summary and "host_idle_s" not in r.summary
    for st in stages:
        # the split never exceeds the stage's idle time (its bubble: compute and collectives idle)
        assert 0.0 <= st["pipeline_wait_s"] and 0.0 <= st["host_idle_s"]
        assert st["pipeline_wait_s"] + st["host_idle_s"] <= st["pipeline_bubble_s"] + 1e-12
    # the 1-layer stage 0 waits for the 3-layer stage 1 at least its imbalance (the time stage 1 is busier)
    assert stages[0]["pipeline_wait_s"] >= stages[0]["pipeline_imbalance_s"] > 0.0


def test_busy_line_blames_nvme_swaps_before_the_host():
    """ZeRO-Infinity: 1.0 s step, 10 % busy (0.9 s idle), swaps in flight 0.8 s: NVMe-bound, not host-bound; with the
    swaps in flight under half the idle time it stays host-bound."""
    s = {"utilisation": {"compute": 0.10}, "step_time_s": 1.0, "nvme_busy_s": 0.8, "nvme_bound_s": 0.75}
    assert _busy_line(s) == ["GPU busy            10 % of the step  (NVMe-bound: ZeRO-Infinity swaps are in flight "
                             "800.00 ms/step; the node's swaps alone on its drives take 750.00 ms)"]
    s["nvme_busy_s"] = 0.4
    assert "host-bound" in _busy_line(s)[0]


def test_busy_line_blames_the_offloaded_cpu_optimizer_before_the_host():
    """ZeRO-Offload: 0.5 s step, 20 % busy (0.4 s idle), CPU Adam 0.3 s: CPU-optimizer-bound; under half the idle
    time (0.1 s) it stays host-bound."""
    s = {"utilisation": {"compute": 0.20}, "step_time_s": 0.5, "offload_cpu_optimizer_s": 0.3}
    assert _busy_line(s) == ["GPU busy            20 % of the step  (CPU-optimizer-bound: the offloaded optimizer "
                             "step takes 300.00 ms/step on the host)"]
    s["offload_cpu_optimizer_s"] = 0.1
    assert "host-bound" in _busy_line(s)[0]
