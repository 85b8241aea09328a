"""What-if: how many DataLoader workers does a scenario need?

``workers_sweep`` runs a scenario with ``dataloader.num_workers`` = each value *until the data
stall settles* and returns one row per value; ``min_workers_without_stall`` answers with the
smallest ``num_workers`` whose steady-state stall is negligible (at most ``stall_tolerance`` of
the step time, default 1%).

Why the run length matters: every worker starts at once, so the first ``num_workers`` batches
are ready together after ``B`` (the time one worker takes per batch); the first step absorbs that
wait (usually a warm-up step) and the next ``num_workers - 1`` steps find their batch ready. The
stall that the steady state has (``B / num_workers - S`` per step, ``S`` the GPU step) shows only
from the second round of batches on: a run of the default 5 steps (1 warm-up) sees no stall with
5 workers whatever ``B`` is. In steady state the loader needs ``ceil(B / S)`` workers. Other
transients (a filling or draining prefetch buffer, random sample costs, epochs) last longer.

Steady state (``steady_run``): the run is lengthened (from ``max(run.steps, 16)`` up to
``max_steps``: doubled, or while the lead falls to twice the step where the buffer empties by
linear extrapolation) until, over its last ``2w`` steps (``w``: about a quarter of the measured
steps, rounded down to whole rounds of ``num_workers`` steps, since batches arrive in rounds), the
mean stall of the last ``w`` steps differs from that of the ``w`` before by at most
``steady_tolerance`` (default 1%) of the step time, or by at most three standard errors (from the
spread of per-round means: random sample costs), and the mean *lead* (how long before
``next()`` asked for it each batch was ready; negative when it stalls) has not fallen by more than
that: a draining buffer shows as a falling lead even while the stall is still 0, while a rising
lead is a loader that keeps up. Rows report the last ``2w`` steps; a row that did not settle
within ``max_steps`` has ``steady = False`` and never counts as an answer.

Example::

    from simulator import load_scenario
    from simulator.studies.whatif_dataloader import min_workers_without_stall
    n, df = min_workers_without_stall(load_scenario("scenarios/h200/dataloader_w0.yaml"), max_workers=8)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable

import numpy as np
import pandas as pd

from hardware_models.dataloader import OversubscribedCpuWarning
from simulator.config.errors import ScenarioError
from simulator.config.loader import scenario_from_dict
from simulator.config.schema import ScenarioConfig
from simulator.api import run_scenario
from simulator.studies.whatif import given_data

COLUMNS = ("num_workers", "step_time_s", "data_stall_s", "stall_fraction", "samples_per_s",
           "worker_utilisation", "host_cpu_busy_cores", "oversubscribed", "steady", "steps_simulated")
START_STEPS = 16
MAX_STEPS = 1024
STEADY_TOLERANCE = 0.01


def with_workers(cfg: ScenarioConfig, num_workers: int, prefetch_factor: int | None = None) -> ScenarioConfig:
    """A copy of ``cfg`` with ``num_workers`` workers (prefetch and persistence made valid for 0).

    Raises:
        ScenarioError: the scenario has no ``dataloader`` section, or the value is invalid.
    """
    if cfg.dataloader is None:
        raise ScenarioError(f"{cfg.name}: no dataloader section: add `dataloader:` (see scenarios/h200/dataloader_w0.yaml)")
    data = given_data(cfg)
    dl = data["dataloader"]
    dl["num_workers"] = int(num_workers)
    if num_workers == 0:
        dl["prefetch_factor"] = None
        dl["persistent_workers"] = False
        dl["remote"] = None
    else:
        dl["prefetch_factor"] = prefetch_factor or dl.get("prefetch_factor") or 2
    return scenario_from_dict(data, f"{cfg.name} (num_workers={num_workers})")


def with_steps(cfg: ScenarioConfig, steps: int) -> ScenarioConfig:
    """A copy of ``cfg`` that simulates ``steps`` steps (same warm-up)."""
    data = given_data(cfg)
    data.setdefault("run", {})["steps"] = int(steps)
    return scenario_from_dict(data, cfg.name)


def _change(series: list[float], w: int, round_steps: int = 1) -> tuple[float, float]:
    """Mean of the last ``w`` entries minus the mean of the ``w`` before, and 3 standard errors
    of that difference from the spread of the windows' per-round means (0 with < 2 rounds)."""
    last, prev = np.asarray(series[-w:], float), np.asarray(series[-2 * w:-w], float)
    k = w // round_steps
    if k < 2:
        return float(last.mean() - prev.mean()), 0.0
    rl, rp = last[-k * round_steps:].reshape(k, -1).mean(1), prev[-k * round_steps:].reshape(k, -1).mean(1)
    return float(last.mean() - prev.mean()), 3.0 * float(np.sqrt((rl.var(ddof=1) + rp.var(ddof=1)) / k))


def _next_length(n: int, w: int, lead: list[float]) -> int:
    """Steps for the next try: double, or, while the lead falls, twice the step where the buffer
    should be empty (linear extrapolation), so that the last half of the run is past it."""
    last, slope = sum(lead[-w:]) / w, _change(lead, w)[0] / w  # seconds of lead, and its change per step
    if slope < 0 and last > 0:
        return max(2 * n, 2 * (n + math.ceil(last / -slope)) + 2 * w)
    return 2 * n


