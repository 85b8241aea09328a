"""Energy-time Pareto sweeps over locked SM clocks or power caps.

``energy_time_pareto(cfg, clocks=[1980, 1600, 1200])`` runs the scenario once per setting (with a
``locked_clock`` or ``power_cap`` DVFS policy) and returns one row per setting: step time, energy
per step, average power, energy per token, whether its setting settled and whether the point is on the
energy-time Pareto frontier (no other point is at least as fast *and* at least as frugal, and strictly
better in one). A power cap the firmware was still stepping the clock down to during the measured steps
(``settled`` false, warned) gives figures of that transient, not of the cap: the row is neither ranked
optimal nor allowed to dominate another.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import pandas as pd

from hardware_models.gpu import GpuSpec
from simulator.config.schema import ScenarioConfig
from simulator.config.sections.dvfs import DvfsConfig
from simulator.policies.dvfs import LIMIT_NOT_HELD, LIMIT_UNSETTLED, requested_clock_mhz, settable_power_limit_w

COLUMNS = ["setting", "value", "step_time_s", "energy_j_per_step", "avg_power_w", "energy_per_token_j",
           "avg_sm_clock_mhz", "settled", "pareto"]


def pareto_mask(time_s: Iterable[float], energy_j: Iterable[float]) -> list[bool]:
    """True where a point (time, energy) is not dominated by another (both lower is better)."""
    pts = list(zip(time_s, energy_j))
    out = []
    for i, (t, e) in enumerate(pts):
        dominated = any((t2 <= t and e2 <= e) and (t2 < t or e2 < e) for j, (t2, e2) in enumerate(pts) if j != i)
        out.append(not dominated)
    return out


def default_clocks(gpu: GpuSpec, n: int = 8) -> list[float]:
    """About ``n`` of ``gpu``'s supported clocks spread from the maximum down to ~45% of it, MHz."""
    sup = sorted(gpu.supported_sm_clocks_mhz or (gpu.max_sm_clock_mhz,), reverse=True)
    sup = [s for s in sup if s >= 0.45 * sup[0]] or sup
    step = max(1, (len(sup) - 1) // max(n - 1, 1))
    picks = sup[::step]
    if sup[-1] not in picks:
        picks.append(sup[-1])
    return [float(x) for x in picks]


def energy_time_pareto(cfg: ScenarioConfig, clocks: Iterable[float] | None = None,
                       power_caps: Iterable[float] | None = None) -> pd.DataFrame:
    """Step time and energy per setting, with a settled and a Pareto flag (``COLUMNS``; module docstring).

    Args:
        cfg: A validated scenario (its own ``dvfs`` section is replaced per point).
        clocks: Locked SM clocks, MHz (snapped to supported clocks with a warning).
        power_caps: Power limits, W. Give ``clocks`` or ``power_caps``, not both; with neither, a
            spread of supported clocks is used.

    Raises:
        ValueError: both ``clocks`` and ``power_caps`` given; ``PolicyError`` (a ValueError): a clock or power cap
            outside the GPU's range, naming ``--clocks`` / ``--power-caps``.
    """
    from simulator.api import run_scenario
    from simulator.config.loader import resolve_hardware

    if clocks is not None and power_caps is not None:
        raise ValueError("give clocks or power_caps, not both")
    base = cfg.dvfs.model_dump() if cfg.dvfs is not None else {}
    keep = {k: base[k] for k in ("clock_switch_latency_s", "power_sample_period_s", "power_window_s", "power_model")
            if k in base}
    hw = resolve_hardware(cfg)  # once: the points differ in their dvfs section only
    if power_caps is not None:
        power_caps = [settable_power_limit_w(p, hw.gpu, "--power-caps") for p in power_caps]  # before any run
        points = [("power_limit_w", p, DvfsConfig(kind="power_cap", power_limit_w=p, **keep)) for p in power_caps]
    else:
        # the row is labelled with the clock that runs (an unsupported request is snapped, with a warning)
        clocks = (default_clocks(hw.gpu) if clocks is None else
                  [requested_clock_mhz(c, hw.gpu, "--clocks") for c in clocks])
        points = [("locked_clocks_mhz", float(c), DvfsConfig(kind="locked_clock", locked_clocks_mhz=c, **keep))
                  for c in clocks]
    rows = []
    for setting, value, dvfs in points:
        s = run_scenario(cfg.model_copy(update={"dvfs": dvfs}), hw).summary
        unheld = [w for w in s["warnings"] if LIMIT_NOT_HELD in w]
        for w in unheld:  # the row's figures are not those of the setting's steady state
            warnings.warn(f"{setting} {value:g}: {w}", stacklevel=2)
        rows.append({"setting": setting, "value": value, "step_time_s": s["step_time_s"],
                     "energy_j_per_step": s["energy_j_per_step"], "avg_power_w": s["avg_power_w"],
                     "energy_per_token_j": s["energy_per_token_j"], "avg_sm_clock_mhz": s["avg_sm_clock_mhz"],
                     # a cap held only at the lowest clock is settled: its figures are of that steady state
                     "settled": not any(LIMIT_UNSETTLED in w for w in unheld)})
    df = pd.DataFrame(rows, columns=COLUMNS[:-1])
    ranked = df[df.settled] if len(df) else df
    front = dict(zip(ranked.index, pareto_mask(ranked.step_time_s, ranked.energy_j_per_step)))
    df["pareto"] = [front.get(i, False) for i in df.index]
    return df
