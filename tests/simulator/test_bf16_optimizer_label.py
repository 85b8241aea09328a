"""A DeepSpeed pipeline with ZeRO stage 0 and bf16 runs BF16_Optimizer (``schema.deepspeed_bf16_optimizer``): the
summary names it (not "DDP") and the ``ddp`` keys the scenario writes, which it does not read, are warned about."""

from __future__ import annotations

import pytest

from simulator.api import data_parallel_strategy, ineffective_setting_warnings
from simulator.cli import main
from simulator.config.loader import load_scenario
from tests.conftest import ROOT

SCEN = ROOT / "scenarios/cluster/gpt_16x2048_pp4_dp2_dgx_h100.yaml"  # bf16, pp 4, dp 2, ddp {bucket_cap_mb, overlap}


def test_stage_0_bf16_pipeline_is_labelled_bf16_optimizer_and_its_ddp_keys_are_warned():
    """The scenario's pasted ``bucket_cap_mb: 25`` (PyTorch's default) asks for nothing and is not named, as under
    ZeRO; its ``overlap_grad_reduce: true`` asks for an overlap BF16_Optimizer does not run and is. Before, the
    pasted default cap was named too."""
    cfg = load_scenario(SCEN, ["zero_optimization.stage=0"])
    assert data_parallel_strategy(cfg) == "DeepSpeed BF16_Optimizer"
    assert "bucket_cap_mb" in cfg.ddp.model_fields_set and cfg.ddp.bucket_cap_mb == 25
    lines = [w for w in ineffective_setting_warnings(cfg) if w.startswith("ddp.")]
    assert len(lines) == 1, lines
    assert lines[0].startswith("ddp.overlap_grad_reduce true has no effect with DeepSpeed BF16_Optimizer")


@pytest.mark.parametrize("setting,line", [
    ("ddp.bucket_cap_mb=1", "ddp.bucket_cap_mb has no effect with DeepSpeed BF16_Optimizer (one all-reduce"),
    ("ddp.first_bucket_mb=5", "ddp.first_bucket_mb has no effect with DeepSpeed BF16_Optimizer (one all-reduce"),
    ("ddp.gradient_as_bucket_view=true", "ddp.gradient_as_bucket_view has no effect with DeepSpeed BF16_Optimizer"),
    ("ddp.bucket_size=1000000", "ddp.bucket_size has no effect with DeepSpeed BF16_Optimizer (one all-reduce"),
])
def test_a_ddp_key_set_to_another_value_is_named_under_bf16_optimizer(setting, line):
    """Set away from its default, each bucket key is named, naming BF16_Optimizer (``bucket_size`` too: before, it
    said the buckets here were ``bucket_cap_mb``'s, PyTorch DDP's, which do not run either)."""
    cfg = load_scenario(SCEN, ["zero_optimization.stage=0", setting])
    lines = [w for w in ineffective_setting_warnings(cfg) if w.startswith("ddp.") and "overlap_grad" not in w]
    assert len(lines) == 1 and lines[0].startswith(line), lines


def test_megatrons_distributed_optimizer_under_bf16_optimizer_is_refused(capsys):
    """Megatron-LM's distributed optimizer beside a DeepSpeed BF16_Optimizer run, one line, exit 2 (as under
    FP16_Optimizer). Before it was refused too; this keeps it so after the grad-buffer keys became warnings."""
    assert main(["run", str(SCEN), "--set", "zero_optimization.stage=0", "--set",
                 "ddp.use_distributed_optimizer=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ddp.use_distributed_optimizer: Megatron-LM's optimizer, but zero_optimization stage 0 " \
        "with bf16 and a pipeline runs DeepSpeed's BF16_Optimizer" in err[0], err


@pytest.mark.parametrize("settings,keys", [
    (["ddp.accumulate_allreduce_grads_in_fp32=true"], "ddp.accumulate_allreduce_grads_in_fp32 has"),
    (["ddp.grad_reduce_in_bf16=true"], "ddp.grad_reduce_in_bf16 has"),
    (["ddp.grad_reduce_in_bf16=true", "ddp.accumulate_allreduce_grads_in_fp32=true"],
     "ddp.accumulate_allreduce_grads_in_fp32, ddp.grad_reduce_in_bf16 have"),
])
def test_megatrons_grad_buffer_keys_under_bf16_optimizer_are_warned_as_under_fp16_optimizer(settings, keys):
    """Megatron-LM's grad-buffer keys beside a DeepSpeed BF16_Optimizer run: one warning naming them, the same graph
    as without them, as under FP16_Optimizer (test_fp16_optimizer_label). Megatron-DeepSpeed accepts
    --accumulate-allreduce-grads-in-fp32 under --deepspeed (validate_args sets it itself for --bf16) and never reads
    it there (deepspeedai/Megatron-DeepSpeed@207b2d5a megatron/training.py get_model returns before LocalDDP).
    Before, they were refused (exit 2) under BF16_Optimizer and only warned under FP16_Optimizer, and the warning's
    BF16_Optimizer branch could not be reached."""
    from simulator.api import build_graph

    base = ["zero_optimization.stage=0", "model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=4",
            "model.seq_length=128", "model.vocab_size=1024"]
    cfg = load_scenario(SCEN, [*base, *settings])
    lines = [w for w in ineffective_setting_warnings(cfg) if "grad_reduce_in_bf16" in w or "in_fp32" in w]
    assert lines == [f"{keys} no effect with DeepSpeed BF16_Optimizer: Megatron-LM's grad buffer is not used "
                     "(DeepSpeed keeps the .grad in the model dtype, training.precision bf16)"]
    plain = load_scenario(SCEN, base)
    assert [(o.name, o.bytes_read, o.bytes_written) for o in build_graph(cfg).ops] == [
        (o.name, o.bytes_read, o.bytes_written) for o in build_graph(plain).ops]


def test_without_deepspeed_the_same_run_is_ddp_and_reads_its_ddp_keys():
    cfg = load_scenario(SCEN)  # no zero_optimization section: Megatron-LM's DDP, which reads ddp.*
    assert data_parallel_strategy(cfg) == "DDP"
    assert not [w for w in ineffective_setting_warnings(cfg) if w.startswith("ddp.")]
