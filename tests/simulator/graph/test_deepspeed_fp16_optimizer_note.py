"""A DeepSpeed config with ZeRO stage 0 and fp16 / bf16 (no pipeline for bf16) runs under DeepSpeed's
``FP16_Optimizer`` (deepspeedai/DeepSpeed@007cca6a deepspeed/runtime/engine.py ``_do_optimizer_sanity_check``), which
is not built: the run says it prices Megatron-LM's DDP instead. BF16 with a pipeline is ``BF16_Optimizer`` (priced,
no such line)."""

from __future__ import annotations

import pytest

from simulator.api import deepspeed_fp16_optimizer_note, resolve_hardware, run_warnings
from simulator.config.loader import load_scenario
from tests.conftest import ROOT

DP8 = ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml"
PP2 = ROOT / "scenarios/cluster/gpt_16x2048_pp4_dp2_dgx_h100.yaml"
LINE = "zero_optimization.stage 0 with training.precision"


def _lines(path, overrides):
    cfg = load_scenario(path, overrides)
    return cfg, [w for w in run_warnings(resolve_hardware(cfg, str(path)), cfg) if w.startswith(LINE)]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_zero0_16bit_without_pipeline_is_flagged(precision):
    cfg, lines = _lines(DP8, ["zero_optimization={stage: 0}", f"training.precision={precision}"])
    assert lines == [deepspeed_fp16_optimizer_note(cfg)] and f"precision {precision} is priced as" in lines[0]


@pytest.mark.parametrize("path,overrides", [
    (DP8, ["training.precision=bf16"]),  # no DeepSpeed section: Megatron-LM's DDP is what runs
    (DP8, ["zero_optimization={stage: 1}", "training.precision=bf16"]),  # ZeRO-1: DeepSpeed's ZeRO optimizer
    (PP2, ["zero_optimization={stage: 0}", "training.precision=bf16"]),  # BF16_Optimizer, priced
])
def test_no_line_where_the_step_is_priced_as_it_runs(path, overrides):
    assert _lines(path, overrides)[1] == []
