"""Every sweep row carries every warning a fresh ``simulate run`` of that point gives, on every backend: a
warning shown once per process (the profile fitted for another GPU) must not go missing from the second point a
worker runs (``loader.resolve_hardware``, ``sweep._run_point``)."""

from __future__ import annotations

import json
import subprocess
import sys

from simulator.studies import sweep
from tests.conftest import ROOT

SCEN = ROOT / "scenarios/h200/gpt_184m_b8.yaml"  # pins profile h200-sxm-141gb
BASE = ["model.num_layers=2", "run.steps=3", "run.warmup_steps=1"]
FACTORS = {"hardware.gpu": ["h100-sxm-80gb"], "training.micro_batch_size": [1, 2, 4]}

FRESH = """
import json, sys, warnings
from simulator.config.loader import load_scenario
from simulator.api import run_scenario
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    res = run_scenario(load_scenario(sys.argv[1], sys.argv[2:]))
shown = dict.fromkeys([str(w.message) for w in caught if w.category.__name__ == "ScenarioWarning"]
                      + [str(w) for w in res.summary.get("warnings") or []])
print(json.dumps("; ".join(shown)))
"""


def _fresh(point: dict) -> str:
    sets = BASE + [f"{k}={v}" for k, v in point.items()]
    out = subprocess.run([sys.executable, "-c", FRESH, str(SCEN), *sets], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    return json.loads(out.stdout.splitlines()[-1])


def test_each_row_carries_the_fresh_runs_warnings_on_every_backend():
    want = [_fresh(p) for p in sweep.grid(FACTORS)]
    assert all("was fitted for 'h200-sxm-141gb', not 'h100-sxm-80gb'" in ws for ws in want)
    for workers in (1, 2):
        df = sweep.run_sweep(SCEN, FACTORS, BASE, workers=workers, progress=False, log=lambda m: None)
        assert list(df["warnings"]) == want, workers  # the row joins them with "; " in the order shown
    try:
        import dask.distributed  # noqa: F401  (the optional `dask` extra)
    except ImportError:  # dask.distributed not installed: the two backends above still ran
        return
    from simulator.studies.sweep_dask import local_cluster
    cluster, client = local_cluster(2)
    try:
        df = sweep.run_sweep(SCEN, FACTORS, BASE, client=client, progress=False, log=lambda m: None)
        assert list(df["warnings"]) == want, "dask"
    finally:
        client.close()
        cluster.close()


LOADER = ROOT / "scenarios/h200/dataloader_w8.yaml"  # 16 host cores
#: a unit slip in an override (1,000x below the preset: warned at load), an SM clock between two supported ones
#: (snapped at run time, with a warning from the clock controller and a run warning)
LOADER_BASE = ["model.num_layers=2", "run.steps=3", "run.warmup_steps=1",
               "hardware.gpu={preset: h200-sxm-141gb, overrides: {hbm_bandwidth_bytes_per_s: 4.8e9}}",
               "dvfs={kind: locked_clock, locked_clocks_mhz: 1402}"]
#: 32 and 64 workers oversubscribe the host's cores (a run-time warning of the DataLoader model), 8 do not
LOADER_FACTORS = {"dataloader.num_workers": [32, 8, 64]}


def _printed(point: dict) -> list[str]:
    """The warnings a fresh ``simulate run`` of the point prints, in order (its ``warning:`` lines on stderr,
    then the summary's ``warning`` lines), each once."""
    sets = [a for s in LOADER_BASE + [f"{k}={v}" for k, v in point.items()] for a in ("--set", s)]
    out = subprocess.run([sys.executable, "-m", "simulator", "run", str(LOADER), *sets], capture_output=True,
                         text=True, check=True, cwd=ROOT)
    return ([ln.removeprefix("warning: ") for ln in out.stderr.splitlines() if ln.startswith("warning: ")]
            + [ln.split(None, 1)[1] for ln in out.stdout.splitlines() if ln.startswith("warning ")])


def test_each_row_carries_what_a_fresh_simulate_run_prints_load_and_run_time_warnings():
    """Each row's warnings are the lines a fresh ``simulate run`` of its point prints, in order, each once: the
    load's (the override far from its preset), the run's own ``warnings.warn`` (the DataLoader threads beyond the
    host's cores, the SM clock snapped) and the summary's. Before, the run-time ones were missing from every row
    (printed by the worker, if at all), and ``simulate run`` printed the override warning twice (the load's, then
    the run's second ``resolve_hardware``)."""
    want = [_printed(p) for p in sweep.grid(LOADER_FACTORS)]
    assert all(len(ws) == len(set(ws)) for ws in want), want  # each printed once
    far = "hardware.gpu.overrides.hbm_bandwidth_bytes_per_s: 4.8e+09 is 1,000x below the preset's 4.8e+12"
    assert all(sum(w.startswith(far) for w in ws) == 1 for ws in want), want
    over = [any("exceed the host's 16 cores" in w for w in ws) for ws in want]
    assert over == [True, False, True], want
    assert all(any("1402 MHz is not a supported SM clock" in w for w in ws) for ws in want), want
    for workers in (1, 2):
        df = sweep.run_sweep(LOADER, LOADER_FACTORS, LOADER_BASE, workers=workers, progress=False, log=lambda m: None)
        assert list(df["warnings"]) == ["; ".join(ws) for ws in want], workers
