"""``attention_backend: flash_varlen``: flash attention between flash-attn's ``bert_padding`` unpad / pad helpers
(llm-foundry's MPT ``flash_attn_fn``); the kernels worked out by hand on a tiny model, and bad input."""

from __future__ import annotations

import pytest

from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.ops import Phase
from tests.conftest import refused_in_one_line

# T = 2 x 4 = 8 tokens, h = 8, 4 heads: q, k, v each 8 columns; 2-byte elements
TINY = dict(num_layers=1, hidden_size=8, num_attention_heads=4, seq_length=4, vocab_size=16, ffn_hidden_size=32,
            micro_batch_size=2)
T, H = 8, 8


def _ops(**kw):
    g = build_gpt_step(TransformerSpec(**{**TINY, **kw}))
    return g, {op.name: op for op in g.ops}


def test_varlen_kernels_by_hand():
    """Forward: three gathers of 2 T h bytes each way, a 2 T h zero-fill and the row put (2 T h each way), no
    transpose; backward: the pad's gather, three zero-fills and scatters, the QKV cat (2 T 3h each way)."""
    _, ops = _ops(attention_backend="flash_varlen")
    n = 2 * T * H
    def rw(name):
        return ops[name].bytes_read, ops[name].bytes_written
    for part in "qkv":
        assert rw(f"L0.fwd.attn.unpad_{part}") == (n, n)
        assert rw(f"L0.bwd.attn.unpad_{part}.dgrad.zeros") == (0, n)
        assert rw(f"L0.bwd.attn.unpad_{part}.dgrad") == (n, n)
    assert ops["L0.fwd.attn.pad.zeros"].bytes_written == n
    assert (ops["L0.fwd.attn.pad"].bytes_read, ops["L0.fwd.attn.pad"].bytes_written) == (n, n)
    assert (ops["L0.bwd.attn.pad.dgrad"].bytes_read, ops["L0.bwd.attn.pad.dgrad"].bytes_written) == (n, n)
    assert (ops["L0.bwd.attn.split.dgrad"].bytes_read, ops["L0.bwd.attn.split.dgrad"].bytes_written) == (3 * n, 3 * n)
    assert not any("attn.transpose" in k for k in ops)


def test_varlen_moves_52_bytes_per_token_and_column_more_than_flash_minus_the_transposes():
    """Per layer: forward 3 x 4 + 2 + 4 = 18, backward 4 + 3 x (2 + 4) + 12 = 34 bytes per token and column of h;
    flash's two transposes move 2 x 4."""
    def copies(backend):
        g, _ = _ops(attention_backend=backend)
        return sum(op.bytes_read + op.bytes_written for op in g.ops if op.layer == 0 and ".attn." in op.name
                   and not op.name.endswith((".attn", ".attn.dgrad")))
    assert copies("flash_varlen") == 52 * T * H
    assert copies("flash") == 8 * T * H


def test_varlen_saves_the_gathered_qkv_in_place_of_the_fused_output():
    """The same bytes saved for backward as flash: the attention's saved input is the gathered q, k, v (2 T 3h
    bytes) instead of the fused QKV output."""
    def saved(backend):
        g, ops = _ops(attention_backend=backend)
        bwd_uses = {u for op in g.ops if op.phase == Phase.BWD for u in op.uses}
        return ops, sum(t.nbytes for op in g.ops if op.phase == Phase.FWD and op.layer == 0 for t in op.allocs
                        if t.name in bwd_uses)
    ops, var = saved("flash_varlen")
    assert any(u.startswith("attn.qkv_unpad") for u in ops["L0.fwd.attn"].uses)
    assert any(u.startswith("attn.qkv_unpad") for u in ops["L0.bwd.attn.dgrad"].uses)
    assert var == saved("flash")[1]


BASE = {
    "name": "varlen",
    "hardware": {"gpu": "h100-sxm-80gb"},
    "model": {"num_layers": 2, "hidden_size": 512, "num_attention_heads": 8, "seq_length": 512, "vocab_size": 1000,
              "attention_backend": "flash_varlen"},
    "training": {"micro_batch_size": 1, "precision": "bf16"},
    "run": {"steps": 2, "warmup_steps": 1},
}


@pytest.mark.parametrize("change,needle", [
    ({"model": {**BASE["model"], "position_embedding_type": "rope"}},
     "attention_backend: flash_varlen with position_embedding_type rope is not modelled"),
    ({"parallelism": {"context_parallel_size": 2},
      "hardware": {"gpu": "h100-sxm-80gb", "cluster": {"preset": "dgx-h100"}}},
     "> 1 with model.attention_backend flash_varlen is not modelled"),
])
def test_bad_input_one_line_exit_2(tmp_path, capsys, change, needle):
    err = refused_in_one_line(tmp_path, capsys, {**BASE, **change})
    assert needle in err, err


def test_builder_refuses_rope():
    with pytest.raises(ValueError, match="flash_varlen with rotary positions is not modelled"):
        build_gpt_step(TransformerSpec(**{**TINY, "attention_backend": "flash_varlen", "position_embedding": "rope"}))
