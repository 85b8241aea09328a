"""Bytes each GPU puts on the wire per step over the data-parallel group (issue 11's hand checks): the builder's
collective messages times the nccl-tests bus factor (``hardware_models.collectives.bus_factor``: 2 (n - 1) / n for
an all-reduce, (n - 1) / n for a reduce-scatter or all-gather; Rajbhandari et al., SC20, section 7: DP and ZeRO-1/2
move 2 Psi, ZeRO-3 3 Psi). Tiny model of ``test_sharding``: 1 layer, h 8, f 32, V 16, s 4, biases, tied, P = 1048
parameters; n = 8 data-parallel ranks."""

from __future__ import annotations

import pytest

from hardware_models.collectives import bus_factor
from simulator.graph.builders.sharding import ShardingSpec
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.ops import OpKind

TINY = dict(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=4, vocab_size=16, ffn_hidden_size=32,
            micro_batch_size=1, data_parallel_size=8)
P, N = 1048, 8


def _wire(g, skip=()) -> float:
    """Bus bytes per GPU over ``dp``: message bytes x bus factor, summed (collectives named in ``skip`` left out)."""
    return sum(bus_factor(o.meta["collective"], N) * o.meta["bytes"] for o in g.ops
               if o.kind is OpKind.COLLECTIVE and o.meta.get("group") == "dp" and o.name not in skip)


def test_dp_all_reduce_is_2_n_minus_1_over_n_psi():
    """PyTorch DDP, fp32 gradients: one all-reduce of the 4 P gradient bytes: 2 x 7/8 x 4192 = 7336 bytes."""
    g = build_gpt_step(TransformerSpec(**TINY))
    assert _wire(g) == pytest.approx(2 * (N - 1) / N * 4 * P, rel=1e-12) == pytest.approx(7336, rel=1e-12)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_1_and_2_move_the_same_2_n_minus_1_over_n_psi(stage):
    """DeepSpeed ZeRO-1/2, fp32: a reduce-scatter of the 4 P gradient bytes (7/8 x 4192) and the all-gathers of the
    updated parameters, one per param group (weight decay 3712 + no weight decay 480 = 4192 bytes, 7/8 of it): the
    DP all-reduce's 7336 bytes, plus the step's 4-byte gradient-norm all-reduce (2 x 7/8 x 4 = 7 bytes)."""
    g = build_gpt_step(TransformerSpec(**TINY, zero_stage=stage))
    assert _wire(g, skip=("zero.grad_norm.all_reduce",)) == pytest.approx(2 * (N - 1) / N * 4 * P, rel=1e-12)
    assert _wire(g) == pytest.approx(7336 + 7, rel=1e-12)


def test_zero_3_moves_3_n_minus_1_over_n_psi():
    """ZeRO-3, bf16: the parameters all-gathered in forward and again in backward (2 P bytes each) and the
    gradients reduce-scattered (2 P): 3 x 7/8 x 2096 = 5502 bytes, plus the 8-byte fp64 norm all-reduce (14)."""
    sh = ShardingSpec("zero3", N, fwd_prefetch_depth=1, bwd_prefetch_depth=1, reshard_root=True,
                      persistence_threshold=0)
    g = build_gpt_step(TransformerSpec(**TINY, precision="bf16", zero_stage=3, sharding=sh))
    assert _wire(g, skip=("zero.grad_norm.all_reduce",)) == pytest.approx(3 * (N - 1) / N * 2 * P, rel=1e-12)
    assert _wire(g) == pytest.approx(5502 + 14, rel=1e-12)


def test_fsdp_full_shard_moves_3_n_minus_1_over_n_psi_but_the_root_gather():
    """FSDP FULL_SHARD, bf16 parameters and gradients: 3 x 7/8 x 2 P, less the root unit's backward all-gather
    (wte, wpe, ln_f: 176 parameters, 352 bytes), which FSDP does not reshard after forward:
    7/8 x (3 x 2096 - 352) = 5194 bytes."""
    sh = ShardingSpec("full_shard", N, 1, bwd_prefetch="pre", reshard_after_forward=True, param_bytes=2,
                      sharded_param_bytes=4, grad_bytes=2)
    g = build_gpt_step(TransformerSpec(**TINY, precision="amp_fp32_params", sharding=sh))
    assert _wire(g) == pytest.approx((N - 1) / N * (3 * 2 * P - 2 * 176), rel=1e-12) == pytest.approx(5194, rel=1e-12)
