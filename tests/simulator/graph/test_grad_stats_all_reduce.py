"""Megatron's gradient-statistics all-reduces (``_GptBuilder._grad_stats_all_reduce``): the squared gradient norm
of clip_grad_norm and fp16's found-inf flag, 4 bytes each, over the model-parallel group (tp x pp) or, with the
distributed optimizer, over every rank (NVIDIA/Megatron-LM megatron/core/optimizer/clip_grads.py
``get_grad_norm_fp32``). Counts, bytes and groups worked by hand; the ranks of each group; a straggler that the
world all-reduce makes the other data-parallel ranks wait for."""
from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest

from simulator.api import build_graph, run_scenario
from simulator.config.loader import resolve_hardware, scenario_from_dict
from simulator.engine.system import System
from simulator.graph.builders.sharding import ShardingSpec
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step

TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1000, ffn_hidden_size=256,
            micro_batch_size=2, precision="bf16")
BASE = {
    "name": "gradstats",
    "hardware": {"gpu": "h100-sxm-80gb", "cluster": {"preset": "dgx-h100", "nodes": 1}},
    "model": {"num_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "seq_length": 256, "vocab_size": 1024},
    "training": {"micro_batch_size": 2, "global_batch_size": 16, "precision": "bf16"},
    "run": {"steps": 3, "warmup_steps": 1},
}


def _stats(g) -> list[tuple[str, str, int]]:
    """(name, group, bytes) of the step's 4-byte gradient-statistics all-reduces, in graph order."""
    return [(o.name, o.meta["group"], o.meta["bytes"]) for o in g.ops
            if o.meta and o.meta.get("collective") == "all_reduce" and ("clip_grad" in o.name or "found_inf" in o.name)]


def _scenario(**par):
    d = copy.deepcopy(BASE)
    d["parallelism"] = par
    return scenario_from_dict(d)


def test_one_rank_and_plain_data_parallel_reduce_nothing():
    # DDP: every replica holds the whole all-reduced gradient, the model-parallel group is the rank itself
    assert _stats(build_gpt_step(TransformerSpec(**TINY))) == []
    assert _stats(build_gpt_step(TransformerSpec(**TINY, data_parallel_size=4))) == []


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_tensor_parallel_reduces_over_the_tp_group(precision):
    g = build_gpt_step(TransformerSpec(**{**TINY, "precision": precision}, tensor_parallel_size=2))
    want = [("opt.tp.clip_grad.total_norm.all_reduce", "tp", 4)]
    if precision == "fp16":
        want.insert(0, ("opt.tp.loss_scale.found_inf.all_reduce", "tp", 4))
    assert _stats(g) == want
    ops = {o.name: o for o in g.ops}
    norm, ar, item = ops["opt.clip_grad.l2norm"], ops["opt.tp.clip_grad.total_norm.all_reduce"], \
        ops["clip_grad.total_norm.item"]
    assert norm.id in ar.deps and ar.id in item.deps and item.id in ops["opt.adamw"].deps
    assert _stats(build_gpt_step(TransformerSpec(**TINY, tensor_parallel_size=2, clip_grad=0.0))) == []


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_distributed_optimizer_reduces_over_the_world(precision):
    g = build_gpt_step(TransformerSpec(**{**TINY, "precision": precision}, data_parallel_size=4,
                                       sharding=ShardingSpec(strategy="distributed_optimizer", shard_size=4)))
    want = [("world.clip_grad.total_norm.all_reduce", "world", 4)]
    if precision == "fp16":
        want.insert(0, ("world.loss_scale.found_inf.all_reduce", "world", 4))
    assert _stats(g) == want
    ar = next(o for o in g.ops if o.name == "world.clip_grad.total_norm.all_reduce")
    assert ar.stream == "comm.world" and "rendezvous" not in ar.meta  # one stage: met by the DP classes only


def test_pipeline_with_tp_reduces_over_the_model_parallel_group():
    cfg = _scenario(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)  # dp 2
    for r in range(2):
        g = build_graph(cfg, r)
        assert _stats(g) == [("mp.clip_grad.total_norm.all_reduce", "mp", 4)]
        op = next(o for o in g.ops if o.name == "mp.clip_grad.total_norm.all_reduce")
        assert op.meta["rendezvous"] == ("mp", "clip_grad.total_norm") and op.meta["parties"] == 2
    dist = _scenario(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    dist = scenario_from_dict({**dist.model_dump(mode="json", exclude_none=True, exclude_unset=True),
                               "ddp": {"use_distributed_optimizer": True}})
    assert _stats(build_graph(dist, 1)) == [("world.clip_grad.total_norm.all_reduce", "world", 4)]


def test_group_ranks_by_hand():
    # 8 GPUs, tp 2, pp 2, dp 2 (tp-cp-dp-pp order): stage 0 holds ranks 0-3, stage 1 ranks 4-7; the
    # model-parallel group of rank 0 is its TP pair on both stages, (0, 1, 4, 5); of stage 1's rank 4 the same
    cfg = _scenario(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    hw = resolve_hardware(cfg)
    for r in range(2):
        here = SimpleNamespace(hw=hw.for_pipeline_rank(r))  # _group_of reads only the machine's groups
        op = next(o for o in build_graph(cfg, r).ops if o.name == "mp.clip_grad.total_norm.all_reduce")
        assert System._group_of(here, op) == (0, 1, 4, 5)
        world = dataclasses.replace(op, meta={**op.meta, "group": "world"})
        assert System._group_of(here, world) == tuple(range(8))


def test_world_all_reduce_makes_the_replicas_wait_for_a_straggler():
    # distributed optimizer over 8 replicas, dp_rank 3 runs every kernel 1.5x: after the gradient
    # reduce-scatter (which meets all of them) the straggler's own norm kernel is slower; the norm all-reduce
    # over the world makes every replica's AdamW wait for it (before: each went on after its own norm)
    d = copy.deepcopy(BASE)
    d["ddp"] = {"use_distributed_optimizer": True, "overlap_grad_reduce": False}
    d["rank_overrides"] = [{"dp_rank": 3, "slowdown": 1.5}]
    sp = run_scenario(scenario_from_dict(d)).spans
    sp = sp[sp.step == 1]
    classes = sorted(set(sp.rank_class))
    assert len(classes) == 2
    fast, slow = (sp[sp.rank_class == c] for c in classes)
    if fast[fast["name"] == "opt.clip_grad.l2norm"].duration_s.iloc[0] > \
            slow[slow["name"] == "opt.clip_grad.l2norm"].duration_s.iloc[0]:
        fast, slow = slow, fast
    slow_norm_end = slow[slow["name"] == "opt.clip_grad.l2norm"].end_s.iloc[0]
    fast_norm_end = fast[fast["name"] == "opt.clip_grad.l2norm"].end_s.iloc[0]
    assert fast_norm_end < slow_norm_end
    ar = fast[fast["name"] == "world.clip_grad.total_norm.all_reduce"]
    assert len(ar) == 1 and ar.start_s.iloc[0] >= slow_norm_end - 1e-12
    assert fast[fast["name"] == "opt.adamw"].start_s.iloc[0] > slow_norm_end
