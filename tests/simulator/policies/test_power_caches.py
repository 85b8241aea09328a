"""The power meter's per-pricing-key caches (``excess_w``, ``excess_bound_w``, ``levels``' activity rows) give what
a fresh meter computes, across clock changes."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from hardware_models.power import generic_power_model
from simulator.engine.system import System
from simulator.graph.op_graph import GraphBuilder
from simulator.graph.ops import CostClass, OpKind
from simulator.policies.power_meter import PowerMeter
from simulator.recording.recorder import Recorder
from tests.conftest import make_hw


def _ops():
    """A compute-bound GEMM, a memory-bound kernel, a host-to-device copy, a host op (draws no power) and a kernel
    whose compute and memory take 1 ms each at the maximum clock (its activity changes with the SM clock)."""
    b = GraphBuilder()
    b.add("G", OpKind.COMPUTE, "compute", cost_class=CostClass.GEMM, dtype="bf16", shape=(200, 1, 5_000_000_000))
    b.add("M", OpKind.COMPUTE, "compute", cost_class=CostClass.ELEMENTWISE, bytes_read=1e9)
    b.add("C", OpKind.MEMCPY_H2D, "h2d", bytes_read=1e8)
    b.add("H", OpKind.HOST, "host", host_s=1e-3)
    b.add("X", OpKind.COMPUTE, "compute", cost_class=CostClass.ELEMENTWISE, bytes_read=1e9, flops=1e11)
    return b.build(samples_per_step=1.0).ops


def _setup():
    hw = make_hw()
    sys_ = System(simpy.Environment(), hw, Recorder())
    return hw, sys_, generic_power_model(hw.gpu)


_CLOCKS = st.sampled_from([1000.0, 800.0, 500.0])


@settings(max_examples=60, deadline=None)
@given(picks=st.lists(st.tuples(st.integers(0, 4), st.sampled_from(["s0", "s1", "s2"])), max_size=12),
       clocks=st.lists(_CLOCKS, min_size=1, max_size=3))
def test_excess_bound_is_the_sum_of_each_streams_largest_excess(picks, clocks):
    """``excess_bound_w`` equals the sum, over streams in the order of their first op with a positive excess, of
    the largest ``excess_w`` a fresh meter gives the stream's ops, at each clock in turn (one meter throughout)."""
    hw, sys_, model = _setup()
    base = _ops()
    ops = [replace(base[i], stream=s) for i, s in picks]
    meter = PowerMeter(model, hw.gpu, sys_.state, sys_.cost)
    for sm in clocks:
        sys_.state.sm_clock_mhz = sm
        fresh = PowerMeter(model, hw.gpu, sys_.state, sys_.cost)
        top: dict[str, float] = {}
        for op in ops:
            e = max(0.0, model.power_of((fresh.activity(op),), sm, 1000.0) - model.power_of((), sm, 1000.0)) \
                if fresh.activity(op) is not None else 0.0
            if e > top.get(op.stream, 0.0):
                top[op.stream] = e
        assert meter.excess_bound_w(ops) == sum(top.values())


def test_excess_bound_hand_worked():
    """Two streams: the GEMM and the memory kernel on one (its bound is the larger excess), the copy on the other;
    the host op draws nothing."""
    hw, sys_, model = _setup()
    g, m, c, h, _ = _ops()
    meter = PowerMeter(model, hw.gpu, sys_.state, sys_.cost)
    eg, em, ec = meter.excess_w(g), meter.excess_w(m), meter.excess_w(c)
    assert meter.excess_w(h) == 0.0 and min(eg, em, ec) > 0.0
    assert meter.excess_bound_w([g, m, c, h]) == max(eg, em) + ec


@settings(max_examples=40, deadline=None)
@given(spans=st.lists(st.tuples(st.integers(0, 4), st.floats(0, 1e-2), st.floats(1e-6, 1e-2)), min_size=1,
                      max_size=10),
       clocks=st.lists(_CLOCKS, min_size=1, max_size=3))
def test_levels_equal_a_fresh_meters_after_clock_changes(spans, clocks):
    """The power levels of any spans (one per op, each on its op's stream) equal those of a fresh meter at each
    clock in turn: the activity rows ``levels`` caches are keyed by the clocks."""
    hw, sys_, model = _setup()
    ops = _ops()
    sys_.state.sm_clock_mhz = 500.0
    assert PowerMeter(model, hw.gpu, sys_.state, sys_.cost).activity(ops[4]).memory == 0.5  # 1.0 at 1000 MHz
    sys_.state.sm_clock_mhz = 1000.0
    rows = [(0, ops[i], s, s + d, None) for i, s, d in spans]
    meter = PowerMeter(model, hw.gpu, sys_.state, sys_.cost)
    for sm in clocks:
        sys_.state.sm_clock_mhz = sm
        got = meter.levels(rows)
        want = PowerMeter(model, hw.gpu, sys_.state, sys_.cost).levels(rows)
        if want is None:
            assert got is None
            continue
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and got[2] == want[2]


