"""What-if questions about memory: what is the largest batch or model that fits?

``largest_fitting(cfg, "training.micro_batch_size", [8, 16, 32, 64])`` runs the scenario at each
value (a short run: memory peaks are reached in the first step) and returns one row per value
with the peak GPU and host memory, whether it fits, what ran out and the step time. Compare with
and without offload by calling it on both scenarios (``with_overrides`` builds the variant).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pandas as pd

from simulator.config.errors import ScenarioError
from simulator.config.loader import scenario_from_dict
from simulator.config.overrides import apply_overrides
from simulator.config.schema import ScenarioConfig

COLUMNS = ("value", "fits", "peak_memory_bytes", "peak_device_memory_bytes", "gpu_memory_capacity_bytes",
           "peak_host_pinned_bytes",
           "peak_host_pageable_bytes", "step_time_s", "samples_per_s", "oom", "error", "memory_binding_class",
           "warnings")


def with_overrides(cfg: ScenarioConfig, **dotted: Any) -> ScenarioConfig:
    """A copy of ``cfg`` with dotted keys replaced: ``with_overrides(cfg, **{"training.micro_batch_size": 8})``.

    Raises:
        ScenarioError: the result does not validate.
    """
    return scenario_from_dict(apply_overrides(given_data(cfg), [f"{k}={_yaml(v)}" for k, v in dotted.items()]),
                              cfg.name)


def given_data(cfg: ScenarioConfig) -> dict[str, Any]:
    """The keys ``cfg`` was given (with those its validators derived), as a plain dict to edit and reload.

    A dump of every default would mark each section as given, and what a section's presence means would change (a
    ``zero_optimization`` section makes a bf16 pipeline DeepSpeed's BF16_Optimizer and another bf16 / fp16 run its
    FP16_Optimizer: schema.deepspeed_bf16_optimizer / deepspeed_fp16_optimizer;
    the warnings on keys given without effect)."""
    return cfg.model_dump(mode="json", exclude_none=True, exclude_unset=True)


def _yaml(v: Any) -> str:
    import json

    return json.dumps(v) if not isinstance(v, str) else v


def largest_fitting(cfg: ScenarioConfig, key: str, values: Iterable[Any], steps: int = 2) -> pd.DataFrame:
    """Run ``cfg`` with ``key`` set to each of ``values``; one row per value.

    Args:
        cfg: Base scenario.
        key: Dotted scenario key (``training.micro_batch_size``, ``model.num_layers``...).
        values: Values to try (in the order given).
        steps: Steps per run (1 warmup + the rest measured).

    Returns:
        DataFrame with ``COLUMNS`` (the peak and capacity of the rank class with the least headroom, named by
        ``memory_binding_class`` when ``rank_overrides`` put ranks on GPUs of different memory; ``fits``: no
        class ran out of memory; ``warnings``: the run's warnings, a list, as ``simulate run`` prints them);
        ``df.attrs["largest"]`` / ``df.attrs["smallest"]`` are the largest / smallest value that fits (``None`` if
        none does), ``df.attrs["key"]`` the key, ``df.attrs["warnings"]`` each distinct warning -> the positions
        of the rows that gave it (``sweep.point_warnings``).
    """
    return _fit_table(key, values, lambda v: with_overrides(
        cfg, **{key: v, "run.steps": max(2, steps), "run.warmup_steps": 1}))


def fitting_values(path: str, key: str, values: Iterable[Any], overrides: list[str] | None = None,
                   steps: int = 2) -> pd.DataFrame:
    """``largest_fitting`` for a scenario file: each value is applied as ``--set key=value`` (after
    ``overrides``) and the scenario loaded as the CLI loads it, so derived keys (``data_parallel_size`` from a
    new ``hardware.cluster.nodes``) follow. Same table and ``attrs``."""
    import json

    from simulator.config.loader import load_scenario

    def point(v):
        text = v if isinstance(v, str) else json.dumps(v)
        return load_scenario(path, [*(overrides or []), f"{key}={text}", f"run.steps={max(2, steps)}",
                                    "run.warmup_steps=1"])
    return _fit_table(key, values, point)


def _fit_table(key: str, values: Iterable[Any], point) -> pd.DataFrame:
    """Simulate ``point(v)`` for each value: one row each (``COLUMNS``); a value the schema or a policy refuses
    (``PolicyError``: ZeRO-Offload under ``amp_fp32_params``) is a row that does not fit, with the reason in
    ``error``."""
    from simulator.api import SimulationError, run_scenario
    from simulator.config.errors import PolicyError

    rows = []
    for v in values:
        row: dict[str, Any] = {c: None for c in COLUMNS}
        row["value"] = v
        try:
            s = run_scenario(point(v)).summary
            row.update({c: s.get(c) for c in COLUMNS if c in s})
            row["fits"] = not s.get("oom")
        except (ScenarioError, PolicyError, SimulationError) as exc:
            row["fits"], row["error"] = False, str(exc)
        rows.append(row)
    df = pd.DataFrame(rows, columns=list(COLUMNS))
    fitting = [r["value"] for r in rows if r["fits"]]
    df.attrs["key"] = key
    df.attrs["largest"] = max(fitting) if fitting else None
    df.attrs["smallest"] = min(fitting) if fitting else None
    from simulator.studies.sweep import point_warnings

    df.attrs["warnings"] = point_warnings(rows)
    return df
