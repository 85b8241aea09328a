"""The dataloader what-ifs copy a scenario without marking its unwritten sections as given.

``with_steps`` / ``with_workers`` dumped every default and reloaded it, so a Megatron bf16 pipeline came back with a
``zero_optimization`` section "given" and was then priced as DeepSpeed's BF16_Optimizer
(``schema.deepspeed_bf16_optimizer`` reads the section's presence): a silently different optimizer step."""

from pathlib import Path

from simulator.config.loader import load_scenario
from simulator.config.schema import deepspeed_bf16_optimizer
from simulator.studies.whatif_dataloader import with_steps, with_workers

ROOT = Path(__file__).resolve().parents[3]


def test_a_megatron_bf16_pipeline_stays_megatron_after_the_copy():
    cfg = load_scenario(ROOT / "scenarios/cluster/gpt_16x2048_pp4_dp2_dgx_h100.yaml")
    assert not deepspeed_bf16_optimizer(cfg)
    copy = with_steps(cfg, 3)
    assert not deepspeed_bf16_optimizer(copy) and copy.run.steps == 3
    assert copy.model_fields_set == cfg.model_fields_set


def test_the_worker_copy_marks_no_new_section_given():
    # a DataLoader is modelled with pp 1 only, so the worker copy is checked on a single-GPU scenario
    cfg = load_scenario(ROOT / "scenarios/h200/dataloader_w0.yaml")
    copy = with_workers(cfg, 2)
    assert copy.dataloader.num_workers == 2 and copy.model_fields_set == cfg.model_fields_set


def test_a_deepspeed_stage0_pipeline_stays_bf16_optimizer_after_the_copy():
    cfg = load_scenario(ROOT / "scenarios/cluster/gpt_16x2048_pp4_dp2_dgx_h100.yaml", ["zero_optimization.stage=0"])
    assert deepspeed_bf16_optimizer(cfg) and deepspeed_bf16_optimizer(with_steps(cfg, 3))
