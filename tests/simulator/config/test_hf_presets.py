"""Model presets in scenarios/models: num_parameters equals the published count, and a hand formula.

Formulas (per layer, whole model, no tensor parallelism):
* Llama / Qwen2 (GQA, SwiGLU, RMSNorm, no position table): ``2 h^2 + 2 h g d + 3 h f + 2 h`` (+ ``h + 2 g d``
  QKV bias for Qwen2); plus ``V h`` embedding, ``V h`` untied head, ``h`` final RMSNorm.
* GPT-2 format (GPT-3 175B): ``12 h^2 + 13 h`` (QKV ``3h^2 + 3h``, projection ``h^2 + h``, MLP ``8 h^2 + 5 h``,
  two LayerNorms ``4 h``); plus ``V h`` (tied), ``n_ctx h`` learned positions, ``2 h`` final LayerNorm.
* MPT (no_bias, ALiBi): ``12 h^2 + 2 h`` (bias-free QKV, projection, 4h MLP, two weight-only LayerNorms); plus
  ``V h`` (tied), no position table, ``h`` final norm.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from simulator.api import transformer_spec
from simulator.cli import main
from simulator.config.hf_config import read_hf_config
from simulator.config.loader import load_scenario
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from tests.conftest import ROOT

BASE = yaml.safe_load((ROOT / "scenarios/h200/gpt_184m_b8.yaml").read_text())
MODELS = ROOT / "scenarios/models"


def scenario(tmp_path: Path, model: dict, hf: dict | None = None) -> Path:
    if hf is not None:
        (tmp_path / "config.json").write_text(json.dumps(hf))
    d = {**BASE, "model": model, "training": {**BASE["training"], "precision": "bf16"}}
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def llama_count(L: int, h: int, a: int, g: int, f: int, V: int, qkv_bias: bool = False) -> int:
    d = h // a
    layer = 2 * h * h + 2 * h * g * d + 3 * h * f + 2 * h + ((h + 2 * g * d) if qkv_bias else 0)
    return L * layer + 2 * V * h + h


def gpt2_count(L: int, h: int, V: int, n_ctx: int) -> int:
    return L * (12 * h * h + 13 * h) + V * h + n_ctx * h + 2 * h


def mpt_count(L: int, h: int, V: int) -> int:
    return L * (12 * h * h + 2 * h) + V * h + h


PRESETS = [  # file, published count, hand formula
    ("llama-3.1-70b", 70_553_706_496, llama_count(80, 8192, 64, 8, 28672, 128256)),
    ("llama-3.1-405b", 405_853_388_800, llama_count(126, 16384, 128, 8, 53248, 128256)),
    ("llama-2-70b", 68_976_648_192, llama_count(80, 8192, 64, 8, 28672, 32000)),
    ("qwen2.5-7b", 7_615_616_512, llama_count(28, 3584, 28, 4, 18944, 152064, qkv_bias=True)),
    ("mpt-7b", 6_649_286_656, mpt_count(32, 4096, 50432)),
    # GPT-3 175B (Brown et al. 2020, Table 2.1; no HF checkpoint: constructed file). The paper's "175.0B" is
    # rounded: the exact count of this shape is 174,604,259,328 (0.23% below).
    ("gpt3-175b", 174_604_259_328, gpt2_count(96, 12288, 50257, 2048)),
]


@pytest.mark.parametrize("name,published,formula", PRESETS, ids=[p[0] for p in PRESETS])
def test_preset_parameter_count(tmp_path, name, published, formula):
    assert formula == published
    s = transformer_spec(load_scenario(scenario(tmp_path, {"from_hf": str(MODELS / f"{name}.json")})))
    assert s.num_parameters == published


def test_gpt3_is_the_papers_shape_and_rounds_to_175b():
    keys = read_hf_config(MODELS / "gpt3-175b.json")
    assert (keys["num_layers"], keys["hidden_size"], keys["num_attention_heads"], keys["seq_length"],
            keys["vocab_size"]) == (96, 12288, 96, 2048, 50257)
    assert round(gpt2_count(96, 12288, 50257, 2048) / 1e9, 1) == 174.6  # the paper's table says 175.0B


def test_qwen25_and_llama_keys():
    q = read_hf_config(MODELS / "qwen2.5-7b.json")
    assert (q["num_query_groups"], q["add_qkv_bias"], q["add_bias_linear"], q["untie_embeddings_and_output_weights"],
            q["sliding_window"]) == (4, True, False, True, None)
    big = read_hf_config(MODELS / "llama-3.1-405b.json")
    assert (big["num_query_groups"], big["position_embedding_type"], big["seq_length"]) == (8, "rope", 131072)


def test_mpt7b_alibi_has_no_position_table(tmp_path):
    keys = read_hf_config(MODELS / "mpt-7b.json")
    assert (keys["position_embedding_type"], keys["ffn_hidden_size"], keys["add_bias_linear"],
            keys["normalization"], keys["untie_embeddings_and_output_weights"]) == ("none", 16384, False, "LayerNorm",
                                                                                  False)
    cfg = load_scenario(scenario(tmp_path, {"from_hf": str(MODELS / "mpt-7b.json"), "num_layers": 1,
                                            "seq_length": 128}))
    s = transformer_spec(cfg)
    assert s.position_table_rows == 0 and s.num_parameters == mpt_count(1, 4096, 50432)
    g = build_gpt_step(s)
    assert not any(p.name.startswith("wpe") for p in g.param_groups)
    assert not any("rope" in op.name for op in g.ops)


TINY_MPT = {"model_type": "mpt", "d_model": 64, "n_heads": 8, "n_layers": 2, "expansion_ratio": 4,
            "max_seq_len": 32, "vocab_size": 1000, "no_bias": False, "norm_type": "low_precision_layernorm",
            "learned_pos_emb": True, "attn_config": {"alibi": False, "attn_impl": "triton"}}


def test_mpt_learned_positions_and_biases_by_hand(tmp_path):
    s = transformer_spec(load_scenario(scenario(tmp_path, {"from_hf": "./config.json"}, TINY_MPT)))
    # per layer: qkv 64*192 + 192, proj 64*64 + 64, fc1 64*256 + 256, fc2 256*64 + 64, 2 LayerNorms 2*128
    layer = 12288 + 192 + 4096 + 64 + 16384 + 256 + 16384 + 64 + 256
    assert s.layer_params == layer
    # tied embedding 64000 + position table 32*64 + final LayerNorm 128
    assert s.num_parameters == 2 * layer + 64000 + 32 * 64 + 128
    alibi = transformer_spec(load_scenario(scenario(
        tmp_path, {"from_hf": "./config.json"}, {**TINY_MPT, "attn_config": {"alibi": True}})))
    assert alibi.num_parameters == s.num_parameters - 32 * 64 and alibi.position_embedding == "none"


def test_mpt_flash_attn_impl_is_flash_between_the_padding_helpers(tmp_path):
    """attn_impl flash: MPT's flash_attn_fn (unpad / pad around the kernel); triton and torch: the plain kernel."""
    for impl, backend in (("flash", "flash_varlen"), ("triton", "flash")):
        cfg = load_scenario(scenario(tmp_path, {"from_hf": "./config.json"},
                                     {**TINY_MPT, "attn_config": {"alibi": False, "attn_impl": impl}}))
        assert cfg.model.attention_backend == backend


