"""The executor's own copy path (issue 12: fewer SimPy events per DMA copy) gives the general path's results to the
bit: a copy that ends first (alone or beside flows in flight) before anything else is due moves without an
event, a flow's end is processed at once when nothing else is due, and the spans equal those of the general code
(``Executor._run``'s transfer with the former wake-up of the fluid scheduler, kept here as the reference) on random
graphs of kernels and copies."""

from __future__ import annotations

import dataclasses
import math

import pandas as pd
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

import simulator.engine.executor as executor_mod
from hardware_models.fabrics import FluidNetwork, LinkSpec
from hardware_models.fluid import FluidScheduler, maxmin_rates
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


def _at(env: simpy.Environment, t: float, fn) -> None:
    """Call ``fn()`` at ``t`` (s) from a process of its own, resumed by its own timeout: a caller that may move the
    clock (``FluidNetwork.move``; ``env.run(until=...)`` would leave its stop event in the heap at that instant)."""

    def proc():
        yield env.timeout(t)
        fn()

    env.process(proc())


@settings(max_examples=200, deadline=None)
@given(st.floats(1.0, 1e12), st.floats(1e-3, 10.0), st.sampled_from([math.inf, 3e8, 2e9]),
       st.sampled_from([("a",), ("a", "b"), ("b",)]))
def test_a_lone_flow_moved_at_once_ends_where_start_ends(size, t0, cap, links):
    """A flow started at ``t0`` alone: ``FluidNetwork.move``'s end, bytes carried and scheduler state equal those of
    ``start`` and running the environment (the wake-up at the same float time); with an event due at that end, it
    is started instead (its end event) and ends there all the same."""
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

    ref = general()
    env = simpy.Environment()
    net = FluidNetwork(env, caps)
    out = {}
    _at(env, t0, lambda: out.update(ev=net.move(size, links, 0.0 if cap == math.inf else cap), now=env.now))
    env.run()
    assert out["ev"] is None and not net._fluid.flows
    assert (out["now"], net.bytes_carried, net._fluid.wakeups, net._fluid._last_t) == ref
    env = simpy.Environment()
    net = FluidNetwork(env, caps)
    env.timeout(ref[0])  # due at the flow's end
    _at(env, t0, lambda: out.update(ev=net.move(size, links, 0.0 if cap == math.inf else cap), now=env.now))
    env.run()
    assert out["ev"] is not None and out["ev"].processed and out["now"] == t0
    assert (net.bytes_carried, net._fluid.wakeups, net._fluid._last_t) == ref[1:]


def test_a_flow_beside_one_in_flight_that_ends_first_moves_at_once():
    """One 1 GB/s link. A 10 GB flow starts at 0 s; at 1 s (9 GB left) a 1 GB flow starts beside it: 0.5 GB/s each,
    so the new one ends at 1 + 1/0.5 = 3 s, the first having 9 - 0.5 x 2 = 8 GB left, which it moves alone at
    1 GB/s by 3 + 8 = 11 s (all exact in floats). ``move`` runs the new flow to 3 s at once (no event) and leaves
    the first one's wake-up at 11 s. A 20 GB flow instead would end after the first (at 1 + 9/0.5 = 19 s): it is
    started (its end event) and ends at 19 + (20 - 9) = 30 s."""
    for nbytes, ends in ((1e9, (11.0, 3.0)), (20e9, (19.0, 30.0))):
        env = simpy.Environment()
        net = FluidNetwork(env, {"l": 1e9})
        first = net.start(10e9, ("l",))
        out = {}

        def second():
            yield env.timeout(1.0)
            ev = out["ev"] = net.move(nbytes, ("l",))
            out["first"] = (first.remaining, first.rate, env.now)
            if ev is not None:
                yield ev
            out["end"] = env.now

        env.process(second())
        env.run(until=first.done)
        first_end = env.now
        env.run()
        assert (first_end, out["end"]) == ends
        assert net.bytes_carried == {"l": 10e9 + nbytes}
        if nbytes == 1e9:  # moved at once: at 3 s, the first flow alone again
            assert out["ev"] is None and out["first"] == (8e9, 1e9, 3.0)
        else:  # started: at 1 s, the first flow at its share
            assert out["ev"] is not None and out["first"] == (9e9, 0.5e9, 1.0)
        assert net._fluid.wakeups == 2


