"""model.architecture: vit in the scenario and model.from_hf of a ViTConfig; bad input one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from simulator.api import model_num_parameters, resolved_config, run_scenario, transformer_spec
from simulator.cli import main
from simulator.config.hf_config import read_hf_config
from simulator.config.loader import load_scenario, scenario_from_dict
from simulator.policies.dataloader import loader_spec
from tests.conftest import ROOT

BASE = yaml.safe_load((ROOT / "scenarios/h200/gpt_184m_b8.yaml").read_text())
VIT_B16 = ROOT / "scenarios/models/vit-base-patch16-224.json"
# ViT-B/16 written out in scenario keys
EXPLICIT = {"architecture": "vit", "num_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
            "ffn_hidden_size": 3072, "image_size": 224, "patch_size": 16, "num_classes": 1000}
TINY = {"architecture": "vit", "num_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "ffn_hidden_size": 32,
        "image_size": 8, "patch_size": 4, "num_classes": 5}


def scenario(tmp_path: Path, model: dict, training: dict | None = None, top: dict | None = None,
             hf: dict | None = None) -> Path:
    if hf is not None:
        (tmp_path / "config.json").write_text(json.dumps(hf))
    d = {**BASE, "model": model, "training": {**BASE["training"], "precision": "bf16", **(training or {})},
         **(top or {})}
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def test_from_hf_round_trip(tmp_path):
    """google/vit-base-patch16-224's config.json gives the same spec as its keys written out: 197 tokens,
    86,567,656 parameters, bidirectional attention; the resolved config a run writes validates again."""
    keys = read_hf_config(VIT_B16)
    assert (keys["architecture"], keys["image_size"], keys["patch_size"], keys["num_channels"],
            keys["num_classes"], keys["ffn_hidden_size"]) == ("vit", 224, 16, 3, 1000, 3072)
    cfg = load_scenario(scenario(tmp_path, {"from_hf": str(VIT_B16)}))
    assert cfg.model.seq_length == 197 and cfg.model.vocab_size is None
    assert model_num_parameters(cfg) == 86_567_656
    s = transformer_spec(cfg)
    assert not s.causal and s.vit.num_patches == 196 and not s.tied_embeddings
    direct = load_scenario(scenario(tmp_path, EXPLICIT))
    assert transformer_spec(direct) == s
    again = scenario_from_dict(resolved_config(cfg))
    assert transformer_spec(again) == s


def test_id2label_and_defaults(tmp_path):
    """num_labels from the size of id2label; ViTConfig defaults for the image keys; PretrainedConfig's 2 labels."""
    hf = {"model_type": "vit", "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
          "intermediate_size": 32, "id2label": {"0": "cat", "1": "dog", "2": "bird"}}
    keys = read_hf_config(_write(tmp_path, hf))
    assert (keys["num_classes"], keys["image_size"], keys["patch_size"], keys["num_channels"]) == (3, 224, 16, 3)
    del hf["id2label"]
    assert read_hf_config(_write(tmp_path, hf))["num_classes"] == 2


def _write(tmp_path: Path, hf: dict) -> Path:
    p = tmp_path / "c.json"
    p.write_text(json.dumps(hf))
    return p


def test_dataloader_sample_bytes_default_to_the_image():
    """A DataLoader's default sample is the fp32 image and its int64 label: 4 x 3 x 224 x 224 + 8 bytes."""
    d = yaml.safe_load((ROOT / "scenarios/h200/dataloader_w1.yaml").read_text())
    d["model"] = {"from_hf": str(VIT_B16)}
    d["training"] = {**d["training"], "precision": "bf16"}
    d["dataloader"]["sample"].pop("bytes", None)  # the default: what the step copies
    cfg = scenario_from_dict(d)
    assert loader_spec(cfg).sample_bytes == 4 * 3 * 224 * 224 + 8


def test_bundled_scenario():
    """scenarios/h200/vit_b16_b64.yaml: ViT-B/16 from its config.json, micro-batch 64, bf16 (a prediction)."""
    cfg = load_scenario(ROOT / "scenarios/h200/vit_b16_b64.yaml", ["run.steps=2"])
    s = run_scenario(cfg).summary
    assert s["num_parameters"] == 86_567_656
    # model FLOPs per image: 3 x 12 blocks + patch embedding (fwd + wgrad) + head (3 passes)
    h, seq = 768, 197
    block = seq * 2 * 12 * h * h + 4 * h * seq * seq
    per_image = 3 * 12 * block + 2 * 2 * 196 * 768 * 768 + 3 * 2 * 768 * 1000
    assert s["model_flops_per_step"] == pytest.approx(64 * per_image, rel=1e-12)


