"""A sweep's points checked before any of them runs: each point's scenario (the file, ``--set``, then the point's
``--factor`` values) is loaded and validated whole, so that a ``--set`` valid only with a factor's values is
taken and a combination of values that the schema refuses is refused up front (one line, exit 2) instead of
becoming an error row after the other points ran."""

from __future__ import annotations

import warnings
from pathlib import Path

from simulator.config.errors import ScenarioError
from simulator.studies.sweep import point_overrides, point_settings


def point_label(point: dict) -> str:
    """``KEY=VALUE, KEY=VALUE`` of a point (the swept keys as given; a null value as ``null``, as ``--factor``
    takes it, not Python's ``None``)."""
    return ", ".join(point_settings(point))


def check_points(scenario: str | Path, base_overrides: list[str] | None, points: list[dict]) -> None:
    """Load every point's scenario (``sweep.point_overrides``) as ``run_sweep`` will, without running it.

    Raises:
        ScenarioError: one line: the first refused point, its first problem (a key it sweeps is named
            ``set by --factor KEY``) and how many more problems it has and how many points are refused.
    """
    from simulator.config.loader import load_scenario

    refused: list[tuple[dict, list[str]]] = []
    with warnings.catch_warnings():  # each point's warnings come with its row when it runs
        warnings.simplefilter("ignore")
        for point in points:
            try:
                load_scenario(scenario, point_overrides(base_overrides, point),
                              set_by={k: f"set by --factor {k}" for k in point})
            except ScenarioError as exc:
                refused.append((point, str(exc).split("\n")))
    if not refused:
        return
    point, lines = refused[0]
    n = len(lines) - 1
    more = f" (and {n} more problem{'s' if n > 1 else ''} of this point)" if n else ""
    others = f"; {len(refused)} of {len(points)} points are refused" if len(refused) > 1 else ""
    raise ScenarioError(f"sweep point {point_label(point)}: {lines[0]}{more}{others}; nothing was run")
