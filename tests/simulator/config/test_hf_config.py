"""model.from_hf: Hugging Face config.json into the model section; bad input one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from simulator.api import transformer_spec
from simulator.cli import main
from simulator.config.hf_config import read_hf_config
from simulator.config.loader import load_scenario
from tests.conftest import ROOT

BASE = yaml.safe_load((ROOT / "scenarios/h200/gpt_184m_b8.yaml").read_text())
MODELS = ROOT / "scenarios/models"
# GPT-2 124M (https://huggingface.co/openai-community/gpt2 config.json, the keys read)
GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
        "n_positions": 1024, "n_inner": None, "vocab_size": 50257, "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-05}


def scenario(tmp_path: Path, model: dict, hf: dict | None = None, training: dict | None = None) -> Path:
    if hf is not None:
        (tmp_path / "config.json").write_text(json.dumps(hf))
    d = {**BASE, "model": model, "training": {**BASE["training"], **(training or {})}}
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def test_gpt2_round_trip(tmp_path):
    """GPT-2's config.json gives the GPT-2 124M model: 124,439,808 parameters (HF count)."""
    cfg = load_scenario(scenario(tmp_path, {"from_hf": "./config.json"}, GPT2))  # relative: the scenario's folder
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size) == (12, 768, 12, 1024,
                                                                                                50257)
    assert (m.normalization, m.position_embedding_type, m.swiglu, m.untie_embeddings_and_output_weights) == (
        "LayerNorm", "learned_absolute", False, False)
    assert transformer_spec(cfg).num_parameters == 124_439_808
    explicit = {k: getattr(m, k) for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                                           "vocab_size", "max_position_embeddings")}
    direct = load_scenario(scenario(tmp_path / "..", explicit))
    assert transformer_spec(direct) == transformer_spec(cfg)


def test_llama_presets_and_overrides(tmp_path):
    keys = read_hf_config(MODELS / "llama-3.1-8b.json")
    assert keys["num_query_groups"] == 8 and keys["group_query_attention"] and keys["swiglu"]
    assert (keys["normalization"], keys["position_embedding_type"], keys["add_bias_linear"]) == ("RMSNorm", "rope",
                                                                                                 False)
    cfg = load_scenario(scenario(tmp_path, {"from_hf": str(MODELS / "llama-3.1-8b.json"), "seq_length": 2048},
                                 training={"precision": "bf16"}))
    s = transformer_spec(cfg)
    assert s.num_parameters == 8_030_261_248 and s.seq_length == 2048 and not s.tied_embeddings
    cfg = load_scenario(scenario(tmp_path, {"from_hf": str(MODELS / "llama-2-7b.json"), "num_layers": 2},
                                 training={"precision": "bf16"}))
    s = transformer_spec(cfg)
    assert s.num_layers == 2 and s.seq_length == 4096 and s.num_query_groups is None
    full = transformer_spec(load_scenario(scenario(tmp_path, {"from_hf": str(MODELS / "llama-2-7b.json")})))
    assert full.num_parameters == 6_738_415_616


def test_qwen2_qkv_bias(tmp_path):
    """Qwen2: bias on q, k, v only (Qwen2Attention): add_qkv_bias, no other bias."""
    hf = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 8,
          "num_key_value_heads": 2, "intermediate_size": 160, "vocab_size": 1000, "max_position_embeddings": 32,
          "hidden_act": "silu", "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
          "use_sliding_window": False, "sliding_window": 16}
    s = transformer_spec(load_scenario(scenario(tmp_path, {"from_hf": "./config.json"}, hf)))
    # embedding 64000 (tied) + qkv 64*96 + 96 bias + o 4096 + mlp 30720 + 2 norms 128 + final norm 64
    assert s.num_parameters == 64000 + 6144 + 96 + 4096 + 30720 + 128 + 64


LLAMA = json.loads((MODELS / "llama-2-7b.json").read_text())
BAD = [
    ("moe", {**LLAMA, "model_type": "qwen3_moe", "num_experts": 128}, {}, ["num_experts", "mixture-of-experts",
                                                                     "mixtral, qwen2_moe, deepseek"]),
    ("architecture", {**LLAMA, "model_type": "t5", "architectures": ["T5ForConditionalGeneration"]}, {},
     ["model_type", "'t5'", "T5ForConditionalGeneration", "gpt2, llama, mistral, mixtral, qwen2"]),
    ("activation", {**LLAMA, "hidden_act": "gelu"}, {}, ["hidden_act", "silu"]),
    ("head_dim", {**LLAMA, "head_dim": 0}, {}, ["head_dim", "positive integer"]),
    ("missing key", {k: v for k, v in LLAMA.items() if k != "hidden_size"}, {}, ["hidden_size", "missing"]),
    ("kv heads", {**LLAMA, "num_key_value_heads": 5}, {}, ["num_key_value_heads (5) must divide"]),
    ("qwen2 sliding window", {**LLAMA, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 1024}, {},
     ["sliding_window 1024", "max_window_layers"]),
    ("groups do not divide", None, {"num_query_groups": 3}, ["num_query_groups (3) must divide"]),
    ("groups without gqa", None, {"num_query_groups": 4, "group_query_attention": False},
     ["needs group_query_attention"]),
    ("not a path", None, {"from_hf": "llama.json"}, ["from_hf", "./"]),
    ("missing file", None, {"from_hf": "./nope.json"}, ["model.from_hf: ./nope.json not found (looked for"]),
]


