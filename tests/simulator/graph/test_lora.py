"""LoRA fine-tuning: exact trainable counts (PEFT's figures for Llama-2-7B), adapter GEMM FLOPs by hand, no
weight-gradient GEMM or gradient/optimizer state for frozen weights, DDP reduces the adapters only, LoRA is faster
than a full fine-tune of the same scenario, and bad input (one line, exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.api import model_num_parameters, run_scenario
from simulator.cli import main
from simulator.config.loader import load_scenario
from simulator.graph.builders.lora import LoraSpec, trainable_parameters
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.ops import CostClass, OpKind
from tests.conftest import ROOT

LLAMA2 = ROOT / "scenarios/models/llama-2-7b.json"
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# tiny Llama-like model: h 64, a 8 heads of d 8, g 2 K/V groups (k/v width 16), f 160, 2 layers, s 16, b 2
TINY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 8, "num_query_groups": 2, "seq_length": 16,
        "vocab_size": 1000, "ffn_hidden_size": 160, "micro_batch_size": 2, "tied_embeddings": False, "bias": False,
        "swiglu": True, "normalization": "RMSNorm", "position_embedding": "rope", "precision": "bf16"}
T = 2 * 16


def spec(lora: LoraSpec | None = None, **kw) -> TransformerSpec:
    return TransformerSpec(**{**TINY, **kw}, lora=lora)


def _scenario(tmp_path: Path, model: dict | None = None, lora: dict | None = None, **training) -> Path:
    d = {"name": "lora", "hardware": {"gpu": "h200-sxm-141gb", "profile": "h200-sxm-141gb",
                                      "pcie": "pcie-gen5-x16-h200-measured", "host": "h200-measured-host"},
         "model": model or {"from_hf": str(LLAMA2), "seq_length": 4096},
         "training": {"micro_batch_size": 1, "precision": "bf16", **training}, "run": {"steps": 2, "warmup_steps": 1}}
    if lora is not None:
        d["training"]["lora"] = lora
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


# -- trainable parameters ------------------------------------------------------------------------
def test_llama2_7b_trainable_counts_exact_as_peft_prints(tmp_path):
    # r 8 on q_proj, v_proj: 32 layers x 2 modules x 8 x (4096 + 4096) = 4,194,304 (PEFT: "trainable params:
    # 4,194,304 || all params: 6,742,609,920"; PEFT's "all" adds the adapters to the 6,738,415,616 of the model)
    cfg = load_scenario(_scenario(tmp_path, lora={"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}))
    from simulator.api import transformer_spec

    assert trainable_parameters(transformer_spec(cfg)) == 32 * 2 * 8 * (4096 + 4096) == 4_194_304
    assert model_num_parameters(cfg) == 6_738_415_616  # the model's count, unchanged by LoRA
    # r 16 on all seven: per layer q, k, v, o 4 x 16 x (4096 + 4096) = 524,288; gate, up 2 x 16 x (4096 + 11008) =
    # 483,328; down 16 x (11008 + 4096) = 241,664; sum 1,249,280 x 32 layers = 39,976,960
    cfg = load_scenario(_scenario(tmp_path, lora={"rank": 16, "alpha": 32, "target_modules": ALL7}))
    assert trainable_parameters(transformer_spec(cfg)) == 32 * (524_288 + 483_328 + 241_664) == 39_976_960
    # all-linear (PEFT's shorthand) is the same seven modules
    assert trainable_parameters(spec(LoraSpec(16, 32, ("all-linear",)), **_llama_dims())) == 39_976_960


def _llama_dims() -> dict:
    return {"num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_query_groups": None,
            "ffn_hidden_size": 11008, "vocab_size": 32000, "seq_length": 64, "micro_batch_size": 1}


def test_megatron_fused_names_one_adapter_per_fused_linear():
    # linear_qkv [64, 64 + 2 x 16] and linear_fc1 [64, 2 x 160]: r 4 x ((64 + 96) + (64 + 320)) x 2 layers = 4352
    s = spec(LoraSpec(4, 8, ("linear_qkv", "linear_fc1")))
    assert trainable_parameters(s) == 2 * 4 * ((64 + 96) + (64 + 320)) == 4352
    graph = build_gpt_step(s)
    assert sum(p.numel for p in graph.param_groups) == 4352
    assert graph.meta["num_trainable_parameters"] == 4352 and graph.meta["num_parameters"] == s.num_parameters


# -- kernels -------------------------------------------------------------------------------------
def test_one_adapted_linear_gemm_flops_by_hand():
    # q_proj of layer 0: in 64, out a d = 64, r 4, T 32 tokens: every adapter GEMM is 2 x 32 x 64 x 4 = 16,384 FLOPs
    g = build_gpt_step(spec(LoraSpec(4, 8, ("q_proj",))))
    gemms = {o.name: o for o in g.ops if o.layer == 0 and ".lora.q_proj." in o.name and o.cost_class is CostClass.GEMM}
    want = {"L0.fwd.lora.q_proj.A.gemm": (T, 4, 64), "L0.fwd.lora.q_proj.B.gemm": (T, 64, 4),
            "L0.bwd.lora.q_proj.B.dgrad": (T, 4, 64), "L0.bwd.lora.q_proj.B.wgrad": (64, 4, T),
            "L0.bwd.lora.q_proj.A.dgrad": (T, 64, 4), "L0.bwd.lora.q_proj.A.wgrad": (4, 64, T)}
    assert {n: o.shape for n, o in gemms.items()} == want
    assert all(o.flops == 2 * T * 64 * 4 == 16_384 for o in gemms.values())
    # forward: scale by alpha / r and add to the q slice of the fused QKV output, [T, 64] 16-bit each
    add = next(o for o in g.ops if o.name == "L0.fwd.lora.q_proj.add")
    assert (add.bytes_read, add.bytes_written) == (4 * T * 64, 2 * T * 64)


def test_backward_has_no_weight_gradient_of_frozen_weights():
    full, lo = build_gpt_step(spec()), build_gpt_step(spec(LoraSpec(4, 8, ("q_proj", "v_proj"))))

    def names(g, suffix):
        return [o.name for o in g.ops if o.name.endswith(suffix)]

    # full fine-tune: qkv, proj, fc1, fc2 wgrad per layer (2 layers) + the LM head
    assert len(names(full, ".wgrad")) == 4 * 2 + 1
    # LoRA: only the adapters' A and B wgrad (2 modules x 2 matrices x 2 layers); no dgamma, no embedding backward
    assert sorted(n for n in names(lo, ".wgrad")) == sorted(
        f"L{l}.bwd.lora.{m}.{ab}.wgrad" for l in (0, 1) for m in ("q_proj", "v_proj") for ab in "AB")
    assert not names(lo, ".dgamma") and not names(lo, "embed.dgrad") and names(full, "embed.dgrad")
    # input gradients still run: the same base dgrad GEMMs as the full fine-tune
    def base_dgrads(g):
        return [n for n in names(g, ".dgrad") if n.endswith(("qkv.dgrad", "proj.dgrad", "fc1.dgrad", "fc2.dgrad"))
                and ".lora." not in n]

    assert base_dgrads(lo) == base_dgrads(full) and len(base_dgrads(lo)) == 4 * 2

    # the base GEMM FLOPs are 2/3 of the full fine-tune's: of forward, dgrad and wgrad (equal FLOPs) wgrad is gone
    def base_gemm_flops(g):
        return sum(o.flops for o in g.ops if o.cost_class is CostClass.GEMM and ".lora." not in o.name)

    assert base_gemm_flops(lo) * 3 == base_gemm_flops(full) * 2


@pytest.mark.parametrize("precision,param_bytes,master", [("bf16", 2, 4), ("amp_fp32_params", 4, 0)])
def test_gradient_and_optimizer_bytes_are_trainable_times_bytes_per_param(precision, param_bytes, master):
    s = spec(LoraSpec(4, 8, ("q_proj", "v_proj", "down_proj")), precision=precision)
    Pa = trainable_parameters(s)  # 2 layers x 4 x ((64 + 64) + (64 + 16) + (160 + 64)) = 3456
    assert Pa == 2 * 4 * (128 + 80 + 224) == 3456
    g = build_gpt_step(s)
    pers = {t.name: t.nbytes for t in g.persistent}
    assert pers["optimizer.exp_avg"] + pers["optimizer.exp_avg_sq"] == 8 * Pa  # fp32 AdamW moments
    base = pers.pop("params.bf16.frozen" if precision == "bf16" else "params.fp32.frozen")
    assert base == param_bytes * s.num_parameters  # frozen base: no fp32 master copy in bf16
    assert sum(v for k, v in pers.items() if k.startswith("params.lora")) == (param_bytes + master) * Pa
    grads = sum(a.nbytes for o in g.ops for a in o.allocs if a.name.startswith("grad."))
    assert grads == 4 * Pa  # fp32 gradients of the adapters only
    assert next(o for o in g.ops if o.name.endswith("adamw")).meta["params"] == Pa


def test_ddp_all_reduces_adapter_gradients_only():
    s = spec(LoraSpec(4, 8, ("q_proj", "v_proj")), data_parallel_size=4)
    g = build_gpt_step(s)
    ar = [o.meta["bytes"] for o in g.ops if o.kind is OpKind.COLLECTIVE and o.meta.get("group") == "dp"]
    assert sum(ar) == 4 * trainable_parameters(s) == 4 * 2 * 4 * (128 + 80)


def test_dropout_adds_a_kernel_and_its_backward():
    g = build_gpt_step(spec(LoraSpec(4, 8, ("q_proj",), dropout=0.1)))
    drop = [o for o in g.ops if o.name.endswith("lora.q_proj.dropout") and o.layer == 0]
    assert len(drop) == 1 and drop[0].bytes_written == 3 * T * 64  # 16-bit output + 1-byte mask
    assert any(o.name == "L0.bwd.lora.q_proj.dropout.dgrad" for o in g.ops)


def test_lora_step_is_faster_and_smaller_than_full_fine_tune(tmp_path):
    # 2 Llama-2-7B layers at seq 1024: the weight-gradient GEMMs (1/3 of the block GEMM FLOPs) are gone, the adapter
    # GEMMs (r 16) add < 1% FLOPs; gradients and AdamW state shrink from 16 B x P to 16 B x 2.5 M
    model = {"from_hf": str(LLAMA2), "num_layers": 2, "seq_length": 1024}
    full = run_scenario(load_scenario(_scenario(tmp_path, model))).summary
    lo = run_scenario(load_scenario(_scenario(tmp_path, model, lora={"rank": 16, "alpha": 32,
                                                                      "target_modules": ALL7}))).summary
    assert lo["num_trainable_parameters"] == 2 * 1_249_280 and full["num_trainable_parameters"] == full["num_parameters"]
    assert lo["step_time_s"] < 0.9 * full["step_time_s"]
    assert lo["peak_memory_bytes"] < 0.5 * full["peak_memory_bytes"]
    assert any(w.startswith("training.lora:") for w in lo["warnings"])
    from simulator.cli import format_summary

    assert "parameters          trainable 2,498,560 of " in format_summary(lo, "lora")
    assert "trainable" not in format_summary(full, "full")


# -- bad input -----------------------------------------------------------------------------------
GPT2_SMALL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 1000}
BAD = [
    ("gate_proj without swiglu", GPT2_SMALL, {"rank": 4, "target_modules": ["gate_proj"]}, {},
     ["training.lora.target_modules", "'gate_proj' is not a module of this model", "swiglu", "up_proj", "linear_qkv"]),
    ("unknown module", None, {"rank": 4, "target_modules": ["c_attn"]}, {},
     ["training.lora.target_modules", "'c_attn'", "allowed: q_proj, k_proj, v_proj, o_proj, gate_proj"]),
    ("mixed families", None, {"rank": 4, "target_modules": ["q_proj", "linear_qkv"]}, {},
     ["training.lora.target_modules", "mixes Hugging Face and Megatron names"]),
    ("rank 0", None, {"rank": 0, "target_modules": ["q_proj"]}, {}, ["training.lora.rank", "greater than 0"]),
    ("rank above the layer", GPT2_SMALL, {"rank": 65, "target_modules": ["q_proj"]}, {},
     ["training.lora.rank", "rank 65 exceeds min(in, out) = 64 of q_proj [64, 64]", "allowed: 1..64"]),
    ("fp8 refused", None, {"rank": 4, "target_modules": ["q_proj"]}, {"fp8": "hybrid"},
     ["training.lora with training.fp8 hybrid is not modelled yet"]),
]


@pytest.mark.parametrize("label,model,lora,training,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_lora_input_one_line_exit_2(tmp_path, capsys, label, model, lora, training, expected):
    p = _scenario(tmp_path, model or {"from_hf": str(LLAMA2), "num_layers": 2, "seq_length": 256}, lora, **training)
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and str(p) in err
    for fragment in expected:
        assert fragment in err, f"{label}: {fragment!r} not in {err!r}"


def _tp_scenario(tmp_path: Path, sequence_parallel: bool) -> Path:
    d = yaml.safe_load(_scenario(tmp_path, {"from_hf": str(LLAMA2), "num_layers": 2, "seq_length": 256},
                                 {"rank": 4, "target_modules": ["q_proj", "o_proj"]}).read_text())
    d["hardware"] = {"gpu": "h100-sxm-80gb", "host": "dgx-h100-host", "cluster": {"preset": "dgx-h100", "nodes": 1}}
    d["parallelism"] = {"tensor_model_parallel_size": 2, "sequence_parallel": sequence_parallel}
    p = tmp_path / "tp.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def test_sequence_parallel_refused_naming_the_key(tmp_path, capsys):
    p = _tp_scenario(tmp_path, sequence_parallel=True)
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "training.lora with parallelism.sequence_parallel True is not modelled" in err


def test_tensor_parallel_splits_b_of_column_and_a_of_row_parallel_linears():
    # t 2: q_proj (column-parallel QKV) A [64, 4] whole, B [4, 32]; o_proj (row-parallel proj) A [32, 4], B [4, 64]
    s = spec(LoraSpec(4, 8, ("q_proj", "o_proj")), tensor_parallel_size=2)
    assert trainable_parameters(s) == 2 * (4 * (64 + 32) + 4 * (32 + 64)) == 1536  # per TP rank
    assert trainable_parameters(spec(LoraSpec(4, 8, ("q_proj", "o_proj")))) == 2 * 2 * 4 * (64 + 64) == 2048
    g = build_gpt_step(s)
    gemm = {o.name: o.shape for o in g.ops if o.layer == 0 and ".lora." in o.name and o.cost_class is CostClass.GEMM}
    assert gemm["L0.fwd.lora.q_proj.A.gemm"] == (T, 4, 64) and gemm["L0.fwd.lora.q_proj.B.gemm"] == (T, 32, 4)
    assert gemm["L0.fwd.lora.o_proj.A.gemm"] == (T, 4, 32) and gemm["L0.fwd.lora.o_proj.B.gemm"] == (T, 64, 4)
    # one [T, r] 16-bit all-reduce per adapter: forward after the row-parallel A, backward after the column-parallel
    # B's input gradient (2 x 32 x 4 = 256 bytes)
    lora_tp = sorted((o.name, o.meta["bytes"]) for o in g.ops if o.layer == 0 and o.kind is OpKind.COLLECTIVE
                     and ".lora." in o.name)
    assert lora_tp == [("L0.bwd.tp.lora.q_proj.B.dgrad.all_reduce", 256), ("L0.fwd.tp.lora.o_proj.A.all_reduce", 256)]
    assert sum(p.numel for p in g.param_groups) == 1536


def test_tensor_parallel_scenario_reports_whole_model_trainable_count(tmp_path):
    summary = run_scenario(load_scenario(_tp_scenario(tmp_path, sequence_parallel=False))).summary
    assert summary["num_trainable_parameters"] == 2 * 2 * 4 * (4096 + 4096) == 131_072


def test_spec_refuses_what_the_schema_refuses():
    with pytest.raises(ValueError, match="rank must be > 0"):
        spec(LoraSpec(0, 8, ("q_proj",)))
    with pytest.raises(ValueError, match="exceeds min"):
        spec(LoraSpec(17, 8, ("k_proj",)))  # k_proj is [64, 16]
    with pytest.raises(ValueError, match="not a module"):
        spec(LoraSpec(4, 8, ("gate_proj",)), swiglu=False)
    with pytest.raises(ValueError, match="sequence parallelism"):
        spec(LoraSpec(4, 8, ("q_proj",)), tensor_parallel_size=2, sequence_parallel=True)


def test_memory_estimate_and_megatron_flops_do_not_pretend_to_cover_lora(tmp_path):
    from simulator.api import megatron_flops_per_s_per_gpu
    from simulator.studies.memory_estimate import NotEstimated, estimate_memory

    cfg = load_scenario(_scenario(tmp_path, {**GPT2_SMALL}, {"rank": 4, "target_modules": ["q_proj"]}))
    with pytest.raises(NotEstimated, match="training.lora"):
        estimate_memory(cfg)
    # Megatron's formula counts weight gradients a LoRA step does not run: no figure rather than a wrong one
    assert megatron_flops_per_s_per_gpu(cfg, {"step_time_s": 1.0, "world_size": 1}) is None
    full = load_scenario(_scenario(tmp_path, {**GPT2_SMALL}))
    assert megatron_flops_per_s_per_gpu(full, {"step_time_s": 1.0, "world_size": 1}) > 0


@settings(max_examples=25, deadline=None)
@given(mods=st.sets(st.sampled_from(ALL7), min_size=1), rank=st.integers(1, 16), t=st.sampled_from([1, 2]),
       dp=st.sampled_from([1, 2]))
def test_param_groups_grads_and_reductions_are_the_trainable_count(mods, rank, t, dp):
    # any HF module subset, rank up to k_proj's width 16, TP 1/2, DDP 1/2: the gradients the graph makes, their
    # DDP all-reduce and the optimizer step all cover exactly this rank's adapters
    s = spec(LoraSpec(rank, 2 * rank, tuple(sorted(mods, key=ALL7.index))), tensor_parallel_size=t,
             data_parallel_size=dp)
    Pa = trainable_parameters(s)
    g = build_gpt_step(s)
    assert sum(p.numel for p in g.param_groups) == Pa
    assert sum(a.nbytes for o in g.ops for a in o.allocs if a.name.startswith("grad.")) == 4 * Pa
    dp_bytes = sum(o.meta["bytes"] for o in g.ops if o.kind is OpKind.COLLECTIVE and o.meta.get("group") == "dp")
    assert dp_bytes == (4 * Pa if dp > 1 else 0)
    assert not [o for o in g.ops if o.name.endswith(".wgrad") and ".lora." not in o.name]


def test_model_flops_count_what_a_lora_step_runs():
    # t 1: model FLOPs = base GEMMs 2 x forward (no wgrad) + adapters 3 x forward + attention 3 x forward; the first two
    # are exactly the graph's GEMM FLOPs (the LM head included: forward and input gradient)
    s = spec(LoraSpec(4, 8, ("q_proj", "o_proj", "down_proj")))
    g = build_gpt_step(s)
    att = 3 * 2 * 4 * s.attention_width * s.attention_pairs * s.micro_batch_size  # 2 layers
    gemm = sum(o.flops for o in g.ops if o.cost_class is CostClass.GEMM)
    # by hand (T 32): base forward 2 T (h x 96 + 64 h + 3 h f) x 2 layers + head 2 T h V = 5,242,880 + 4,096,000, x 2 =
    # 18,677,760; adapters r (in + out) = 4 x (128 + 128 + 224) = 1,920 per layer, 2 T x 3,840 x 3 = 737,280
    assert g.model_flops_per_step - att == gemm == 18_677_760 + 737_280
    full = build_gpt_step(spec())
    assert g.model_flops_per_step < full.model_flops_per_step
