"""A layer-fidelity block's timeline with TP collectives running beside its kernels (``run.fidelity: layer``).

A block (``simulator.graph.side_blocks``) runs its parts (kernels) one after another on the compute stream; each
of its TP collectives (one comm stream, in stream order) starts once the part it waits for has ended and the
collective before it on the stream is done, and the part that waits for it starts only once it is done. This is
the schedule kernel fidelity gives the same ops on an otherwise idle GPU (``System.run_kernel`` /
``System.run_collective``), with its interference rules (``simulator.cost.interference``):

* a part in flight beside a collective takes its duration beside that collective's load (the caller's
  ``beside_s``); when the collective ends mid-part the rest of the part goes at its rate alone;
* a collective progresses at ``1 / (slow * t)`` while a part runs (``slow = 1 + gamma``) and ``1 / t`` while the
  compute stream waits, ``t`` its time alone on its links (NCCL model).

A blocking collective (the next part waits for it) is the case with no part beside it: it takes ``t``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Timeline:
    """What ``overlap_timeline`` works out, all in seconds from the block's start.

    Attributes:
        end_s: The block's end (its last part's end).
        busy_s: Time some part runs (the compute stream is busy); ``end_s - busy_s`` it waits for collectives.
        comm_s: Each collective's time in flight (start to end), in stream order.
        comm_start_s: Each collective's start, in stream order.
        run_s: Each part's time from its start to its end.
        wait_s: Each part's wait, after the part before it ended, for the collectives it waits for.
    """

    end_s: float
    busy_s: float
    comm_s: tuple[float, ...]
    comm_start_s: tuple[float, ...]
    run_s: tuple[float, ...]
    wait_s: tuple[float, ...]


def overlap_timeline(part_s: Sequence[float], comms: Sequence[tuple[int, int, float]], slow: float,
                     beside_s: Callable[[int, int], float]) -> Timeline:
    """The block's timeline (module docstring).

    Args:
        part_s: Duration of each part alone (nothing in flight beside it), s.
        comms: One ``(a, b, t_s)`` per collective in stream order: it starts after part ``a`` ends (``-1``: at the
            block's start), part ``b`` (``a < b``) waits for it, ``t_s`` its time alone, s.
        slow: How many times longer a collective takes while a part runs (1: no interference).
        beside_s: ``beside_s(i, k)``: duration of part ``i`` while collective ``k`` is in flight, s.

    Raises:
        ValueError: a collective that would start after the part waiting for it (``b <= a``) or past the parts,
            or an order in which a part waits for a collective that waits for a later part.
    """
    n, m = len(part_s), len(comms)
    gate = [0] * (n + 1)  # gate[i]: collectives that must be done before part i starts
    for k, (a, b, _) in enumerate(comms):
        if not -1 <= a < b < n:
            raise ValueError(f"collective {k} starts after part {a} and is waited for by part {b} of {n}")
        gate[b] = k + 1
    for i in range(1, n + 1):
        gate[i] = max(gate[i], gate[i - 1])
    t = busy = 0.0
    i, pf = 0, 0.0  # the part in progress and the fraction of it done
    k, cp, c0 = 0, 0.0, None  # the next collective, the fraction of it done, its start (None: not started)
    comm_s: list[float] = []
    comm_t0: list[float] = []
    run_s, wait_s = [0.0] * n, [0.0] * n
    p0 = 0.0  # when the part in progress started (or the one before it ended, while it waits)
    started = False
    while i < n or k < m:
        if k < m and c0 is None and i > comms[k][0]:
            c0 = t
        running = i < n and k >= gate[i]
        if not running and c0 is None:
            raise ValueError(f"part {i} waits for collective {k}, which waits for a later part")
        if running and not started:
            wait_s[i], p0, started = t - p0, t, True
        d = (beside_s(i, k) if c0 is not None else part_s[i]) if running else 0.0
        tc = (1.0 - pf) * d if running else float("inf")
        tt = comms[k][2] * (slow if running else 1.0) if c0 is not None else 0.0
        tm = (1.0 - cp) * tt if c0 is not None else float("inf")
        dt = min(tc, tm)
        t += dt
        if running:
            busy += dt
            if tc <= tm:
                run_s[i], i, pf, p0, started = t - p0, i + 1, 0.0, t, False
            else:
                pf += dt / d if d > 0 else 1.0
        if c0 is not None:
            if tm <= tc:
                comm_s.append(t - c0)
                comm_t0.append(c0)
                k, cp, c0 = k + 1, 0.0, None
            else:
                cp += dt / tt if tt > 0 else 1.0
    return Timeline(t, busy, tuple(comm_s), tuple(comm_t0), tuple(run_s), tuple(wait_s))
