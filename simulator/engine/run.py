"""``run_scenario``: build -> elaborate -> run -> collect. Touches no files."""

from __future__ import annotations

import numpy as np
import pandas as pd
import simpy

from hardware_models.machine import Hardware
from simulator.analysis import metrics
from simulator.analysis.results import SimulationResult
from simulator.config.loader import resolve_hardware
from simulator.config.schema import ScenarioConfig
from simulator.engine.executor import Executor
from simulator.engine.system import System
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.op_graph import OpGraph
from simulator.policies import apply_graph_policies, build_runtime
from simulator.policies.registry import PolicyError, Runtime
from simulator.recording.recorder import Recorder, dependencies_frame, launches_frame


class SimulationError(RuntimeError):
    """A run failed; the message names the phase (build, run, collect)."""


def transformer_spec(cfg: ScenarioConfig) -> TransformerSpec:
    """The builder's view of a scenario's model, batch and precision."""
    m, t, p = cfg.model, cfg.training, cfg.parallelism
    per_step = t.micro_batch_size * p.data_parallel_size
    gbs = t.global_batch_size or per_step
    return TransformerSpec(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        seq_length=m.seq_length, vocab_size=m.vocab_size, ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
        micro_batch_size=t.micro_batch_size, num_micro_batches=gbs // per_step,
        tied_embeddings=not m.untie_embeddings_and_output_weights, bias=m.add_bias_linear,
        precision=t.precision, optimizer_impl=t.optimizer.impl,
        recompute=t.recompute_granularity or "none", data_parallel_size=p.data_parallel_size,
    )


def build_graph(cfg: ScenarioConfig) -> OpGraph:
    """The step graph of a scenario."""
    return build_gpt_step(transformer_spec(cfg))


def simulate_graph(graph: OpGraph, hw: Hardware, steps: int, warmup_steps: int = 0, seed: int = 0,
                   config: dict | None = None, cfg: ScenarioConfig | None = None) -> SimulationResult:
    """Run ``steps`` repetitions of ``graph`` on ``hw`` and summarise.

    Args:
        graph: Step graph.
        hw: Machine specs.
        steps: Steps to simulate (>= 1).
        warmup_steps: Leading steps excluded from the metrics.
        seed: Seed of the run's random generator (stochastic models draw from it).
        config: Resolved config to attach to the result.
        cfg: The scenario, when there is one: runtime components (DVFS, dataloader...) attach from it.

    Raises:
        SimulationError: the engine failed.
    """
    env = simpy.Environment()
    env.rng = np.random.default_rng(seed)  # the run's only random source (no global state)
    rec = Recorder()
    system = System(env, hw, rec)
    runtime = build_runtime(cfg, hw, env, system) if cfg is not None else Runtime([])
    ex = Executor(env, system, graph, rec, steps, hooks=runtime.hooks(), host_handlers=runtime.host_handlers())
    try:
        env.run(ex.start())
    except Exception as exc:  # pragma: no cover - engine bugs surface with the phase named
        raise SimulationError(f"run phase failed: {type(exc).__name__}: {exc}") from exc
    rec.counters.extend(system.memory_counters())
    spans = rec.spans_frame()
    step_df = pd.DataFrame({"step": range(steps), "start_s": ex.step_start, "end_s": ex.step_end})
    step_df["step_time_s"] = step_df.end_s - step_df.start_s
    step_df["warmup"] = step_df.step < warmup_steps
    summary = summarize(graph, hw, system, spans, step_df)
    counters = rec.counters_frame()
    for comp in runtime.components:
        if hasattr(comp, "summarize"):
            summary.update(comp.summarize(spans=spans, steps=step_df, counters=counters, summary=summary))
    launches = launches_frame(graph, ex.launch_time, getattr(ex, "launch_cost_s", None))
    return SimulationResult(summary, spans, counters, step_df, config or {}, launches, dependencies_frame(graph))


def summarize(graph: OpGraph, hw: Hardware, system: System, spans: pd.DataFrame, steps: pd.DataFrame) -> dict:
    """Headline metrics of a run (SI units; per GPU unless named otherwise)."""
    measured = steps[~steps.warmup]
    step_time = float(measured.step_time_s.mean())
    gpu_mem = system.memory["gpu"]
    oom = [p.oom_message() for p in system.memory.values() if p.oom is not None]
    util = metrics.utilisation(spans, steps)
    split = metrics.phase_split(spans, steps)
    return {
        "step_time_s": step_time,
        "samples_per_s": graph.samples_per_step / step_time if step_time else 0.0,
        "tokens_per_s": graph.tokens_per_step / step_time if step_time else 0.0,
        "mfu": metrics.mfu(graph.model_flops_per_step, step_time, hw.gpu.peak("bf16")),
        "model_flops_per_step": graph.model_flops_per_step,
        "peak_memory_bytes": int(gpu_mem.peak),
        "peak_memory_by_category_bytes": {k: int(v) for k, v in gpu_mem.peak_by_category.items() if v},
        "gpu_memory_capacity_bytes": float(gpu_mem.capacity_bytes),
        "peak_host_pinned_bytes": int(system.memory["host_pinned"].peak),
        "peak_host_pageable_bytes": int(system.memory["host_pageable"].peak),
        "oom": oom[0] if oom else None,
        "phase_s": split,
        "data_stall_s": 0.0,
        "exposed_comm_s": 0.0,
        "utilisation": util,
        "num_ops": len(graph),
        "steps_simulated": int(len(steps)),
        "warmup_steps": int(steps.warmup.sum()),
        "gpu": hw.gpu.name,
        "profile": hw.profile.name,
    }


def run_scenario(cfg: ScenarioConfig) -> SimulationResult:
    """Simulate a validated scenario.

    Raises:
        ScenarioError: presets do not resolve.
        PolicyError: a policy's parameters are invalid for this scenario.
        SimulationError: the engine failed.
    """
    hw = resolve_hardware(cfg)
    try:
        graph = apply_graph_policies(build_graph(cfg), cfg, hw)
    except PolicyError:
        raise
    except ValueError as exc:
        raise SimulationError(f"build phase failed: {exc}") from exc
    return simulate_graph(graph, hw, cfg.run.steps, cfg.run.warmup_steps, cfg.run.seed,
                          cfg.model_dump(mode="json"), cfg)
