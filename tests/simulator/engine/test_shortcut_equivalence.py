"""The executor's clock shortcut (``Executor._stream``: a stream resumed by its own event moves ``env._now`` itself)
and ``System._Wake.fire_last`` (a wake processed at once) give the spans SimPy's own event order gives: on random
small graphs whose ops end at the same instants (durations on a 1 ms grid), with host ops waking then, launch
costs, cross-stream dependencies and collectives with and without interference, the spans are identical (exact
floats) to a run where both shortcuts are disabled (SimPy's heap made to look always due, so every wait goes through
``env.timeout`` and every wake through the heap)."""

from __future__ import annotations

import math

import pytest
import simpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulator.api import simulate_graph
from simulator.graph.op_graph import GraphBuilder
from simulator.graph.ops import CostClass, OpKind
from hardware_models.collectives import NcclConfig
from tests.conftest import make_hw
from tests.simulator.engine.test_interference import _ToyModel

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class _AlwaysDue(list):
    """SimPy's event heap, read from Python as if an event were due before any time (``heapq`` works on the list
    itself, so the schedule is unchanged): both shortcuts' ``queue[0][0] > t`` tests fail, the fallback runs."""

    def __bool__(self) -> bool:
        return True

    def __getitem__(self, i):
        if i == 0:
            return (-math.inf,)
        return list.__getitem__(self, i)


def _spans(graph, hw, disable: bool, monkeypatch) -> list[tuple]:
    if disable:
        init = simpy.Environment.__init__

        def patched(env, *a, **k):
            init(env, *a, **k)
            env._queue = _AlwaysDue()

        monkeypatch.setattr(simpy.Environment, "__init__", patched)
    try:
        r = simulate_graph(graph, hw, steps=2)
    finally:
        monkeypatch.undo()
    sp = r.spans
    return list(zip(sp.step, sp.name, sp.stream, sp.start_s, sp.end_s)), r.summary["step_time_s"]  # record order


_OP = st.tuples(st.sampled_from(["fixed", "mem", "host", "ar"]), st.sampled_from(["compute", "side"]),
                st.integers(1, 3), st.lists(st.integers(0, 30), max_size=2))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_OP, min_size=1, max_size=9), interference=st.booleans(), launch=st.sampled_from([0.0, 1e-3]))
def test_shortcuts_give_simpys_spans(ops, interference, launch, monkeypatch):
    b = GraphBuilder()
    for i, (kind, stream, ms, deps) in enumerate(ops):
        deps = [d for d in deps if d < i]
        if kind == "fixed":
            b.add(f"f{i}", OpKind.COMPUTE, stream, deps=deps, fixed_duration_s=ms * 1e-3)
        elif kind == "mem":  # ms GB at 1 TB/s: ms milliseconds alone
            b.add(f"m{i}", OpKind.COMPUTE, stream, deps=deps, cost_class=CostClass.ELEMENTWISE, bytes_read=ms * 1e9)
        elif kind == "host":
            b.add(f"h{i}", OpKind.HOST, "host", deps=deps, host_s=ms * 1e-3)
        else:  # 1 GB/s toy collective: ms MB take ms milliseconds alone
            b.add(f"ar{i}", OpKind.COLLECTIVE, "comm.dp", deps=deps,
                  meta={"collective": "all_reduce", "bytes": ms * 1_000_000, "group": "dp"})
    graph = b.build(samples_per_step=1.0)
    hw = make_hw(launch_s=launch)  # as test_interference._hw, with a launch cost
    hw.collectives, hw.dp_group, hw.world_size = _ToyModel(), (0, 1), 2
    hw.nccl = NcclConfig(interference=interference)
    fast = _spans(graph, hw, False, monkeypatch)
    slow = _spans(graph, hw, True, monkeypatch)
    assert fast == slow
