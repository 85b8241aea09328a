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


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_bytes_per_kernel_by_hand(precision):
    ops = _ops(precision=precision)
    z, norm, copy, adam = (ops[n] for n in ("opt.megatron.zero_grad_buffer", "opt.clip_grad.l2norm",
                                             "opt.megatron.copy_main_to_model_params", "opt.adamw"))
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
