"""FSDP2 reshards every block after forward here; torchtitan keeps its last block gathered
(pytorch/torchtitan@81c12433 torchtitan/models/llama3/infra/parallelize.py ``apply_fsdp``): the run says so."""

from __future__ import annotations

from simulator.api import fsdp2_last_block_note, resolve_hardware, run_warnings
from simulator.config.loader import load_scenario
from tests.conftest import ROOT

DP8 = ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml"
LINE = "fsdp.version 2: every block is resharded after forward"


def _warnings(overrides):
    cfg = load_scenario(DP8, overrides)
    return cfg, run_warnings(resolve_hardware(cfg, str(DP8)), cfg)


def test_fsdp2_resharding_every_block_is_flagged():
    cfg, out = _warnings(["fsdp={version: 2}"])
    assert [w for w in out if w.startswith(LINE)] == [fsdp2_last_block_note(cfg)]


def test_no_note_without_resharding_or_with_fsdp1():
    for o in (["fsdp={version: 2, reshard_after_forward: false}"], ["fsdp={version: 1}"], []):
        cfg, out = _warnings(o)
        assert fsdp2_last_block_note(cfg) is None and not any(w.startswith(LINE) for w in out), o
