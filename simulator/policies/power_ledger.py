"""The energy ledger of a run: the board power as piecewise-constant levels, their integral, and the
``power_w`` counters.

One job: record power levels and integrate them (``hardware_models.power.EnergyLedger``), whether they come
one at a time during the run (``set_level``, ``update``; a level change at an op's end is deferred until time
moves on, so a zero-length idle level between two ops is never recorded) or as arrays from recorded spans
(``append_levels``). What the power is comes from the meter (``power_meter``); who reacts to it (the
power-limit firmware) subscribes with ``listener``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hardware_models.power import EnergyLedger

#: counter scope of the (one) GPU of a simulated rank
SCOPE = "gpu0"


class PowerLedger(EnergyLedger):
    """Power levels over the run (``t``, ``p``: level ``p[i]`` from ``t[i]``; ``e[i]``: energy to ``t[i]``, J)
    with the recorder's ``power_w`` counters kept equal to them.

    Args:
        env: SimPy environment (``now``).
        recorder: The run's recorder (None: no counters).
        power: The meter's board power now, W (``PowerMeter.power``).

    Attributes:
        dirty_t: When a level change was deferred (an op ended at that instant), or None.
        listener: Called as ``listener(t, previous_w, new_w)`` after each level change (the firmware's wake-up).
    """

    def __init__(self, env, recorder, power: Callable[[], float]):
        super().__init__(env.now, power())
        self.env, self.rec, self._power = env, recorder, power
        self.dirty_t: float | None = None
        self.listener: Callable[[float, float, float], None] | None = None

    def count(self, t: float, metric: str, value: float) -> None:
        """A counter sample of the GPU (``power_w``, ``sm_clock_mhz``) at ``t``."""
        if self.rec is not None:
            self.rec.counter(t, SCOPE, metric, float(value))

    def set_level(self, t: float, p: float) -> None:
        """Power becomes ``p`` at ``t``: ledger entry, ``power_w`` counter, listener."""
        prev = self.p[-1]
        if self.set(t, p):
            self.count(t, "power_w", p)
            if self.listener is not None:
                self.listener(t, prev, p)

    def defer(self) -> None:
        """The power changed now (an op ended) but may change again at this instant: commit it later (``flush``)."""
        if self.dirty_t is None:
            self.dirty_t = self.env.now

    def flush(self) -> None:
        """Commit a level change deferred by ``defer`` if time has moved on since."""
        t = self.dirty_t
        if t is not None:
            self.dirty_t = None
            if t < self.env.now:
                self.set_level(t, self._power())

    def update(self) -> None:
        """Commit any deferred change, then the meter's power now."""
        self.flush()
        self.set_level(self.env.now, self._power())

    def record_levels(self, levels) -> None:
        """The levels ``(times, power, last_starts)`` of ``PowerMeter.levels`` (None: none), in place of per-op
        updates: the level after the last op end stays deferred (``update`` commits it), as per op."""
        if levels is None:
            return
        times, power, last_starts = levels
        n = len(times)
        if not last_starts:
            n -= 1
            self.dirty_t = float(times[-1])
        self.append_levels(times[:n], power[:n])

    def append_levels(self, times, power) -> None:
        """``set_level(t, p)`` for each level in time order (no listener runs), on arrays: the same ledger
        entries (energy accumulated in the same order) and ``power_w`` counters."""
        if not len(times):
            return
        keep = power != np.concatenate(([self.p[-1]], power[:-1]))  # set() skips an unchanged level
        times, power = times[keep], power[keep]
        if not len(times):
            return
        t_list, p_list = times.tolist(), power.tolist()
        if t_list[0] == self.t[-1]:  # a change at the ledger's last instant replaces its level
            self.p[-1] = p_list[0]
            self.count(t_list[0], "power_w", p_list[0])
            t_list, p_list, times, power = t_list[1:], p_list[1:], times[1:], power[1:]
            if not t_list:
                return
        t_prev = np.concatenate(([self.t[-1]], times[:-1]))
        p_prev = np.concatenate(([self.p[-1]], power[:-1]))
        e = np.cumsum(np.concatenate(([self.e[-1]], p_prev * (times - t_prev))))[1:]
        self.t.extend(t_list)
        self.p.extend(p_list)
        self.e.extend(e.tolist())
        if self.rec is not None:  # the first may replace a sample at that instant
            self.rec.counter_series(t_list, SCOPE, "power_w", p_list)
