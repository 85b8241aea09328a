"""Host CPU power counts the threads the CPU step actually runs on (trial finding: ``_host_busy_cores`` counted
every host op as ``cores - 1`` busy cores, so threads=1 read 87.0 W on the offload scenario, more than 78.8 W at
16 threads)."""

from __future__ import annotations

import pytest

from simulator.api import run_scenario
from simulator.config.loader import load_scenario
from tests.conftest import ROOT

OFFLOAD = ROOT / "scenarios/h200/gpt_184m_b16_offload_overlap.yaml"
IDLE_W, BUSY_W, CORES = 1.5, 4.0, 16  # power/h200-sxm-141gb.yaml host_*_w_per_core; h200-measured-host cores


def _run(threads):
    return run_scenario(load_scenario(OFFLOAD, [f"hardware.host.threads={threads}", "run.steps=2",
                                                "run.warmup_steps=1"])).summary


def test_one_thread_keeps_only_the_training_threads_core_busy():
    # the CPU step runs on the training thread itself: 1 busy core all step, 16 x 1.5 W + 1 x 4.0 W = 28.0 W
    s = _run(1)
    assert s["host_avg_power_w"] == pytest.approx(CORES * IDLE_W + 1 * BUSY_W, rel=1e-12)
    assert s["host_energy_j_per_step"] == pytest.approx(28.0 * s["step_time_s"], rel=1e-9)


@pytest.mark.parametrize("threads", [4, 16])
def test_n_threads_add_n_minus_one_cores_while_the_cpu_step_runs(threads):
    # busy = 1 + (threads - 1) x (CPU-step time / step): the grad cast, AdamW and param cast back to back
    s = _run(threads)
    frac = s["offload_cpu_optimizer_s"] / s["step_time_s"]
    assert s["host_avg_power_w"] == pytest.approx(CORES * IDLE_W + (1 + (threads - 1) * frac) * BUSY_W, rel=1e-3)


def test_fewer_threads_draw_less_host_power():
    assert _run(1)["host_avg_power_w"] < _run(16)["host_avg_power_w"]
