"""A DeepSpeed pipeline with ZeRO stage 0 and bf16 runs BF16_Optimizer (``schema.deepspeed_bf16_optimizer``): the
summary names it (not "DDP") and the ``ddp`` keys the scenario writes, which it does not read, are warned about."""

from __future__ import annotations

from simulator.api import data_parallel_strategy, ineffective_setting_warnings
from simulator.config.loader import load_scenario
from tests.conftest import ROOT

SCEN = ROOT / "scenarios/cluster/gpt_16x2048_pp4_dp2_dgx_h100.yaml"  # bf16, pp 4, dp 2, ddp {bucket_cap_mb, overlap}


def test_stage_0_bf16_pipeline_is_labelled_bf16_optimizer_and_its_ddp_keys_are_warned():
    cfg = load_scenario(SCEN, ["zero_optimization.stage=0"])
    assert data_parallel_strategy(cfg) == "DeepSpeed BF16_Optimizer"
    lines = [w for w in ineffective_setting_warnings(cfg) if w.startswith("ddp.")]
    assert len(lines) == 2, lines
    assert lines[0].startswith("ddp.bucket_cap_mb has no effect with DeepSpeed BF16_Optimizer")
    assert lines[1].startswith("ddp.overlap_grad_reduce true has no effect with DeepSpeed BF16_Optimizer")


def test_without_deepspeed_the_same_run_is_ddp_and_reads_its_ddp_keys():
    cfg = load_scenario(SCEN)  # no zero_optimization section: Megatron-LM's DDP, which reads ddp.*
    assert data_parallel_strategy(cfg) == "DDP"
    assert not [w for w in ineffective_setting_warnings(cfg) if w.startswith("ddp.")]
