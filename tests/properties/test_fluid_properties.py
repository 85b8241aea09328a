"""The fluid solver (links and CPU pool) against an exact max-min reference, at simulated hours.

The reference replays the same flows in exact rational arithmetic (``fractions.Fraction``): max-min
fair rates by progressive filling, recomputed at every arrival and completion. The simulator runs
the same flows in floats on a SimPy clock starting at 1e3..1e7 s, where a float time step is
1e-13..1e-9 s (the old solver re-scheduled the same instant forever there).
"""

from __future__ import annotations

import contextlib
import math
import signal
from fractions import Fraction

import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

import simulator.api as api
import simulator.engine.run as run_mod
from hardware_models.dataloader import CpuPool
from hardware_models.fabrics import FluidNetwork, LinkSpec
from hardware_models.fluid import FluidScheduler, maxmin_rates
from simulator.config.loader import load_scenario
from tests.conftest import ROOT

PCIE = {"h2d": ("pcie.h2d", "pcie.duplex"), "d2h": ("pcie.d2h", "pcie.duplex")}


# -- exact reference -------------------------------------------------------------------------------
def _exact_rates(active, flows, capacities):
    """Progressive filling in rationals: the textbook algorithm, no tolerances."""
    rates, used, left = {}, {k: Fraction(0) for k in capacities}, set(active)
    while left:
        count = {}
        for i in left:
            for k in flows[i][2]:
                count[k] = count.get(k, 0) + 1
        shares = {k: (capacities[k] - used[k]) / c for k, c in count.items()}
        caps = [flows[i][3] for i in left if flows[i][3] is not None]
        level = min(list(shares.values()) + caps)
        tight = {k for k, s in shares.items() if s == level}
        frozen = {i for i in left if flows[i][3] == level or tight & set(flows[i][2])}
        for i in frozen:
            rates[i] = level
            for k in flows[i][2]:
                used[k] += level
        left -= frozen
    return rates


def exact_finish_times(flows, capacities):
    """Finish time of each flow ``(start_s, nbytes, links, cap or None)`` under exact max-min sharing."""
    flows = [(Fraction(s), Fraction(n), tuple(ls), None if c is None else Fraction(c)) for s, n, ls, c in flows]
    capacities = {k: Fraction(v) for k, v in capacities.items()}
    arrivals = sorted(range(len(flows)), key=lambda i: flows[i][0])
    remaining, finish, t = {}, {}, flows[arrivals[0]][0]
    while arrivals or remaining:
        while arrivals and flows[arrivals[0]][0] <= t:
            i = arrivals.pop(0)
            remaining[i] = flows[i][1]
        rates = _exact_rates(remaining, flows, capacities) if remaining else {}
        t_done = min((t + remaining[i] / rates[i] for i in remaining), default=None)
        t_arr = flows[arrivals[0]][0] if arrivals else None
        t_new = min(x for x in (t_done, t_arr) if x is not None)
        for i in list(remaining):
            remaining[i] -= rates[i] * (t_new - t)
            if remaining[i] == 0:
                finish[i] = t_new
                del remaining[i]
        t = t_new
    return [finish[i] for i in range(len(flows))]


# -- the simulator on the same flows -----------------------------------------------------------------
@contextlib.contextmanager
def deadline(seconds: int):
    """Turn a hang into a failure (SIGALRM; the old solver spun forever at late simulated times)."""

    def hang(signum, frame):
        raise TimeoutError(f"the simulation did not finish within {seconds} s")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def simulate_network(flows, capacities):
    env = simpy.Environment()
    net = FluidNetwork(env, capacities)
    ends = [None] * len(flows)

    def one(i, start, nbytes, links, cap):
        yield env.timeout(start)
        yield from net.transfer(nbytes, links, cap_bytes_per_s=cap or 0.0)
        ends[i] = env.now

    for i, (s, n, ls, c) in enumerate(flows):
        env.process(one(i, s, n, ls, c))
    with deadline(10):
        env.run()
    return ends, net


def _close(t_sim, t_exact, start, n_flows):
    """Within a relative 1e-9 of the flow's duration plus a few float steps per event at that time."""
    t_exact = float(t_exact)
    return abs(t_sim - t_exact) <= 1e-9 * (t_exact - start) + 8 * n_flows * math.ulp(t_exact)


sizes = st.floats(0, 15).map(lambda e: float(round(10 ** e)) or 1.0)  # 1 .. 1e15 bytes, log-uniform
rates = st.floats(8, 11).map(lambda e: 10 ** e)  # 1e8 .. 1e11 bytes/s


