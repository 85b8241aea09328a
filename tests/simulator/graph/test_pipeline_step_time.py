"""Pipeline step time vs step latency on built stage graphs: ``training.clip_grad`` (Megatron-LM ``--clip-grad``)
gates the cross-stage gradient-norm all-reduce; with it a GPU-bound pipeline's latency is its step time, the
period of the last stage's step ends (the iteration time Megatron-LM logs); without it (bf16, untied embeddings)
the last stage starts the next step early and the overlap is reported, the step time unchanged but for the sync."""

from __future__ import annotations

import copy

import pytest

from simulator.api import build_graph, run_scenario
from simulator.config.loader import scenario_from_dict
from tests.simulator.graph.test_pipeline_parallel import BASE

#: GPU-bound (h 2048, s 1024): the host launches ahead, the stages' optimizers differ by microseconds only
BIG = {"num_layers": 8, "hidden_size": 2048, "num_attention_heads": 16, "seq_length": 1024,
       "untie_embeddings_and_output_weights": True}


def _cfg(model=None, **training):
    d = copy.deepcopy(BASE)
    d["model"].update(model or {})
    d["training"].update(training)
    return scenario_from_dict(d)


def _names(cfg, r):
    return [op.name for op in build_graph(cfg, r).ops]


def test_clip_grad_gates_the_grad_norm_all_reduce():
    for r in range(4):
        names = _names(_cfg(), r)
        op = next(op for op in build_graph(_cfg(), r).ops if op.name == "pp.clip_grad.total_norm.all_reduce")
        assert op.meta["parties"] == 4 and op.meta["rendezvous"] == ("pp", "clip_grad.total_norm")
        # Megatron get_grad_norm_fp32: the local norm kernel, the all-reduce, then the host reads the norm
        assert (names.index("opt.clip_grad.l2norm") < names.index("pp.clip_grad.total_norm.all_reduce")
                < names.index("clip_grad.total_norm.item") < names.index("opt.adamw"))
        names = _names(_cfg(clip_grad=0.0), r)
        assert not any(n.startswith("pp.") and "all_reduce" in n and "embedding" not in n for n in names)
        # fp16: the found-inf all-reduce over the model-parallel group joins the stages before the host reads the
        # flag, with or without clipping (optimizer.py _unscale_main_grads_and_check_for_nan)
        for clip in (0.0, 1.0):
            names = _names(_cfg(clip_grad=clip, precision="fp16"), r)
            assert names.index("pp.loss_scale.found_inf.all_reduce") < names.index("loss_scale.found_inf.item")
            assert ("pp.clip_grad.total_norm.all_reduce" in names) == (clip > 0)


def test_synchronised_pipeline_latency_is_the_last_stage_period():
    r = run_scenario(_cfg(BIG))
    s, sp = r.summary, r.spans
    # the stages' step ends lie apart by their optimizer differences (the embedding and the head), but the next
    # step's first op (stage 0's input copy) follows the last end: no overlap. Before: the latency counted from a
    # middle stage's loop start, which only waits in a receive, and read step time + that spread
    assert 0 < s["pipeline"]["step_end_spread_s"] < 1e-4
    assert s["step_latency_s"] == s["step_time_s"] and s["pipeline"]["step_overlap_s"] == 0.0
    ends = sp[sp.pp_rank == 3].groupby("step").end_s.max().to_numpy()
    assert s["step_time_s"] == pytest.approx((ends[2] - ends[0]) / 2, rel=1e-12)


def test_without_the_sync_the_last_stage_starts_early_and_is_reported():
    synced, free = (run_scenario(_cfg(BIG, **kw)) for kw in ({}, {"clip_grad": 0.0}))
    a, b = synced.summary, free.summary
    # 1F1B: the last stage ends its backward m + p - 1 slots before stage 0 and loads its next inputs at once
    assert b["pipeline"]["step_overlap_s"] > 0.1 * b["step_time_s"]
    assert b["step_latency_s"] == pytest.approx(b["step_time_s"] + b["pipeline"]["step_overlap_s"], rel=1e-12)
    first = free.spans[free.spans.step == 2].sort_values("start_s").iloc[0]
    # (Megatron's zero_grad_buffer memset opens each step, then the input copy)
    assert first.pp_rank == 3 and first["name"] == "opt.megatron.zero_grad_buffer"
    nxt = free.spans[(free.spans.step == 2) & (free.spans.pp_rank == 3)].sort_values("start_s").iloc[1]
    assert nxt["name"] == "fwd.input.h2d"
    # the period is still stage 0's cycle: clip_grad cost stage 0 its norm kernel (Megatron clip_grad_norm, 0.15
    # ms), the 4-byte all-reduce (about 10 us of 36 ms) and total_norm.item()'s host sync, after which the host
    # launches the optimizer and the next kernels with the GPU idle (about 0.8 ms on this launch-bound model)
    sp = synced.spans
    norm = sp[(sp.step == 2) & (sp.pp_rank == 0) & (sp["name"] == "opt.clip_grad.l2norm")].duration_s.sum()
    assert norm > 0
    assert 0 < a["step_time_s"] - b["step_time_s"] - norm < 3e-2 * a["step_time_s"]


def test_deepspeed_pipeline_step_end_is_flagged():
    d = copy.deepcopy(BASE)
    d["zero_optimization"] = {"stage": 1}
    ws = run_scenario(scenario_from_dict(d)).summary["warnings"]
    assert any("loss broadcast from the last stage" in w and "_aggregate_total_loss" in w for w in ws)
    assert not any("loss broadcast" in w for w in run_scenario(_cfg()).summary["warnings"])