#: the links of a flow in ``test_move_gives_starts_ends_on_random_flow_sets``: a PCIe slot's two directions under
#: their duplex limit, and a link of its own
_ROUTES = [("h2d", "duplex"), ("d2h", "duplex"), ("h2d",), ("nic",), ("nic", "d2h", "duplex")]


@st.composite
def _flow_sets(draw):
    """Flows in flight ``(start_s, bytes, route, cap)`` and one that starts later, often small (ending first)."""
    n = draw(st.integers(0, 4))
    caps = st.sampled_from([math.inf, math.inf, 3e8, 7.5e8])
    flows = [(draw(st.floats(0.0, 2.0)), draw(st.floats(1e3, 5e9)), draw(st.sampled_from(_ROUTES)), draw(caps))
             for _ in range(n)]
    new = (draw(st.floats(0.0, 3.0)), draw(st.one_of(st.floats(1.0, 1e6), st.floats(1e6, 5e9))),
           draw(st.sampled_from(_ROUTES)), draw(caps))
    return flows, new


@settings(max_examples=300, deadline=None)
@given(_flow_sets(), st.booleans())
def test_move_gives_starts_ends_on_random_flow_sets(fs, weighted):
    """Flows started at random times over shared links (each by a process of its own), the last one by ``move``
    (run to its end at once when it ends first and nothing else is due) or by ``start`` (the general solver and its
    wake-ups): every flow's end, the bytes each link carried and the wake-up count agree to the last bit; with a
    weighted name on the path (an NVMe drive's writes) too."""
    flows, new = fs

    def run(fast: bool):
        env = simpy.Environment()
        net = FluidNetwork(env, {"h2d": 1e9, "d2h": 8e8, "duplex": 1.5e9, "nic": 5e8})
        if weighted:
            net.add_weighted_name("nic.w", "nic", 2.5)
        ends, moved = {}, []

        def proc(i, t, nbytes, route, cap, last):
            if weighted and route[0] == "nic":
                route = ("nic.w", *route[1:])
            yield env.timeout(t)
            if last and fast:
                ev = net.move(nbytes, route, 0.0 if cap == math.inf else cap)
                moved.append(ev is None)
            else:
                ev = net.start(nbytes, route, cap).done
            if ev is not None:
                yield ev
            ends[i] = env.now

        for i, f in enumerate([*flows, new]):
            env.process(proc(i, *f, i == len(flows)))
        env.run()
        return ends, net.bytes_carried, net._fluid.wakeups, moved

    fast, slow = run(True), run(False)
    assert fast[:3] == slow[:3]
    if not flows:  # alone, and nothing else due: always moved at once
        assert fast[3] == [True]


@settings(max_examples=150, deadline=None)
@given(_flow_sets())
def test_run_integrates_as_its_wake_up_on_random_flow_sets(fs):
    """``FluidScheduler.run`` on a scheduler with an ``on_advance`` (the CPU pool's utilisation integral): the same
    intervals ``on_advance`` is called with, in order, and the same ends, as ``add_flow`` and its wake-ups."""
    flows, new = fs
    caps = {"h2d": 1e9, "d2h": 8e8, "duplex": 1.5e9, "nic": 5e8}

    def run(fast: bool):
        env = simpy.Environment()
        steps = []

        def set_rates(fl):
            for f, r in zip(fl, maxmin_rates([(f.links, f.cap) for f in fl], caps)):
                f.rate = r

        sched = FluidScheduler(env, set_rates, steps.append)
        ends = {}

        def proc(i, t, size, route, cap, last):
            yield env.timeout(t)
            ev = sched.run(size, route, cap) if last and fast else sched.add(size, route, cap)
            if ev is not None:
                yield ev
            ends[i] = env.now

        for i, f in enumerate([*flows, new]):
            env.process(proc(i, *f, i == len(flows)))
        env.run()
        return ends, steps, sched.wakeups

    assert run(True) == run(False)
