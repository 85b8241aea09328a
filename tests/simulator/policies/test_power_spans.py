"""The power-limit watch prices spans on arrays (``policies.power_spans``): a window's sums are the ones a loop over
its spans gives, each distinct pricing key is priced once however many spans carry it, and levels read by op id
equal levels read per op."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import simulator.policies.dvfs as dvfs_mod
from simulator.engine.run import run_graph
from simulator.policies.power_meter import PowerMeter
from simulator.policies.power_spans import SpanPricing, WindowSpans
from tests.simulator.engine.test_speed_exactness import _capturing_runtimes, _late_burst, b8_step_spans


def _op(i: int):
    return SimpleNamespace(id=i)


def test_window_sums_of_a_hand_worked_window():
    """Three ops (excess 100 W of which 60 W adds, a kernel; one drawing nothing; a 50 W copy): spans ending at
    4, 6 and 12 ms, op 0 running again from 15 ms; at t = 20 ms with a 10 ms window (lo = 10 ms) only the copy's
    span (2 ms inside) and the running op (5 ms) count: inst 150 W, excess x time 50 x 0.002 + 100 x 0.005 = 0.6 J,
    share x time 50 x 0.002 + 60 x 0.005 = 0.4 J, kernel time 5 ms."""
    pricing = SimpleNamespace(excess=np.array([100.0, 0.0, 50.0]), share=np.array([60.0, 0.0, 50.0]),
                              kernel=np.array([True, False, False]))
    spans: list = [(0, _op(0), 0.0, 0.004, "s"), (0, _op(1), 0.001, 0.006, "s")]
    w = WindowSpans(spans, pricing)
    w.advance(0.0)
    assert w.rows() == spans
    spans.append((0, _op(2), 0.005, 0.012, "c"))
    w.advance(0.01)
    assert w.rows() == spans[2:]
    inst, avg_hi, lin, kernel_s = w.bounds([(0, _op(0), 0.015, 0.02, "s")], 0.02, 0.01)
    assert inst == 150.0
    assert avg_hi == pytest.approx(0.6, rel=1e-12)
    assert lin == pytest.approx(0.4, rel=1e-12)
    assert kernel_s == pytest.approx(0.005, rel=1e-12)


def _loop_sums(rows, pricing, t, lo):
    """The sums the watch's Python loop made before ``WindowSpans`` (one term after another)."""
    inst = avg_hi = lin = kernel_s = 0.0
    for _st, op, s0, s1, _stream in rows:
        e = float(pricing.excess[op.id])
        if e:
            inst += e
            d = (t if t < s1 else s1) - (lo if lo > s0 else s0)
            avg_hi += e * d
            lin += float(pricing.share[op.id]) * d
            if pricing.kernel[op.id]:
                kernel_s += d
    return inst, avg_hi, lin, kernel_s


def test_window_sums_equal_the_loop_to_the_bit():
    """Random spans of 50 ops over 200 windows: every sum is the float the loop over the same spans gives (summed
    in the same order), not merely close to it."""
    rng = np.random.default_rng(7)
    n_ops = 50
    excess = np.where(rng.random(n_ops) < 0.2, 0.0, rng.random(n_ops) * 300.0)
    kernel = (rng.random(n_ops) < 0.7) & (excess > 0)
    share = np.where(kernel, np.maximum(0.0, excess - 40.0), excess)
    pricing = SimpleNamespace(excess=excess, share=share, kernel=kernel)
    spans: list = []
    w = WindowSpans(spans, pricing)
    t_rec = 0.0
    for k in range(1, 201):
        t = k * 1e-3 * 3.7
        lo = max(0.0, t - 7e-3)
        while t_rec < t:
            start = t_rec - rng.random() * 2e-3
            t_rec = min(t, t_rec + rng.random() * 1e-3)
            spans.append((0, _op(int(rng.integers(n_ops))), start, t_rec, "s"))
        w.advance(lo)
        running = [(0, _op(int(rng.integers(n_ops))), t - rng.random() * 1e-3, t, "r")]
        kept = [x for x in spans if x[3] > lo]
        assert w.rows() == kept
        assert w.bounds(running, t, lo) == _loop_sums(kept + running, pricing, t, lo)


def test_watch_prices_each_distinct_key_once(monkeypatch):
    """A watched run of 110 like kernels (30 alone on one stream, then 40 on each of two) prices their power
    (``excess_parts_w``) once per pricing key (one), not once per span or op (before the spans were priced by key:
    once per op), and still switches online when the two streams push the window over the limit."""
    hw, attach, made = _capturing_runtimes(monkeypatch)
    monkeypatch.setattr(dvfs_mod, "WATCH_MIN_OPS", 0)
    calls = []
    parts = PowerMeter.excess_parts_w
    monkeypatch.setattr(PowerMeter, "excess_parts_w", lambda self, op: calls.append(op.id) or parts(self, op))
    graph = _late_burst()
    run_graph(graph, hw, 1, attach=attach)
    assert made[0].switched_at_s is not None
    keys = {made[0].meter.price_keys.of(op) for op in graph.ops}
    assert len(keys) == 1 and len(calls) == 1


def test_levels_by_op_id_equal_levels_per_op(monkeypatch):
    """The spans of one H200 step: levels read by op id from ``SpanPricing`` are the levels read per distinct op,
    to the bit (times, power, last flag); at other clocks than the pricing's, levels ignore it."""
    graph, runtime, spans = b8_step_spans(monkeypatch)
    meter = runtime.meter
    pricing = SpanPricing(meter, graph.ops)
    assert pricing.by_id
    t_a, p_a, last_a = meter.levels(spans)
    t_b, p_b, last_b = meter.levels(spans, pricing=pricing)
    assert last_a == last_b and t_a.tobytes() == t_b.tobytes() and p_a.tobytes() == p_b.tobytes()
    pricing.rows = np.zeros_like(pricing.rows)  # stale prices...
    pricing.clocks = (pricing.clocks[0] + 1.0, pricing.clocks[1])  # ...at another clock: not read
    assert meter.levels(spans, pricing=pricing)[1].tobytes() == p_a.tobytes()
