"""The executor's own copy path (issue 12: fewer SimPy events per DMA copy) gives the general path's results to the
bit: a lone copy that nothing can disturb moves without an event, a flow's end is processed at once when nothing
else is due, and the spans equal those of the general code (``Executor._run``'s transfer with the former wake-up of
the fluid scheduler, kept here as the reference) on random graphs of kernels and copies."""

from __future__ import annotations

import dataclasses
import math

import pandas as pd
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

import simulator.engine.executor as executor_mod
from hardware_models.fabrics import FluidNetwork, LinkSpec
from hardware_models.fluid import FluidScheduler
from simulator.api import simulate_graph
from simulator.graph.op_graph import GraphBuilder
from simulator.graph.ops import OpKind
from tests.conftest import make_hw
from tests.properties.test_engine_properties import graphs


def _hw(latency_s: float = 1e-5, bw: float = 1e9):
    return dataclasses.replace(make_hw(pcie_bw=bw), pcie=LinkSpec("toy-pcie", bw, latency_s=latency_s))


def _one_copy(nbytes: float = 2e6, host_s: float = 0.0):
    b = GraphBuilder()
    b.add("c0", OpKind.MEMCPY_H2D, "h2d", bytes_read=nbytes, host_s=host_s, launch=False)
    return b.build()


class _Counting(simpy.Environment):
    """An environment that counts the events scheduled on it, by type name."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.scheduled: dict[str, int] = {}

    def schedule(self, event, priority=1, delay=0):
        name = type(event).__name__
        self.scheduled[name] = self.scheduled.get(name, 0) + 1
        super().schedule(event, priority, delay)


def test_lone_copy_takes_latency_plus_size_over_rate_and_no_event(monkeypatch):
    """2 MB at 1 GB/s after 10 us of latency, then 3 us of host work: ends at 1e-5 + 2e-3 + 3e-6 s (the float sum in
    that order). The latency is a timeout (the host thread's start is due at the same instant), after which nothing
    else is due: the flow moves without its wake-up and its end event, and the host work without a timeout (the
    general path: the latency's timeout, the fluid wake-up, the flow's end and the host work's timeout)."""
    envs = []

    def counting_env(*a, **k):
        envs.append(_Counting(*a, **k))
        return envs[-1]

    monkeypatch.setattr("simulator.engine.run.simpy.Environment", counting_env)
    r = simulate_graph(_one_copy(2e6, host_s=3e-6), _hw(), steps=1)
    (span,) = r.spans.itertuples()
    assert span.start_s == 0.0
    assert span.end_s == 0.0 + 1e-5 + 2e6 / 1e9 + 3e-6
    counts = envs[0].scheduled
    assert counts.get("Timeout", 0) == 1, counts
    assert counts.get("Event", 0) == 0, counts


def _old_wake(self, gen, due):
    """``FluidScheduler._wake`` before the flow's end was processed at once: every ended flow's ``done`` succeeds
    (queued), then the rest is rescheduled."""
    if gen == self._generation:
        self.advance()
        self.wakeups += 1
        ended = [f for f in self.flows if any(f is d for d in due) or self._finished(f, self.env.now)]
        self.flows = [f for f in self.flows if all(f is not e for e in ended)]
        for f in ended:
            f.remaining = 0.0
            f.done.succeed()
        self.reschedule()


def _general(monkeypatch):
    """Run copies the general way: ``Executor._run``'s transfer and the former fluid wake-up."""
    plan = executor_mod.Executor._plan

    def general_plan(self, op):
        mode, fixed = plan(self, op)
        return (executor_mod._GENERIC, fixed) if mode == executor_mod._COPY else (mode, fixed)

    monkeypatch.setattr(executor_mod.Executor, "_plan", general_plan)
    monkeypatch.setattr(FluidScheduler, "_wake", _old_wake)


@settings(max_examples=40, deadline=None)
@given(graphs(), st.sampled_from([0.0, 1e-5]), st.sampled_from([0.0, 2e-6]), st.integers(1, 3))
def test_copy_fast_path_gives_the_general_paths_spans(g, latency_s, launch_s, steps):
    """Kernels and copies on three streams with random dependencies: every span, to the last bit, and the bytes
    each link carried, as the general path gives them."""
    hw = dataclasses.replace(make_hw(launch_s=launch_s), pcie=LinkSpec("toy-pcie", 1e9, latency_s=latency_s))
    fast = simulate_graph(g, hw, steps=steps)
    with pytest_monkeypatch() as mp:
        _general(mp)
        slow = simulate_graph(g, hw, steps=steps)
    cols = ["step", "op_id", "start_s", "end_s"]
    pd.testing.assert_frame_equal(fast.spans[cols], slow.spans[cols], check_exact=True)
    assert repr(fast.summary["step_time_s"]) == repr(slow.summary["step_time_s"])


def pytest_monkeypatch():
    """A ``MonkeyPatch`` context (hypothesis runs one test body per example: the fixture would span them all)."""
    import pytest

    return pytest.MonkeyPatch.context()


@settings(max_examples=200, deadline=None)
@given(st.floats(1.0, 1e12), st.floats(1e-3, 10.0), st.sampled_from([math.inf, 3e8, 2e9]),
       st.sampled_from([("a",), ("a", "b"), ("b",)]))
def test_run_alone_ends_where_add_flow_ends(size, t0, cap, links):
    """A flow started at ``t0`` alone: ``FluidNetwork.move_alone``'s end, bytes carried and scheduler state equal
    those of ``start`` and running the environment (the wake-up at the same float time)."""
    caps = {"a": 1e9, "b": 4e8}

    def general():
        env = simpy.Environment()
        net = FluidNetwork(env, caps)
        out = {}

        def proc():
            yield env.timeout(t0)
            yield net.start(size, links, cap).done
            out["end"] = env.now

        env.process(proc())
        env.run()
        return out["end"], net.bytes_carried, net._fluid.wakeups, net._fluid._last_t

    env = simpy.Environment()
    net = FluidNetwork(env, caps)
    env.run(until=t0)
    end = net.move_alone(size, links, cap, math.inf)
    assert (end, net.bytes_carried, net._fluid.wakeups, net._fluid._last_t) == general()
    assert not net._fluid.flows
    # an event due at or before its end: nothing is done (the caller starts the flow instead)
    env2 = simpy.Environment()
    net2 = FluidNetwork(env2, caps)
    env2.run(until=t0)
    assert net2.move_alone(size, links, cap, end) is None
    assert net2._fluid.wakeups == 0 and net2.bytes_carried == {"a": 0.0, "b": 0.0}
