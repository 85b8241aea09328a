"""Output folders: whole runs only, overrides recorded, sweep tables, safe point folders, Ctrl-C."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from simulator.studies import sweep
from simulator.cli import main
from simulator.config.errors import ScenarioError
from simulator.api import simulate_graph
from simulator.graph.op_graph import GraphBuilder
from simulator.graph.ops import OpKind
from simulator.recording import writers
from tests.conftest import ROOT, make_hw

SCEN = str(ROOT / "scenarios/h200/gpt_184m_b4.yaml")
FAST = ["--set", "run.steps=1", "--set", "run.warmup_steps=0"]


def _result(steps):
    b = GraphBuilder()
    b.add("k", OpKind.COMPUTE, "compute", fixed_duration_s=1e-3)
    return simulate_graph(b.build(), make_hw(), steps=steps)


def _snapshot(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_interrupted_write_leaves_the_old_run_whole(tmp_path, monkeypatch):
    out = tmp_path / "run"
    writers.write_outputs(_result(1), out)
    old = _snapshot(out)
    # one fixed-duration kernel: no tensor (no memory counters) and no power model, so no memory/power PNG
    assert set(old) == set(writers.RUN_FILES) - {"memory.png", "power.png"}
    assert sorted(json.loads(old["manifest.json"])["files"]) == sorted(old)

    def boom(result):  # the trace is written after the config, summary and CSVs
        raise KeyboardInterrupt

    monkeypatch.setattr(writers, "result_trace", boom)
    with pytest.raises(KeyboardInterrupt):
        writers.write_outputs(_result(3), out)
    assert _snapshot(out) == old
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no temporary folder left behind

    monkeypatch.undo()
    writers.write_outputs(_result(3), out)
    assert len(pd.read_csv(out / "steps.csv")) == 3
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


def test_a_folder_with_user_files_is_not_replaced(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ScenarioError, match="notes.txt"):
        writers.write_outputs(_result(1), out)
    assert main(["run", SCEN, *FAST, "--out", str(out)]) == 2  # refused before simulating
    assert "notes.txt" in capsys.readouterr().err
    assert _snapshot(out) == {"notes.txt": b"keep me"}


def test_resolved_config_records_the_overrides_and_still_loads(tmp_path, capsys):
    from simulator.config.loader import load_scenario

    out = tmp_path / "run"
    assert main(["run", SCEN, *FAST, "--set", "training.micro_batch_size=2", "--out", str(out)]) == 0
    capsys.readouterr()
    text = (out / "config.resolved.yaml").read_text()
    assert "#   --set training.micro_batch_size=2" in text.splitlines()
    assert load_scenario(out / "config.resolved.yaml").training.micro_batch_size == 2
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["overrides"] == ["run.steps=1", "run.warmup_steps=0", "training.micro_batch_size=2"]


def test_sweep_writes_one_table_with_an_error_column(tmp_path, monkeypatch, capsys):
    import simulator.api as engine_run
    from simulator.engine.run import SimulationError

    real = engine_run.run_scenario

    def fail_at_2(cfg):
        if cfg.training.micro_batch_size == 2:
            raise SimulationError("run phase failed: test")
        return real(cfg)

    monkeypatch.setattr(engine_run, "run_scenario", fail_at_2)
    out = tmp_path / "sw"
    rc = main(["sweep", SCEN, "--factor", "training.micro_batch_size=1,2", *FAST, "--out", str(out)])
    assert rc == 1
    capsys.readouterr()
    df = pd.read_csv(out / "results.csv")
    assert list(df["training.micro_batch_size"]) == [1, 2]
    assert df["error"].isna().tolist() == [True, False] and "test" in df["error"][1]
    assert df["step_time_s"][0] > 0 and pd.isna(df["step_time_s"][1])
    assert list(df["folder"]) == ["micro_batch_size=1", "micro_batch_size=2"]
    assert (out / "micro_batch_size=1" / "summary.json").is_file()
    assert not (out / "micro_batch_size=2").exists()


def test_point_folder_names_stay_inside_out():
    names = sweep.point_folder_names([{"name": "../../evil"}, {"name": "a/b"}, {"name": "a_b"}, {"name": ".."},
                                      {"name": "x" * 300}])
    assert names[:4] == ["name=.._.._evil", "name=a_b", "name=a_b-2", "name=.."]
    assert len(names[4].encode()) <= 120 and len(set(names)) == 5
    assert all("/" not in n and n not in (".", "..") for n in names)


def test_sweep_values_with_dots_and_slashes_write_inside_out(tmp_path, capsys):
    out = tmp_path / "a" / "out"
    assert main(["sweep", SCEN, "--factor", "name=../../../escape,x/../../y", *FAST, "--out", str(out)]) == 0
    capsys.readouterr()
    written = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_dir()}
    assert written == {"a", "a/out", "a/out/name=.._.._.._escape", "a/out/name=x_.._.._y"}


def test_ctrl_c_prints_the_finished_points(tmp_path, monkeypatch, capsys):
    real = sweep._run_point
    calls = []

    def second_is_interrupted(job):
        calls.append(job)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(job)

    monkeypatch.setattr(sweep, "_run_point", second_is_interrupted)
    out = tmp_path / "sw"
    rc = main(["sweep", SCEN, "--factor", "training.micro_batch_size=1,2,4", *FAST, "--out", str(out), "--json"])
    assert rc == 130
    cap = capsys.readouterr()
    rows = json.loads(cap.out)
    assert [r["training.micro_batch_size"] for r in rows] == [1] and rows[0]["step_time_s"] > 0
    assert "interrupted: 1 of 3 points finished" in cap.err
    assert list(pd.read_csv(out / "results.csv")["training.micro_batch_size"]) == [1]


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("simulate (trainsim-des) ")


def test_pareto_out_writes_the_table(tmp_path, capsys):
    out = tmp_path / "p"
    assert main(["pareto", SCEN, "--clocks", "1980,1200", *FAST, "--json", "--out", str(out)]) == 0
    printed = pd.DataFrame(json.loads(capsys.readouterr().out))
    saved = pd.read_csv(out / "pareto.csv")
    assert list(saved["value"]) == [1980, 1200]
    assert saved["step_time_s"].tolist() == pytest.approx(printed["step_time_s"].tolist())


def test_pareto_rows_name_the_clock_that_ran(capsys):
    """A clock between supported ones is snapped (with a warning); the row carries the snapped clock, not the
    request. One outside the GPU's range is refused (it used to run at 1980 MHz)."""
    assert main(["pareto", SCEN, "--clocks", "1412", *FAST, "--json"]) == 0
    out = capsys.readouterr()
    assert pd.DataFrame(json.loads(out.out))["value"].tolist() == [1410]
    assert "1412 MHz is not a supported SM clock" in out.err
    assert main(["pareto", SCEN, "--clocks", "99999", *FAST, "--json"]) == 2
    assert "--clocks: 99999 MHz is outside the SM clocks" in capsys.readouterr().err