@st.composite
def pcie_case(draw, max_flows=6):
    t0 = draw(st.floats(3, 7).map(lambda e: 10 ** e))  # 1e3 .. 1e7 s
    cap = {"pcie.h2d": draw(rates), "pcie.d2h": draw(rates)}
    cap["pcie.duplex"] = draw(st.floats(0.5, 1.0)) * (cap["pcie.h2d"] + cap["pcie.d2h"])
    flows = []
    for _ in range(draw(st.integers(1, max_flows))):
        n = draw(sizes)
        # arrivals spread over about one flow duration, so flows overlap and arrive mid-way
        start = t0 + draw(st.floats(0, 1)) * n / cap["pcie.h2d"]
        links = PCIE[draw(st.sampled_from(["h2d", "d2h"]))]
        c = draw(st.one_of(st.none(), rates))
        flows.append((start, n, links, c))
    return flows, cap


@settings(max_examples=150, deadline=None)
@given(pcie_case())
def test_every_flow_finishes_at_the_exact_max_min_time(case):
    flows, cap = case
    ends, net = simulate_network(flows, cap)
    exact = exact_finish_times(flows, cap)
    assert all(e is not None for e in ends)
    for (start, *_), t, x in zip(flows, ends, exact):
        assert _close(t, x, start, len(flows)), (t, float(x))
    # termination: each wake-up that runs finishes at least one flow
    assert net._fluid.wakeups <= len(flows)
    # bytes conserved: each link carried the bytes of the flows crossing it
    for k in cap:
        assert net.bytes_carried[k] == sum(n for _, n, ls, _ in flows if k in ls)


@settings(max_examples=60, deadline=None)
@given(st.floats(3, 7).map(lambda e: 10 ** e), st.lists(sizes, min_size=1, max_size=8), rates)
def test_single_link_is_work_conserving(t0, nbytes, cap):
    """Flows all present at t0 on one uncapped link: the link never idles, the last ends at t0 + sum / cap."""
    flows = [(t0, n, ("l",), None) for n in nbytes]
    ends, _ = simulate_network(flows, {"l": cap})
    exact = t0 + math.fsum(nbytes) / cap
    assert abs(max(ends) - exact) <= 1e-9 * (exact - t0) + 8 * len(flows) * math.ulp(exact)


@settings(max_examples=60, deadline=None)
@given(pcie_case(max_flows=5), st.floats(1.0, 4.0))
def test_more_bandwidth_is_never_slower(case, factor):
    """Scaling every link's capacity by ``factor`` >= 1 finishes no flow later."""
    flows, cap = case
    slow, _ = simulate_network(flows, cap)
    fast, _ = simulate_network(flows, {k: v * factor for k, v in cap.items()})
    for a, b in zip(fast, slow):
        assert a <= b + 8 * len(flows) * math.ulp(b)


# -- hand-worked cases ---------------------------------------------------------------------------------
@pytest.mark.parametrize("t0", [0.0, 1e6])
def test_two_flows_on_one_link_share_it(t0):
    """Two 1 GB flows on a 1 GB/s link: 0.5 GB/s each, both done after 2 s."""
    ends, _ = simulate_network([(t0, 1e9, ("l",), None), (t0, 1e9, ("l",), None)], {"l": 1e9})
    assert ends == [t0 + 2.0, t0 + 2.0]


@pytest.mark.parametrize("t0", [0.0, 1e6])
def test_flow_arriving_mid_way(t0):
    """A: 3 GB at t0, B: 1 GB at t0+1 on 1 GB/s. A alone for 1 s (2 GB left); both at 0.5 GB/s for
    2 s: B done at t0+3 with A at 1 GB left; A alone again, done at t0+4."""
    ends, _ = simulate_network([(t0, 3e9, ("l",), None), (t0 + 1.0, 1e9, ("l",), None)], {"l": 1e9})
    assert ends == [t0 + 4.0, t0 + 3.0]


def test_rate_cap_leaves_the_rest_to_the_other_flow():
    """1 GB/s link, flow A capped at 0.25 GB/s, B uncapped: B gets 0.75 GB/s (max-min)."""
    assert maxmin_rates([(("l",), 0.25e9), (("l",), math.inf)], {"l": 1e9}) == [0.25e9, 0.75e9]


