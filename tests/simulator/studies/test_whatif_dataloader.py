"""``dataloader-workers``: the answer is the steady-state one, worked out analytically."""

from __future__ import annotations

import json
import math

import pytest

from simulator import load_scenario, run_scenario
from simulator.studies.whatif_dataloader import min_workers_without_stall, steady_run, with_workers
from simulator.cli import main
from tests.conftest import ROOT

W0 = ROOT / "scenarios/h200/dataloader_w0.yaml"
SMALL = ["model.num_layers=2", "run.steps=5", "run.warmup_steps=1"]  # the schema's default run length
RATIO = 8.4  # one worker's batch time / GPU step: the steady state needs ceil(8.4) = 9 workers


def gpu_step_s() -> float:
    """The step without a loader (the GPU step S a fast enough loader leaves)."""
    cfg = load_scenario(W0, SMALL)
    data = cfg.model_dump(mode="python")
    data["dataloader"] = None
    from simulator.config.loader import scenario_from_dict

    return run_scenario(scenario_from_dict(data, "no loader")).summary["step_time_s"]


@pytest.fixture(scope="module")
def needs_nine():
    """Per-sample cost so that a batch of 8 takes one worker B = 8.4 S (collate and pinning copies
    of 66 kB at 67 GB/s add about 2 us: 0.01% of B)."""
    s = gpu_step_s()
    return s, load_scenario(W0, SMALL + [f"dataloader.sample.cost.mean_s={RATIO * s / 8 * 1e3}ms"])


def test_answer_is_the_steady_state_one(needs_nine):
    """Steady state: n workers deliver a batch every B/n; n = 8 stalls B/8 - S = 0.05 S per step
    (5% > 1%), n = 9 never. The 5-step run of the scenario alone sees only the first round of
    batches (ready together), which answered 5 before."""
    s, cfg = needs_nine
    answer, df = min_workers_without_stall(cfg, max_workers=12)
    assert answer == math.ceil(RATIO) == 9
    assert df.steady.all()
    row8 = df.set_index("num_workers").loc[8]
    assert row8.data_stall_s == pytest.approx((RATIO / 8 - 1) * s, rel=0.01)
    assert row8.step_time_s == pytest.approx(RATIO / 8 * s, rel=0.01)
    for n in range(2, 9):  # every value below stalls to the period B/n
        assert df.set_index("num_workers").loc[n].step_time_s == pytest.approx(RATIO * s / n, rel=0.01)


def test_a_run_that_does_not_settle_says_so(needs_nine):
    """Random sample costs and a run too short to tell the noise from a trend: not steady."""
    _, cfg = needs_nine
    noisy = load_scenario(W0, SMALL + ["dataloader.sample.cost.distribution=lognormal",
                                       "dataloader.sample.cost.sigma=1.5",
                                       f"dataloader.sample.cost.mean_s={cfg.dataloader.sample.cost.mean_s * 1e3}ms"])
    row = steady_run(with_workers(noisy, 8), max_steps=33)
    assert row["steady"] is False and row["steps_simulated"] == 33


def test_cli_json(capsys):
    """dataloader_w0 as measured: 48 ms per batch and worker against a 30 ms step: 2 workers."""
    rc = main(["dataloader-workers", str(W0), "--max-workers", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["answer"] == 2 and out["steady"] is True
    assert [r["num_workers"] for r in out["rows"]] == [0, 1, 2]
    assert out["rows"][0]["data_stall_s"] > 0 and out["rows"][2]["data_stall_s"] == 0


def test_cli_max_steps_too_small_is_one_line(capsys):
    assert main(["dataloader-workers", str(W0), "--max-steps", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--max-steps" in err[0]
