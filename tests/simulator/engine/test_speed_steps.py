"""SimPy steps per op: a stream resumed by its own event moves the clock itself when its timeout would be the next
event (``Executor._stream``), and an interfered kernel's timeout processes its wake at once when nothing else is
due then (``System._Wake.fire_last``); the times are those of the hand-worked schedule either way."""

from __future__ import annotations

import pytest
import simpy

from simulator.api import simulate_graph
from simulator.graph.op_graph import GraphBuilder
from simulator.graph.ops import CostClass, OpKind
from tests.conftest import make_hw
from tests.simulator.engine.test_interference import _hw

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def steps_taken(monkeypatch):
    """A list whose length is the number of ``Environment.step`` calls made since the fixture was set up."""
    calls: list = []
    step = simpy.Environment.step

    def counted(env):
        calls.append(None)
        return step(env)

    monkeypatch.setattr(simpy.Environment, "step", counted)
    return calls


def test_back_to_back_kernels_of_one_stream_take_no_step_each(steps_taken):
    """Ten kernels of 1..10 ms on one stream, launched at once (no launch cost): they end at 1, 3, 6, ... 55 ms
    (the triangular numbers), in fewer SimPy steps than kernels: the first kernel's timeout (the host thread's end
    is due at 0 beside it) and the processes' starts and ends, 7 in all (before: one timeout per kernel, 16)."""
    b = GraphBuilder()
    for i in range(10):
        b.add(f"k{i}", OpKind.COMPUTE, "compute", fixed_duration_s=(i + 1) * 1e-3)
    r = simulate_graph(b.build(), make_hw(), steps=1)
    ends = r.spans.sort_values("start_s").end_s.tolist()
    assert ends == pytest.approx([(i + 1) * (i + 2) / 2 * 1e-3 for i in range(10)], rel=1e-12)
    assert len(steps_taken) <= 7


def test_interfered_kernels_take_one_step_each(steps_taken):
    """With interference on, a kernel waits on its timeout or a change of the collectives beside it; alone (no
    collective), ten 1 ms memory-bound kernels (1 GB at 1 TB/s) end at 1..10 ms in one SimPy step each (the
    timeout; its wake is processed at once) plus the run's 6 (processes' starts and ends), not two (the timeout, then
    the wake; before: 26 steps)."""
    b = GraphBuilder()
    for i in range(10):
        b.add(f"m{i}", OpKind.COMPUTE, "compute", cost_class=CostClass.ELEMENTWISE, bytes_read=1e9)
    r = simulate_graph(b.build(samples_per_step=1.0), _hw(), steps=1)
    assert r.spans.sort_values("start_s").end_s.tolist() == pytest.approx([(i + 1) * 1e-3 for i in range(10)],
                                                                         rel=1e-9)
    assert len(steps_taken) <= 10 + 6