def test_none_position_embedding_drops_the_table_and_keeps_the_kernels():
    """position_embedding none: the learned-position spec minus the table's parameters and its gather row."""
    kw = {"num_layers": 1, "hidden_size": 64, "num_attention_heads": 8, "seq_length": 16, "vocab_size": 1000,
          "ffn_hidden_size": 256, "micro_batch_size": 2, "precision": "bf16"}
    learned, none = TransformerSpec(**kw), TransformerSpec(**kw, position_embedding="none")
    assert learned.num_parameters - none.num_parameters == 16 * 64
    a, b = build_gpt_step(learned), build_gpt_step(none)
    assert [op.name for op in b.ops if op.name.startswith("L0.")] == [op.name for op in a.ops
                                                                       if op.name.startswith("L0.")]
    with pytest.raises(ValueError, match="position_embedding must be one of"):
        TransformerSpec(**kw, position_embedding="alibi")


BAD_MPT = [
    ("no positions", {**TINY_MPT, "learned_pos_emb": False}, ["learned_pos_emb", "alibi", "positional"]),
    ("attn_impl", {**TINY_MPT, "attn_config": {"alibi": True, "attn_impl": "xformers"}},
     ["attn_config.attn_impl", "'xformers'", "flash, triton, torch"]),
    ("qk_ln", {**TINY_MPT, "attn_config": {"alibi": True, "qk_ln": True}}, ["attn_config.qk_ln", "allowed: false"]),
    ("prefix_lm", {**TINY_MPT, "attn_config": {"alibi": True, "prefix_lm": True}}, ["attn_config.prefix_lm"]),
    ("rope", {**TINY_MPT, "attn_config": {"rope": True}}, ["attn_config.rope"]),
    ("gqa", {**TINY_MPT, "attn_config": {"alibi": True, "attn_type": "grouped_query_attention"}},
     ["attn_config.attn_type", "multihead_attention"]),
    ("ffn", {**TINY_MPT, "ffn_config": {"ffn_type": "mptglu"}}, ["ffn_config", "mptmlp"]),
    ("norm", {**TINY_MPT, "norm_type": "groupnorm"}, ["norm_type", "'groupnorm'", "low_precision_layernorm"]),
    ("ratio", {**TINY_MPT, "expansion_ratio": 1.01}, ["expansion_ratio", "integer"]),
    ("alibi type", {**TINY_MPT, "attn_config": {"alibi": "yes"}}, ["attn_config.alibi", "true or false"]),
    ("missing", {k: v for k, v in TINY_MPT.items() if k != "d_model"}, ["d_model", "missing"]),
]


@pytest.mark.parametrize("label,hf,expected", BAD_MPT, ids=[b[0] for b in BAD_MPT])
def test_bad_mpt_config_one_line_exit_2(tmp_path, capsys, label, hf, expected):
    p = scenario(tmp_path, {"from_hf": "./config.json"}, hf)
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and str(p) in err
    for fragment in expected:
        assert fragment in err, f"{label}: {fragment!r} not in {err!r}"


def test_mpt_torch_attention_is_flagged():
    """The published MPT-7B file sets attn_impl torch (unfused); it is priced as flash and the load says so."""
    import warnings as w

    from simulator.config.errors import ScenarioWarning
    from simulator.config.hf_config import read_hf_config

    with w.catch_warnings(record=True) as caught:
        w.simplefilter("always")
        read_hf_config(ROOT / "scenarios/models/mpt-7b.json")
    assert any(issubclass(c.category, ScenarioWarning) and "attn_impl torch" in str(c.message) for c in caught)
