"""A multi-rank run whose power limit may bind simulates once: exact power from the start
(``DvfsRuntime.may_repeat``), the same result as the run repeated after the offline check; and a
finished multi-rank run leaves none of its ops to the cyclic collector (``System.release_ops``)."""

from __future__ import annotations

import gc
import warnings

import pytest
import simpy

import simulator.policies.dvfs as dvfs_mod
from simulator import load_scenario, run_scenario
from tests.conftest import ROOT

SCALE = ROOT / "scenarios/scale/gpt3_175b_tp8_pp8_dp16.yaml"
#: GPT-3 175B layers on 16 DGX H100 nodes: TP8 x PP2 x DP8, 12 layers per stage, 8 micro-batches, layer fidelity
#: (582 and 701 ops per stage); its windowed power exceeds the 700 W board limit in the optimizer phase with the
#: blocking TP backward (with Megatron's asynchronous one the limit does not bind: no repeat to check)
SMALL = ["hardware.cluster.nodes=16", "parallelism.pipeline_model_parallel_size=2", "model.num_layers=24",
         "training.global_batch_size=64", "run.fidelity=layer",
         "parallelism.async_tensor_model_parallel_allreduce=false"]


def _run(mp, *, precheck: bool):
    """The small pipeline's result and how many simulations (``Environment.run`` calls) it took."""
    with mp.context() as monkeypatch:
        return _run_patched(monkeypatch, precheck)


def _run_patched(monkeypatch, precheck: bool):
    calls = []
    run = simpy.Environment.run
    monkeypatch.setattr(simpy.Environment, "run", lambda self, until=None: calls.append(1) or run(self, until))
    cfg = load_scenario(SCALE, SMALL)
    # the run large enough for the pre-run decision, its stages below the watch (as the 175B layer-fidelity stages)
    monkeypatch.setattr(dvfs_mod, "WATCH_MIN_OPS", 1000)
    if not precheck:
        monkeypatch.setattr(dvfs_mod.DvfsRuntime, "may_repeat", lambda self, graph, run_ops: False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = run_scenario(cfg)
    return r, len(calls)


def test_binding_limit_runs_once_with_the_repeated_runs_result(monkeypatch):
    before, n_before = _run(monkeypatch, precheck=False)
    assert n_before == 2  # the offline check found the limit binding and repeated the run: the case at hand
    after, n_after = _run(monkeypatch, precheck=True)
    assert n_after == 1
    assert repr(after.summary) == repr(before.summary)  # every figure to the last bit, energy included
    for k in ("spans", "counters", "steps"):
        assert getattr(after, k).equals(getattr(before, k)), k


def test_may_repeat_false_below_the_run_size_or_for_a_watched_graph(monkeypatch):
    from simulator.api import rank_classes, resolve_hardware

    cfg = load_scenario(SCALE, SMALL)
    hw = resolve_hardware(cfg)
    c = rank_classes(cfg, hw)[0]
    env = simpy.Environment()
    from simulator.engine.system import System
    from simulator.recording.recorder import Recorder

    system = System(env, c.hw, Recorder())
    comp = dvfs_mod.DvfsRuntime(c.cfg, c.hw, env, system)

    class G:
        ops = ()

    monkeypatch.setattr(dvfs_mod, "WATCH_MIN_OPS", 10)
    assert not comp.may_repeat(G, run_ops=9)  # a run below the size: the after-run check stays
    G.ops = tuple(range(10))
    assert not comp.may_repeat(G, run_ops=100)  # a graph the watch covers


def test_multi_rank_run_frees_its_ops_by_reference_counting():
    cfg = load_scenario(SCALE, SMALL)
    on = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = run_scenario(cfg)
        del r
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        ops = sum(1 for o in gc.garbage if type(o).__name__ == "Op")
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if on:
            gc.enable()
    assert ops == 0
