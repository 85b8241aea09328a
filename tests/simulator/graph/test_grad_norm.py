"""Gradient-norm work outside Megatron's optimizer (``simulator.graph.builders.grad_norm``): DeepSpeed ZeRO-1/2's
step (per-view fp64 norms, the 4-byte all-reduce over the data-parallel group, the fp32 copy of the partition and
the unscale ``mul_``; fp16's overflow check with its ``.item()``) and PyTorch's ``clip_grad_norm_`` (one foreach
norm, one foreach ``mul_``, no collective under DDP, no host sync). Bytes worked by hand on a tiny model."""
from __future__ import annotations

import copy

import pytest

from simulator.api import build_graph, run_scenario, run_warnings
from simulator.config.loader import resolve_hardware, scenario_from_dict
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.ops import CostClass, OpKind, Phase

# L=2, h=64, a=4, f=256, s=16, V=1000, biases, learned positions: P = 165,120 (test_megatron_optimizer_kernels)
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1000, ffn_hidden_size=256,
            micro_batch_size=2, precision="bf16", data_parallel_size=4)
P = 165_120
N = P // 4  # one rank's ZeRO partition: 41,280 elements
# model.parameters() order: wpe 1024, wte 64000, then per layer ln1.b, ln1.w 64, qkv.w 12288, qkv.b 192,
# proj.w 4096, proj.b 64, ln2.b, ln2.w 64, fc1.w 16384, fc1.b 256, fc2.w 16384, fc2.b 64; ln_f.b, ln_f.w 64.
# Partitions of 41,280: rank 0 = wpe + 40,256 of wte (2 views); rank 1 = the rest of wte .. 640 of L0.fc1.w (10);
# rank 2 = the rest of L0.fc1.w .. 8,704 of L1.qkv.w (7); rank 3 = the rest of L1.qkv.w (3,584) .. ln_f (12 views)
RANK3 = [3584, 192, 4096, 64, 64, 64, 16384, 256, 16384, 64, 64, 64]


def _opt(**kw):
    return [o for o in build_gpt_step(TransformerSpec(**{**TINY, **kw})).ops if o.phase == Phase.OPT]


def test_partition_views_by_hand():
    from simulator.graph.builders.grad_norm import zero_partition_pieces

    assert zero_partition_pieces([10, 5, 5], 2) == [5, 5]  # rank 0: the first tensor; rank 1: two views, kept
    assert zero_partition_pieces([10, 5, 5], 4) == [5]  # every rank one view: rank 0 (lowest) is kept
    assert zero_partition_pieces([3, 3, 3, 3], 2) == [3, 3]
    assert zero_partition_pieces([4, 4], 3) == [1, 2]  # size ceil(8 / 3) = 3: rank 1 takes [3, 6)
    with pytest.raises(ValueError):
        zero_partition_pieces([1], 0)


def test_zero2_bf16_norm_copy_and_unscale_by_hand():
    ops = _opt(zero_stage=2)
    by = {o.name: o for o in ops}
    casts = [o for o in ops if o.name.endswith(".double")]
    norms = [o for o in ops if o.name.endswith(".vector_norm")]
    assert [c.bytes_read / 2 for c in casts] == RANK3 and sum(RANK3) == N
    assert all(c.cost_class is CostClass.CAST and c.bytes_written == 4 * c.bytes_read for c in casts)
    assert [(n.cost_class, n.bytes_read, n.bytes_written) for n in norms] == [
        (CostClass.REDUCTION, 8 * m, 8) for m in RANK3]
    ar = by["zero.grad_norm.all_reduce"]
    assert ar.kind is OpKind.COLLECTIVE and ar.meta == {"collective": "all_reduce", "bytes": 4, "group": "dp"}
    assert set(n.id for n in norms) <= set(ar.deps)
    flat, cast, mul = (by[f"opt.zero.{n}"] for n in ("grad_partition.flatten", "grad_partition.to_fp32",
                                                     "unscale_and_clip_grads.mul"))
    assert (flat.bytes_read, flat.bytes_written) == (2 * N, 2 * N) and ar.id in flat.deps
    assert (cast.cost_class, cast.bytes_read, cast.bytes_written) == (CostClass.CAST, 2 * N, 4 * N)
    assert (mul.cost_class, mul.bytes_read, mul.bytes_written) == (CostClass.ELEMENTWISE, 4 * N, 4 * N)
    adam = by["opt.adamw"]
    assert mul.id in adam.deps and adam.bytes_read == 16 * N
    # 36 B per partition element before the AdamW: 18 (norm) + 10 (fp32 copy) + 8 (mul_); bf16: no overflow check
    moved = sum(o.bytes_read + o.bytes_written for o in ops if o.kind is OpKind.COMPUTE and o.name != "opt.adamw")
    assert moved == 36 * N + 8 * len(RANK3)
    assert not any(o.kind is OpKind.SYNC for o in ops) and "opt.loss_scale.unscale_check" not in by