def _tp(d: dict) -> dict:
    return {"hardware": {**BASE["hardware"], "gpu": "h100-sxm-80gb", "profile": None,
                         "cluster": {"preset": "dgx-h100", "nodes": 1}}, **d}


BAD = [
    ("vocab", {**TINY, "vocab_size": 100}, {}, {}, ["model.vocab_size: not allowed", "architecture vit", "no vocabulary"]),
    ("rope", {**TINY, "position_embedding_type": "rope"}, {}, {}, ["position_embedding_type", "architecture vit"]),
    ("swiglu", {**TINY, "swiglu": True}, {}, {}, ["swiglu", "architecture vit"]),
    ("moe", {**TINY, "num_experts": 4}, {}, {}, ["num_experts", "architecture vit"]),
    ("gqa", {**TINY, "group_query_attention": True}, {}, {}, ["group_query_attention", "architecture vit"]),
    ("no bias", {**TINY, "add_bias_linear": False}, {}, {}, ["add_bias_linear", "biases"]),
    ("patch", {**TINY, "image_size": 225, "patch_size": 16}, {}, {}, ["patch_size: 16 must divide image_size 225"]),
    ("seq", {**TINY, "seq_length": 17}, {}, {}, ["seq_length: 17", "= 5"]),
    ("missing classes", {k: v for k, v in TINY.items() if k != "num_classes"}, {}, {},
     ["num_classes: required key is missing"]),
    ("decoder with image", {**{k: v for k, v in TINY.items() if k != "architecture"}, "seq_length": 8,
                            "vocab_size": 10}, {}, {}, ["image_size: needs architecture: vit"]),
    ("decoder without vocab", {"num_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "seq_length": 8}, {},
     {}, ["vocab_size: required key is missing"]),
    ("architecture", {**TINY, "architecture": "encoder"}, {}, {}, ["architecture", "decoder", "vit"]),
    ("pipeline", {**TINY, "num_layers": 2}, {}, _tp({"parallelism": {"pipeline_model_parallel_size": 2}}),
     ["parallelism.pipeline_model_parallel_size: 2 with model.architecture vit"]),
    ("sequence parallel", {**TINY, "num_attention_heads": 2}, {}, _tp({"parallelism": {
        "tensor_model_parallel_size": 2, "sequence_parallel": True}}), ["parallelism.sequence_parallel"]),
    ("fsdp", TINY, {"precision": "amp_fp32_params"}, _tp({"fsdp": {"sharding_strategy": "FULL_SHARD"}}),
     ["fsdp", "architecture vit"]),
    ("tp heads", {**TINY, "num_attention_heads": 1}, {}, _tp({"parallelism": {"tensor_model_parallel_size": 2}}),
     ["must divide model.num_attention_heads"]),
    ("hf relu", {"from_hf": "./config.json"}, {}, {}, ["hidden_act: 'relu'", "vit"]),
    ("hf qkv bias", {"from_hf": "./config.json"}, {}, {}, ["qkv_bias: false"]),
]
HF = {"relu": {"hidden_act": "relu"}, "qkv bias": {"qkv_bias": False}}


@pytest.mark.parametrize("label,model,training,top,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_vit_input_one_line_exit_2(tmp_path, capsys, label, model, training, top, expected):
    hf = None
    if label.startswith("hf "):
        hf = {**json.loads(VIT_B16.read_text()), **HF[label[3:]]}
    p = scenario(tmp_path, model, training, top, hf)
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    lines = err.split("\n")  # sequence parallel: also tp 2 not dividing the 5 tokens, its own line in the same run
    assert len(lines) == (2 if label == "sequence parallel" else 1) and "Traceback" not in err
    assert all(line.startswith(f"error: {p}: ") for line in lines)
    for fragment in expected:
        assert fragment in err, f"{label}: {fragment!r} not in {err!r}"


def test_tensor_parallel_vit_runs(tmp_path):
    """TP 2 on a DGX H100 (heads and FFN divisible): the blocks split, the ends replicated."""
    p = scenario(tmp_path, {**TINY, "num_layers": 2}, {"micro_batch_size": 4},
                 _tp({"parallelism": {"tensor_model_parallel_size": 2}, "run": {"steps": 2, "warmup_steps": 1}}))
    cfg = load_scenario(p)
    s = run_scenario(cfg).summary
    assert s["step_time_s"] > 0 and s["num_parameters"] == model_num_parameters(cfg)
