"""The GPT step builder: parameter count, FLOPs and memory structure."""

from __future__ import annotations

import pytest

from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.ops import CostClass, Phase

GPT_184M = dict(num_layers=12, hidden_size=1024, num_attention_heads=16, seq_length=1024, vocab_size=32768,
                ffn_hidden_size=4096)


def test_parameter_count_matches_measured_model():
    """tests/data/h200/measurements.json train.gpt_184m_b16.params = 185,759,744."""
    assert TransformerSpec(micro_batch_size=1, **GPT_184M).num_parameters == 185_759_744


def test_gemm_flops_are_3x_forward():
    g = build_gpt_step(TransformerSpec(micro_batch_size=2, **GPT_184M))
    fwd = sum(op.flops for op in g.ops if op.cost_class == CostClass.GEMM and op.phase == Phase.FWD)
    bwd = sum(op.flops for op in g.ops if op.cost_class == CostClass.GEMM and op.phase == Phase.BWD)
    assert bwd == pytest.approx(2 * fwd)
    T, h, f, V, L = 2048, 1024, 4096, 32768, 12
    assert fwd == pytest.approx(2 * T * (L * (4 * h * h + 2 * h * f) + h * V))


def test_full_recompute_adds_one_forward_of_the_blocks():
    base = build_gpt_step(TransformerSpec(micro_batch_size=2, **GPT_184M))
    ckpt = build_gpt_step(TransformerSpec(micro_batch_size=2, recompute="full", **GPT_184M))
    block_fwd = sum(op.flops for op in base.ops if op.phase == Phase.FWD and op.layer >= 0)
    assert ckpt.total("flops") - base.total("flops") == pytest.approx(block_fwd)
    assert ckpt.model_flops_per_step == base.model_flops_per_step  # MFU counts no recompute


def test_gradient_accumulation_repeats_micro_batches():
    one = build_gpt_step(TransformerSpec(micro_batch_size=2, **GPT_184M))
    two = build_gpt_step(TransformerSpec(micro_batch_size=2, num_micro_batches=2, **GPT_184M))
    assert two.samples_per_step == 2 * one.samples_per_step
    assert sum(op.phase == Phase.OPT for op in two.ops) == 1


@pytest.mark.parametrize("bad", [dict(num_attention_heads=7), dict(hidden_size=0), dict(precision="fp8")])
def test_invalid_specs(bad):
    with pytest.raises(ValueError):
        TransformerSpec(micro_batch_size=1, **{**GPT_184M, **bad})
