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
