"""Parameter sweeps: a grid of ``--set`` overrides, one run per point, one DataFrame back.

Points run in a local process pool (``workers`` > 1) with a progress bar; each point may write
its own output folder. A failed point becomes a row with its error instead of stopping the sweep.
For more than one machine, pass a ``dask.distributed.Client`` as ``client``.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pandas as pd
import yaml

from simulator.config.errors import ScenarioError

SUMMARY_COLUMNS = ("step_time_s", "samples_per_s", "tokens_per_s", "mfu", "peak_memory_bytes", "data_stall_s",
                   "energy_j_per_step", "avg_power_w", "oom")


def parse_factor(text: str) -> tuple[str, list]:
    """``"training.micro_batch_size=4,8,16"`` -> ``("training.micro_batch_size", [4, 8, 16])``.

    Raises:
        ScenarioError: no ``=`` or no values.
    """
    key, sep, vals = text.partition("=")
    if not sep or not key.strip() or not vals.strip():
        raise ScenarioError(f"--factor {text!r}: expected dotted.key=v1,v2,...")
    return key.strip(), [yaml.safe_load(v) for v in vals.split(",")]


def _run_point(args) -> dict:
    scenario, overrides, point, out_dir = args
    from simulator.config.loader import load_scenario
    from simulator.api import run_scenario
    from simulator.recording.writers import write_outputs

    row = dict(point)
    try:
        res = run_scenario(load_scenario(scenario, overrides))
        for k in SUMMARY_COLUMNS:
            if k in res.summary:
                row[k] = res.summary[k]
        # busy fraction of the GPU's compute stream: well below 1 means a host-bound step
        row["gpu_busy"] = (res.summary.get("utilisation") or {}).get("compute", float("nan"))
        row["profile"] = res.summary.get("profile")  # "generic:..." = unfitted GPU profile (see summary warnings)
        if out_dir:
            tag = "_".join(f"{k.split('.')[-1]}={v}" for k, v in point.items())
            write_outputs(res, Path(out_dir) / tag)
    except Exception as exc:  # one bad point must not lose the others
        row["error"] = str(exc)
    return row


def run_sweep(scenario: str | Path, factors: dict[str, list], base_overrides: list[str] | None = None,
              workers: int = 1, out_dir: str | Path | None = None, progress: bool = True, client=None) -> pd.DataFrame:
    """Run the full grid of ``factors`` over ``scenario``.

    Args:
        scenario: Scenario YAML path.
        factors: Dotted key -> list of values.
        base_overrides: ``--set`` strings applied to every point.
        workers: Local processes.
        out_dir: If set, each point writes its outputs to a sub-folder.
        progress: Show a tqdm progress bar on stderr.
        client: Optional ``dask.distributed.Client`` to run the points on a cluster.

    Returns:
        One row per point: the swept keys, then the summary metrics (and ``error`` if it failed).
    """
    keys = list(factors)
    points = [dict(zip(keys, combo)) for combo in itertools.product(*(factors[k] for k in keys))]
    jobs = [(str(scenario), list(base_overrides or []) + [f"{k}={v}" for k, v in p.items()], p,
             str(out_dir) if out_dir else None) for p in points]
    if client is not None:
        rows = client.gather(client.map(_run_point, jobs))
    elif workers > 1:
        from tqdm import tqdm

        with ProcessPoolExecutor(workers) as pool:
            rows = list(tqdm(pool.map(_run_point, jobs), total=len(jobs), disable=not progress, desc="sweep"))
    else:
        from tqdm import tqdm

        rows = [_run_point(j) for j in tqdm(jobs, disable=not progress, desc="sweep")]
    return pd.DataFrame(rows)
