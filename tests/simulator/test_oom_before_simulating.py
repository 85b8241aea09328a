"""Out of memory found before simulating: a scenario whose persistent tensors (parameters, gradients, optimizer
state) alone exceed the GPU's memory gets its out-of-memory result without simulating the step
(``api.run_scenario``), and ``simulate run`` announces a run far over capacity before simulating it
(``cli.oom_notice``)."""

import pytest

from simulator import load_scenario, run_scenario
from simulator.api import PERSISTENT_OOM_NOTE, build_graph, memory_overheads, resolve_hardware, simulate_graph
from simulator.cli import main, oom_notice

SCEN = "scenarios/h200/gpt_184m_b16.yaml"
#: 2 GB of HBM: below the 184M GPT's persistent state (fp32 parameters 4 B, fp32 grads 4 B, Adam moments 8 B per
#: parameter: about 3 GB), above its first tensor
SMALL_GPU = ["hardware.gpu={preset: h200-sxm-141gb, overrides: {hbm_capacity_bytes: 2 GB}}", "run.steps=2"]


def test_persistent_over_capacity_reports_at_once_with_the_simulated_first_tensor():
    cfg = load_scenario(SCEN, SMALL_GPU)
    res = run_scenario(cfg)
    s = res.summary
    assert not res.ok and s["step_simulated"] is False
    assert s["oom"].endswith(PERSISTENT_OOM_NOTE) and s["num_ops"] == 0
    graph = build_graph(cfg)
    # the demand is the persistent tensors' plus the overheads (CUDA context + allocator reserve)
    persistent = sum(t.nbytes for t in graph.persistent if t.device == "gpu")
    assert s["peak_device_memory_bytes"] == pytest.approx(memory_overheads(cfg).device_bytes(persistent), abs=1)
    # the same first allocation over capacity, at the same time, as the simulated run's
    full = simulate_graph(graph, resolve_hardware(cfg), 1, 0, 0, {}, cfg).summary["oom"]
    first = full[full.index("first allocation over capacity"):full.index("; largest at peak")]
    assert first in s["oom"] and "at t=0.000 ms" in first


def test_activations_over_capacity_still_simulate():
    """Persistent state fits (about 3 GB of 30 GB); the activations of batch 256 do not: simulated as before."""
    cfg = load_scenario(SCEN, ["hardware.gpu={preset: h200-sxm-141gb, overrides: {hbm_capacity_bytes: 30 GB}}",
                               "training.micro_batch_size=256", "run.steps=2"])
    s = run_scenario(cfg).summary
    assert s["oom"] and PERSISTENT_OOM_NOTE not in s["oom"] and "step_simulated" not in s and s["step_time_s"] > 0


def test_cli_exit_1_and_summary_without_step_time(capsys):
    assert main(["run", SCEN, *[a for kv in SMALL_GPU for a in ("--set", kv)]]) == 1
    out = capsys.readouterr().out
    assert "step time           not simulated" in out and "throughput" not in out and "MFU" not in out
    assert "found before simulating" in out


def test_notice_far_over_capacity_only(capsys):
    far = load_scenario(SCEN, ["model.seq_length=10000000"])
    line = oom_notice(far)
    assert line is not None and line.startswith("notice: estimated peak ") and line.endswith(
        "GB of 150.75 GB: the run will report out of memory")
    assert float(line.split()[3]) > 1e5  # about 140,000 GB (the simulated peak: 139975.30 GB)
    assert oom_notice(load_scenario(SCEN)) is None  # fits
    # over capacity but by less than OOM_NOTICE_FACTOR: no notice (the simulation answers)
    assert oom_notice(load_scenario(SCEN, ["training.micro_batch_size=160"])) is None