def test_zero_gradient_clipping_zero_runs_the_same_kernels():
    """DeepSpeed computes the norm whatever gradient_clipping (logged as _global_grad_norm) and runs the mul_ by
    1 / loss_scale even unclipped."""
    names = [o.name for o in _opt(zero_stage=1, clip_grad=1.0)]
    assert names == [o.name for o in _opt(zero_stage=1, clip_grad=0.0)]
    assert "opt.zero.unscale_and_clip_grads.mul" in names and "opt.zero.grad_norm.11.vector_norm" in names


def test_zero1_fp16_overflow_check_and_item_by_hand():
    ops = _opt(zero_stage=1, precision="fp16")
    chk = [o for o in ops if ".has_inf_or_nan." in o.name]
    assert len(chk) == 6 * len(RANK3)  # float, isnan, isinf, logical_or, float, max per view
    # 28 B per 16-bit element: 2+4, 4+1, 4+1, 2+1, 1+4, 4 (and a 4-byte max per view)
    assert sum(o.bytes_read + o.bytes_written for o in chk) == 28 * N + 4 * len(RANK3)
    by = {o.name: o for o in ops}
    ar, item = by["zero.overflow.all_reduce"], by["zero.overflow.item"]
    assert ar.meta == {"collective": "all_reduce", "bytes": 1, "group": "dp"} and ar.id in item.deps
    assert item.kind is OpKind.SYNC and all(item.id in o.deps for o in ops if o.name.endswith(".double"))
    assert "opt.loss_scale.unscale_check" not in by and "loss_scale.found_inf.item" not in by


def test_zero_with_pipeline_reduces_the_norm_over_the_stages_too():
    ops = _opt(zero_stage=2, precision="bf16", pipeline_parallel_size=2)
    by = {o.name: o for o in ops}
    pp = by["pp.zero.grad_norm.all_reduce"]
    assert pp.meta["rendezvous"] == ("pp", "zero.grad_norm") and by["zero.grad_norm.all_reduce"].id in pp.deps
    assert pp.id in by["opt.zero.grad_partition.flatten"].deps
    assert "pp.grad_norm.all_reduce" not in by  # the stage sync is DeepSpeed's model-parallel all-reduce
    # ... which runs unclipped too: the stages still meet before the optimizer with bf16 and clip_grad 0
    assert TransformerSpec(**TINY, zero_stage=1, clip_grad=0.0, pipeline_parallel_size=2).pipeline_step_end_sync
    assert "pp.zero.grad_norm.all_reduce" in [o.name for o in _opt(zero_stage=1, clip_grad=0.0,
                                                                    pipeline_parallel_size=2)]


def test_torch_clip_grad_norm_by_hand():
    spec = dict(precision="amp_fp32_params", clip_grad=1.0, clip_grad_norm_call=True)
    for dp in (1, 4):  # DDP: the gradients are already all-reduced, no collective
        ops = _opt(**spec, data_parallel_size=dp)
        by = {o.name: o for o in ops}
        norm, mul = by["opt.clip_grad.foreach.norm"], by["opt.clip_grad.foreach.mul"]
        assert (norm.cost_class, norm.bytes_read, norm.bytes_written) == (CostClass.REDUCTION, 4 * P, 4)
        assert (mul.cost_class, mul.bytes_read, mul.bytes_written) == (CostClass.ELEMENTWISE, 4 * P, 4 * P)
        assert norm.id in mul.deps and mul.id in by["opt.adamw"].deps
        assert not any(o.kind in (OpKind.SYNC, OpKind.COLLECTIVE) and "clip" in o.name for o in ops)
    assert not any("clip_grad" in o.name for o in _opt(**{**spec, "clip_grad_norm_call": False}))
    ops = _opt(**spec, pipeline_parallel_size=2)  # the local norm, its all-reduce over the stages, the mul_
    by = {o.name: o for o in ops}
    pp = by["pp.clip_grad.total_norm.all_reduce"]
    assert by["opt.clip_grad.foreach.norm"].id in pp.deps and pp.id in by["opt.clip_grad.foreach.mul"].deps
    assert "pp.grad_norm.all_reduce" not in by


