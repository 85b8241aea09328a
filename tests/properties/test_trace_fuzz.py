"""Fuzz ``simulate replay`` / ``calibrate`` with mutated traces (issue 9): one line and exit 2, or strict JSON.

A small bundled trace (HTA ``cuda_event_sync``, 92 events, one A100 step) is mutated: keys dropped,
values of the wrong type, huge / NaN / infinite numbers, arrays where objects belong, a bare event
list at the top level, truncated text. Every outcome must be exit 2 with one line on stderr, or
exit 0 with strict JSON whose numbers are finite and non-negative (``error``, a signed relative
change, is only required to be finite); never a traceback, and each run within a few seconds.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulator.cli import main
from tests.conftest import ROOT
from tests.json_numbers import json_numbers

SMALL = ROOT / "tests/data/traces/HolisticTraceAnalysis/tests/data/critical_path/cuda_event_sync/event_sync_trace.json.gz"
SCENARIO = ROOT / "scenarios/h200/gpt_184m_b16.yaml"
BASE = json.loads(gzip.decompress(SMALL.read_bytes()))
KEYS = ["ts", "dur", "name", "tid", "pid", "ph", "cat", "args"]
WEIRD = st.sampled_from([None, True, "x", "", [], [1, 2], {}, {"a": 1}, 0, -1, 2**70, -(2**70), 1e308, -1e308,
                         math.nan, math.inf, -math.inf, 1e-300])
SIGNED = {"error"}  # a relative change: finite, any sign


@st.composite
def mutated_text(draw) -> str:
    t = json.loads(json.dumps(BASE))
    ev = t["traceEvents"]
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(ev) - 1))
        op = draw(st.sampled_from(["drop", "value", "array", "args"]))
        if not isinstance(ev[i], dict):
            continue
        key = draw(st.sampled_from(KEYS))
        if op == "drop":
            ev[i].pop(key, None)
        elif op == "value":
            ev[i][key] = draw(WEIRD)
        elif op == "array":
            ev[i] = list(ev[i].values())
        else:
            ev[i]["args"] = draw(WEIRD)
    top = draw(st.sampled_from(["object", "list", "events_dict", "device_props"]))
    if top == "list":
        t = ev
    elif top == "events_dict":
        t["traceEvents"] = {"0": ev[0]}
    elif top == "device_props":
        t["deviceProperties"] = draw(st.sampled_from([[], [{}], [{"name": 5}], {"name": "x"}, "x", [[1]]]))
    text = json.dumps(t)  # NaN / Infinity as Python writes them (Python's reader accepts them)
    if draw(st.booleans()) and draw(st.booleans()):
        text = text[: draw(st.integers(0, len(text)))]
    return text


def _run(argv: list[str]) -> tuple[int, str, str, float]:
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue(), time.monotonic() - t0


def _check(rc: int, out: str, err: str, elapsed: float) -> None:
    assert elapsed < 10, f"took {elapsed:.1f} s"
    if rc == 2:
        line = err.strip()
        assert line.startswith("error: ") and "\n" not in line, err
        return
    assert rc == 0, (rc, err)

    def bad(c):
        raise AssertionError(f"non-strict JSON constant {c}")

    doc = json.loads(out, parse_constant=bad)
    for key, v in json_numbers(doc):
        assert math.isfinite(v), (key, v)
        assert key in SIGNED or v >= 0, (key, v)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(text=mutated_text())
def test_replay_of_a_mutated_trace_is_one_line_or_strict_json(text):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "mutated.json"
        p.write_text(text)
        _check(*_run(["replay", str(p), "--json"]))


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(text=mutated_text())
def test_calibrate_on_a_mutated_trace_is_one_line_or_strict_json(text):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "mutated.json"
        p.write_text(text)
        rc, out, err, elapsed = _run(["calibrate", str(p), "--scenario", str(SCENARIO), "--out",
                                      str(Path(d) / "p.yaml"), "--json"])
        if rc == 0:  # the profile and report hold measured class times: non-negative; scales may be anything > 0
            json.loads(out, parse_constant=lambda c: (_ for _ in ()).throw(AssertionError(c)))
            assert elapsed < 20
        else:
            _check(rc, out, err, elapsed)
