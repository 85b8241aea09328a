"""Discrete-event simulator of ML training systems.

Public API::

    from simulator import load_scenario, run_scenario, write_outputs
    cfg = load_scenario("scenarios/h200/gpt_184m_b16.yaml", overrides=["training.micro_batch_size=8"])
    result = run_scenario(cfg)          # SimulationResult: summary dict + pandas DataFrames
    write_outputs(result, "out/")       # summary.json, spans.csv, trace.json (Perfetto), config
"""

from simulator.analysis.results import SimulationResult
from simulator.config.errors import ScenarioError
from simulator.config.loader import load_scenario, scenario_from_dict
from simulator.api import SimulationError, run_scenario
from simulator.recording.writers import write_outputs

__all__ = [
    "SimulationResult", "ScenarioError", "SimulationError", "load_scenario", "scenario_from_dict",
    "run_scenario", "write_outputs",
]
