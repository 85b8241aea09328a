"""Plain fp32 and TF32 training (``training.precision: fp32 | tf32``): fp32 parameters, activations and Adam
state, GEMMs at the GPU's fp32 or TF32 rate; worked out by hand on a tiny model, and bad input."""

from __future__ import annotations

import pytest

from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.ops import Phase
from tests.conftest import refused_in_one_line

TINY = dict(num_layers=1, hidden_size=8, num_attention_heads=4, seq_length=4, vocab_size=16, ffn_hidden_size=32,
            micro_batch_size=2, attention_backend="unfused")
T, H = 8, 8  # tokens, hidden


def _graph(**kw):
    return build_gpt_step(TransformerSpec(**{**TINY, **kw}))


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_gemms_are_fp32_operands_at_the_precisions_rate(precision):
    g = _graph(precision=precision)
    ops = {op.name: op for op in g.ops}
    qkv = ops["L0.fwd.qkv.gemm"]
    assert qkv.dtype == precision
    assert (qkv.bytes_read, qkv.bytes_written) == (4 * (T * H + H * 3 * H), 4 * T * 3 * H)
    wgrad = ops["L0.bwd.fc1.wgrad"]
    assert (wgrad.bytes_read, wgrad.bytes_written) == (4 * (T * 32 + T * H), 4 * H * 32)
    core = ops["L0.fwd.attn.qk_bmm"]  # B = 8, s = 4, d = 2: scores 4 bytes each
    assert core.dtype == precision and core.bytes_written == 4 * 8 * 16
    # no autocast casts, no fp32 copy of the logits (they are fp32)
    assert not any(".cast_" in n or n.endswith("logits.float") or "logits.float.dgrad" in n for n in ops)


def test_fp32_states_no_master_copy_and_adam_writes_12_bytes_per_param():
    g = _graph(precision="tf32")
    P = TransformerSpec(**{**TINY, "precision": "tf32"}).num_parameters
    persistent = {t.name: t.nbytes for t in g.persistent}
    assert persistent == {"params.fp32": 4 * P, "optimizer.exp_avg": 4 * P, "optimizer.exp_avg_sq": 4 * P}
    adam = next(op for op in g.ops if op.name == "opt.adamw")
    assert (adam.bytes_read, adam.bytes_written) == (16 * P, 12 * P)


def test_fp32_activation_memory_doubles_all_but_the_masks():
    """Korthikanti's per-layer terms with 4-byte tensors: 2 x 34 sbh, less the two 1-byte hidden-dropout masks
    (2 sbh), and (2 x 4 + 1) a s^2 b for the softmax output, dropout output and mask: 66 x 64 + 9 x 128 = 5,376;
    plus the two LayerNorms' fp32 mean and rstd (8 B x 8 tokens each, which Korthikanti's count leaves out): 5,504."""
    g = _graph(precision="fp32", attention_dropout=0.1, hidden_dropout=0.1)
    bwd_uses = {u for op in g.ops if op.phase == Phase.BWD for u in op.uses}
    saved = sum(t.nbytes for op in g.ops if op.phase == Phase.FWD and op.layer == 0 for t in op.allocs
                if t.name in bwd_uses)
    assert saved == 66 * 64 + 9 * 4 * 16 * 2 + 2 * 8 * T == 5504


def test_fp32_gemm_is_priced_at_the_fp32_peak_and_tf32_at_its_own():
    from hardware_models import presets
    from simulator.config.loader import default_profile_for
    from simulator.cost.roofline import RooflineCostModel

    gpu = presets.get("gpus", "a100-sxm4-80gb")
    cm = RooflineCostModel(gpu, default_profile_for(gpu, "a100-sxm4-80gb", presets.get("links", "pcie-gen4-x16")))
    big = dict(TINY, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=16384, seq_length=2048)

    def fc1(precision):
        g = build_gpt_step(TransformerSpec(**{**big, "precision": precision}))
        return cm.split_s(next(op for op in g.ops if op.name == "L0.fwd.fc1.gemm"))[0]

    # compute-bound: the ratio of the datasheet peaks, 156 / 19.5 = 8, up to the fixed and per-wave times
    assert fc1("fp32") / fc1("tf32") == pytest.approx(gpu.peak("tf32") / gpu.peak("fp32"), rel=0.02)


BASE = {
    "name": "fp32",
    "hardware": {"gpu": "a100-sxm4-80gb"},
    "model": {"num_layers": 2, "hidden_size": 512, "num_attention_heads": 8, "seq_length": 512, "vocab_size": 1000,
              "attention_backend": "unfused"},
    "training": {"micro_batch_size": 1, "precision": "tf32"},
    "run": {"steps": 2, "warmup_steps": 1},
}


@pytest.mark.parametrize("change,needle", [
    ({"hardware": {"gpu": "v100-sxm2-32gb"}},
     "training.precision: tf32 needs TF32 tensor cores, which NVIDIA Tesla V100 SXM2 32GB has not"),
    ({"training": {**BASE["training"], "precision": "fp32", "fp8": "hybrid"}},
     "training.fp8: hybrid needs training.precision bf16"),
    ({"model": {**BASE["model"], "attention_backend": "flash"}},
     "training.precision: tf32 needs model.attention_backend: unfused"),
    ({"zero_optimization": {"stage": 3}}, "training.precision: tf32 with experts, ZeRO-3"),
])
def test_bad_input_one_line_exit_2(tmp_path, capsys, change, needle):
    err = refused_in_one_line(tmp_path, capsys, {**BASE, **change})
    assert needle in err, err


def test_tf32_runs_and_fp32_is_several_times_slower():
    """A GEMM-bound model: the fp32 step is several times the TF32 one (peaks 19.5 vs 156 TFLOP/s), not 8x (the
    memory-bound kernels run at the same speed)."""
    from simulator.api import run_scenario
    from simulator.config.loader import scenario_from_dict

    cfg = {**BASE, "model": {**BASE["model"], "hidden_size": 2048, "num_attention_heads": 16, "seq_length": 1024},
           "training": {"micro_batch_size": 4, "precision": "tf32"}}
    tf32 = run_scenario(scenario_from_dict(cfg)).summary["step_time_s"]
    fp32 = run_scenario(scenario_from_dict({**cfg, "training": {**cfg["training"], "precision": "fp32"}}))
    assert 3 < fp32.summary["step_time_s"] / tf32 < 8
