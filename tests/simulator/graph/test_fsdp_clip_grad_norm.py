"""PyTorch FSDP ``clip_grad_norm_`` (``_GptBuilder._fsdp_clip_grad_norm``, ``training.clip_grad`` with ``fsdp``):
the shard's norm (4 B per fp32 grad element), a 4-byte all-reduce over the FSDP process group, the clip
coefficient's ``mul_`` over every grad (8 B per element), no host sync; off by default with ``fsdp`` (PyTorch
clips only when the loop calls it). Bytes worked by hand on a tiny model."""
from __future__ import annotations

import copy

import pytest

from simulator.api import build_graph, run_scenario
from simulator.config.loader import scenario_from_dict
from simulator.graph.builders.sharding import ShardingSpec
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.ops import CostClass, OpKind

# L=2, h=64, a=4, f=256, s=16, V=1000, biases, learned positions: P = 165,120 (test_megatron_optimizer_kernels)
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1000, ffn_hidden_size=256,
            micro_batch_size=2, precision="amp_fp32_params", data_parallel_size=4)
P = 165_120
FSDP = ShardingSpec(strategy="full_shard", shard_size=4, param_bytes=4, sharded_param_bytes=4, grad_bytes=4)
NAMES = ("opt.fsdp.clip_grad.norm", "fsdp.clip_grad.total_norm.all_reduce", "opt.fsdp.clip_grad.mul")


def _ops(**kw):
    return build_gpt_step(TransformerSpec(**{**TINY, "sharding": FSDP, **kw})).ops


def test_bytes_group_and_order_by_hand():
    ops = _ops(clip_grad=1.0)
    by = {o.name: o for o in ops}
    norm, ar, mul = (by[n] for n in NAMES)
    n = P / 4  # this rank's shard of the flat parameters: 41,280 elements
    adam = next(o for o in ops if o.name.startswith("opt.adamw"))
    assert adam.bytes_read == pytest.approx(16 * n)  # the optimizer's share is the same shard
    assert (norm.cost_class, norm.bytes_read, norm.bytes_written) == (CostClass.REDUCTION, pytest.approx(4 * n), 4)
    assert (mul.cost_class, mul.bytes_read, mul.bytes_written) == (CostClass.ELEMENTWISE, pytest.approx(4 * n),
                                                                    pytest.approx(4 * n))
    assert ar.kind is OpKind.COLLECTIVE and ar.meta == {"collective": "all_reduce", "bytes": 4, "group": "dp"}
    assert norm.id in ar.deps and ar.id in mul.deps and mul.id in adam.deps
    # no .item(): FSDP keeps the clip coefficient on the device
    assert not any(o.kind is OpKind.SYNC and "clip" in o.name for o in ops)


def test_hybrid_shard_reduces_over_the_shard_group_and_zero_clips_nothing():
    hy = ShardingSpec(strategy="hybrid_shard", shard_size=2, replicate_size=2, param_bytes=4, sharded_param_bytes=4,
                      grad_bytes=4)
    ar = next(o for o in _ops(clip_grad=1.0, sharding=hy) if o.name.endswith("clip_grad.total_norm.all_reduce"))
    assert ar.meta["group"] == "dp_shard"
    assert not any("clip_grad" in o.name for o in _ops(clip_grad=0.0))


BASE = {
    "name": "fsdpclip",
    "hardware": {"gpu": "h100-sxm-80gb", "cluster": {"preset": "dgx-h100", "nodes": 1}, "launch_overhead_s": 0},
    "model": {"num_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "seq_length": 256, "vocab_size": 1024},
    "training": {"micro_batch_size": 2},
    "fsdp": {"sharding_strategy": "FULL_SHARD"},
    "run": {"steps": 3, "warmup_steps": 1},
}


def test_default_is_off_with_fsdp_and_the_value_turns_it_on():
    d = copy.deepcopy(BASE)
    assert not any("clip_grad" in o.name for o in build_graph(scenario_from_dict(d)).ops)
    d["training"]["clip_grad"] = 1.0
    names = [o.name for o in build_graph(scenario_from_dict(d)).ops]
    assert all(n in names for n in NAMES)


def test_step_grows_by_the_clip_kernels():
    d = copy.deepcopy(BASE)
    off = run_scenario(scenario_from_dict(d))
    d["training"]["clip_grad"] = 1.0
    on = run_scenario(scenario_from_dict(d))
    sp = on.spans[on.spans.step == 2]
    clip = sp[sp["name"].isin(NAMES)].duration_s.sum()
    assert clip > 0
    # no launch cost: the step grows by exactly the three ops' time (the optimizer waits for the mul_)
    grow = on.summary["step_time_s"] - off.summary["step_time_s"]
    assert grow == pytest.approx(clip, rel=1e-6)
