"""A run's counters and launches frames are built when first read (``recording.deferred``; the summary does not
read them), and are then the frames the eager build gave; the DVFS average clock, which read it, comes from the clock's recorded samples
with the same result."""

from __future__ import annotations

import pickle
import types
import warnings

import pandas as pd
import pytest

from simulator import load_scenario, run_scenario
from simulator.api import build_graph
from simulator.policies.dvfs import DvfsRuntime
from simulator.recording.deferred import Deferred, DeferredField
from simulator.recording.recorder import counter_frame
from tests.conftest import ROOT


def test_deferred_builds_once_on_first_read():
    calls = []
    d = Deferred(lambda: calls.append(1) or 42)
    assert calls == []
    assert (d.value(), d.value(), calls) == (42, 42, [1])


def r_cfg():
    return load_scenario(ROOT / "scenarios/h200/llama3_8b_b1.yaml", ["run.steps=2", "run.warmup_steps=1"])


def test_run_counters_are_built_on_first_read_and_pickle_built():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = run_scenario(r_cfg())
    assert isinstance(DeferredField.raw(r, "counters"), Deferred)
    assert isinstance(DeferredField.raw(r, "launches"), Deferred)
    launches = r.launches  # every launched op of both steps, each ending when the host thread launched it
    assert len(launches) == 2 * sum(op.launch for op in build_graph(r_cfg(), 0).ops)
    assert launches.end_s.is_monotonic_increasing
    frame = r.counters
    assert DeferredField.raw(r, "counters") is frame is r.counters
    assert set(frame.metric.astype(str)) >= {"memory_bytes", "power_w", "sm_clock_mhz"}
    assert frame.t_s.is_monotonic_increasing
    with pytest.raises(AttributeError):
        r.counters = frame  # still a frozen result
    back = pickle.loads(pickle.dumps(r))
    pd.testing.assert_frame_equal(back.counters, frame, check_exact=True)
    pd.testing.assert_frame_equal(back.launches, launches, check_exact=True)


def test_average_clock_from_samples_equals_the_frames():
    """1980 MHz from 0, 990 MHz from 0.5 s; over [0.25, 1.0]: (1980 x 0.25 + 990 x 0.5) / 0.75 = 1320 MHz, from the
    samples and from a counters frame holding them among other rows (a memory sample at 0.5 s)."""
    rows = [(0, "gpu0", "sm_clock_mhz", 1980.0), (0.5, "gpu0.hbm", "memory_bytes", 7), (0.5, "gpu0", "power_w", 300.0),
            (0.5, "gpu0", "sm_clock_mhz", 990.0)]
    dv = object.__new__(DvfsRuntime)
    dv.state = types.SimpleNamespace(sm_clock_mhz=1980)
    from_frame = dv._avg_clock(counter_frame(tuple(map(list, zip(*rows)))), 0.25, 1.0)
    dv._clock_samples = [(t, v) for t, sc, m, v in rows if (sc, m) == ("gpu0", "sm_clock_mhz")]
    assert dv._avg_clock(None, 0.25, 1.0) == from_frame == (1980.0 * 0.25 + 990.0 * 0.5) / 0.75
    dv._clock_samples = []
    assert dv._avg_clock(None, 0.25, 1.0) == 1980.0
