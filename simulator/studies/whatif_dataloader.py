"""What-if: how many DataLoader workers does a scenario need?

``workers_sweep`` runs a scenario with ``dataloader.num_workers`` = each value and returns one row
per value; ``min_workers_without_stall`` answers with the smallest ``num_workers`` whose data stall
is negligible (at most ``stall_tolerance`` of the step time, default 1%).

Example::

    from simulator import load_scenario
    from simulator.studies.whatif_dataloader import min_workers_without_stall
    n, df = min_workers_without_stall(load_scenario("scenarios/h200/dataloader_w0.yaml"), max_workers=8)
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import pandas as pd

from hardware_models.dataloader import OversubscribedCpuWarning
from simulator.config.errors import ScenarioError
from simulator.config.loader import scenario_from_dict
from simulator.config.schema import ScenarioConfig
from simulator.api import run_scenario

COLUMNS = ("num_workers", "step_time_s", "data_stall_s", "stall_fraction", "samples_per_s",
           "worker_utilisation", "host_cpu_busy_cores", "oversubscribed")


def with_workers(cfg: ScenarioConfig, num_workers: int, prefetch_factor: int | None = None) -> ScenarioConfig:
    """A copy of ``cfg`` with ``num_workers`` workers (prefetch and persistence made valid for 0).

    Raises:
        ScenarioError: the scenario has no ``dataloader`` section, or the value is invalid.
    """
    if cfg.dataloader is None:
        raise ScenarioError(f"{cfg.name}: no dataloader section: add `dataloader:` (see scenarios/h200/dataloader_w0.yaml)")
    data = cfg.model_dump(mode="python")
    dl = data["dataloader"]
    dl["num_workers"] = int(num_workers)
    if num_workers == 0:
        dl["prefetch_factor"] = None
        dl["persistent_workers"] = False
        dl["remote"] = None
    else:
        dl["prefetch_factor"] = prefetch_factor or dl.get("prefetch_factor") or 2
    return scenario_from_dict(data, f"{cfg.name} (num_workers={num_workers})")


def workers_sweep(cfg: ScenarioConfig, workers: Iterable[int]) -> pd.DataFrame:
    """Step time, data stall and utilisation for each ``num_workers`` value (one row each)."""
    rows = []
    for n in workers:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", OversubscribedCpuWarning)
            s = run_scenario(with_workers(cfg, n)).summary
        dl = s.get("dataloader", {})
        rows.append({
            "num_workers": int(n), "step_time_s": s["step_time_s"], "data_stall_s": s["data_stall_s"],
            "stall_fraction": s["data_stall_s"] / s["step_time_s"] if s["step_time_s"] else 0.0,
            "samples_per_s": s["samples_per_s"], "worker_utilisation": dl.get("worker_utilisation", 0.0),
            "host_cpu_busy_cores": dl.get("host_cpu_busy_cores", 0.0),
            "oversubscribed": any(issubclass(w.category, OversubscribedCpuWarning) for w in caught),
        })
    return pd.DataFrame(rows, columns=list(COLUMNS))


def min_workers_without_stall(cfg: ScenarioConfig, max_workers: int = 16, stall_tolerance: float = 0.01,
                              ) -> tuple[int | None, pd.DataFrame]:
    """The smallest ``num_workers`` (0..``max_workers``) whose stall is within tolerance.

    Args:
        cfg: A scenario with a ``dataloader`` section.
        max_workers: Largest value tried.
        stall_tolerance: Stall allowed, as a fraction of the step time.

    Returns:
        ``(answer, table)``: ``answer`` is ``None`` when even ``max_workers`` stalls; ``table``
        has one row per value tried (``COLUMNS``), stopping at the answer.

    Raises:
        ScenarioError: no dataloader section or ``max_workers`` < 0.
    """
    if max_workers < 0:
        raise ScenarioError(f"max_workers must be >= 0, got {max_workers}")
    frames = []
    for n in range(max_workers + 1):
        row = workers_sweep(cfg, [n])
        frames.append(row)
        if row.stall_fraction.iloc[0] <= stall_tolerance:
            return n, pd.concat(frames, ignore_index=True)
    return None, pd.concat(frames, ignore_index=True)
