"""The run's seed decides the DataLoader's random sample costs: one seed repeats, two seeds differ."""

from __future__ import annotations

import numpy as np
import pytest

from hardware_models.dataloader import SampleCost
from simulator import load_scenario, run_scenario
from tests.conftest import ROOT

W0 = ROOT / "scenarios/h200/dataloader_w0.yaml"
MEAN_S, SIGMA = 6.0553e-3, 0.5


def lognormal_run(seed: int, scenario=W0):
    return run_scenario(load_scenario(scenario, [
        "dataloader.sample.cost.distribution=lognormal", "dataloader.sample.cost.sigma=0.5",
        f"run.seed={seed}"]))


def test_one_seed_repeats_byte_for_byte_and_two_seeds_differ():
    a, b, c = lognormal_run(7), lognormal_run(7), lognormal_run(8)
    assert a.spans.to_csv(index=False) == b.spans.to_csv(index=False)
    assert a.summary == b.summary
    assert a.spans.to_csv(index=False) != c.spans.to_csv(index=False)
    assert a.summary["data_stall_s"] != c.summary["data_stall_s"]


def test_sample_costs_are_the_runs_generator_draws():
    """With 0 workers next() builds the batch inline: its span lasts the batch's 8 sample costs
    (plus about 5 us of collate and pinning copies at the host's 67 GB/s), and those costs are the
    first draws of ``default_rng(run.seed)``, in sample order."""
    seed = 11
    r = lognormal_run(seed)
    costs = SampleCost("lognormal", MEAN_S, SIGMA).draw(np.random.default_rng(seed), 1024)
    nxt = r.spans[r.spans.kind == "dataloader"].sort_values("step")
    assert len(nxt) == 8
    for step, dur in zip(nxt.step, nxt.end_s - nxt.start_s):
        assert dur == pytest.approx(costs[8 * step: 8 * step + 8].sum(), abs=10e-6)
