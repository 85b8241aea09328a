"""Fuzzed scenarios (issues 9 and 16): a mutated scenario is refused in one line or runs cleanly.

Starting from bundled scenarios, hypothesis mutates one or more values (huge, negative, NaN and
infinite numbers, strings with units, lists, mappings, deep nesting, YAML tags), renames or deletes
keys, or corrupts the file's bytes, then runs ``simulate run FILE --json`` in-process with two
steps. The property: exit 2 with one ``error:`` line per problem on stderr (``warning:`` lines aside; at most
20 and a "... and N more" line, ``loader``),
or exit 0/1 whose stdout, if any, is strict JSON (no NaN/Infinity) with finite, non-negative
numbers; never a traceback, never longer than the deadline.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulator.cli import main
from tests.conftest import ROOT
from tests.json_numbers import json_numbers

BASES = ["h200/gpt_184m_b8.yaml", "h200/dataloader_w8.yaml", "h200/gpt_184m_b16_offload_overlap.yaml"]
_BASE = {b: yaml.safe_load((ROOT / "scenarios" / b).read_text()) for b in BASES}
_PLACEHOLDER = "FUZZ_VALUE_PLACEHOLDER"

#: Values written as raw YAML text (so tags, nesting and odd scalars reach the loader as written).
RAW_VALUES = [
    "9" * 5000, "-" + "1" + "0" * 58, "9007199254740993", "18446744073709551616", "4294967296", "-1", "0",
    "1e400", "-1e308", ".nan", ".inf", "-.inf", "1e-320", "true", "false", "yes", "1:30", "null", "~",
    "2001-12-14t21:59:43.10-05:00", "'1e400 TB/s'", "'9**9**9 s'", "'4.8 TB/s'", "'-3 ms'", "'nan s'",
    "'inf W'", "'1 TB'", "'0 s'", "'80 GiB'", "'1980 MHz'", "'5'", "''", "[[1]]", "[]", "[1, 2]", "{a: 1}", "{}",
    "!!set {a, b}", "!!python/object:os.system x", "!!binary aGk=", "!!timestamp 2001-12-14", "!!int x",
    "[" * 3000 + "]" * 3000, "{a: " * 200 + "1" + "}" * 200, "&a [1, *a]", "'../../etc/passwd'", "'/dev/zero'",
    "'" + "x" * 300 + "'", "{bf16: 900 TFLOP/s}", "h200-sxm-141gb", "'./nope.yaml'",
]


def _leaves(d, prefix=()):
    """Key paths of every value (mappings walked; lists taken as values)."""
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from _leaves(v, prefix + (k,))
        yield prefix + (k,)


_PATHS = {b: sorted(set(_leaves(d))) + [("hardware", "gpu", "overrides", k) for k in (
    "hbm_bandwidth_bytes_per_s", "peak_flops_per_s", "sm_count", "supported_sm_clocks_mhz", "name", "sources")]
    + [("hardware", "host", "overrides", "memory"), ("hardware", "profile"), ("dvfs",),
       ("dvfs", "power_model"), ("zero_optimization", "stage")] for b, d in _BASE.items()}


def _set(d: dict, path: tuple, value) -> None:
    node = d
    for k in path[:-1]:
        if not isinstance(node.get(k), dict):
            node[k] = {"preset": node[k]} if isinstance(node.get(k), str) and k in ("gpu", "host", "pcie") else {}
        node = node[k]
    node[path[-1]] = value


@st.composite
def scenario_texts(draw) -> bytes:
    base = draw(st.sampled_from(BASES))
    d = yaml.safe_load(yaml.safe_dump(_BASE[base]))
    d["run"] = {"steps": 2, "warmup_steps": 1}
    raws = []
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_PATHS[base]))
        kind = draw(st.sampled_from(["raw", "raw", "raw", "number", "delete", "rename"]))
        if kind == "delete":
            node = d
            for k in path[:-1]:
                node = node.get(k) if isinstance(node, dict) else None
            if isinstance(node, dict):
                node.pop(path[-1], None)
        elif kind == "rename":
            _set(d, path[:-1] + (path[-1] + draw(st.sampled_from(["x", "_", "s"])),), 1)
        elif kind == "number":
            _set(d, path, draw(st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True))))
        else:
            _set(d, path, f"{_PLACEHOLDER}{len(raws)}")
            raws.append(draw(st.sampled_from(RAW_VALUES)))
    text = yaml.safe_dump(d, sort_keys=False)
    for i, raw in enumerate(raws):
        text = text.replace(f"{_PLACEHOLDER}{i}", raw, 1)
    data = text.encode()
    corrupt = draw(st.sampled_from(["none"] * 6 + ["truncate", "bytes", "duplicate"]))
    if corrupt == "truncate":
        data = data[: draw(st.integers(0, len(data)))]
    elif corrupt == "bytes":
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.binary(min_size=1, max_size=4)) + data[at:]
    elif corrupt == "duplicate":
        first = data.split(b"\n", 1)[0]
        data = data + b"\n" + first + b"\n"
    return data


def _reject_constant(text):
    raise ValueError(f"non-standard JSON constant {text}")


#: Summary keys that are signed by definition (finite, any sign): how early each batch was ready
#: (negative = late, a stall).
SIGNED = {"lead_by_step_s"}


#: More examples for a longer local hunt: FUZZ_EXAMPLES=2000 python -m pytest tests/properties/test_fuzz_scenarios.py
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))


@settings(max_examples=EXAMPLES, deadline=10_000, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenario_texts())
def test_mutated_scenarios_are_refused_in_one_line_or_run_cleanly(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.yaml"
        path.write_bytes(data)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["run", str(path), "--json"])
    stderr = err.getvalue()
    assert "Traceback" not in stderr
    lines = [ln for ln in stderr.splitlines() if not ln.startswith("warning:")]
    if rc == 2:  # one line per problem, each naming the file (the loader's cap: 20 and "... and N more")
        assert 1 <= len(lines) <= 21 and all(ln.startswith(f"error: {path}") for ln in lines), stderr
        problems = [ln.removeprefix("error: ") for ln in lines]  # --json: the same lines as one object on stdout
        assert json.loads(out.getvalue()) == {"error": "; ".join(problems), "errors": problems, "exit_status": 2}
        return
    assert rc in (0, 1), (rc, stderr)
    if out.getvalue():
        summary = json.loads(out.getvalue(), parse_constant=_reject_constant)
        for key, v in json_numbers(summary):
            assert math.isfinite(v) and (key in SIGNED or v >= 0), (key, v, summary)
    else:
        assert rc == 1 and len(lines) == 1 and lines[0].startswith("error: "), stderr