BASE = {
    "name": "gradnorm",
    "hardware": {"gpu": "h100-sxm-80gb", "cluster": {"preset": "dgx-h100", "nodes": 1}, "launch_overhead_s": 0},
    "model": {"num_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "seq_length": 256, "vocab_size": 1024},
    "training": {"micro_batch_size": 2},
    "run": {"steps": 3, "warmup_steps": 1},
}


def _warns(d):
    cfg = scenario_from_dict(d)
    return [w for w in run_warnings(resolve_hardware(cfg), cfg) if "norm" in w]


def test_torch_clip_follows_the_given_value_and_grows_the_step():
    d = copy.deepcopy(BASE)
    off = run_scenario(scenario_from_dict(d))  # not given: the loop is assumed not to clip
    assert not any("clip_grad" in o.name for o in build_graph(scenario_from_dict(d)).ops)
    d["training"]["clip_grad"] = 1.0
    on = run_scenario(scenario_from_dict(d))
    sp = on.spans[on.spans.step == 2]
    clip = sp[sp["name"].str.startswith("opt.clip_grad.foreach")].duration_s.sum()
    assert clip > 0
    assert on.summary["step_time_s"] - off.summary["step_time_s"] == pytest.approx(clip, rel=1e-6)
    assert _warns(d) == []


def test_priced_norms_are_no_longer_flagged():
    d = copy.deepcopy(BASE)
    d["training"]["precision"] = "bf16"
    d["zero_optimization"] = {"stage": 2}
    assert _warns(d) == []
    names = [o.name for o in build_graph(scenario_from_dict(d)).ops]
    assert "opt.zero.unscale_and_clip_grads.mul" in names
    d = copy.deepcopy(BASE)  # FSDP on one data-parallel rank: its clip_grad_norm_ is the local norm and mul_
    d["hardware"] = {"gpu": "h200-sxm-141gb"}
    d["fsdp"] = {"sharding_strategy": "FULL_SHARD"}
    d["parallelism"] = {"data_parallel_size": 1}
    d["training"]["clip_grad"] = 1.0
    assert _warns(d) == []
    assert "opt.clip_grad.foreach.mul" in [o.name for o in build_graph(scenario_from_dict(d)).ops]


def test_deepspeed_moe_expert_norm_is_flagged():
    """DeepSpeed's MoE parameter groups all-reduce their norm once more over the expert-data-parallel group
    (``_average_expert_grad_norms``): not modelled, so flagged (one line), and only under ZeRO-1/2."""
    d = copy.deepcopy(BASE)
    d["training"]["precision"] = "bf16"
    d["model"].update(num_experts=4, moe_router_topk=2, add_bias_linear=False)
    assert _warns(d) == []
    d["zero_optimization"] = {"stage": 2}
    w = _warns(d)
    assert len(w) == 1 and w[0].startswith("zero_optimization.stage 2 with model.num_experts")


@pytest.mark.parametrize("version,tp_reduce", [(1, False), (2, True)])
def test_fsdp2_clip_grad_norm_reduces_over_tp_too(version, tp_reduce):
    """FSDP with TP 2 (gpt_1p3b_dgx_h100_fsdp_tp2, dp 4), clip_grad 1.0: FSDP1's ``clip_grad_norm_`` all-reduces
    the 4-byte squared norm over its process group only; FSDP2's DTensor norm is ``Partial`` over the shard group
    and the TP group, so ``full_tensor()`` adds a 4-byte all-reduce over TP before the ``mul_``."""
    from simulator.config.loader import load_scenario
    from tests.conftest import ROOT

    fsdp = "fsdp={version: 2}" if version == 2 else "fsdp.sharding_strategy=FULL_SHARD"
    cfg = load_scenario(ROOT / "scenarios" / "cluster" / "gpt_1p3b_dgx_h100_fsdp_tp2.yaml",
                        ["run.steps=2", "run.warmup_steps=1", "training.clip_grad=1.0", fsdp])
    by = {o.name: o for o in build_graph(cfg).ops}
    dp = by["fsdp.clip_grad.total_norm.all_reduce"]
    assert dp.meta == {"collective": "all_reduce", "bytes": 4, "group": "dp"}
    tp = [o for n, o in by.items() if n.endswith("clip_grad.total_norm.all_reduce") and o is not dp]
    mul = by["opt.fsdp.clip_grad.mul"]
    if tp_reduce:
        assert len(tp) == 1 and tp[0].meta["bytes"] == 4 and tp[0].meta["group"] == "tp"
        assert dp.id in tp[0].deps and tp[0].id in mul.deps
    else:
        assert tp == [] and dp.id in mul.deps


# the TINY model's parameter tensors (model.parameters() order), each ZeRO-3-partitioned over dp 4 on its own
TENSORS = [1024, 64000] + [64, 64, 12288, 192, 4096, 64, 64, 64, 16384, 256, 16384, 64] * 2 + [64, 64]
Z3 = [-(-n // 4) for n in TENSORS]  # ceil(numel / 4): 256, 16000, 16, 16, 3072, 48, ... (every size a multiple of 4)


def _z3(**kw):
    from simulator.graph.builders.sharding import ShardingSpec

    return _opt(zero_stage=3, sharding=ShardingSpec("zero3", 4), **kw)


def test_zero3_partition_views_by_hand():
    from simulator.graph.builders.grad_norm import zero3_partition_pieces

    assert zero3_partition_pieces([10, 5, 4], 4) == [3, 2, 1]
    assert sum(Z3) == N and sorted(zero3_partition_pieces(TENSORS, 4)) == sorted(Z3)
    with pytest.raises(ValueError):
        zero3_partition_pieces([1], 0)


def test_zero3_bf16_norm_copy_and_unscale_by_hand():
    """DeepSpeed ZeRO-3's step (stage3.py ``step``): per parameter partition ``g.double().norm(2)`` (2 + 8, then 8
    bytes per element; 8-byte result), the fp64 sum all-reduced over dp (8 bytes), then the flat copy of the
    41,280-element partition (2 + 2 B), its fp32 cast (2 + 4 B) and the unscale ``mul_`` (4 + 4 B), before the
    AdamW; bf16: no overflow check, no host sync. Before this change the step went straight to the AdamW."""
    ops = _z3()
    by = {o.name: o for o in ops}
    casts = [o for o in ops if o.name.endswith(".double")]
    norms = [o for o in ops if o.name.endswith(".vector_norm")]
    assert sorted(c.bytes_read / 2 for c in casts) == sorted(Z3) and len(casts) == 28
    assert all(c.cost_class is CostClass.CAST and c.bytes_written == 4 * c.bytes_read for c in casts)
    assert sorted((n.bytes_read, n.bytes_written) for n in norms) == sorted((8 * m, 8) for m in Z3)
    ar = by["zero.grad_norm.all_reduce"]
    assert ar.meta == {"collective": "all_reduce", "bytes": 8, "group": "dp"} and ar.dtype == "fp64"
    assert set(n.id for n in norms) <= set(ar.deps)
    flat, cast, mul = (by[f"opt.zero.{n}"] for n in ("grad_partition.flatten", "grad_partition.to_fp32",
                                                     "unscale_and_clip_grads.mul"))
    assert (flat.bytes_read, flat.bytes_written) == (2 * N, 2 * N) and ar.id in flat.deps
    assert (cast.bytes_read, cast.bytes_written) == (2 * N, 4 * N)
    assert (mul.bytes_read, mul.bytes_written) == (4 * N, 4 * N) and mul.id in by["opt.adamw"].deps
    moved = sum(o.bytes_read + o.bytes_written for o in ops if o.kind is OpKind.COMPUTE and o.name != "opt.adamw")
    assert moved == 18 * sum(Z3) + 8 * len(Z3) + 18 * N
    assert not any(o.kind is OpKind.SYNC for o in ops)
    assert [o.name for o in _z3(clip_grad=0.0)] == [o.name for o in ops]  # whatever gradient_clipping


@pytest.mark.parametrize("stage,nbytes,dtype", [(2, 4, "fp32"), (3, 8, "fp64")])
def test_zero_model_parallel_norm_all_reduce_bytes(stage, nbytes, dtype):
    """With TP 2 the norm's total goes over the model-parallel group after the data-parallel one: ZeRO-3's is the
    fp64 sum (8 B, stage3.py ``get_grad_norm_direct`` -> ``_model_parallel_all_reduce``), ZeRO-1/2's 4 B."""
    from simulator.graph.builders.sharding import ShardingSpec

    kw = dict(zero_stage=stage, tensor_parallel_size=2, data_parallel_size=2)
    if stage == 3:
        kw["sharding"] = ShardingSpec("zero3", 2)
    by = {o.name: o for o in build_gpt_step(TransformerSpec(**{**TINY, **kw})).ops}
    dp, mp = by["zero.grad_norm.all_reduce"], by["opt.tp.zero.grad_norm.all_reduce"]
    assert (dp.meta["bytes"], mp.meta["bytes"], mp.meta["group"]) == (nbytes, nbytes, "tp")
    assert mp.bytes_read == nbytes and mp.dtype == dtype and dp.id in mp.deps


def test_zero3_fp16_overflow_check_over_the_flat_partition_by_hand():
    """fp16: ``isinf(buf).any()`` and ``isnan(buf).any()`` over the 41,280-element flat 16-bit partition (2 + 1,
    1 + 1 byte each: 6 B per element, 4 launches), the 1-byte flag all-reduced over dp, then ``.item()``."""
    ops = _z3(precision="fp16")
    chk = [o for o in ops if ".has_inf_or_nan." in o.name]
    assert [(o.name.rsplit(".", 1)[-1], o.bytes_read, o.bytes_written) for o in chk] == [
        ("isinf", 2 * N, N), ("isinf_any", N, 1), ("isnan", 2 * N, N), ("isnan_any", N, 1)]
    by = {o.name: o for o in ops}
    ar, item = by["zero.overflow.all_reduce"], by["zero.overflow.item"]
    assert ar.meta == {"collective": "all_reduce", "bytes": 1, "group": "dp"} and ar.id in item.deps
    assert all(item.id in o.deps for o in ops if o.name.endswith(".double"))


def test_deepspeed_zero3_step_norm_is_priced_not_flagged():
    """ZeRO-3 without optimizer offload: its step's norm and unscale are built, so no longer flagged (the run
    grows by them); with offload_optimizer (the CPU path) still flagged."""
    d = copy.deepcopy(BASE)
    d["training"]["precision"] = "bf16"
    d["zero_optimization"] = {"stage": 3}
    assert _warns(d) == []
    assert "opt.zero.unscale_and_clip_grads.mul" in [o.name for o in build_graph(scenario_from_dict(d)).ops]
    d["zero_optimization"] = {"stage": 3, "offload_optimizer": {"device": "cpu"}}
    w = _warns(d)
    assert len(w) == 1 and w[0].startswith("zero_optimization.stage 3 with offload_optimizer")


def test_fsdp_clip_with_pipeline_stages_is_flagged():
    """FSDP with 2 pipeline stages and clip_grad 1.0: the norm's all-reduce over the stages is not built, so flagged
    in one line; with clip_grad 0 nothing is."""
    d = copy.deepcopy(BASE)
    d["fsdp"] = {"sharding_strategy": "FULL_SHARD"}
    d["training"].update(precision="amp_fp32_params", clip_grad=1.0, global_batch_size=8)
    d["parallelism"] = {"pipeline_model_parallel_size": 2}
    d["model"] = {**d["model"], "untie_embeddings_and_output_weights": True}
    w = _warns(d)
    assert len(w) == 1 and "over the pipeline stages" in w[0] and "pipeline_model_parallel_size 2" in w[0]
    d["training"]["clip_grad"] = 0.0
    assert _warns(d) == []
