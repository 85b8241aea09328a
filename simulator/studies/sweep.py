"""Parameter sweeps: a grid of ``--set`` overrides, one run per point, one DataFrame back.

Points run in a local process pool (``workers`` > 1) with a progress bar; each point may write
its own output folder under ``out_dir`` (named after its values, sanitised so that no value can
name a path outside ``out_dir``) and the table of all points to ``out_dir/results.csv``. A failed
point becomes a row with its error instead of stopping the sweep. An interrupted sweep (Ctrl-C)
raises ``SweepInterrupted`` carrying the points that finished. For more than one machine, pass a
``dask.distributed.Client`` as ``client``.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pandas as pd

from hardware_models import safe_yaml
from simulator.config.errors import ScenarioError

RESULTS_FILE = "results.csv"
_UNSAFE = re.compile(r"[^A-Za-z0-9._=+,-]+")
_MAX_NAME = 120  # bytes; file systems allow 255


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C during a sweep. ``table`` holds the finished points (``run_sweep``'s columns), ``total``
    the number of points in the grid."""

    def __init__(self, table: pd.DataFrame, total: int):
        super().__init__(f"sweep interrupted after {len(table)} of {total} points")
        self.table, self.total = table, total


def point_folder_names(points: list[dict]) -> list[str]:
    """One folder name per point, e.g. ``micro_batch_size=8_seq_length=512``: unique, and a single
    path component (characters other than letters, digits and ``._=+,-`` become ``_``; no leading
    dot, so ``..`` cannot climb out; long names are shortened with a hash)."""
    names: list[str] = []
    seen: set[str] = set()
    for i, point in enumerate(points):
        raw = "_".join(f"{k.split('.')[-1]}={v}" for k, v in point.items())
        name = _UNSAFE.sub("_", raw).lstrip(".") or "point"
        if len(name.encode()) > _MAX_NAME:
            name = name[:_MAX_NAME - 9] + "-" + hashlib.sha1(raw.encode()).hexdigest()[:8]
        if name in seen:
            name = f"{name}-{i}"
        seen.add(name)
        names.append(name)
    return names


SUMMARY_COLUMNS = ("step_time_s", "samples_per_s", "tokens_per_s", "mfu", "peak_memory_bytes", "data_stall_s",
                   "energy_j_per_step", "avg_power_w", "oom")


def parse_factor(text: str) -> tuple[str, list]:
    """``"training.micro_batch_size=4,8,16"`` -> ``("training.micro_batch_size", [4, 8, 16])``.

    Raises:
        ScenarioError: no ``=``, no values, or a value ``hardware_models.safe_yaml`` refuses.
    """
    key, sep, vals = text.partition("=")
    if not sep or not key.strip() or not vals.strip():
        raise ScenarioError(f"--factor {text!r}: expected dotted.key=v1,v2,...")
    try:  # the same YAML 1.2 reader as --set: "1:30" stays a string, "yes" is not a boolean
        return key.strip(), [safe_yaml.loads(v) if v.strip() else "" for v in vals.split(",")]
    except safe_yaml.YamlInputError as exc:
        raise ScenarioError(f"--factor {key.strip()}: {exc}") from None


def _run_point(args) -> dict:
    scenario, overrides, point, folder = args
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
        if folder:
            write_outputs(res, folder, overrides=overrides, scenario=scenario)
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
        out_dir: If set, each point writes its outputs to a sub-folder (``point_folder_names``,
            column ``folder``) and the table goes to ``out_dir/results.csv``.
        progress: Show a tqdm progress bar on stderr.
        client: Optional ``dask.distributed.Client`` to run the points on a cluster.

    Returns:
        One row per point, in grid order: the swept keys, the summary metrics, ``error`` (None when
        the point ran) and, with ``out_dir``, ``folder``.

    Raises:
        SweepInterrupted: Ctrl-C; it carries the finished points (also written to results.csv).
    """
    from tqdm import tqdm

    keys = list(factors)
    points = [dict(zip(keys, combo)) for combo in itertools.product(*(factors[k] for k in keys))]
    folders = [Path(out_dir) / n for n in point_folder_names(points)] if out_dir else [None] * len(points)
    jobs = [(str(scenario), list(base_overrides or []) + [f"{k}={v}" for k, v in p.items()], p,
             str(f) if f else None) for p, f in zip(points, folders)]
    done: dict[int, dict] = {}
    try:
        if client is not None:
            for i, row in enumerate(client.gather(client.map(_run_point, jobs))):
                done[i] = row
        elif workers > 1:
            with ProcessPoolExecutor(workers) as pool:
                futures = {pool.submit(_run_point, j): i for i, j in enumerate(jobs)}
                try:
                    from concurrent.futures import as_completed

                    for fut in tqdm(as_completed(futures), total=len(jobs), disable=not progress, desc="sweep"):
                        done[futures[fut]] = fut.result()
                except KeyboardInterrupt:
                    pool.shutdown(wait=False, cancel_futures=True)
                    raise
        else:
            for i, j in enumerate(tqdm(jobs, disable=not progress, desc="sweep")):
                done[i] = _run_point(j)
    except KeyboardInterrupt:
        table = _table([done[i] for i in sorted(done)], [folders[i] for i in sorted(done)], out_dir)
        raise SweepInterrupted(table, len(jobs)) from None
    return _table([done[i] for i in range(len(jobs))], folders, out_dir)


def _table(rows: list[dict], folders: list, out_dir) -> pd.DataFrame:
    """The sweep's table; with ``out_dir`` also written to ``out_dir/results.csv``."""
    df = pd.DataFrame(rows)
    if "error" not in df:
        df["error"] = None
    if out_dir:
        from simulator.recording.writers import atomic_write_text

        df["folder"] = [f.name for f in folders]
        atomic_write_text(Path(out_dir) / RESULTS_FILE, df.to_csv(index=False))
    return df
