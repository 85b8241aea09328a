"""Sequence parallelism under DeepSpeed's engine: Megatron-DeepSpeed all-reduces no sequence-parallel replicated
gradient (LayerNorms, row-parallel biases) over the TP group (microsoft/Megatron-DeepSpeed@00caa0e9
``megatron/training.py`` ``train_step``: Megatron's ``reduce_model_grads`` only ``if not args.deepspeed``; issues
#170, #223), whereas Megatron-LM's own optimizer does (``_allreduce_layernorm_grads``): the graph prices it for
Megatron only, and the run flags the DeepSpeed case."""
from __future__ import annotations

import pytest

from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step

# L=2, h=64, biases, tp 2 with sequence parallelism: per block 2 LayerNorms (2 x 128) + the two row-parallel biases
# (2 x 64) = 384 replicated parameters, 2 blocks = 768, + the final LayerNorm 128 on the last stage.
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1024, ffn_hidden_size=256,
            micro_batch_size=2, num_micro_batches=2, data_parallel_size=2, tensor_parallel_size=2,
            sequence_parallel=True)


def _sp_all_reduces(**kw):
    g = build_gpt_step(TransformerSpec(**{**TINY, **kw}))
    return [(o.meta["bytes"], o.dtype) for o in g.ops if "layernorm_grads.all_reduce" in o.name]


def test_megatron_all_reduces_the_replicated_grads_in_fp32():
    """Megatron-LM, bf16 (fp32 main_grad): one all-reduce of 4 B x (2 x 384 + 128) = 3584 bytes."""
    assert _sp_all_reduces(precision="bf16") == [(4 * (2 * 384 + 128), "fp32")]


@pytest.mark.parametrize("kw", [
    dict(precision="bf16", pipeline_parallel_size=2, deepspeed_bf16_optimizer=True),  # BF16_Optimizer
    dict(precision="fp16", deepspeed_fp16_optimizer=True),  # FP16_Optimizer
    dict(precision="bf16", zero_stage=1),  # ZeRO-1
], ids=["bf16_optimizer", "fp16_optimizer", "zero1"])
def test_deepspeed_engine_all_reduces_none(kw):
    """DeepSpeed's engine runs backward and the step: no TP all-reduce of the replicated gradients."""
    assert TransformerSpec(**{**TINY, **kw}).deepspeed_engine
    assert _sp_all_reduces(**kw) == []


def test_the_run_flags_it_for_deepspeed_only():
    """The configuration-level note: present for ZeRO-1 / FP16_Optimizer with tp 2 and sequence parallelism, absent
    for Megatron-LM's optimizer and without sequence parallelism."""
    from simulator.api import deepspeed_sp_grads_note
    from simulator.config.loader import load_scenario
    from tests.conftest import ROOT

    base = ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml"
    tp = ["parallelism.tensor_model_parallel_size=2", "parallelism.data_parallel_size=4", "training.precision=bf16"]
    sp = [*tp, "parallelism.sequence_parallel=true"]
    for extra, flagged in (([*sp, "zero_optimization={stage: 1}"], True), ([*sp, "zero_optimization={stage: 0}"], True),
                           (sp, False), ([*tp, "zero_optimization={stage: 1}"], False)):
        note = deepspeed_sp_grads_note(load_scenario(base, extra))
        assert (note is not None and "never all-reduces" in note) is flagged, extra
