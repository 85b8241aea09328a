"""``run_graph``: repeat a step graph on a machine and return the raw records (``run_ranks``: several
ranks side by side, meeting at their rendezvous ops). Touches no files.

The engine knows graphs and machine specs, not scenarios: what a scenario attaches at run time
(DVFS controllers, dataloaders) comes in through ``attach``, and the headline summary is
computed from the records by ``simulator.analysis.summary``.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from functools import partial
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np
import pandas as pd
import simpy

from hardware_models.machine import Hardware
from simulator.engine.errors import SimulationError
from simulator.engine.executor import Executor
from simulator.engine.memory import DeviceMemoryOverheads
from simulator.engine.links import Fabric
from simulator.engine.rendezvous import Rendezvous
from simulator.engine.system import System
from simulator.graph.op_graph import OpGraph
from simulator.recording.deferred import Deferred, DeferredField
from simulator.recording.recorder import Recorder, column_array, counter_frame, launch_intervals, launched_ids


@contextmanager
def gc_paused():
    """Pause Python's cyclic garbage collector inside the block (restored as it was on exit).

    A run allocates many short-lived containers (events, span tuples, frames) that reference
    counting frees; they still trigger the collector's full passes over every long-lived object of
    the process (about 55 ms each with pandas, scipy and pydantic loaded, about every other run:
    a third to a half of a run's time). Paused, the run's cyclic garbage (its graph and machine)
    waits for the next collection after the block.
    """
    on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if on:
            gc.enable()


@dataclass(frozen=True)
class RunRecords:
    """What one engine run recorded.

    Attributes:
        spans: One row per op execution (``recording.recorder.SPAN_COLUMNS`` + ``duration_s``).
        counters: Level samples ``t_s, scope, metric, value`` (memory, clocks, power); built when first read
            (``recording.deferred``: ``DeferredField.raw(records, "counters")`` passes it on unbuilt).
        steps: One row per step: ``step, start_s, end_s, step_time_s``, seconds.
        memory: Memory pools by name (``gpu``, ``host_pinned``, ``host_pageable``), each with
            ``capacity_bytes``, ``peak``, ``peak_by_category``, ``oom`` and ``oom_message()``.
        launches: One row per host kernel/copy launch: ``step, op_id, start_s, end_s`` (built when first read, as
            ``counters``).
        samples: The recorded level samples alone (clocks, power: ``counters`` without the memory timelines), in
            time order (stable); built when first read, as ``counters``. Its rows are the rows of ``counters`` that
            are not memory samples, in the same order.
    """

    spans: pd.DataFrame
    counters: pd.DataFrame = DeferredField()
    steps: pd.DataFrame
    memory: dict[str, Any]
    launches: pd.DataFrame = DeferredField()
    samples: pd.DataFrame = DeferredField(None)


class _NoRuntime:
    components: list = []

    def hooks(self) -> list:
        return []

    def host_handlers(self) -> dict:
        return {}


def run_graph(graph: OpGraph, hw: Hardware, steps: int, seed: int = 0,
              attach: Callable[[simpy.Environment, System], Any] | None = None,
              overheads: DeviceMemoryOverheads | None = None, *, exact_power: bool = False) -> tuple[RunRecords, Any]:
    """Run ``steps`` repetitions of ``graph`` on ``hw``.

    Args:
        graph: Step graph.
        hw: Machine specs.
        steps: Steps to simulate (>= 1).
        seed: Seed of the run's random generator ``env.rng`` (stochastic models draw from it).
        attach: ``attach(env, system)`` returns the run's runtime components (an object with
            ``hooks()``, ``host_handlers()`` and ``components``), or None for none.
        overheads: The GPU's non-tensor memory (CUDA context, allocator reserve); None counts
            tensors only.
        exact_power: Meter power per op during the run (``System.exact_power``). Otherwise a
            component may meter from the spans afterwards; its ``finish(recorder)`` returning
            False (the offline result would differ) repeats the run with ``exact_power``.

    Returns:
        ``(records, runtime)``: the raw records and the attached runtime (whose components
        may add metrics to the summary).

    Raises:
        SimulationError: the engine failed.
    """
    return run_ranks([graph], [hw], steps, seed, attach, overheads, exact_power=exact_power)[0]


def run_ranks(graphs: Sequence[OpGraph], hws: Sequence[Hardware], steps: int, seed: int = 0,
              attach: Callable[[simpy.Environment, System], Any] | Sequence | None = None,
              overheads: DeviceMemoryOverheads | None = None, *,
              exact_power: bool = False) -> list[tuple[RunRecords, Any]]:
    """Run several ranks side by side in one SimPy environment (one ``System`` and ``Executor`` each),
    meeting at their ``rendezvous`` ops (pipeline send/recv): ``run_graph`` for each, coupled.

    Args:
        graphs: One step graph per rank (pipeline stage representative).
        hws: The machine of each rank (same length).
        steps, seed, attach, overheads, exact_power: as ``run_graph`` (``attach`` is called per rank; a
            sequence gives each rank its own).

    Returns:
        ``[(records, runtime)]`` per rank, in the order given.

    Raises:
        SimulationError: the engine failed, or the ranks deadlocked (a rendezvous some rank never reached:
            the message names it).
    """
    env = simpy.Environment()
    env.rng = np.random.default_rng(seed)  # the run's only random source (no global state)
    meet = Rendezvous(env)
    fabric = Fabric(env)  # the calls the ranks share (a pipeline send/recv runs over both ranks' links)
    attaches = list(attach) if isinstance(attach, Sequence) else [attach] * len(graphs)
    parts = []
    for graph, hw, attach_one in zip(graphs, hws, attaches, strict=True):
        rec = Recorder()
        system = System(env, hw, rec, fabric)
        system.exact_power = exact_power
        system.memory["gpu"].overheads = overheads if overheads is not None else DeviceMemoryOverheads()
        runtime = attach_one(env, system) if attach_one is not None else _NoRuntime()
        parts.append((graph, rec, system, runtime))
    run_ops = sum(len(g.ops) for g in graphs)
    if not exact_power and len(graphs) > 1 and any(
            getattr(comp, "may_repeat", None) is not None and comp.may_repeat(graph, run_ops)
            for graph, _, _, runtime in parts for comp in getattr(runtime, "components", ())):
        # a component that may ask to repeat the run with exact power after it (``finish`` below), in a run large
        # enough to make that the costly case: run exact at once (the run it would repeat), nothing simulated yet
        return run_ranks(graphs, hws, steps, seed, attach, overheads, exact_power=True)
    ranks = []
    for graph, rec, system, runtime in parts:
        ex = Executor(env, system, graph, rec, steps, hooks=runtime.hooks(), host_handlers=runtime.host_handlers(),
                      rendezvous=meet)
        ranks.append((graph, rec, system, runtime, ex))
    try:
        with gc_paused():
            env.run(env.all_of([ex.start() for *_, ex in ranks]))
    except Exception as exc:  # pragma: no cover - engine bugs surface with the phase named
        stuck = meet.pending()
        if stuck:
            raise SimulationError(f"run phase failed: the ranks deadlocked at rendezvous {stuck[0][0]!r} of step "
                                  f"{stuck[0][1]} ({len(stuck)} waiting)") from exc
        raise SimulationError(f"run phase failed: {type(exc).__name__}: {exc}") from exc
    for _, rec, _, runtime, _ in ranks:
        for comp in getattr(runtime, "components", ()):
            finish = getattr(comp, "finish", None)
            if finish is not None and finish(rec) is False and not exact_power:
                for _, rec_, system_, _, ex_ in ranks:  # this run's records are not used: freed now
                    _release(ex_, rec_, system_)
                return run_ranks(graphs, hws, steps, seed, attach, overheads, exact_power=True)
    out = []
    for graph, rec, system, runtime, ex in ranks:
        start, end = column_array(ex.step_start), column_array(ex.step_end)
        step_df = pd.DataFrame({"step": np.arange(steps, dtype=np.int64), "start_s": start, "end_s": end,
                                "step_time_s": end - start})
        cost = getattr(ex, "launch_cost_s", None)  # (the launched ids now: the thunk does not hold the graph)
        launches = Deferred(partial(launch_intervals, launched_ids(graph) if cost is not None else None,
                                    ex.launch_time, cost))
        # the recorded samples, then the memory timelines; built when read (the summary does not)
        counters = Deferred(partial(_counter_frame, rec.counter_columns(), system.take_memory_counter_parts()))
        samples = Deferred(partial(counter_frame, rec.counter_columns()))
        out.append((RunRecords(rec.spans_frame(), counters, step_df, system.memory, launches, samples), runtime))
    for _, rec, system, _, ex in ranks:
        _release(ex, rec, system)
    return out


def _counter_frame(columns: tuple[list, list, list, list], memory_parts: Callable[[], list[tuple]]) -> pd.DataFrame:
    """``counter_frame`` of the recorded samples' ``columns`` (``Recorder.counter_columns``) and the memory
    timelines ``memory_parts()`` (``System.take_memory_counter_parts``: built now)."""
    return counter_frame(columns, None, memory_parts())


def _release(ex: Executor, rec: Recorder, system: System) -> None:
    """Drop a finished run's per-op state (the executor's tables and processes, the recorder's rows, the memory
    pools' timelines) once its frames are built.

    The executor sits in reference cycles (environment -> processes -> executor -> system -> executor) that hold
    the graph and every span: left to the cyclic collector after ``gc_paused``, a 1,024-GPU pipeline's millions of
    objects took ~5 s to traverse; emptied here, reference counting frees them at once (< 1 s).
    """
    vars(ex).clear()
    system.release_ops()
    rec.release()
    for pool in system.memory.values():
        pool.release_timelines()