def steady_run(cfg: ScenarioConfig, start_steps: int = START_STEPS, max_steps: int = MAX_STEPS,
               steady_tolerance: float = STEADY_TOLERANCE) -> dict:
    """Run ``cfg`` until its data stall settles (see the module docstring); one table row.

    Returns:
        The ``COLUMNS`` of ``workers_sweep`` (without ``num_workers``): step period, stall and
        samples/s over the run's last ``2w`` steps, worker and host-CPU use over the measured
        steps, ``steady`` and ``steps_simulated``.

    Raises:
        ScenarioError: ``max_steps`` is below ``run.warmup_steps + max(8, 4 * num_workers)``.
    """
    warm = cfg.run.warmup_steps
    # batches arrive in rounds of num_workers (round-robin; equal costs finish together): the
    # windows span whole rounds so that a periodic stall compares equal
    round_steps = max(cfg.dataloader.num_workers if cfg.dataloader is not None else 1, 1)
    shortest = warm + max(8, 4 * round_steps)
    if max_steps < shortest:
        raise ScenarioError(f"max_steps (--max-steps) {max_steps} must be >= run.warmup_steps + max(8, 4 * num_workers) "
                            f"= {shortest}")
    n = min(max(cfg.run.steps, start_steps, shortest), max_steps)
    while True:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", OversubscribedCpuWarning)
            r = run_scenario(with_steps(cfg, n))
        s, dl = r.summary, r.summary.get("dataloader", {})
        w = max(round_steps, max(2, (n - warm) // 4) // round_steps * round_steps)
        ends = r.steps.end_s.to_numpy()
        period = float(ends[-1] - ends[-2 * w - 1]) / (2 * w) if len(ends) > 2 * w else float(s["step_time_s"])
        tol_s = steady_tolerance * period
        stall, lead = dl.get("stall_by_step_s", [0.0] * n), dl.get("lead_by_step_s", [0.0] * n)
        # a falling lead is a buffer draining towards a stall; a rising one is a loader that keeps up
        d_stall, noise_stall = _change(stall, w, round_steps)
        d_lead, noise_lead = _change(lead, w, round_steps)
        steady = abs(d_stall) <= max(tol_s, noise_stall) and d_lead >= -max(tol_s, noise_lead)
        if steady or n >= max_steps:
            break
        n = min(_next_length(n, w, lead), max_steps)
    stall_s = float(sum(stall[-2 * w:]) / (2 * w))
    samples_per_step = s["samples_per_s"] * s["step_time_s"]
    return {
        "step_time_s": period, "data_stall_s": stall_s, "stall_fraction": stall_s / period if period else 0.0,
        "samples_per_s": samples_per_step / period if period else 0.0,
        "worker_utilisation": dl.get("worker_utilisation", 0.0), "host_cpu_busy_cores": dl.get("host_cpu_busy_cores", 0.0),
        "oversubscribed": any(issubclass(x.category, OversubscribedCpuWarning) for x in caught),
        "steady": bool(steady), "steps_simulated": int(n),
    }


def workers_sweep(cfg: ScenarioConfig, workers: Iterable[int], max_steps: int = MAX_STEPS,
                  steady_tolerance: float = STEADY_TOLERANCE) -> pd.DataFrame:
    """Steady-state step time, data stall and utilisation for each ``num_workers`` (one row each).

    Raises:
        ScenarioError: no dataloader section, or an invalid value.
    """
    rows = [{"num_workers": int(n), **steady_run(with_workers(cfg, n), START_STEPS, max_steps, steady_tolerance)}
            for n in workers]
    return pd.DataFrame(rows, columns=list(COLUMNS))


def min_workers_without_stall(cfg: ScenarioConfig, max_workers: int = 16, stall_tolerance: float = 0.01,
                              max_steps: int = MAX_STEPS, steady_tolerance: float = STEADY_TOLERANCE,
                              ) -> tuple[int | None, pd.DataFrame]:
    """The smallest ``num_workers`` (0..``max_workers``) whose steady-state stall is within tolerance.

    Args:
        cfg: A scenario with a ``dataloader`` section.
        max_workers: Largest value tried.
        stall_tolerance: Stall allowed, as a fraction of the step time.
        max_steps: Longest run per value (steps) while waiting for the stall to settle.
        steady_tolerance: Settling criterion, as a fraction of the step time (module docstring).

    Returns:
        ``(answer, table)``: ``answer`` is ``None`` when no value up to ``max_workers`` reaches a
        steady state within tolerance; ``table`` has one row per value tried (``COLUMNS``),
        stopping at the answer. A row with ``steady == False`` is never the answer; when one
        precedes the answer, a smaller value might also do (run with a larger ``max_steps``).

    Raises:
        ScenarioError: no dataloader section, ``max_workers`` < 0 or ``max_steps`` too small.
    """
    if max_workers < 0:
        raise ScenarioError(f"max_workers must be >= 0, got {max_workers}")
    rows = []
    for n in range(max_workers + 1):
        row = {"num_workers": n, **steady_run(with_workers(cfg, n), START_STEPS, max_steps, steady_tolerance)}
        rows.append(row)
        if row["steady"] and row["stall_fraction"] <= stall_tolerance:
            return n, pd.DataFrame(rows, columns=list(COLUMNS))
    return None, pd.DataFrame(rows, columns=list(COLUMNS))
