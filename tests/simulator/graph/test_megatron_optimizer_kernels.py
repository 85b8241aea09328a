"""Megatron-LM's optimizer-step kernels beside the fused AdamW (``_GptBuilder._megatron_optimizer``): the grad
buffer's memset, clip_grad_norm's l2-norm and the fp32 -> 16-bit parameter copy. Bytes worked by hand on a tiny
model; presence by precision, framework and ``clip_grad``; the step grows by exactly their priced time."""
from __future__ import annotations

import pytest

from simulator.api import simulate_graph
from simulator.cost.roofline import RooflineCostModel
from simulator.graph.builders.sharding import ShardingSpec
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.ops import CostClass, OpKind
from tests.conftest import make_hw

# L=2, h=64, a=4, f=256, s=16, V=1000, biases, learned positions: P = 1000*64 + 16*64 + 2*(4*64*64 + 2*64*256
# + 5*64 + 256 + 256) + 128 = 165,120 parameters (the final LayerNorm 128)
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1000, ffn_hidden_size=256,
            micro_batch_size=2, precision="bf16")
P = 165_120
NEW = ("opt.megatron.zero_grad_buffer", "opt.clip_grad.l2norm", "clip_grad.total_norm.item",
       "opt.megatron.copy_main_to_model_params")


def _ops(**kw) -> dict:
    return {o.name: o for o in build_gpt_step(TransformerSpec(**{**TINY, **kw})).ops}


def test_parameter_count_by_hand():
    assert TransformerSpec(**TINY).rank_num_parameters == P


@pytest.mark.parametrize("precision,fp32_grads", [("bf16", False), ("fp16", True)])
def test_bytes_per_kernel_by_hand(precision, fp32_grads):
    # bf16: Megatron forces --accumulate-allreduce-grads-in-fp32; fp16 with it: the fp32 buffer too
    ops = _ops(precision=precision, accumulate_allreduce_grads_in_fp32=fp32_grads)
    z, norm, copy, adam = (ops[n] for n in ("opt.megatron.zero_grad_buffer", "opt.clip_grad.l2norm",
                                             "opt.megatron.copy_main_to_model_params", "opt.adamw"))
    assert "opt.megatron.copy_model_grads_to_main_grads" not in ops  # .float() of an fp32 main_grad: no kernel
    assert (z.cost_class, z.bytes_read, z.bytes_written) == (CostClass.MEMSET, 0, 4 * P)  # fp32 main_grad: 660,480
    assert (norm.cost_class, norm.bytes_read, norm.bytes_written) == (CostClass.REDUCTION, 4 * P, 4)
    assert (copy.bytes_read, copy.bytes_written) == (4 * P, 2 * P)  # 660,480 -> 330,240
    assert (adam.bytes_read, adam.bytes_written) == (16 * P, 12 * P)  # no 16-bit write: the copy does it
    assert ops["clip_grad.total_norm.item"].kind is OpKind.SYNC
    # order: memset first of the step; norm -> .item() -> adamw -> copy
    first = min(ops.values(), key=lambda o: o.id)
    assert first.name == "opt.megatron.zero_grad_buffer"
    assert ops["clip_grad.total_norm.item"].id in adam.deps and norm.id in ops["clip_grad.total_norm.item"].deps
    assert adam.id in copy.deps


def test_fp16_grad_buffer_by_hand():
    # fp16 without --accumulate-allreduce-grads-in-fp32 (Megatron's default): the buffer is fp16, 2 B per param
    # (memset 330,240 B), each grad accumulation writes 2 B per element, and the step first casts the buffer into
    # fp32 main grads (read 2 P, write 4 P) that the unscale, the norm and the AdamW read
    ops = _ops(precision="fp16")
    z, cast = ops["opt.megatron.zero_grad_buffer"], ops["opt.megatron.copy_model_grads_to_main_grads"]
    assert z.bytes_written == 2 * P
    assert (cast.cost_class, cast.bytes_read, cast.bytes_written) == (CostClass.CAST, 2 * P, 4 * P)
    assert cast.allocs[0].nbytes == 4 * P
    chk, norm = ops["opt.loss_scale.unscale_check"], ops["opt.clip_grad.l2norm"]
    assert cast.id in chk.deps and (chk.bytes_read, norm.bytes_read) == (4 * P, 4 * P)
    assert ops["opt.adamw"].bytes_read == 16 * P
    accum = [o for o in ops.values() if o.name.endswith(".grad_accum")]
    assert accum
    fp32 = _ops(precision="fp16", accumulate_allreduce_grads_in_fp32=True)
    by_name = {o.name: o.bytes_written for o in accum}
    assert {n: fp32[n].bytes_written for n in by_name} == {n: 2 * b for n, b in by_name.items()}
    # data parallel: the bucket all-reduces move 2 B per parameter in fp16 (4 B in fp32)
    for flag, eb, dt in ((False, 2, "fp16"), (True, 4, "fp32")):
        dp = _ops(precision="fp16", data_parallel_size=2, accumulate_allreduce_grads_in_fp32=flag)
        ar = [o for o in dp.values() if o.meta and o.meta.get("group") == "dp"]
        assert sum(o.meta["bytes"] for o in ar) == eb * P and {o.dtype for o in ar} == {dt}


