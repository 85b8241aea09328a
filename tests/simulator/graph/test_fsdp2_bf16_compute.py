"""FSDP2 (``fsdp.version: 2``) gathering bf16 parameters (``MixedPrecisionPolicy(param_dtype=bfloat16)``, torchtitan's
default ``mixed_precision_param = "bfloat16"``) runs without autocast: torchtitan's ``maybe_enable_amp`` enters none
when FSDP is on, and fully_shard casts only at module boundaries, so the residual stream, the norms and every saved
activation are bf16 and no Linear casts its input (``TransformerSpec.fsdp2_bf16_params``). FSDP1 (llm-foundry /
Composer's autocast) keeps the fp32 residual stream. Worked out by hand on a one-block model over one DGX H100."""

from __future__ import annotations

import pytest

from simulator.api import build_graph
from simulator.config.loader import scenario_from_dict
from simulator.graph.ops import OpKind, Phase

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# 1 block, h 8, f 32, V 16, s 4, b 1, 2 heads (GPT-2 style: LayerNorm, learned positions, biases, flash attention):
# T = 4 tokens, T h = 32 elements
T, H, F = 4, 8, 32
BASE = {
    "name": "fsdp2-bf16",
    "hardware": {"gpu": "h100-sxm-80gb", "host": "dgx-h100-host", "cluster": {"preset": "dgx-h100", "nodes": 1}},
    "model": {"num_layers": 1, "hidden_size": H, "num_attention_heads": 2, "seq_length": T, "vocab_size": 16,
              "ffn_hidden_size": F},
    "training": {"micro_batch_size": 1, "precision": "amp_fp32_params"},
    "parallelism": {},
    "fsdp": {"version": 2, "mixed_precision": "DEFAULT"},
    "run": {"steps": 2, "warmup_steps": 1},
}


def _graph(version=2):
    return build_graph(scenario_from_dict({**BASE, "fsdp": {**BASE["fsdp"], "version": version}}))


def _op(g, name):
    return next(o for o in g.ops if o.name == name)


def _saved_block_bytes(g) -> int:
    bwd_uses = {u for op in g.ops if op.phase == Phase.BWD for u in op.uses}
    return sum(t.nbytes for op in g.ops if op.phase == Phase.FWD and op.layer == 0 and op.kind is OpKind.COMPUTE
               for t in op.allocs if t.name in bwd_uses)


def test_residual_add_and_norm_bytes_by_hand():
    """The residual add reads the bf16 stream and the bf16 proj output, 2 x 32 + 2 x 32 = 128 B, and writes 64 B
    (autocast: the fp32 stream, 4 x 32 + 2 x 32 = 192 B read, 128 written); the LayerNorm reads and writes 2 x 32 B
    (its fp32 mean and rstd, 8 B x 4 tokens, beside them), its backward reads the bf16 gradient and input, 128 B, and
    writes 64 B; no cast kernels (autocast's qkv / fc1 / lm_head ``cast_in`` and the ``cast_grad`` of proj, fc2 and
    the norms are gone)."""
    g = _graph()
    r1 = _op(g, "L0.fwd.residual1")
    assert (r1.bytes_read, r1.bytes_written) == (2 * 32 + 2 * 32, 2 * 32) == (128, 64)
    ln2 = _op(g, "L0.fwd.ln2")
    assert (ln2.bytes_read, ln2.bytes_written) == (64, 64)
    assert sorted(t.nbytes for t in ln2.allocs) == [8 * T, 2 * T * H]
    d = _op(g, "L0.bwd.ln2.dgrad")
    assert (d.bytes_read, d.bytes_written) == (2 * 2 * 32, 2 * 32)
    assert not any(".cast_in" in o.name or ".cast_grad" in o.name for o in g.ops)
    # the loss still upcasts the bf16 logits (torchtitan cross_entropy_loss: pred.float()): [4, 16] 2 B -> 4 B
    lf = _op(g, "fwd.logits.float")
    assert (lf.bytes_read, lf.bytes_written) == (2 * 64, 4 * 64)


def test_saved_activations_by_hand():
    """Block 0's tensors saved for backward: the two LayerNorm outputs (the QKV and fc1 inputs) 2 x 64 B and their
    statistics 2 x 32, QKV's output 2 x 4 x 24 = 192, the flash output 64, its fp32 log-sum-exp 4 x 2 heads x 4 = 32
    and its contiguous copy 64, the two residual sums 2 x 64, fc1's output and GELU's 2 x 2 x 4 x 32 = 512: 1,184 B.
    Autocast saved 1,312 B: the same with the two residual sums in fp32 (+128) and the casts' bf16 copies of the norm
    outputs in place of the outputs."""
    assert _saved_block_bytes(_graph()) == 128 + 64 + 192 + 64 + 32 + 64 + 128 + 512 == 1184


def test_fsdp1_keeps_autocast():
    """FSDP1 (FullyShardedDataParallel under autocast, llm-foundry / Composer): the fp32 residual stream (192 B read,
    128 written), the norms in fp32 and a cast before QKV; 1,312 B saved."""
    g = _graph(version=1)
    r1 = _op(g, "L0.fwd.residual1")
    assert (r1.bytes_read, r1.bytes_written) == (4 * 32 + 2 * 32, 4 * 32)
    c = _op(g, "L0.fwd.qkv.cast_in")
    assert (c.bytes_read, c.bytes_written) == (4 * 32, 2 * 32)
    assert _saved_block_bytes(g) == 1312