@settings(max_examples=60, deadline=None)
@given(picks=st.lists(st.integers(0, 4), min_size=1, max_size=8), clock=_CLOCKS)
def test_power_of_running_ops_at_most_idle_plus_floor_plus_shares(picks, clock):
    """The watch's window bound (``PowerLimitFirmware.watch``): the board power of any set of running ops is at most
    idle + the SM floor once (``busy_w``, when a kernel runs) + each op's ``excess_parts_w`` share; a kernel's share is
    its excess less the floor, a copy's its whole excess, an op drawing nothing has none."""
    hw, sys_, model = _setup()
    ops = _ops()
    sys_.state.sm_clock_mhz = clock
    meter = PowerMeter(model, hw.gpu, sys_.state, sys_.cost)
    floor = meter.busy_w()
    assert floor > 0.0
    for op in ops:
        e, share, kernel = meter.excess_parts_w(op)
        assert e == meter.excess_w(op)
        assert share == (max(0.0, e - floor) if kernel else e)
    assert meter.excess_parts_w(ops[3]) == (0.0, 0.0, False)  # the host op
    acts = [meter.activity(ops[i]) for i in picks if meter.activity(ops[i]) is not None]
    idle = model.power_of((), clock, sys_.state.mem_clock_mhz)
    p = model.power_of(acts, clock, sys_.state.mem_clock_mhz)
    kernels = any(meter.excess_parts_w(ops[i])[2] for i in picks)
    bound = idle + (floor if kernels else 0.0) + sum(meter.excess_parts_w(ops[i])[1] for i in picks)
    assert p <= bound * (1 + 1e-12)


@settings(max_examples=60, deadline=None)
@given(picks=st.lists(st.tuples(st.integers(0, 4), st.sampled_from(["s0", "s1", "s2"])), max_size=12),
       limit=st.floats(0.0, 2000.0), base=st.sampled_from([0.0, 55.5, 300.0]))
def test_excess_bound_stopping_above_a_limit_answers_as_the_full_bound(picks, limit, base):
    """``excess_bound_w(ops, above_w=limit, base_w=base)`` stops once ``base`` plus the sum so far exceeds ``limit``:
    ``base + bound > limit`` is the same answer as with the full bound, and the ops after the stop are not read."""
    hw, sys_, model = _setup()
    ops = [replace(_ops()[i], stream=s) for i, s in picks]
    meter = PowerMeter(model, hw.gpu, sys_.state, sys_.cost)
    full = meter.excess_bound_w(ops)
    read: list = []

    def each():
        for op in ops:
            read.append(op)
            yield op

    part = meter.excess_bound_w(each(), None, limit, base)
    assert (base + part > limit) == (base + full > limit)
    assert part <= full
    if base + full > limit:  # stopped at the first op whose stream's new largest excess takes the sum above
        top: dict[str, float] = {}
        stop = len(ops)  # (``base`` alone above the limit: the sum is checked only when it grows)
        for n, op in enumerate(ops, 1):
            e = meter.excess_w(op)
            if e > top.get(op.stream, 0.0):
                top[op.stream] = e
                if base + sum(top.values()) > limit:
                    stop = n
                    break
        assert len(read) == stop
    else:
        assert part == full and len(read) == len(ops)


@settings(max_examples=60, deadline=None)
@given(events=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 2), st.booleans()), max_size=16),
       clocks=st.lists(_CLOCKS, min_size=1, max_size=3))
def test_power_is_cached_by_the_running_activities_not_the_op_ids(events, clocks):
    """``PowerMeter.power`` after any sequence of starts and ends (ops of three steps, at changing clocks) equals
    ``GpuPowerModel.power_of`` of the running ops' activities in start order, to the last bit, and the cache holds
    one entry per distinct running set of activity keys: a set of other op ids with the same kinds hits."""
    hw, sys_, model = _setup()
    base = _ops()
    meter = PowerMeter(model, hw.gpu, sys_.state, sys_.cost)
    for k, (i, step, start) in enumerate(events):
        sys_.state.sm_clock_mhz = clocks[k % len(clocks)]
        op = replace(base[i], id=10 * step + i)  # each step's op a distinct object and id, priced alike
        if start and not meter.is_running(op, step) and meter.activity(op) is not None:
            meter.add(op, step, meter.activity(op))
        elif not start and meter.is_running(op, step):
            meter.remove(op, step)
        want = model.power_of(list(meter.active.values()), sys_.state.sm_clock_mhz, sys_.state.mem_clock_mhz)
        assert meter.power() == want
    # two steps' copies of the same two kernels, started in the same order: one cache entry
    sys_.state.sm_clock_mhz = 1000.0
    fresh = PowerMeter(model, hw.gpu, sys_.state, sys_.cost)
    for step in (0, 1):
        ops = [replace(base[0], id=10 * step), replace(base[1], id=10 * step + 1)]
        for op in ops:
            fresh.add(op, step, fresh.activity(op))
        fresh.power()
        for op in ops:
            fresh.remove(op, step)
    assert len(fresh._power_cache) == 1
