"""DataLoader workers that do not hold up the step say that more change nothing (they said nothing), and a run
whose measured steps see no stall only because the prefetch buffer is still draining says so; each claim is
checked against the runs it is about."""

from __future__ import annotations

import re

import pytest

from simulator import load_scenario, run_scenario
from tests.conftest import ROOT

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

H200 = ROOT / "scenarios/h200"
OFF_PATH = "dataloader: data loading is not on the critical path with num_workers"


def _run(name: str, *sets):
    return run_scenario(load_scenario(H200 / name, list(sets))).summary


def _notes(s) -> list[str]:
    return [w for w in s["warnings"] if w.startswith("dataloader:")]


def test_workers_off_the_critical_path_say_more_change_nothing():
    """6.0553 ms x 8 samples = 48.4 ms per batch on a worker against a 30.4 ms step: 2 workers (24.2 ms per batch)
    keep up, so 2, 4 and 8 workers give the same step to the bit; the 4-worker run says adding workers changes
    nothing and that 2 = ceil(48.4 / 30.4) keep up; 1 worker (48.4 ms) stalls and gets no such note."""
    two, four, eight = _run("dataloader_w2.yaml"), _run("dataloader_w4.yaml"), _run("dataloader_w8.yaml")
    assert two["step_time_s"] == four["step_time_s"] == eight["step_time_s"]
    assert two["data_stall_s"] == four["data_stall_s"] == 0.0
    (note,) = _notes(four)
    assert note.startswith(f"{OFF_PATH} 4: no measured step waits for a batch (a batch takes 48.4 ms on a worker, "
                           "so 4 workers deliver one every 12.1 ms, and the step takes 30.4 ms per batch)")
    assert note.endswith("so adding workers changes nothing; 2 workers keep up in steady state")
    (note2,) = _notes(two)
    assert note2.endswith("so adding workers changes nothing")  # 2 is already the fewest
    one = _run("dataloader_w1.yaml")
    assert one["data_stall_s"] > 0 and not _notes(one)


def test_a_batch_that_costs_nothing_says_workers_change_nothing():
    """Zero decode cost: a batch is only its collate copy (2 x 8 x 8200 B at the host's 67.05 GB/s memcpy:
    1.96 us), so one worker keeps up and three change nothing."""
    (note,) = _notes(_run("dataloader_w3.yaml", "dataloader.sample.cost={distribution: constant, mean_s: 0}"))
    assert note.startswith(f"{OFF_PATH} 3: no measured step waits for a batch (a batch takes 0.00196 ms on a worker")
    assert note.endswith("adding workers changes nothing; 1 worker keeps up in steady state")


def test_a_draining_prefetch_buffer_is_flagged_and_its_stall_predicted():
    """32 ms x 8 samples = 256 ms per batch: 8 workers deliver one every 32.0 ms, slower than the 30.4 ms step;
    the 16 batches prefetched at the start last the 8 steps of the scenario, so no measured step stalls. The note
    predicts the stall of a longer run (32.0 - 30.4 = 1.57 ms per batch); a simulated 96-step run timing its last 48
    steps stalls that much (a consistency check of the model, not a measurement) (1% tolerance: the steady state's step is the workers' period)."""
    cost = "dataloader.sample.cost={distribution: constant, mean_s: 32 ms}"
    short = _run("dataloader_w8.yaml", cost)
    assert short["data_stall_s"] == 0.0
    (note,) = _notes(short)
    assert note.startswith("dataloader: no measured step waits for a batch, but a batch takes 256 ms on a worker, "
                           "so 8 workers deliver one every 32 ms, slower than the 30.4 ms per batch")
    predicted_s = float(re.search(r"stalls about ([\d.]+) ms per batch", note).group(1)) * 1e-3
    long = _run("dataloader_w8.yaml", cost, "run.steps=96", "run.warmup_steps=48")
    assert long["data_stall_s"] == pytest.approx(predicted_s, rel=0.01)
    assert not _notes(long)  # it stalls: neither note


def test_a_loader_without_any_cost_says_so_and_one_with_a_cost_does_not():
    """`--set dataloader.num_workers=4` on a scenario without a dataloader section (fresh-user trial) builds a loader
    whose batches cost nothing but their copy: the run says so; a sample cost of 1 ms or a collate time silences it."""
    import warnings

    from simulator.api import ineffective_setting_warnings
    from simulator.config.loader import load_scenario
    from tests.conftest import ROOT

    b8 = ROOT / "scenarios/h200/gpt_184m_b8.yaml"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bare = ineffective_setting_warnings(load_scenario(b8, ["dataloader.num_workers=4"]))
        cost = ineffective_setting_warnings(load_scenario(b8, ["dataloader.num_workers=4",
                                                               "dataloader.sample.cost.mean_s=0.001"]))
        collate = ineffective_setting_warnings(load_scenario(b8, ["dataloader.collate_overhead_s=0.002"]))
    assert [w for w in bare if w.startswith("dataloader: no per-sample or per-batch cost")]
    assert not [w for w in cost + collate if w.startswith("dataloader: no per-sample")]
