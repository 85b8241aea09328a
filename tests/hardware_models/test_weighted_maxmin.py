"""``fluid.weighted_maxmin_rates`` against ``fluid.maxmin_rates``: with every weight 1 the rates are the same floats
(its docstring's claim), and with weights every link's weighted load stays within its capacity and every flow is held
by its cap or by a saturated link it crosses (max-min fairness, Bertsekas & Gallager, Data Networks 6.5.2)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from hardware_models.fluid import maxmin_rates, weighted_maxmin_rates

LINKS = ["a", "b", "c", "d"]
_CAP = st.sampled_from([1.0, 3.0, 7.5, 1e9, 31.5e9])
_FLOW = st.tuples(st.lists(st.sampled_from(LINKS), min_size=1, max_size=3, unique=True),
                  st.sampled_from([math.inf, 2.0, 5.0, 1e10]))


@settings(max_examples=300, deadline=None)
@given(flows=st.lists(_FLOW, min_size=1, max_size=6), caps=st.fixed_dictionaries({k: _CAP for k in LINKS}))
def test_unit_weights_give_maxmin_rates_exactly(flows, caps):
    plain = maxmin_rates([(tuple(ls), c) for ls, c in flows], caps)
    assert weighted_maxmin_rates([(tuple((k, 1.0) for k in ls), c) for ls, c in flows], caps) == plain


@settings(max_examples=300, deadline=None)
@given(flows=st.lists(st.tuples(_FLOW, st.lists(st.sampled_from([0.5, 1.0, 1.6, 3.0]), min_size=3, max_size=3)),
                      min_size=1, max_size=6), caps=st.fixed_dictionaries({k: _CAP for k in LINKS}))
def test_weighted_rates_are_feasible_and_max_min(flows, caps):
    spec = [(tuple(zip(ls, ws)), c) for (ls, c), ws in flows]
    rates = weighted_maxmin_rates(spec, caps)
    load = {k: 0.0 for k in LINKS}
    for (ls, _), r in zip(spec, rates):
        for k, w in ls:
            load[k] += w * r
    assert all(load[k] <= caps[k] * (1 + 1e-9) for k in LINKS)
    full = {k for k in LINKS if load[k] >= caps[k] * (1 - 1e-9)}
    for (ls, c), r in zip(spec, rates):
        assert r > 0
        assert r >= c * (1 - 1e-12) or any(k in full for k, _ in ls)


_DUP_FLOW = st.tuples(st.lists(st.sampled_from(LINKS), min_size=0, max_size=4),  # links may repeat
                      st.sampled_from([math.inf, 0.5, 2.0, 5.0, 1e10]))


@settings(max_examples=500, deadline=None)
@given(flows=st.lists(_DUP_FLOW, min_size=2, max_size=2), caps=st.fixed_dictionaries({k: _CAP for k in LINKS}))
def test_two_flow_path_gives_the_general_fill_exactly(flows, caps):
    """``maxmin_rates`` of two flows (its own path, ``fluid._fill_two``) is the general progressive filling's result to
    the last bit (the weighted solver with weights 1 runs the general rounds), repeated links and no links included;
    both refuse an unbounded flow."""
    try:
        general = weighted_maxmin_rates([(tuple((k, 1.0) for k in ls), c) for ls, c in flows], caps)
    except ValueError:
        general = None
    try:
        two = maxmin_rates([(tuple(ls), c) for ls, c in flows], caps)
    except ValueError:
        two = None
    assert two == general
