"""Discrete-event simulator of ML training systems.

Public API::

    from simulator import load_scenario, run_scenario, write_outputs
    cfg = load_scenario("scenarios/h200/gpt_184m_b16.yaml", overrides=["training.micro_batch_size=8"])
    result = run_scenario(cfg)          # SimulationResult: summary dict + pandas DataFrames
    write_outputs(result, "out/")       # summary.json, spans.csv, trace.json (Perfetto), config

The names are imported on first use (PEP 562 ``__getattr__``), so that ``import simulator.cli``
(``simulate --version``, ``simulate presets``) does not load pandas, pydantic and pint.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

#: public name -> module that defines it
_EXPORTS = {
    "SimulationResult": "simulator.analysis.results",
    "ScenarioError": "simulator.config.errors",
    "load_scenario": "simulator.config.loader",
    "scenario_from_dict": "simulator.config.loader",
    "SimulationError": "simulator.api",
    "run_scenario": "simulator.api",
    "write_outputs": "simulator.recording.writers",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs
    from simulator.analysis.results import SimulationResult
    from simulator.api import SimulationError, run_scenario
    from simulator.config.errors import ScenarioError
    from simulator.config.loader import load_scenario, scenario_from_dict
    from simulator.recording.writers import write_outputs


def __getattr__(name: str):
    """Import a public name's module on first access (``AttributeError`` for any other name)."""
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'simulator' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