def test_huge_flows_terminate():
    """1e300 bytes at 1e10 B/s ends at 1e290 s; a finish time past the float range is refused."""
    ends, _ = simulate_network([(1e7, 1e300, ("l",), None), (1e7, 1.0, ("l",), None)], {"l": 1e10})
    assert ends[1] == pytest.approx(1e7 + 2e-10, abs=4 * math.ulp(1e7))
    assert ends[0] == pytest.approx(1e290, rel=1e-12)
    with pytest.raises(OverflowError, match="float time range"):
        simulate_network([(0.0, 1e300, ("l",), 1e-10)], {"l": 1e10})
    with pytest.raises(ValueError, match="finite"):
        simulate_network([(0.0, math.inf, ("l",), None)], {"l": 1e10})


# -- CPU pool (processor sharing) -----------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(st.floats(3, 7).map(lambda e: 10 ** e), st.integers(1, 8),
       st.lists(st.tuples(st.floats(0, 1), st.floats(-6, 4).map(lambda e: 10 ** e)), min_size=1, max_size=8))
def test_cpu_pool_matches_exact_processor_sharing(t0, cores, jobs):
    """Each job runs at min(1, cores / runnable): max-min on one link of ``cores`` with a cap of 1 per job."""
    env = simpy.Environment()
    pool = CpuPool(env, cores)
    span = max(w for _, w in jobs)
    flows = [(t0 + f * span, w, ("cpu",), 1.0) for f, w in jobs]
    ends = [None] * len(flows)

    def one(i, start, work):
        yield env.timeout(start)
        yield from pool.run(work)
        ends[i] = env.now

    for i, (s, w, *_) in enumerate(flows):
        env.process(one(i, s, w))
    with deadline(10):
        env.run()
    exact = exact_finish_times(flows, {"cpu": cores})
    for (start, *_), t, x in zip(flows, ends, exact):
        assert _close(t, x, start, len(flows)), (t, float(x))
    assert pool._fluid.wakeups <= len(flows)
    # busy core-seconds = the CPU work done (every job runs on one core at most), up to float
    # steps of the clock per event
    work = math.fsum(w for _, w in jobs)
    assert abs(pool.busy_core_s - work) <= 1e-9 * work + 8 * len(jobs) * cores * math.ulp(max(ends))


def test_cpu_pool_background_threads_share_the_cores():
    """2 cores, 2 background threads, 1 job of 3 CPU-s at t=1e6: speed 2/3, done after 4.5 s."""
    env = simpy.Environment(initial_time=1e6)
    pool = CpuPool(env, 2)
    pool.set_background("train", 2)
    end = []

    def job():
        yield from pool.run(3.0)
        end.append(env.now)

    env.process(job())
    env.run()
    assert end[0] == pytest.approx(1e6 + 4.5, abs=4 * math.ulp(1e6))


def test_scheduler_refuses_non_finite_work():
    sched = FluidScheduler(simpy.Environment(), lambda flows: None)
    for bad in (math.nan, math.inf, 0.0, -1.0):
        with pytest.raises(ValueError, match="positive finite"):
            sched.add(bad)


# -- regression: the ZeRO-Offload scenario past 1,000 s of simulated time -------------------------------
def test_zerooffload_scenario_runs_at_late_simulated_times(monkeypatch):
    """The same 2-layer ZeRO-Offload step at t = 0 and starting at t = 1e5 s: same step time, fast.

    Before the shared solver this hung (the PCIe fluid model re-scheduled the same instant); the
    alarm turns a hang into a failure.
    """
    cfg = load_scenario(ROOT / "scenarios/validation/ZEROOFFLOAD-GPT2-10B-1xV100-log.yaml",
                        ["model.num_layers=2", "run.steps=3"])
    base = api.run_scenario(cfg).summary["step_time_s"]
    environment = simpy.Environment
    monkeypatch.setattr(run_mod.simpy, "Environment", lambda: environment(initial_time=1e5))
    with deadline(20):
        late = api.run_scenario(cfg).summary["step_time_s"]
    assert late == pytest.approx(base, rel=1e-9)


def test_infinite_bandwidth_is_refused():
    """``1e400 TB/s`` parses to inf; a link that fast is refused, not taken as instantaneous copies."""
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s must be a positive finite number, got inf"):
        LinkSpec("x", math.inf)
    with pytest.raises(ValueError, match="capacity must be a positive finite number"):
        FluidNetwork(simpy.Environment(), {"l": math.inf})
