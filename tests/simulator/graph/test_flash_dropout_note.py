"""Attention dropout inside a flash kernel is not priced, and the run says so (``attention.flash_dropout_note``), with
the FlashAttention-1 slowdowns of Dao et al. 2022 (Appendix E.6, Tables 15-20) worked by hand."""

from __future__ import annotations

import pytest

from simulator.api import resolve_hardware, run_warnings
from simulator.config.loader import scenario_from_dict
from simulator.graph.builders.attention import fa1_dropout_slowdown, flash_dropout_note

BASE = {
    "name": "flash-dropout",
    "hardware": {"gpu": "h100-sxm-80gb"},
    "model": {"num_layers": 2, "hidden_size": 512, "num_attention_heads": 8, "seq_length": 512, "vocab_size": 1000},
    "training": {"micro_batch_size": 1, "precision": "bf16"},
    "run": {"steps": 2, "warmup_steps": 1},
}


def test_fa1_slowdowns_by_hand():
    # forward: 2k 2.81 / 2.40 = 1.1708 (smallest), 16k 167.01 / 134.03 = 1.2461 (largest);
    # backward: 2k 6.50 / 5.45 = 1.1927 (smallest), 16k 416.10 / 336.00 = 1.2384 (largest)
    assert fa1_dropout_slowdown("fwd") == pytest.approx((0.41 / 2.40, 32.98 / 134.03), rel=1e-12)
    assert fa1_dropout_slowdown("bwd") == pytest.approx((1.05 / 5.45, 80.10 / 336.00), rel=1e-12)


@pytest.mark.parametrize("backend", ["flash", "flash_varlen"])
def test_flash_with_attention_dropout_is_flagged(backend):
    note = flash_dropout_note(backend, 0.1)
    assert note.startswith(f"model.attention_dropout 0.1 with attention_backend {backend}: the dropout inside")
    assert "17%-25% slower forward and 19%-24% backward" in note, note


@pytest.mark.parametrize("backend,p", [("flash", 0.0), ("flash_varlen", 0.0), ("unfused", 0.1), ("unfused", 0.0)])
def test_no_note_without_flash_dropout(backend, p):
    assert flash_dropout_note(backend, p) is None


def test_run_warnings_carry_the_note_only_with_dropout():
    def notes(p: float) -> list[str]:
        cfg = scenario_from_dict({**BASE, "model": {**BASE["model"], "attention_dropout": p}})
        return [w for w in run_warnings(resolve_hardware(cfg), cfg) if w.startswith("model.attention_dropout")]

    assert len(notes(0.1)) == 1 and "flash-attention kernels is not priced" in notes(0.1)[0]
    assert notes(0.0) == []
