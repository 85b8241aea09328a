"""``model.kv_channels`` (head dimension other than h / a) and ``model.window_size`` (sliding-window attention):
shapes, parameters and FLOPs worked out by hand, the Mistral-7B preset, bad input (one line, exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from simulator.api import model_num_parameters, transformer_spec
from simulator.cli import main
from simulator.config.loader import load_scenario
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from tests.conftest import ROOT

# L=2, h=64, a=4 heads of d=32 (a d = 128, twice h), g=2 K/V groups, s=16, b=2 (T = 32), f=128 SwiGLU, V=1000
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1000, ffn_hidden_size=128,
            micro_batch_size=2, tied_embeddings=False, bias=False, precision="bf16", swiglu=True,
            normalization="RMSNorm", position_embedding="rope", num_query_groups=2)
T = 32


def _spec(**kw) -> TransformerSpec:
    return TransformerSpec(**{**TINY, **kw})


def _ops(g, layer=0):
    return {o.name: o for o in g.ops if o.layer == layer}


def test_kv_channels_shapes_and_parameters_by_hand():
    s = _spec(kv_channels=32)
    assert (s.head_dim, s.attention_width, s.qkv_out_size) == (32, 128, 128 + 2 * 2 * 32)
    # per layer: qkv 64 x 256, proj 128 x 64, MLP 3 x 64 x 128, 2 RMSNorms; + embedding, head, final norm
    layer = 64 * 256 + 128 * 64 + 3 * 64 * 128 + 2 * 64
    assert s.num_parameters == 2 * layer + 2 * 1000 * 64 + 64
    g = build_gpt_step(s)
    assert sum(p.numel for p in g.param_groups) == s.num_parameters
    ops = _ops(g)
    assert ops["L0.fwd.qkv.gemm"].shape == (T, 256, 64)
    assert ops["L0.fwd.proj.gemm"].shape == (T, 64, 128)
    assert ops["L0.bwd.proj.dgrad"].shape == (T, 128, 64)
    att = ops["L0.fwd.attn"]
    assert att.flops == 4 * 2 * 4 * (16 * 16 / 2) * 32 and att.shape == (2 * 4, 16, 16, 32)
    assert att.allocs[0].nbytes == 2 * T * 128  # the attention output is a d wide
    assert ops["L0.fwd.rope"].bytes_written == 2 * T * (128 + 2 * 32)  # q and k
    # model FLOPs: 3 x s x (L x (2 (h (a d + 2 g d) + a d h + 3 h f) + 2 s a d) + 2 h V)
    per_token = 2 * (64 * 256 + 128 * 64 + 3 * 64 * 128) + 2 * 16 * 128
    assert s.model_flops_per_sample() == 3 * 16 * (2 * per_token + 2 * 64 * 1000)
    assert _spec(kv_channels=16).num_parameters == _spec().num_parameters  # a d = h: the default


def test_kv_channels_lifts_heads_dividing_hidden():
    with pytest.raises(ValueError, match="must divide hidden_size"):
        _spec(num_attention_heads=6, num_query_groups=None)
    s = _spec(num_attention_heads=6, num_query_groups=None, kv_channels=16)  # 6 heads x 16 = 96 on h = 64
    assert s.qkv_out_size == 3 * 96 and build_gpt_step(s).ops


@pytest.mark.parametrize("window,pairs", [(None, 128.0), (16, 128.0), (64, 128.0), (4, 56.0), (1, 15.5)])
def test_sliding_window_flops_by_hand(window, pairs):
    # s = 16: causal half square 16^2 / 2 = 128 pairs per head; window 4: 128 - (16 - 4)^2 / 2 = 4 (32 - 4) / 2 = 56
    s = _spec(window_size=window)
    assert s.attention_pairs == pairs
    ops = _ops(build_gpt_step(s))
    d = 16
    assert ops["L0.fwd.attn"].flops == 4 * 2 * 4 * pairs * d
    assert ops["L0.bwd.attn.dgrad"].flops == 2.5 * 4 * 2 * 4 * pairs * d
    full = _ops(build_gpt_step(_spec()))
    # flash attention reads q, k, v once either way: every key is inside some query's window
    assert ops["L0.fwd.attn"].bytes_read == full["L0.fwd.attn"].bytes_read
    per_token = 2 * (64 * (64 + 2 * 2 * 16) + 64 * 64 + 3 * 64 * 128) + 4 * 64 * pairs / 16
    assert s.model_flops_per_sample() == 3 * 16 * (2 * per_token + 2 * 64 * 1000)


def _scenario(tmp_path: Path, model: dict) -> Path:
    d = {"name": "w", "hardware": {"gpu": "h100-sxm-80gb"}, "model": model,
         "training": {"micro_batch_size": 1, "precision": "bf16"}, "run": {"steps": 2, "warmup_steps": 1}}
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def test_mistral_7b_preset_sliding_window(tmp_path):
    # 32 x (attention 41,943,040 + MLP 3 x 4096 x 14336 + norms 8,192) + 2 x 32000 x 4096 + 4096 (Mistral 7B: 7.24B)
    cfg = load_scenario(_scenario(tmp_path, {"from_hf": str(ROOT / "scenarios/models/mistral-7b.json"),
                                             "seq_length": 8192}))
    assert model_num_parameters(cfg) == 7_241_732_096
    s = transformer_spec(cfg)
    assert s.window_size == 4096 and s.attention_pairs == 4096 * (2 * 8192 - 4096) / 2
    assert s.attention_pairs / (8192**2 / 2) == 0.75


def test_head_dim_from_hf_becomes_kv_channels(tmp_path):
    # Mistral-Nemo-style: h 5120, 32 heads of 128 (a d = 4096), 8 K/V groups
    hf = {"model_type": "mistral", "hidden_size": 5120, "num_hidden_layers": 1, "num_attention_heads": 32,
          "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336, "vocab_size": 131072,
          "max_position_embeddings": 1024, "hidden_act": "silu", "sliding_window": None}
    (tmp_path / "config.json").write_text(yaml.safe_dump(hf))
    s = transformer_spec(load_scenario(_scenario(tmp_path, {"from_hf": "./config.json"})))
    assert (s.kv_channels, s.window_size, s.qkv_out_size) == (128, None, 4096 + 2 * 8 * 128)
    attn = 5120 * (4096 + 2048) + 4096 * 5120
    assert s.num_parameters == attn + 3 * 5120 * 14336 + 2 * 5120 + 2 * 131072 * 5120 + 5120


@pytest.mark.parametrize("model,expected", [({"window_size": 0}, "window_size"), ({"kv_channels": 0}, "kv_channels"),
                                            ({"window_size": True}, "window_size"),
                                            ({"num_attention_heads": 6}, "or set kv_channels")])
def test_bad_attention_input_one_line_exit_2(tmp_path, capsys, model, expected):
    base = {"num_layers": 1, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16, "vocab_size": 100}
    p = _scenario(tmp_path, {**base, **model})
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and expected in err and str(p) in err
