"""``metrics._segments`` assigns each phase's non-kernel ops at once (``searchsorted`` on the running maximum of
the segments' keys): the same segments as the rule it implements, one op at a time (the reference below)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.analysis.metrics import COMPUTE_KIND, PHASES, _segments


def _reference(kind, phase, start, end, thread):
    """The rule of ``phase_split``, op by op: an op of a phase joins the first segment of its phase (in device
    order) whose key is at or after its end, else the last; a phase without kernels forms one segment. A training
    thread op (``thread``) that ends after a segment of its phase and no later than the first kernel start of the
    segment after that extends that segment instead."""
    inph = np.isin(phase, PHASES)
    comp = inph & (kind == COMPUTE_KIND)
    ci = np.flatnonzero(comp)
    ci = ci[np.lexsort((end[ci], start[ci]))]
    ph, ends = phase[ci], end[ci]
    segs = []
    if len(ci):
        cut = np.flatnonzero(ph[1:] != ph[:-1]) + 1
        for a, b in zip(np.concatenate([[0], cut]), np.concatenate([cut, [len(ci)]])):
            e = float(ends[a:b].max())
            segs.append([str(ph[a]), e, e, float(start[ci][a])])
    orphans = {}
    for p, e, th in zip(phase[inph & ~comp], end[inph & ~comp], thread[inph & ~comp]):
        same = [g for g in segs if g[0] == p]
        if not same:
            orphans[p] = max(orphans.get(p, -np.inf), float(e))
            continue
        before = [i for i, g in enumerate(segs) if g[0] == p and g[2] < e]
        if th and before and before[-1] + 1 < len(segs) and e <= segs[before[-1] + 1][3]:
            segs[before[-1]][1] = max(segs[before[-1]][1], float(e))
            continue
        g = next((g for g in same if g[2] >= e), same[-1])
        g[1] = max(g[1], float(e))
    segs.extend([p, e, e, e] for p, e in orphans.items())
    segs.sort(key=lambda g: g[2])
    return [(str(p), e) for p, e, _, _ in segs]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["compute", "collective", "memcpy_h2d"]),
                          st.sampled_from([*PHASES, "data", "other"]),
                          st.integers(0, 40), st.integers(0, 10), st.booleans()), min_size=0, max_size=60))
def test_segments_equal_the_op_by_op_rule(rows):
    kind = np.array([r[0] for r in rows], dtype=str)
    phase = np.array([r[1] for r in rows], dtype=str)
    start = np.array([float(r[2]) for r in rows])
    end = start + np.array([float(r[3]) for r in rows])  # small integers: ties between keys and ends happen
    thread = np.array([r[4] for r in rows], dtype=bool)  # on the training thread (stream host)
    inph = np.isin(phase, PHASES)
    assert (_segments(phase, start, end, inph, inph & (kind == COMPUTE_KIND), None, thread)
            == _reference(kind, phase, start, end, thread))
