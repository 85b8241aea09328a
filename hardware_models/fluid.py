"""Fluid (rate-based) progress of work items on a SimPy clock, and max-min fair rates.

Two models share this solver: the link network (``hardware_models.fabrics.FluidNetwork``: bytes over
links) and the host CPU pool (``hardware_models.dataloader.CpuPool``: CPU-seconds over cores). A
*flow* has an amount of work (bytes, CPU-seconds) and, at any instant, a rate; rates are
piecewise constant and are recomputed by the owner's rate function whenever a flow starts or ends
(or the owner declares another change). ``FluidScheduler`` advances the flows between those
instants and wakes up when the next flow finishes.

Termination: every wake-up that is not superseded finishes at least one flow. The flow whose
completion time was scheduled finishes at that wake-up by identity (whatever float rounding left in
its remaining work); other flows finish with it when their completion time rounds to the current
time or their remaining work is below a relative ``REL_TOL`` of their size. Nothing compares
remaining work with an absolute threshold, so the solver behaves the same at t = 1 s and at
t = 1e7 s, for 1 byte and for 1e300 bytes (the former code kept re-scheduling the same instant past
~1,000 s of simulated time: float time steps below the resolution of ``env.now``).

Max-min fairness by progressive filling: Bertsekas & Gallager, *Data Networks*, 2nd ed., 1992,
section 6.5.2.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Sequence

import simpy

#: Remaining work below this fraction of a flow's size counts as done (float noise of the
#: ``remaining -= rate * dt`` updates is a few ulps of the size per update).
REL_TOL = 1e-12
#: Completion times within this many ulps of the earliest one count as simultaneous.
_TIME_ULPS = 4


class FluidFlow:
    """One work item: ``size`` units, ``remaining`` of them left, moving at ``rate`` units/s.

    Attributes:
        size: Total work (bytes or CPU-seconds), > 0 and finite.
        remaining: Work left.
        rate: Current rate, units/s (set by the owner's rate function).
        done: Event that succeeds when the flow finishes.
        links: Resources the flow crosses (for ``maxmin_rates``).
        cap: The flow's own rate limit, units/s (``inf`` = none).
    """

    __slots__ = ("cap", "done", "links", "rate", "remaining", "size")

    def __init__(self, size: float, done: simpy.Event, links: tuple = (), cap: float = math.inf):
        self.size = float(size)
        self.remaining = float(size)
        self.rate = 0.0
        self.done = done
        self.links = links
        self.cap = cap


def maxmin_rates(flows: Sequence[tuple[Iterable[Hashable], float]], capacities: dict) -> list[float]:
    """Max-min fair rates by progressive filling.

    All unfrozen flows' rates rise together; a flow freezes when its own cap is reached or a link it
    crosses saturates. Each round freezes at least one flow, so at most ``len(flows)`` rounds run.

    Args:
        flows: ``(links, cap)`` per flow; ``cap`` in units/s (``inf`` = none), > 0.
        capacities: Link -> capacity, units/s (> 0).

    Returns:
        The rate of each flow, in order (units/s).

    Raises:
        ValueError: a flow crosses no link and has no cap (unbounded rate).
    """
    n = len(flows)
    if n == 1:  # the common case: a lone flow gets its bottleneck
        ls, c = flows[0]
        level = min(c, min((capacities[k] for k in ls), default=math.inf))
        if level == math.inf:
            _unbounded()
        return [level]
    if n == 2:  # two flows (a copy beside a CPU step on the host DRAM link): the same rounds, without the sets
        (l0, c0), (l1, c1) = flows
        return _fill_two(tuple(l0), tuple(l1), c0, c1, capacities)
    return _fill([tuple(ls) for ls, _ in flows], [None] * n, [c for _, c in flows], capacities)


def _fill_two(l0: tuple, l1: tuple, c0: float, c1: float, capacities: dict) -> list[float]:
    """``_fill`` of two unweighted flows (links ``l0``, ``l1``, caps ``c0``, ``c1``): the same rounds and the same
    float operations (the first round's shares ``capacity / count``, the second's ``capacity - frozen rate``), so
    the same rates to the last bit."""
    count: dict = {}
    for k in l0:
        count[k] = count.get(k, 0) + 1
    for k in l1:
        count[k] = count.get(k, 0) + 1
    level = min(c0, c1)
    for k, c in count.items():  # round one: nothing frozen yet (``used`` 0)
        sh = max(capacities[k] - 0.0, 0.0) / c
        if sh < level:
            level = sh
    if level == math.inf:
        _unbounded()
    f0 = c0 <= level or _crosses_tight(l0, count, capacities, level)
    f1 = c1 <= level or _crosses_tight(l1, count, capacities, level)
    r0 = min(level, c0) if f0 else 0.0
    r1 = min(level, c1) if f1 else 0.0
    if f0 and f1:
        return [r0, r1]
    # round two: the flow left alone, on its links less what the frozen one uses there
    lf, rf, lj, cj = (l0, r0, l1, c1) if f0 else (l1, r1, l0, c0)
    used: dict = {}
    for k in lf:
        used[k] = used.get(k, 0.0) + rf
    count = {}
    for k in lj:
        count[k] = count.get(k, 0) + 1
    level = cj
    for k, c in count.items():
        sh = max(capacities[k] - used.get(k, 0.0), 0.0) / c
        if sh < level:
            level = sh
    if level == math.inf:
        _unbounded()
    r = min(level, cj)
    return [r0, r] if f0 else [r, r1]


def weighted_maxmin_rates(flows: Sequence[tuple[Sequence[tuple[Hashable, float]], float]],
                          capacities: dict) -> list[float]:
    """Max-min fair rates by progressive filling when a flow may load a link by more (or less) than its own rate.

    Flow ``i`` crossing link ``k`` with weight ``w_ik`` uses ``w_ik x rate_i`` of the link's capacity (a drive whose
    writes take ``read_bw / write_bw`` of its time per byte: ``hardware_models.nvme``). All unfrozen flows' rates
    rise together; link ``k`` saturates at the level ``(capacity_k - used_k) / sum_i w_ik`` (Bertsekas & Gallager,
    *Data Networks*, 2nd ed., 1992, section 6.5.2, with the link loads weighted). With every weight 1 it gives
    ``maxmin_rates``' rates.

    Args:
        flows: ``(((link, weight), ...), cap)`` per flow; weights > 0, ``cap`` in units/s (``inf`` = none), > 0.
        capacities: Link -> capacity, units/s (> 0).

    Returns:
        The rate of each flow, in order (units/s).

    Raises:
        ValueError: a flow crosses no link and has no cap (unbounded rate).
    """
    links = [tuple(k for k, _ in ls) for ls, _ in flows]
    weights = [tuple(w for _, w in ls) for ls, _ in flows]
    return _fill(links, weights, [c for _, c in flows], capacities)


def _fill(links: list[tuple], weights: list, caps: list[float], capacities: dict) -> list[float]:
    """Progressive filling (``maxmin_rates``, ``weighted_maxmin_rates``): ``weights[i]`` the per-link weights of flow
    ``i`` (None: every weight 1, the links counted). Each round freezes at least one flow."""
    n = len(links)
    rates = [0.0] * n
    used = {k: 0.0 for ls in links for k in ls}  # rate (weighted) of frozen flows per link
    active = set(range(n))
    while active:
        count: dict = {}
        for i in active:
            ws = weights[i]
            if ws is None:
                for k in links[i]:
                    count[k] = count.get(k, 0) + 1
            else:
                for k, w in zip(links[i], ws):
                    count[k] = count.get(k, 0) + w
        share = {k: max(capacities[k] - used[k], 0.0) / c for k, c in count.items()}
        level = min(min(share.values(), default=math.inf), min(caps[i] for i in active))
        if level == math.inf:
            _unbounded()
        tight = {k for k, s in share.items() if s <= level}
        frozen = {i for i in active if caps[i] <= level or any(k in tight for k in links[i])}
        for i in frozen:
            rates[i] = r = min(level, caps[i])
            ws = weights[i]
            if ws is None:
                for k in links[i]:
                    used[k] += r
            else:
                for k, w in zip(links[i], ws):
                    used[k] += w * r
        active -= frozen
    return rates


def _crosses_tight(links: tuple, count: dict, capacities: dict, level: float) -> bool:
    """Whether a flow over ``links`` crosses a link saturated at ``level`` in ``_fill_two``'s first round (its share
    ``capacity / count`` at most ``level``)."""
    for k in links:
        if max(capacities[k] - 0.0, 0.0) / count[k] <= level:
            return True
    return False


def _unbounded():
    raise ValueError("a flow crosses no link and has no rate cap: its rate is unbounded")


class FluidScheduler:
    """Advances fluid flows on a SimPy clock and finishes each at its completion time.

    Args:
        env: SimPy environment.
        set_rates: Called with the list of live flows; sets each flow's ``rate`` (units/s).
        on_advance: Called as ``on_advance(dt_s)`` before the flows advance by ``dt_s`` at their
            current rates (owners integrate utilisation with it).

    The owner calls ``advance()`` before changing anything the rates depend on, then
    ``reschedule()`` after; ``add`` does both.
    """

    def __init__(self, env: simpy.Environment, set_rates: Callable[[list[FluidFlow]], None],
                 on_advance: Callable[[float], None] | None = None):
        self.env = env
        self.flows: list[FluidFlow] = []
        self._set_rates = set_rates
        self._on_advance = on_advance
        self._last_t = env.now
        self._generation = 0
        #: wake-ups that ran (not superseded); each finished >= 1 flow
        self.wakeups = 0

    def add(self, size: float, links: tuple = (), cap: float = math.inf) -> simpy.Event:
        """Start a flow of ``size`` units now; returns the event of its completion.

        Raises:
            ValueError: ``size`` is not a positive finite number, or ``cap`` is not > 0.
        """
        return self.add_flow(size, links, cap).done

    def add_flow(self, size: float, links: tuple = (), cap: float = math.inf) -> FluidFlow:
        """``add``, returning the flow itself (its ``done`` event, and a handle for ``set_caps``).

        Raises:
            ValueError: as ``add``.
        """
        if not (size > 0 and math.isfinite(size)):
            raise ValueError(f"flow size must be a positive finite number, got {size!r}")
        if not cap > 0:
            raise ValueError(f"flow rate cap must be > 0, got {cap!r}")
        self.advance()
        flow = FluidFlow(size, self.env.event(), tuple(links), cap)
        self.flows.append(flow)
        self.reschedule()
        return flow

    def advance(self) -> None:
        """Move every flow forward to ``env.now`` at its current rate."""
        dt = self.env.now - self._last_t
        if dt > 0:
            if self._on_advance is not None:
                self._on_advance(dt)
            for f in self.flows:
                f.remaining = max(f.remaining - f.rate * dt, 0.0)
        self._last_t = self.env.now

    def reschedule(self) -> None:
        """Recompute rates and schedule the next completion (supersedes any pending wake-up).

        Raises:
            OverflowError: the next completion time is beyond the float range (finite but absurd
                work at a tiny rate): refused rather than never finishing.
        """
        self._generation += 1
        flows = self.flows
        if not flows:
            return
        self._set_rates(flows)
        now = self.env._now
        nxt = self._next(flows, now)
        if nxt is not None:
            gen, due = self._generation, nxt[1]  # a timeout with a callback: cheaper than a process per wake-up
            self.env.timeout(max(nxt[0] - now, 0.0)).callbacks.append(lambda _ev: self._wake(gen, due))

    def _next(self, flows: list[FluidFlow], now: float) -> tuple[float, list[FluidFlow]] | None:
        """The next completion time of ``flows`` at their rates (set) from ``now``, and the flows due then (those whose
        completion times agree with the earliest to a few ulps); None when nothing moves.

        Raises:
            OverflowError: as ``reschedule``.
        """
        if len(flows) == 1:  # the common case (a copy alone on its links): the same arithmetic, no lists
            f = flows[0]
            if not f.rate > 0:
                return None  # nothing moves; a later change reschedules
            t_next = now + f.remaining / f.rate
            if t_next == math.inf:
                raise OverflowError(f"a flow of {f.remaining:g} units at {f.rate:g} units/s would finish "
                                    f"beyond the float time range (now {now:g} s)")
            return t_next, flows[:]
        ends = [now + f.remaining / f.rate if f.rate > 0 else math.inf for f in flows]
        t_next = min(ends)
        if t_next == math.inf:
            if any(f.rate > 0 for f in flows):
                big = max(flows, key=lambda f: f.remaining)
                raise OverflowError(f"a flow of {big.remaining:g} units at {big.rate:g} units/s would finish "
                                    f"beyond the float time range (now {now:g} s)")
            return None  # nothing moves (the owner has no capacity now); a later change reschedules
        tol = _TIME_ULPS * math.ulp(t_next)
        return t_next, [f for f, t in zip(flows, ends) if t - t_next <= tol]

    def _finished(self, f: FluidFlow, now: float) -> bool:
        return _ends_by(f, f.remaining, now)

    def run(self, size: float, links: tuple, cap: float) -> simpy.Event | None:
        """Start a flow of ``size`` units over ``links`` (at most ``cap`` units/s) now, as ``add`` does; when it is due
        alone at the next completion, before anything in SimPy's heap, and no flow in flight finishes with it, run
        it to its end instead: move the clock there and do what its wake-up would (``advance``, ``wakeups``, the
        other flows' remaining work, rates and next wake-up as it leaves them, to the last bit), without its timeout
        and end event. The flows in flight may run at other rates meanwhile: they are advanced at the rates the
        solver gives them beside it, as its wake-up advances them.

        Only for a caller that may move the clock: a SimPy process resumed as the last callback of an event only it
        waits on (nothing else runs at this instant before it yields), so that nothing can start, end or re-cap a
        flow before the heap's earliest entry.

        Returns:
            None: the flow has ended, the clock is at its end. Otherwise its end event (``add``'s).

        Raises:
            ValueError, OverflowError: as ``add_flow`` and ``reschedule``.
        """
        if not (size > 0 and math.isfinite(size)):
            raise ValueError(f"flow size must be a positive finite number, got {size!r}")
        if not cap > 0:
            raise ValueError(f"flow rate cap must be > 0, got {cap!r}")
        self.advance()  # ``add_flow``'s
        env = self.env
        flow = FluidFlow(size, None, tuple(links), cap)
        flows = self.flows
        flows.append(flow)
        self._generation += 1  # ``reschedule``'s
        self._set_rates(flows)
        now = env._now
        queue = env._queue
        before = queue[0][0] if queue else math.inf  # nothing else due before its end, nor at it (its wake-up: last)
        left = rem = ()
        if len(flows) == 1:  # alone (the common case): ``_next``'s arithmetic, without its lists
            nxt = None
            rate = flow.rate
            end = now + max(now + flow.remaining / rate - now, 0.0) if rate > 0 else math.inf  # (inf: ``_next`` raises)
        else:
            nxt = self._next(flows, now)
            end = math.inf
            if nxt is not None and len(nxt[1]) == 1 and nxt[1][0] is flow:
                end = now + max(nxt[0] - now, 0.0)  # the wake-up's time (``Environment.schedule``'s ``now + delay``)
                if end < before:  # the wake-up's ``advance``: no other flow may finish with it (``_wake``'s ``done``)
                    dt = end - now
                    left = flows[:-1]
                    rem = [max(f.remaining - f.rate * dt, 0.0) for f in left]  # (dt 0: unchanged)
                    for f, r in zip(left, rem):
                        if _ends_by(f, r, end):
                            end = math.inf
                            break
        if end < before:  # its wake-up, done now
            if end > now and self._on_advance is not None:
                self._on_advance(end - now)
            for f, r in zip(left, rem):
                f.remaining = r
            flow.remaining = 0.0
            self._last_t = end
            self.wakeups += 1
            env._now = end
            if left:
                self.flows = left
                self.reschedule()  # the wake-up's: the others' rates and next wake-up from ``end``
            else:
                self.flows = []
                self._generation += 1  # the wake-up's ``reschedule`` of no flow
            return None
        if nxt is None and len(flows) == 1:
            nxt = self._next(flows, now)
        flow.done = env.event()
        if nxt is not None:  # ``reschedule``'s wake-up
            gen, due = self._generation, nxt[1]
            env.timeout(max(nxt[0] - now, 0.0)).callbacks.append(lambda _ev: self._wake(gen, due))
        return flow.done

    def _wake(self, gen: int, due: list[FluidFlow]) -> None:
        if gen != self._generation:
            return  # superseded: a flow started or ended, or the rates changed
        self.advance()
        self.wakeups += 1
        env = self.env
        queue = env._queue
        now = env._now
        # nothing else is due at this instant: the one flow that ends is processed at once after this wake-up (what
        # ``Environment.step`` does next with its ``done``: ``process_at_once``)
        free = not queue or queue[0][0] > now
        flows = self.flows
        if len(flows) == 1 and len(due) == 1 and due[0] is flows[0]:  # the lone flow ends (as below, no sets)
            f = flows[0]
            self.flows = []
            f.remaining = 0.0
            self._generation += 1  # ``reschedule`` of no flow
            if free:
                process_at_once(f.done)
            else:
                f.done.succeed()
            return
        due_ids = {id(f) for f in due}
        done, left = [], []
        for f in self.flows:
            (done if id(f) in due_ids or self._finished(f, now) else left).append(f)
        self.flows = left
        for f in done:
            f.remaining = 0.0
        if free and len(done) == 1:
            self.reschedule()  # its wake-up is due at or after ``done``, which ``Environment.step`` takes first
            process_at_once(done[0].done)
            return
        for f in done:
            f.done.succeed()
        self.reschedule()


def _ends_by(f: FluidFlow, remaining: float, now: float) -> bool:
    """Whether flow ``f`` with ``remaining`` units left counts as finished at ``now`` (s): the remaining work is below
    ``REL_TOL`` of its size, or its completion at its rate rounds to ``now``."""
    if remaining <= REL_TOL * f.size:
        return True
    return f.rate > 0 and now + remaining / f.rate <= now


def process_at_once(event: simpy.Event) -> None:
    """Trigger ``event`` (a success, value None) and run its callbacks now, as ``Environment.step`` would when it
    takes it from the heap. Only for the last action of an event's last callback when nothing else is due at this
    instant (no entry of SimPy's heap at or before now, but what the caller scheduled after it): ``step`` would
    take this event next, at the same time, so the order and the times are the same without the heap push and
    pop."""
    event._ok, event._value = True, None
    callbacks, event.callbacks = event.callbacks, None
    for callback in callbacks:
        callback(event)


__all__ = ["REL_TOL", "FluidFlow", "FluidScheduler", "maxmin_rates", "process_at_once", "weighted_maxmin_rates"]
