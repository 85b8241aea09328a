"""``metrics._subtract`` (a linear sweep since issue 12) equals the plain quadratic definition, and
worked examples by hand."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.analysis.metrics import _merge, _subtract


def _subtract_plain(a, b):
    """The definition: every interval of ``b`` against every interval of ``a`` (main's code)."""
    out = []
    for s, e in a:
        cur = s
        for bs, be in b:
            if be <= cur or bs >= e:
                continue
            if bs > cur:
                out.append((cur, bs))
            cur = max(cur, be)
            if cur >= e:
                break
        if cur < e:
            out.append((cur, e))
    return np.asarray(out, dtype=float).reshape(-1, 2)


def test_by_hand():
    a = np.array([[0.0, 10.0], [20.0, 30.0]])
    b = np.array([[2.0, 3.0], [5.0, 22.0], [29.0, 40.0]])
    assert _subtract(a, b).tolist() == [[0.0, 2.0], [3.0, 5.0], [22.0, 29.0]]
    assert _subtract(a, np.zeros((0, 2))).tolist() == a.tolist()
    assert _subtract(np.zeros((0, 2)), b).shape == (0, 2)


_iv = st.lists(st.tuples(st.integers(0, 200), st.integers(0, 30)), max_size=25).map(
    lambda xs: _merge(np.array([(s / 4, (s + d) / 4) for s, d in xs], dtype=float).reshape(-1, 2)))


@settings(max_examples=300, deadline=None)
@given(_iv, _iv)
def test_equals_plain_definition(a, b):
    assert np.array_equal(_subtract(a, b), _subtract_plain(a, b))
