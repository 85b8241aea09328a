"""``training.recompute_granularity: selective`` is Megatron-LM's policy; with ``fsdp.version 2`` (torchtitan) the run
says that torchtitan's own selective activation checkpointing (pytorch/torchtitan@81c12433
torchtitan/models/llama3/infra/parallelize.py ``_apply_ac_to_transformer_block``) is not what it prices."""

from __future__ import annotations

from simulator.api import fsdp2_selective_note, resolve_hardware, run_warnings
from simulator.config.loader import load_scenario
from tests.conftest import ROOT

DP8 = ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml"
LINE = "training.recompute_granularity selective with fsdp.version 2 is priced as Megatron-LM's selective recompute"


def _warnings(overrides):
    cfg = load_scenario(DP8, overrides)
    return cfg, run_warnings(resolve_hardware(cfg, str(DP8)), cfg)


def test_fsdp2_with_selective_recompute_is_flagged():
    cfg, out = _warnings(["fsdp={version: 2}", "training.recompute_granularity=selective"])
    assert [w for w in out if w.startswith(LINE)] == [fsdp2_selective_note(cfg)]


def test_no_note_for_fsdp1_full_or_none():
    for o in (["fsdp={version: 1}", "training.recompute_granularity=selective"],
              ["fsdp={version: 2}", "training.recompute_granularity=full"], ["fsdp={version: 2}"]):
        cfg, out = _warnings(o)
        assert fsdp2_selective_note(cfg) is None and not any(w.startswith(LINE) for w in out), o