@pytest.mark.parametrize("label,hf,model,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_hf_input_one_line_exit_2(tmp_path, capsys, label, hf, model, expected):
    base = {"from_hf": "./config.json", "num_layers": 2, "seq_length": 2048, "group_query_attention": True}
    if hf is not None:
        base = {"from_hf": "./config.json", "num_layers": 2, "seq_length": 2048}
    p = scenario(tmp_path, {**base, **model}, hf if hf is not None else LLAMA, training={"precision": "bf16"})
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and str(p) in err
    for fragment in expected:
        assert fragment in err, f"{label}: {fragment!r} not in {err!r}"


def test_query_groups_divisible_by_tp(tmp_path, capsys):
    p = scenario(tmp_path, {"from_hf": str(MODELS / "llama-3.1-8b.json"), "num_layers": 1, "seq_length": 512,
                            "num_query_groups": 2}, training={"precision": "bf16"})
    d = yaml.safe_load(p.read_text())
    d["hardware"]["cluster"] = {"preset": "dgx-h100", "nodes": 1}
    d["hardware"]["gpu"] = "h100-sxm-80gb"
    d["hardware"].pop("profile", None)
    d["parallelism"] = {"tensor_model_parallel_size": 4}
    p.write_text(yaml.safe_dump(d))
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "model.num_query_groups (2" in err and "tensor_model_parallel_size" in err


def test_set_from_hf_replaces_the_scenarios_model_section():
    """``--set model.from_hf`` on a GPT-2 184M scenario gives Llama-2-7B, not a hybrid with the
    scenario's 12 layers and 1024 width; model keys set before it are kept, later ones apply."""
    path = ROOT / "scenarios/h200/gpt_184m_b8.yaml"
    hf = f"{MODELS}/llama-2-7b.json"
    cfg = load_scenario(path, ["model.seq_length=1024", f"model.from_hf={hf}", "model.num_layers=2"])
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.vocab_size, m.seq_length) == (2, 4096, 11008, 32000, 1024)
    full = load_scenario(path, [f"model.from_hf={hf}"]).model
    assert (full.num_layers, full.hidden_size, full.seq_length) == (32, 4096, 4096)


def test_seq_length_taken_from_max_position_embeddings_is_flagged():
    """``--set model.from_hf`` keeps no seq_length of the scenario: the config's max_position_embeddings is used and
    the load says so (Llama-2-7B: 4,096); a scenario that sets seq_length, even to the same value, is not flagged."""
    import warnings

    from simulator.config.errors import ScenarioWarning

    def flagged(sets):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = load_scenario(ROOT / "scenarios/h200/gpt_184m_b8.yaml", sets)
        return cfg.model.seq_length, [str(c.message) for c in caught if issubclass(c.category, ScenarioWarning)
                                      and "model.seq_length: not set" in str(c.message)]

    hf = f"model.from_hf={MODELS}/llama-2-7b.json"
    seq, w = flagged([hf])
    assert seq == 4096 and len(w) == 1 and "4,096 from the max_position_embeddings" in w[0]
    assert flagged([hf, "model.seq_length=4096"]) == (4096, [])


def test_error_on_a_key_read_from_config_json_names_the_files_key(tmp_path, capsys):
    """Mixtral's ``num_experts_per_tok`` becomes ``moe_router_topk``: the error names both (the user edits the
    file), and a key the scenario sets itself is named only by its scenario name."""
    mixtral = json.loads((MODELS / "mixtral-8x7b.json").read_text())
    p = scenario(tmp_path, {"from_hf": str(tmp_path / "config.json"), "num_layers": 1, "seq_length": 512},
                 hf={**mixtral, "num_experts_per_tok": 9})
    assert main(["run", str(p)]) == 2
    # the scenario's precision (amp_fp32_params) is refused with experts too: one line each, in the same run
    (err,) = [line for line in capsys.readouterr().err.strip().split("\n") if "exceeds" in line]
    assert "moe_router_topk (9) exceeds num_experts (8)" in err
    assert f"moe_router_topk is num_experts_per_tok in {tmp_path / 'config.json'}" in err
    p = scenario(tmp_path, {"from_hf": str(tmp_path / "config.json"), "num_layers": 1, "seq_length": 512,
                            "moe_router_topk": 9}, hf=mixtral)
    assert main(["run", str(p)]) == 2
    (err,) = [line for line in capsys.readouterr().err.strip().split("\n") if "exceeds" in line]
    assert "moe_router_topk (9)" in err and "moe_router_topk is" not in err and "num_experts is num_local_experts" in err


def test_json_syntax_error_says_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 4096')
    p = scenario(tmp_path, {"from_hf": str(tmp_path / "config.json")})
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "config.json: JSON syntax error at line 1" in err and "YAML" not in err
