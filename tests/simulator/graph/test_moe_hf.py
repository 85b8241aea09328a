"""Qwen2-MoE and DeepSeek-MoE from their Hugging Face configs: exact parameter counts worked out by hand against the
published ones, per-layer MLP kinds (DeepSeek's dense first block, Qwen's decoder_sparse_step / mlp_only_layers,
model.moe_layer_freq), the shared-expert sigmoid gate, and refusals (MLA, sigmoid scoring): one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from simulator.api import model_num_parameters, transformer_spec
from simulator.cli import main
from simulator.config.loader import load_scenario
from simulator.graph.builders.transformer import build_gpt_step
from tests.conftest import ROOT

QWEN = ROOT / "scenarios/models/qwen1.5-moe-a2.7b.json"
DEEPSEEK = ROOT / "scenarios/models/deepseek-moe-16b.json"


def _scenario(tmp_path: Path, model: dict) -> Path:
    d = {"name": "moe", "hardware": {"gpu": "h100-sxm-80gb", "host": "dgx-h100-host"}, "model": model,
         "training": {"micro_batch_size": 1, "precision": "bf16"}, "run": {"steps": 3, "warmup_steps": 1}}
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def _cfg(tmp_path, **model):
    return load_scenario(_scenario(tmp_path, {"seq_length": 1024, **model}))


def _hf(tmp_path, base: Path, **changes) -> str:
    cfg = {**json.loads(base.read_text()), **changes}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return str(p)


def test_qwen15_moe_a27b_parameter_count_exact(tmp_path):
    # per block: attention q/k/v with biases 3 h^2 + 3 h, o_proj h^2; router 60 h; 60 experts x 3 h 1408; shared
    # expert 3 h 5632 and its gate h; 2 RMSNorms -> 570,560,512 x 24; untied embedding and head 2 V h; final norm h
    h, V = 2048, 151936
    block = 4 * h * h + 3 * h + 60 * h + 60 * 3 * h * 1408 + 3 * h * 5632 + h + 2 * h
    assert block == 570_560_512
    total = 24 * block + 2 * V * h + h
    cfg = _cfg(tmp_path, from_hf=str(QWEN))
    # published: the safetensors index of Qwen/Qwen1.5-MoE-A2.7B(-Chat) has total_size 28,631,568,384 bf16 bytes
    assert model_num_parameters(cfg) == total == 14_315_784_192 == 28_631_568_384 // 2
    m = cfg.model
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_shared_expert_intermediate_size,
            m.moe_shared_expert_gate, m.add_qkv_bias, m.moe_layer_freq) == (60, 4, 1408, 5632, True, True, 1)
    # active: top-4 of the 60 experts ("2.7B activated" on the model card)
    active = total - 24 * 56 * 3 * h * 1408
    assert transformer_spec(cfg).num_active_parameters == active == 2_689_173_504


def test_deepseek_moe_16b_parameter_count_exact(tmp_path):
    # block 0 dense (SwiGLU 10944), blocks 1..27 MoE: router 64 h, 64 experts x 3 h 1408, 2 shared experts fused
    # into one of 2 x 1408; attention 4 h^2 without biases, 2 RMSNorms
    h, V = 2048, 102400
    dense = 4 * h * h + 3 * h * 10944 + 2 * h
    moe = 4 * h * h + 64 * h + 64 * 3 * h * 1408 + 3 * h * 2816 + 2 * h
    total = dense + 27 * moe + 2 * V * h + h
    cfg = _cfg(tmp_path, from_hf=str(DEEPSEEK))
    assert model_num_parameters(cfg) == total == 16_375_728_128
    # published: "16.4B" (Dai et al., DeepSeekMoE, 2024, table 1; 16.38B in GGUF conversions): within 0.2%
    assert abs(total / 16.4e9 - 1) < 0.002
    assert cfg.model.moe_layer_freq == [0] + [1] * 27
    active = total - 27 * 58 * 3 * h * 1408  # 6 of 64 routed experts ("2.8B")
    assert transformer_spec(cfg).num_active_parameters == active == 2_828_650_496


def test_deepseek_dense_first_block_in_the_graph(tmp_path):
    # cut to 3 blocks: block 0 has the dense MLP of 10944, blocks 1, 2 the MoE layer with a 2816-wide shared expert
    cfg = _cfg(tmp_path, from_hf=str(DEEPSEEK), num_layers=3, seq_length=256)
    assert cfg.model.moe_layer_freq == [0, 1, 1]
    spec = transformer_spec(cfg)
    g = build_gpt_step(spec)
    shapes = {o.name: o.shape for o in g.ops if o.layer in (0, 1) and o.name.endswith(".gemm")}
    assert shapes["L0.fwd.fc1.gemm"] == (256, 2 * 10944, 2048) and "L0.fwd.router.gemm" not in shapes
    assert shapes["L1.fwd.experts.fc1.gemm"] == (256 * 6, 2 * 1408, 2048)
    assert shapes["L1.fwd.shared_expert.fc1.gemm"] == (256, 2 * 2816, 2048) and "L1.fwd.fc1.gemm" not in shapes
    assert sum(p.numel for p in g.param_groups) == spec.num_parameters
    # model FLOPs: the dense block counts its 3 h f MLP, the MoE blocks router + 6 experts + shared expert
    h, s = 2048, 256
    att = 4 * h * (s * s / 2) / s
    dense = 2 * (4 * h * h + 3 * h * 10944) + att
    moe = 2 * (4 * h * h + 64 * h + 6 * 3 * h * 1408 + 3 * h * 2816) + att
    assert spec.model_flops_per_sample() == pytest.approx(3 * s * (dense + 2 * moe + 2 * h * 102400))


def test_qwen_shared_expert_gate_kernels(tmp_path):
    cfg = _cfg(tmp_path, from_hf=str(QWEN), num_layers=1, seq_length=128)
    g = build_gpt_step(transformer_spec(cfg))
    names = {o.name: o for o in g.ops}
    assert names["L0.fwd.shared_expert.gate.gemm"].shape == (128, 1, 2048)
    assert "L0.fwd.shared_expert.gate.sigmoid_mul" in names and "L0.bwd.shared_expert.gate.wgrad" in names
    assert [p.numel for p in g.param_groups if p.name == "L0.shared_expert.gate.weight"] == [2048]


@pytest.mark.parametrize("changes,pattern", [({"decoder_sparse_step": 2}, [0, 1, 0, 1]),
                                             ({"mlp_only_layers": [0, 3]}, [0, 1, 1, 0])])
def test_qwen_sparse_step_and_mlp_only_layers(tmp_path, changes, pattern):
    cfg = _cfg(tmp_path, from_hf=_hf(tmp_path, QWEN, **changes), num_layers=4)
    assert cfg.model.moe_layer_freq == pattern
    spec = transformer_spec(cfg)
    assert sum(p.numel for p in build_gpt_step(spec).param_groups) == spec.num_parameters


def test_moe_layer_freq_integer_is_megatrons_rule(tmp_path):
    # Megatron --moe-layer-freq 2: blocks 0 and 2 of 4 are MoE
    cfg = _cfg(tmp_path, from_hf=str(QWEN), num_layers=4, moe_layer_freq=2)
    assert transformer_spec(cfg).moe_layer_pattern == (1, 0, 1, 0)


BAD = [
    ("mla", {"model_type": "deepseek_v2", "kv_lora_rank": 512}, {}, ["'deepseek_v2' uses MLA attention", "not modelled"]),
    ("sigmoid scoring", {"scoring_func": "sigmoid"}, {}, ["scoring_func: 'sigmoid' is not modelled"]),
    ("freq length", {}, {"moe_layer_freq": [0, 1]}, ["moe_layer_freq: 2 values for num_layers 28"]),
    ("no moe layer", {}, {"num_layers": 1}, ["moe_layer_freq: no MoE layer"]),
]


@pytest.mark.parametrize("label,changes,model,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_moe_configs_one_line_exit_2(tmp_path, capsys, label, changes, model, expected):
    p = _scenario(tmp_path, {"from_hf": _hf(tmp_path, DEEPSEEK, **changes), "seq_length": 1024, **model})
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    for fragment in expected:
        assert fragment in err, f"{label}: {fragment!r} not in {err!r}"
