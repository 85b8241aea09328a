"""The engine's fast paths (issue 12) give the results of the general code: a flow alone on its links
ends at ``size / bottleneck`` exactly as under max-min filling, the out-of-memory test skipped below the
largest tested value finds the same first allocation over capacity, and a finished run leaves its rows
to reference counting instead of the cyclic garbage collector."""

from __future__ import annotations

import gc
import math
import warnings

import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from hardware_models.fabrics import FluidNetwork
from hardware_models.fluid import maxmin_rates
from simulator import load_scenario
from simulator.api import build_graph
from simulator.config.loader import resolve_hardware
from simulator.engine.memory import DeviceMemoryOverheads, MemoryPool
from simulator.engine.run import run_graph
from simulator.policies import apply_graph_policies, build_runtime
from tests.conftest import ROOT


def test_lone_flow_ends_at_its_bottleneck_then_shares_with_a_second():
    """1 GB alone over links of 4 and 2 GB/s with a 3 GB/s cap: 2 GB/s, done at 0.5 s; a second 1 GB flow
    started at 0.25 s on the 2 GB/s link halves both rates: the first has 0.5 GB left at 1 GB/s, so it ends
    at 0.75 s, and the second (0.5 GB moved by then) ends at 0.75 + 0.5 / 2 = 1.0 s."""
    env = simpy.Environment()
    net = FluidNetwork(env, {"a": 4e9, "b": 2e9})
    ends = {}

    def flow(name, t0, links, cap):
        yield env.timeout(t0)
        yield net.start(1e9, links, cap).done
        ends[name] = env.now

    env.process(flow("alone", 0.0, ("a", "b"), 3e9))
    env.run()
    assert ends == {"alone": 0.5}
    assert [maxmin_rates([(("a", "b"), 3e9)], net.capacities)[0]] == [2e9]
    ends.clear()
    env = simpy.Environment()
    net = FluidNetwork(env, {"a": 4e9, "b": 2e9})
    env.process(flow("first", 0.0, ("a", "b"), 3e9))
    env.process(flow("second", 0.25, ("b",), math.inf))
    env.run()
    assert ends == {"first": 0.75, "second": 1.0}


def _reference_oom(ops, overheads, capacity):
    """First allocation whose device demand exceeds ``capacity``, testing every allocation."""
    sizes, live = {}, 0
    for i, (name, nbytes) in enumerate(ops):
        if nbytes is None:
            live -= sizes.pop(name, 0)
            continue
        sizes[name] = nbytes
        live += nbytes
        demand = overheads.device_bytes(live)
        if demand > capacity:
            return name, float(i), nbytes, int(demand)
    return None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["params.w", "grad.w", "a#1", "a#2", "optimizer.m"]),
                          st.one_of(st.none(), st.integers(1, 100))), max_size=40),
       st.integers(1, 400), st.sampled_from([0.0, 0.25]), st.sampled_from([0.0, 7.0]))
def test_first_out_of_memory_equals_testing_every_allocation(ops, capacity, reserve, context):
    overheads = DeviceMemoryOverheads(cuda_context_bytes=context, allocator_reserve_fraction=reserve)
    t = [0.0]
    pool = MemoryPool("gpu0.hbm", capacity, lambda: t[0], overheads)
    for i, (name, nbytes) in enumerate(ops):
        t[0] = float(i)
        if nbytes is None:
            pool.free(name)
        else:
            pool.alloc(name, nbytes, float(i))
    got = pool.oom
    assert (None if got is None else (got.tensor, got.t_s, got.requested_bytes, got.live_bytes)) == \
        _reference_oom(ops, overheads, capacity)


def test_new_overheads_test_the_same_live_bytes_again():
    """100 B fit a 150 B pool without overheads; after a 60 B CUDA context is set, re-allocating the same
    100 B (no new peak) is the first allocation over capacity."""
    pool = MemoryPool("gpu0.hbm", 150, lambda: 0.0)
    pool.alloc("a#1", 100, 0.0)
    pool.free("a#1")
    assert pool.oom is None
    pool.overheads = DeviceMemoryOverheads(cuda_context_bytes=60.0, allocator_reserve_fraction=0.0)
    pool.alloc("a#2", 100, 1.0)
    assert pool.oom is not None and pool.oom.tensor == "a#2"


def _cyclic_garbage_of_run(cfg, hw, graph, steps: int) -> tuple[int, int]:
    """``(objects the cyclic collector frees after the run, spans)`` of a ``steps``-step run."""
    gc.collect()
    gc.disable()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rec, runtime = run_graph(graph, hw, steps, attach=lambda env, system: build_runtime(cfg, hw, env, system))
        n_spans = len(rec.spans)
        del rec, runtime
        return gc.collect(), n_spans
    finally:
        gc.enable()


def test_finished_run_leaves_its_rows_to_reference_counting():
    """A run's span and sample rows are freed once its frames are built: what the cyclic collector finds
    after a run (the environment, the plans per op) does not grow with the steps run (before: every span,
    sample and memory-timeline tuple, about six per span)."""
    cfg = load_scenario(ROOT / "scenarios/h200/gpt_184m_b4.yaml", ["run.warmup_steps=0"])
    hw = resolve_hardware(cfg)
    graph = apply_graph_policies(build_graph(cfg), cfg, hw)
    g2, s2 = _cyclic_garbage_of_run(cfg, hw, graph, 2)
    g6, s6 = _cyclic_garbage_of_run(cfg, hw, graph, 6)
    assert s6 - s2 == 4 * len(graph.ops)
    assert g6 - g2 < (s6 - s2) / 4, (g2, g6, s2, s6)
