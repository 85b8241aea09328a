"""The GPU's power-limit firmware: the clock decisions a board power limit makes.

One job: every period, compare the windowed average board power (from the energy ledger, ``power_ledger``)
with the limit and lower or raise the clock limit of the ``ClockController``. It runs only where the limit can
bind (the highest power the model can draw exceeds it); the clock policies (``dvfs``) set the requested clock.

The limit is the firmware's, so it binds over any clock policy: a locked or planned clock is only the upper
bound, and the effective clock is ``min(target, limit)`` (NVIDIA NVML API reference,
*NvmlClocksThrottleReasons*: ``SwPowerCap`` = "SW Power Scaling algorithm is reducing the clocks below
requested clocks because the GPU is consuming too much power"; nvidia-smi reports it as "SW Power Cap" under
Clocks Throttle Reasons). When power allows, the limit climbs back to the highest clock, so the GPU returns to
the requested clock.

Windows: the modelled firmware acts on the power averaged over ``window_s``, evaluated every ``period_s``
(``dvfs.power_window_s`` / ``power_sample_period_s``, defaults 20 ms and 10 ms), not on the instantaneous
draw: NVIDIA's NVML reference, *nvmlDeviceGetPowerUsage*, states that on Ampere (except GA100) and newer GPUs
the board power it reports is averaged over a 1 s interval, with the instantaneous value a separate field
(``NVML_FI_DEV_POWER_INSTANT`` vs ``NVML_FI_DEV_POWER_AVERAGE``). So one kernel drawing more than the limit
does not by itself make an evaluated average exceed it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import chain

import numpy as np

from hardware_models.power import ratio_step
from simulator.policies.power_spans import SpanPricing, WindowSpans

#: The firmware raises the clock only when the power is this far below the cap.
HYSTERESIS = 0.03
#: Relative margin a bound computed in floats (``watch``'s window energy bound, a sum of ~100s of terms, each
#: within one rounding of its real value) takes before it rules the limit out: far above the sum's rounding
#: (~1e-14) and far below the watch's own 1e-9 margin under the limit
BOUND_SLACK = 1.0 + 1e-12


def window_over(T, P, E, t_end: float, cap: float, t0: float, period_s: float, window_s: float) -> bool:
    """Whether the average of the piecewise-constant power ``P`` (levels from ``T``, energy ``E`` at ``T``) over
    the window ``[max(0, t - window_s), t]`` exceeds ``cap`` at an evaluation time ``t = t0 + k * period_s <=
    t_end`` (``k >= 1``; the firmware's grid, see ``PowerLimitFirmware.run``)."""
    return bool(np.any(window_averages(T, P, E, t_end, t0, period_s, window_s) > cap))


def window_averages(T, P, E, t_end: float, t0: float, period_s: float, window_s: float) -> np.ndarray:
    """The windowed average power the firmware reads at each of its evaluation times up to ``t_end``, W: one value
    per ``t = t0 + k * period_s <= t_end`` (``k >= 1``), the average of ``P`` over ``[max(0, t - window_s), t]``
    (``window_over``'s arguments; empty before the first evaluation)."""
    kmax = int((t_end - t0) // period_s)
    if kmax < 1:
        return np.zeros(0)
    tk = t0 + np.arange(1, kmax + 1) * period_s
    lo = np.maximum(0.0, tk - window_s)

    def energy_at(x):
        i = np.maximum(np.searchsorted(T, x, side="right") - 1, 0)
        return E[i] + P[i] * (x - T[i])

    return (energy_at(tk) - energy_at(lo)) / (tk - lo)


class PowerLimitFirmware:
    """The power-limit loop of one GPU (SimPy process ``run``) and its offline twin (``watch``).

    Args:
        env: SimPy environment.
        ctl: The GPU's ``ClockController`` (the firmware moves its ``limit_mhz``).
        ledger: The run's ``PowerLedger`` (the firmware subscribes to its level changes).
        meter: The run's ``PowerMeter``.
        state: The device state (``sm_clock_mhz``).
        cap_w: The power limit, W.
        supported_mhz: Supported SM clocks, MHz.
        fmax_mhz: Highest clock, MHz.
        period_s, window_s: Evaluation period and averaging window, s.
        quiet_since: ``quiet_since(t)`` (default ``self.quiet_since``): may the loop sleep.

    Attributes:
        ticks: Evaluations that ran (the loop sleeps while the limit cannot bind).
        lowered: Evaluations that lowered the clock limit (the power above the limit); 0: the limit never bound.
        t0: Start of the evaluation grid ``t0 + k * period_s``, s.
    """

    def __init__(self, env, ctl, ledger, meter, state, cap_w: float, supported_mhz, fmax_mhz: float,
                 period_s: float, window_s: float, quiet_since: Callable[[float], bool] | None = None):
        self.env, self.ctl, self.ledger, self.meter, self.state = env, ctl, ledger, meter, state
        self.cap_w, self.supported, self.fmax_mhz = cap_w, tuple(supported_mhz), fmax_mhz
        self.period_s, self.window_s, self.t0 = period_s, window_s, env.now
        self.ticks = 0
        self.lowered = 0
        self._quiet = quiet_since or self.quiet_since
        self._sleep = None  # event the sleeping loop waits on (see ``run``)
        self._over_end_t = -math.inf  # when the last power level above the cap ended
        ledger.listener = self.on_level

    def on_level(self, t: float, prev_w: float, p_w: float) -> None:
        """The ledger's power became ``p_w`` at ``t``: note the end of a level above the cap; a sleeping loop
        wakes when the power rises above it."""
        cap = self.cap_w
        if prev_w > cap >= p_w:
            self._over_end_t = t
        elif p_w > cap and self._sleep is not None:
            ev, self._sleep = self._sleep, None
            ev.succeed(t)

    def quiet_since(self, t: float) -> bool:
        """Whether the power has been at or below the cap since ``t`` and still is (deferred level included)."""
        cap = self.cap_w
        return self.ledger.p[-1] <= cap and self.meter.power() <= cap and self._over_end_t <= t

    def would_act(self, t_end: float) -> bool:
        """Whether the windowed average power of the ledger exceeds the limit at an evaluation time up to ``t_end``."""
        T, P, E = (np.asarray(x, dtype=float) for x in (self.ledger.t, self.ledger.p, self.ledger.e))
        return window_over(T, P, E, t_end, self.cap_w, self.t0, self.period_s, self.window_s)

    def resume(self) -> None:
        """Take up the ledger metered so far without the loop (``watch``): when a level above the cap last ended."""
        p = np.asarray(self.ledger.p)
        over = np.nonzero((p[:-1] > self.cap_w) & (p[1:] <= self.cap_w))[0]
        if len(over):
            self._over_end_t = float(self.ledger.t[over[-1] + 1])

    def run(self, k0: int = 1):
        """SimPy process: every period, compare the windowed average power with the cap.

        Evaluations happen on the grid ``t0 + k * period``. While the limit cannot bind (clock not limited,
        current level and every level in the last window at or below the cap) the loop sleeps until a level
        above the cap appears; the evaluations it skips would have done nothing, so the result equals ticking
        every period (up to the float rounding of the grid times). ``k0``: the first evaluation (1 from the
        start; later when a run is switched to per-op metering mid-run).
        """
        env, ctl, cap = self.env, self.ctl, self.cap_w
        fmax, t0, period = self.fmax_mhz, self.t0, self.period_s
        k = k0 - 1
        while True:
            k += 1
            t_next = t0 + k * period
            if t_next > env.now:
                yield env.timeout(t_next - env.now)
            self.ticks += 1
            if ctl.pending:  # wait until the last change has landed before judging again
                continue
            now = env.now
            self.ledger.flush()
            avg = self.ledger.average_w(max(0.0, now - self.window_s), now)
            if avg <= 0:
                continue
            if avg > cap:
                self.lowered += 1
                cur = min(ctl.limit_mhz, self.state.sm_clock_mhz)
                ratio = max(0.85, (cap / avg) ** 0.5)
                ctl.set_limit(ratio_step(cur, ratio, self.supported))
            elif avg < cap * (1 - HYSTERESIS) and ctl.limit_mhz < fmax:
                ratio = min(1.05, (cap / avg) ** 0.5)
                ctl.set_limit(min(fmax, ratio_step(ctl.limit_mhz, ratio, self.supported + (fmax,))))
            elif ctl.limit_mhz >= fmax and self._quiet(now - self.window_s):
                # cannot bind until the power rises above the cap: sleep until it does
                self._sleep = env.event()
                t_rise = yield self._sleep
                k = max(k, int((max(t_rise, env.now) - t0) // period))

    def watch(self, system, recorder, go_online: Callable[[list, int, SpanPricing], None]):
        """SimPy process of an offline-metered run (power from the spans afterwards) whose limit may bind: it
        keeps the run offline until the firmware could act, then calls ``go_online(running, k, pricing)`` at that
        instant (the caller meters per op from there and starts ``run(k)``; ``pricing``: the graph's
        ``power_spans.SpanPricing``), so that the run is never repeated.

        At each evaluation time ``t = t0 + k * period`` it computes the average power over the window
        ``[max(0, t - window_s), t]`` exactly as the online meter would (``PowerMeter.levels`` of the spans ending
        in the window plus the ops still running, ``System.running``). While it is at or below the limit the
        firmware, had it run, would not have changed the clock (an evaluation only lowers the clock when the
        window average exceeds the limit; the limit starts at the highest clock, so raising it does nothing
        either; see ``run``), so the offline record is exact up to ``t``. At the first ``t`` where it is above
        the limit (less a 1e-9 relative margin, so that float rounding can only switch early, which is exact
        too) it hands over. Only where the executor keeps ``System.running`` (``track_running``: large graphs);
        otherwise it returns at once.
        """
        env, sys_, meter = self.env, system, self.meter
        if not getattr(sys_, "track_running", False):
            return  # a small graph: cheaper to check after the run and repeat it in the rare case it binds
        t0, period, w = self.t0, self.period_s, self.window_s
        thresh = self.cap_w * (1.0 - 1e-9)
        idle = self.ledger.p[0]
        busy_w = meter.busy_w()
        window = pricing = None
        k = 0
        while True:
            k += 1
            t = t0 + k * period
            if t > env.now:
                yield env.timeout(t - env.now)
            if sys_.executor is None:  # no executor to hook into (a bare harness): the after-run check decides
                return
            if k == 1:
                # a stream runs one op at a time and the power above idle is subadditive (see below): idle plus
                # each stream's largest op excess bounds every level of the run; at or below the limit the firmware
                # can never act and the offline record is exact without watching
                if idle + meter.excess_bound_w(chain.from_iterable(sys_.executor.by_stream.values()), None,
                                               thresh, idle) <= thresh:
                    return
                # a span's op, or a block's folded TP collective, carries its id: priced as the graph's op of that id,
                # once per distinct pricing key (the clocks do not move while the run is offline)
                pricing = SpanPricing(meter, sys_.executor.g.ops)
                window = WindowSpans(recorder._spans, pricing)
            lo = max(0.0, t - w)
            window.advance(lo)
            running = [(st, op, start, t, stream) for stream, (st, op, start) in sys_.running.items()]
            # cheap bounds first: the power above idle is subadditive over the running ops (a max and sums clipped
            # at 1, all coefficients >= 0), so idle + the sum of each op's own excess bounds every level; tighter for
            # the window's energy: a kernel's excess is the SM floor (``busy_w``, drawn once however many kernels
            # run) plus its activity's share, so the floor counts at most once at each instant
            inst, avg_hi, lin, kernel_s = window.bounds(running, t, lo)
            quiet = idle + inst <= thresh
            if not quiet and (idle * (t - lo) + avg_hi <= thresh * (t - lo)
                              or (idle * (t - lo) + busy_w * min(t - lo, kernel_s) + lin) * BOUND_SLACK
                              <= thresh * (t - lo)):
                continue  # this window's average cannot exceed the limit
            lv = None if quiet else meter.levels(window.rows() + running, pricing=pricing)
            if lv is None or lv[1].max() <= thresh:
                # every level in the window and the current one at or below the limit: power changes only when an op
                # starts or ends, and an end only lowers it (``levels`` is monotone), so no window can exceed the
                # limit before the next op starts: sleep until then, and go on at the next evaluation time after it
                ev = sys_.start_waiter = env.event()
                t_start = yield ev
                k = max(k, int((t_start - t0) // period))
                continue
            times, power, _ = lv
            # integral of the levels over [lo, t]: idle before the first level
            edges = np.clip(np.concatenate((times, [t])), lo, t)
            energy = float(np.sum(power * np.diff(edges))) + idle * max(0.0, min(times[0], t) - lo)
            if t > lo and energy / (t - lo) > thresh:
                go_online(running, k, pricing)
                return
