"""``simulate replay`` / ``simulate calibrate`` arguments and bad trace input: one line, exit 2, strict JSON."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

from simulator.cli import main
from tests.conftest import ROOT

B16 = ROOT / "tests/data/h200/trace_gpt_184m_b16.json.gz"
SMALL = ROOT / "tests/data/traces/HolisticTraceAnalysis/tests/data/critical_path/cuda_event_sync/event_sync_trace.json.gz"
SCENARIO = ROOT / "scenarios/h200/gpt_184m_b16.yaml"


def _strict(text: str):
    def bad(c):
        raise ValueError(f"non-strict JSON constant {c}")

    return json.loads(text, parse_constant=bad)


def _one_line_error(capsys, *needles):
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    for n in needles:
        assert n in err, err
    return err


@pytest.mark.parametrize(("args", "needle"), [
    (["--steps", "-1"], "--steps -1"),
    (["--pcie-speedup", "inf"], "--pcie-speedup inf"),
    (["--host-speedup", "nan"], "--host-speedup nan"),
    (["--host-speedup", "0"], "--host-speedup 0"),
    (["--dataloader-workers", "0"], "--dataloader-workers 0"),
])
def test_bad_replay_arguments_are_one_line(capsys, args, needle):
    assert main(["replay", str(SMALL), *args]) == 2
    _one_line_error(capsys, needle)


def test_replay_out_writes_strict_json(tmp_path, capsys):
    assert main(["replay", str(SMALL), "--out", str(tmp_path / "r")]) == 0
    out = _strict((tmp_path / "r" / "replay.json").read_text())
    assert out["device"] == "NVIDIA A100-PG509-200" and out["measured_step_time_s"] > 0
    assert "replay.json" in capsys.readouterr().out


def test_replay_out_on_a_file_is_refused(tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("x")
    assert main(["replay", str(SMALL), "--out", str(f)]) == 2
    _one_line_error(capsys, "existing file")


def _write(tmp_path: Path, obj, name="t.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(obj))
    return p


def _events():
    with gzip.open(SMALL, "rt") as fh:
        return json.load(fh)


def test_top_level_array_goes_through_the_importer(tmp_path, capsys):
    """A bare event list is a valid Chrome trace: replay reads it once through the importer."""
    p = _write(tmp_path, _events()["traceEvents"])
    assert main(["replay", str(p), "--json"]) == 0
    assert _strict(capsys.readouterr().out)["measured_step_time_s"] > 0


@pytest.mark.parametrize("key", ["ts", "dur", "name", "tid"])
def test_events_missing_keys_do_not_escape(tmp_path, capsys, key):
    t = _events()
    for e in t["traceEvents"]:
        e.pop(key, None)
    p = _write(tmp_path, t)
    rc = main(["replay", str(p), "--json"])
    if rc == 0:
        out = _strict(capsys.readouterr().out)
        assert out["measured_step_time_s"] > 0
    else:
        assert rc == 2
        _one_line_error(capsys, "t.json")


def test_huge_duration_is_refused_quickly(tmp_path, capsys):
    """dur = 1e308 used to hang calibrate; the importer refuses durations over a day."""
    t = _events()
    next(e for e in t["traceEvents"] if e.get("cat") == "kernel")["dur"] = 1e308
    p = _write(tmp_path, t)
    assert main(["replay", str(p), "--json"]) == 2
    _one_line_error(capsys, "t.json", "more than a day")
    assert main(["calibrate", str(p), "--scenario", str(SCENARIO), "--out", str(tmp_path / "p.yaml")]) == 2
    _one_line_error(capsys, "t.json", "more than a day")


def test_calibrate_out_never_overwrites_an_input(tmp_path, capsys):
    trace = tmp_path / "trace.json.gz"
    trace.write_bytes(SMALL.read_bytes())
    before = trace.read_bytes()
    assert main(["calibrate", str(trace), "--scenario", str(SCENARIO), "--out", str(trace)]) == 2
    _one_line_error(capsys, "is one of the inputs")
    assert trace.read_bytes() == before
    other = tmp_path / "sub" / ".." / "trace.json.gz"  # the same file by another spelling
    (tmp_path / "sub").mkdir()
    assert main(["calibrate", str(trace), "--scenario", str(SCENARIO), "--out", str(other)]) == 2
    assert trace.read_bytes() == before


def test_calibrate_out_replaces_only_its_own_profiles(tmp_path, capsys):
    """An unrelated existing file is never overwritten; a profile an earlier calibrate wrote is."""
    unrelated = tmp_path / "notes.yaml"
    unrelated.write_text("my: notes\n")
    assert main(["calibrate", str(SMALL), "--scenario", str(SCENARIO), "--out", str(unrelated)]) == 2
    _one_line_error(capsys, "was not written by simulate calibrate")
    assert unrelated.read_text() == "my: notes\n"
    assert main(["calibrate", str(SMALL), "--scenario", str(SCENARIO), "--out", str(tmp_path / "existing")]) == 2
    _one_line_error(capsys, "ending in .yaml or .yml")
    ours = tmp_path / "p.yaml"
    assert main(["calibrate", str(SMALL), "--scenario", str(SCENARIO), "--out", str(ours)]) == 0
    capsys.readouterr()
    assert main(["calibrate", str(SMALL), "--scenario", str(SCENARIO), "--out", str(ours)]) == 0


def test_calibrate_json_is_strict(tmp_path, capsys):
    out_yaml = tmp_path / "p.yaml"
    assert main(["calibrate", str(SMALL), "--scenario", str(SCENARIO), "--out", str(out_yaml), "--json"]) == 0
    out = _strict(capsys.readouterr().out)
    assert out["profile"] == str(out_yaml) and out_yaml.exists()
    assert out["report"] and {"trace", "class", "measured_s"} <= set(out["report"][0])


def test_readme_replay_example_names_a_bundled_trace():
    readme = (ROOT / "README.md").read_text()
    examples = re.findall(r"^simulate (?:replay|calibrate) (\S+)", readme, flags=re.M)
    assert examples
    for path in examples:
        assert (ROOT / path).exists(), path


def test_trace_errors_name_the_path_given(tmp_path, capsys):
    bad = tmp_path / "sub" / "notrace.json"
    bad.parent.mkdir()
    bad.write_text('{"a": 1}')
    assert main(["replay", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {bad}: not a Kineto trace"), err


@pytest.mark.parametrize("verb", ["replay", "calibrate"])
@pytest.mark.parametrize(("content", "problem"), [
    (None, "file not found"),  # read_trace_bytes
    (b"", "empty file"),  # read_trace_json
    (b"\x1f\x8b\x08\x00garbage", "truncated gzip stream"),
])
def test_unreadable_trace_errors_keep_the_folder(tmp_path, capsys, verb, content, problem):
    """The reading errors name the trace as typed, folder included (they named the file alone: ``nope.json.gz:
    file not found`` for ``/tmp/nope.json.gz``), as ``run`` names its scenario."""
    path = tmp_path / "sub" / "nope.json.gz"
    if content is not None:
        path.parent.mkdir()
        path.write_bytes(content)
    args = [verb, str(path)] + (["--scenario", str(SCENARIO), "--out", str(tmp_path / "o.yaml")] if verb == "calibrate" else [])
    assert main(args) == 2
    assert _one_line_error(capsys).startswith(f"error: {path}: {problem}")


def test_chakra_errors_keep_the_folder(tmp_path):
    from simulator.graph.importers.chakra import load_chakra
    from simulator.graph.importers.kineto import TraceImportError

    path = tmp_path / "sub" / "empty.et"
    path.parent.mkdir()
    path.write_bytes(b"")
    with pytest.raises(TraceImportError, match=rf"^{re.escape(str(path))}: empty file$"):
        load_chakra(path)