def test_distributed_optimizer_prices_the_shard_but_zeroes_the_whole_buffer():
    ops = _ops(data_parallel_size=4, sharding=ShardingSpec(strategy="distributed_optimizer", shard_size=4))
    share = ops["opt.adamw"].bytes_read / (16 * P)
    assert share < 1
    assert ops["opt.megatron.zero_grad_buffer"].bytes_written == 4 * P
    assert ops["opt.clip_grad.l2norm"].bytes_read == pytest.approx(4 * P * share)
    assert ops["opt.megatron.copy_main_to_model_params"].bytes_written == pytest.approx(2 * P * share)


def test_presence_by_clip_grad_and_precision():
    assert all(n in _ops() for n in NEW)
    no_clip = _ops(clip_grad=0.0)
    assert "opt.clip_grad.l2norm" not in no_clip and "clip_grad.total_norm.item" not in no_clip
    assert "opt.megatron.zero_grad_buffer" in no_clip and "opt.megatron.copy_main_to_model_params" in no_clip
    # PyTorch autocast / fp32 (torch DDP, FSDP): zero_grad(set_to_none=True), no Megatron kernels; the fused
    # AdamW writes the fp32 params only, as before
    for prec in ("amp_fp32_params", "fp32"):
        ops = _ops(precision=prec, **({"attention_backend": "unfused"} if prec == "fp32" else {}))
        assert not any(n in ops for n in NEW)
        assert ops["opt.adamw"].bytes_written == 12 * P
    # DeepSpeed ZeRO-1 bf16: its 16-bit copy stays folded into the adamw kernel, none of Megatron's kernels
    ds = _ops(data_parallel_size=2, zero_stage=1)
    assert not any(n in ds for n in NEW)


def test_step_grows_by_exactly_the_priced_kernels():
    hw = make_hw()
    cm = RooflineCostModel(hw.gpu, hw.profile)
    g_on, g_off = (build_gpt_step(TransformerSpec(**{**TINY, "clip_grad": c})) for c in (1.0, 0.0))
    t_on = simulate_graph(g_on, hw, steps=1).summary["step_time_s"]
    t_off = simulate_graph(g_off, hw, steps=1).summary["step_time_s"]
    norm = next(o for o in g_on.ops if o.name == "opt.clip_grad.l2norm")
    assert t_on - t_off == pytest.approx(cm.duration_s(norm), rel=1e-9)
    assert cm.duration_s(norm) == pytest.approx((4 * P + 4) / 1e12, rel=1e-9)  # toy: 1 TB/s, no fixed cost
    # the copy and the memset against the amp_fp32_params step of the same model are not comparable (other
    # kernels differ); against the adamw they replace: memset 4P + copy 6P - the adamw's 2P write
    z = next(o for o in g_off.ops if o.name == "opt.megatron.zero_grad_buffer")
    c = next(o for o in g_off.ops if o.name == "opt.megatron.copy_main_to_model_params")
    assert cm.duration_s(z) + cm.duration_s(c) == pytest.approx(10 * P / 1e12, rel=1e-9)


@pytest.mark.parametrize("extra,needle", [
    ({"training": {"precision": "bf16"}, "ddp": {"accumulate_allreduce_grads_in_fp32": False}}, "forces it on"),
    ({"training": {"precision": "amp_fp32_params"}, "ddp": {"accumulate_allreduce_grads_in_fp32": True}},
     "Megatron-LM's"),
])
def test_accumulate_flag_bad_input_is_one_line(tmp_path, extra, needle):
    import subprocess
    import sys

    import yaml
    d = {"name": "x", "hardware": {"gpu": "h100-sxm-80gb"},
         "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16, "vocab_size": 1000},
         "training": {"micro_batch_size": 2, **extra["training"]}, "ddp": extra["ddp"]}
    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump(d))
    r = subprocess.run([sys.executable, "-m", "simulator", "run", str(f)], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "ddp.accumulate_allreduce_grads_in_fp32" in err[0] and needle in err[0]


def test_fp16_buffer_halves_the_main_grad_reductions_outside_the_buckets():
    # sequence parallelism's LayerNorm / bias grads (TP all-reduce) and the tied embedding's (pipeline ends) are
    # main_grad reductions too: fp16 with the fp16 buffer, fp32 with --accumulate-allreduce-grads-in-fp32
    def ln(flag):
        ops = _ops(precision="fp16", tensor_parallel_size=2, sequence_parallel=True,
                   accumulate_allreduce_grads_in_fp32=flag)
        o = next(o for o in ops.values() if "layernorm_grads.all_reduce" in o.name)
        return o.meta["bytes"], o.dtype
    # 2 layers x (2 LN x 2h + 2 row-parallel biases x h) + the final LN 2h, h = 64: 2 x 384 + 128 = 896 elements
    assert ln(True) == (4 * 896, "fp32") and ln(False) == (2 * 896, "fp16")

    import copy

    from simulator.api import build_graph
    from simulator.config.loader import scenario_from_dict
    from tests.simulator.graph.test_pipeline_parallel import BASE
    for flag, eb in ((None, 2), (True, 4)):
        d = copy.deepcopy(BASE)
        d["training"]["precision"] = "fp16"
        if flag is not None:
            d["ddp"] = {"accumulate_allreduce_grads_in_fp32": flag}
        op = next(o for o in build_graph(scenario_from_dict(d), 0).ops if o.name == "pp.embedding_grads.all_reduce")
        assert op.meta["bytes"] == eb * 1024 * 512  # V 1024 x h 512 (tp 1: no vocabulary padding)
