"""First-touch page faults in the run summary (fresh-user trial): ``host_page_fault_s`` per step, and a printed line
when it is not zero."""

from __future__ import annotations

import warnings

import pytest

from simulator import load_scenario, run_scenario
from simulator.cli import format_summary
from tests.conftest import ROOT


def _summary(path, sets):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_scenario(load_scenario(path, sets)).summary


def test_fsdp2_offload_accumulation_faults_are_reported():
    # 1 layer, 3 micro-batches: micro-batches 1 and 2 copy the root's reduced shard (wte 32768 x 2048 / 8 ranks =
    # 8,388,608 fp32 = 32 MiB: mmap-ed, freed after its add) into a fresh tensor, 8,192 pages at the fitted
    # 6.18 us (DEFAULT_PAGE_FAULT_S; dgx-h100-host has none): 2 x 8192 x 6.18e-6 = 101.25 ms per step; the block's
    # parameters (under 32 MiB each) and the fused CPU AdamW fault nothing
    s = _summary(ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_fsdp2_offload.yaml",
                 ["model.num_layers=1", "training.global_batch_size=192", "run.steps=2", "run.warmup_steps=1"])
    assert s["host_page_fault_s"] == pytest.approx(2 * 8192 * 6.18e-6, rel=1e-12)
    assert "host page faults    101.25 ms/step of host time on first-touch faults" in format_summary(s, "x")


def test_zero_offload_cpu_adam_faults_are_reported():
    # gpt_184m_b16_offload_serial: torch_foreach CPU AdamW on the h200-measured-host (16 threads, 6.177 us a page).
    # Fresh each step: cpu.grad_cast's fp32 gradients and cpu.adam's sqrt temporary, 4 B per parameter each, all
    # 185,759,744 parameters (148 tensors, freed together: over 32 MiB in all, host_kernels.faulting_elements):
    # 2 x 4 x 185759744 B / 4096 = 362,812 pages x 6.177 us / 16 threads = 140.07 ms per step
    s = _summary(ROOT / "scenarios/h200/gpt_184m_b16_offload_serial.yaml", [])
    assert s["host_page_fault_s"] == pytest.approx(2 * 4 * 185759744 / 4096 * 6.177e-6 / 16, rel=1e-9)
    assert "host page faults    140.07 ms/step" in format_summary(s, "x")


def test_no_faults_no_line():
    s = _summary(ROOT / "scenarios/h200/gpt_184m_b16.yaml", ["run.steps=2", "run.warmup_steps=1"])
    assert s["host_page_fault_s"] == 0.0
    assert "page faults" not in format_summary(s, "x")
