"""Resumable sweeps: an interrupted 16-point sweep re-run computes exactly the unfinished points,
changed points are recomputed and only they, one table row per point, bad input is one line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

from simulator.cli import main
from simulator.studies import sweep
from tests.conftest import ROOT

SCEN = ROOT / "scenarios/h200/gpt_184m_b4.yaml"
FAST = ["--set", "run.steps=1", "--set", "run.warmup_steps=0"]
#: points slow enough (tens of ms each at one step) that a signal sent after the third lands mid-sweep
SLOW = ["--set", "run.steps=10", "--set", "run.warmup_steps=0"]
GRID16 = ["--factor", "training.micro_batch_size=1,2", "--factor", "run.seed=0,1,2,3", "--factor", "name=a,b"]


def _scenario(tmp_path):
    p = tmp_path / "scen.yaml"
    shutil.copy(SCEN, p)
    return p


def _counting(monkeypatch, interrupt_at=None):
    real, calls = sweep._run_point, []

    def run(job):
        calls.append(job[3].rsplit("/", 1)[-1])
        if len(calls) == interrupt_at:
            raise KeyboardInterrupt
        return real(job)

    monkeypatch.setattr(sweep, "_run_point", run)
    return calls


def _index_folders(out):
    return [json.loads(line)["folder"] for line in (out / "index.jsonl").read_text().splitlines()]


def test_interrupted_sweep_resumes_with_exactly_the_unfinished_points(tmp_path, monkeypatch, capsys):
    scen, out = _scenario(tmp_path), tmp_path / "sw"
    first = _counting(monkeypatch, interrupt_at=7)
    assert main(["sweep", str(scen), *GRID16, *FAST, "--out", str(out), "--json"]) == 130
    capsys.readouterr()
    finished = _index_folders(out)
    assert finished == first[:6] and len(set(finished)) == 6
    monkeypatch.undo()

    second = _counting(monkeypatch)
    assert main(["sweep", str(scen), *GRID16, *FAST, "--out", str(out), "--json"]) == 0
    err = capsys.readouterr().err
    names = sweep.point_folder_names([{"training.micro_batch_size": m, "run.seed": s, "name": n}
                                      for m in (1, 2) for s in range(4) for n in "ab"])
    assert sorted(second) == sorted(set(names) - set(finished)) and len(second) == 10
    assert "6 of 16 points already done and unchanged (skipped), 10 computed" in err
    df = pd.read_csv(out / "results.csv")
    assert list(df["folder"]) == names  # one row per point, grid order
    assert df["error"].isna().all() and (df["step_time_s"] > 0).all()
    # a reused row is the row the first run recorded
    rec = {json.loads(x)["folder"]: json.loads(x)["row"] for x in (out / "index.jsonl").read_text().splitlines()}
    for _, r in df.iterrows():
        assert r["step_time_s"] == pytest.approx(rec[r["folder"]]["step_time_s"], rel=1e-12)
    assert len(_index_folders(out)) == 16

    third = _counting(monkeypatch)
    assert main(["sweep", str(scen), *GRID16, *FAST, "--out", str(out), "--json"]) == 0
    assert third == [] and "16 of 16 points already done and unchanged (skipped), 0 computed" in capsys.readouterr().err


def test_sigint_to_a_running_sweep_loses_nothing_written(tmp_path, capsys):
    scen, out = _scenario(tmp_path), tmp_path / "sw"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "simulator", "sweep", str(scen), *GRID16, *SLOW, "--out", str(out),
                             "--json"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    index = out / "index.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not index.exists() or len(index.read_text().splitlines()) < 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    done = _index_folders(out)
    assert 3 <= len(done) < 16, "the sweep finished before the signal; nothing was interrupted"
    assert f"interrupted: {len(done)} of 16 points finished" in err
    df = sweep.run_sweep(scen, {"training.micro_batch_size": [1, 2], "run.seed": [0, 1, 2, 3], "name": ["a", "b"]},
                         base_overrides=SLOW[1::2], out_dir=out, progress=False, log=lambda m: None)
    assert df.attrs == {"skipped": len(done), "computed": 16 - len(done)}
    assert len(df) == 16 and df["error"].isna().all()


def test_changed_points_and_only_they_are_recomputed(tmp_path, monkeypatch, capsys):
    scen, out = _scenario(tmp_path), tmp_path / "sw"
    grid = ["--factor", "training.micro_batch_size=1,2", "--factor", "run.seed=0,1"]
    calls = _counting(monkeypatch)
    assert main(["sweep", str(scen), *grid, *FAST, "--out", str(out), "--json"]) == 0
    assert len(calls) == 4
    capsys.readouterr()

    # an edit of a swept key changes no point's resolved scenario: nothing to recompute
    text = scen.read_text()
    assert "micro_batch_size: 4" in text
    scen.write_text(text.replace("micro_batch_size: 4", "micro_batch_size: 16"))
    calls.clear()
    assert main(["sweep", str(scen), *grid, *FAST, "--out", str(out), "--json"]) == 0
    assert calls == []
    # a new value of a factor: only the two new points
    grid3 = ["--factor", "training.micro_batch_size=1,2,4", "--factor", "run.seed=0,1"]
    assert main(["sweep", str(scen), *grid3, *FAST, "--out", str(out), "--json"]) == 0
    assert sorted(calls) == ["micro_batch_size=4_seed=0", "micro_batch_size=4_seed=1"]
    assert len(pd.read_csv(out / "results.csv")) == 6
    # a point folder deleted by hand: only that point
    shutil.rmtree(out / "micro_batch_size=2_seed=1")
    calls.clear()
    assert main(["sweep", str(scen), *grid3, *FAST, "--out", str(out), "--json"]) == 0
    assert calls == ["micro_batch_size=2_seed=1"]
    # an edit every point sees (a key no factor overrides): every point, with the new value
    before = pd.read_csv(out / "results.csv")
    calls.clear()
    assert main(["sweep", str(scen), *grid3, *FAST, "--set", "model.seq_length=512", "--out", str(out),
                 "--json"]) == 0
    assert len(calls) == 6
    after = pd.read_csv(out / "results.csv")
    assert (after["tokens_per_s"] / after["samples_per_s"]).round().eq(512).all()
    assert not (before["tokens_per_s"] / before["samples_per_s"]).round().eq(512).any()
    assert "0 of 6 points already done and unchanged (skipped), 6 computed" in capsys.readouterr().err


def test_point_hash_sees_the_resolved_scenario(tmp_path):
    scen = _scenario(tmp_path)
    a = sweep.point_hash(scen, ["training.micro_batch_size=2"])
    assert a == sweep.point_hash(scen, ["training.micro_batch_size=2"])
    assert a == sweep.point_hash(scen, ["training.micro_batch_size=4", "training.micro_batch_size=2"])
    assert a != sweep.point_hash(scen, ["training.micro_batch_size=4"])


def test_failed_points_are_recomputed_on_resume(tmp_path, monkeypatch, capsys):
    from simulator import api
    from simulator.engine.run import SimulationError

    real, fail = api.run_scenario, {"on": True}

    def flaky(cfg):
        if fail["on"] and cfg.training.micro_batch_size == 2:
            raise SimulationError("run phase failed: test")
        return real(cfg)

    monkeypatch.setattr(api, "run_scenario", flaky)
    scen, out = _scenario(tmp_path), tmp_path / "sw"
    args = ["sweep", str(scen), "--factor", "training.micro_batch_size=1,2", *FAST, "--out", str(out), "--json"]
    assert main(args) == 1
    fail["on"] = False
    capsys.readouterr()
    assert main(args) == 0
    assert "1 of 2 points already done and unchanged (skipped), 1 computed" in capsys.readouterr().err
    assert pd.read_csv(out / "results.csv")["error"].isna().all()


def test_table_flattens_every_scalar_metric_and_matches_the_summary(tmp_path, capsys):
    from simulator import load_scenario, run_scenario

    scen, out = _scenario(tmp_path), tmp_path / "sw"
    df = sweep.run_sweep(scen, {"training.micro_batch_size": [1, 2]}, base_overrides=FAST[1::2], out_dir=out,
                         progress=False, log=lambda m: None)
    summary = run_scenario(load_scenario(scen, FAST[1::2] + ["training.micro_batch_size=2"])).summary
    row = df.iloc[1]
    assert row["phase_s.fwd_s"] == pytest.approx(summary["phase_s"]["fwd_s"], rel=1e-12)
    assert row["utilisation.compute"] == pytest.approx(summary["utilisation"]["compute"], rel=1e-12)
    assert row["peak_memory_by_category_bytes.activations"] == summary["peak_memory_by_category_bytes"]["activations"]
    assert row["memory_overheads.cuda_context_bytes"] == summary["memory_overheads"]["cuda_context_bytes"]
    assert row["profile"] == summary["profile"] and row["warnings"] is None
    assert list(df.columns[:2]) == ["training.micro_batch_size", "gpu_busy"] and list(df.columns[-2:]) == ["error", "folder"]
    saved = pd.read_csv(out / "results.csv")
    assert list(saved.columns) == list(df.columns) and len(saved) == 2
    assert saved["phase_s.fwd_s"].tolist() == pytest.approx(df["phase_s.fwd_s"].tolist(), rel=1e-12)


def test_comm_by_group_is_a_column():
    flat = sweep.flatten_summary({"step_time_s": 1.0, "comm_s_by_group": {"dp": 0.25, "tp": 0.5},
                                  "warnings": ["a", "b"], "phase_s": {"fwd_s": 0.1}})
    assert flat == {"step_time_s": 1.0, "comm_s_by_group.dp": 0.25, "comm_s_by_group.tp": 0.5,
                    "warnings": "a; b", "phase_s.fwd_s": 0.1}


def test_parquet_is_written_or_its_absence_said_once(tmp_path, monkeypatch):
    scen, out, notes = _scenario(tmp_path), tmp_path / "sw", []
    df = sweep.run_sweep(scen, {"training.micro_batch_size": [1]}, base_overrides=FAST[1::2], out_dir=out,
                         progress=False, log=notes.append)
    parquet = [n for n in notes if "parquet" in n]
    if sweep.parquet_engine() is None:
        assert len(parquet) == 1 and "pyarrow or fastparquet" in parquet[0]
        assert not (out / "results.parquet").exists()
    else:
        assert parquet == []
        back = pd.read_parquet(out / "results.parquet")
        assert len(back) == 1 and back["step_time_s"][0] == pytest.approx(df["step_time_s"][0])
    monkeypatch.setattr(sweep, "parquet_engine", lambda: None)
    notes.clear()
    sweep.run_sweep(scen, {"training.micro_batch_size": [1]}, base_overrides=FAST[1::2], out_dir=out,
                    progress=False, log=notes.append)
    assert len([n for n in notes if "parquet" in n]) == 1


def test_process_pool_resumes_the_same_way(tmp_path, capsys):
    scen, out = _scenario(tmp_path), tmp_path / "sw"
    args = ["sweep", str(scen), "--factor", "training.micro_batch_size=1,2,4", *FAST, "--out", str(out),
            "--workers", "2", "--json"]
    assert main(args) == 0
    assert "0 of 3 points already done and unchanged (skipped), 3 computed" in capsys.readouterr().err
    assert sorted(_index_folders(out)) == ["micro_batch_size=1", "micro_batch_size=2", "micro_batch_size=4"]
    assert main(args) == 0
    assert "3 of 3 points already done and unchanged (skipped), 0 computed" in capsys.readouterr().err


def test_dask_cluster_resumes_the_same_way(tmp_path, capsys):
    distributed = pytest.importorskip("dask.distributed")
    scen, out = _scenario(tmp_path), tmp_path / "sw"
    factors = {"training.micro_batch_size": [1, 2]}
    with distributed.Client(processes=False, n_workers=1, threads_per_worker=1, dashboard_address=None) as client:
        df = sweep.run_sweep(scen, factors, base_overrides=FAST[1::2], out_dir=out, progress=False,
                             client=client, log=lambda m: None)
        assert df.attrs == {"skipped": 0, "computed": 2} and df["error"].isna().all()
        factors["training.micro_batch_size"].append(4)
        df = sweep.run_sweep(scen, factors, base_overrides=FAST[1::2], out_dir=out, progress=False,
                             client=client, log=lambda m: None)
    assert df.attrs == {"skipped": 2, "computed": 1}
    assert list(df["folder"]) == ["micro_batch_size=1", "micro_batch_size=2", "micro_batch_size=4"]


def test_unreachable_dask_scheduler_is_one_line(monkeypatch, capsys):
    pytest.importorskip("dask.distributed")
    from simulator import cli

    monkeypatch.setattr(cli, "DASK_CONNECT_TIMEOUT_S", 1)
    assert main(["sweep", str(SCEN), "--factor", "training.micro_batch_size=1", *FAST,
                 "--dask-scheduler", "tcp://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --dask-scheduler tcp://127.0.0.1:1: cannot connect")


_CLUSTER = """
import time
from dask.distributed import LocalCluster
c = LocalCluster(n_workers=1, threads_per_worker=1, processes=False, protocol="tcp", dashboard_address=None)
print(c.scheduler_address, flush=True)
time.sleep(300)
"""


def test_scheduler_lost_mid_sweep_is_one_line_and_keeps_the_finished_points(tmp_path):
    """The scheduler process dies after some points finished: one error line, exit 2, the finished points
    stay in index.jsonl and results.csv, and the same command resumes from them."""
    pytest.importorskip("dask.distributed")
    scen, out = _scenario(tmp_path), tmp_path / "sw"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    cluster = subprocess.Popen([sys.executable, "-c", _CLUSTER], stdout=subprocess.PIPE, text=True, env=env)
    try:
        addr = cluster.stdout.readline().strip()
        assert addr.startswith("tcp://")
        sw = subprocess.Popen([sys.executable, "-m", "simulator", "sweep", str(scen), *GRID16, *SLOW, "--out", str(out),
                               "--dask-scheduler", addr], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=tmp_path)
        deadline = time.monotonic() + 120
        while ((not (out / "index.jsonl").exists() or len(_index_folders(out)) < 2)
               and time.monotonic() < deadline and sw.poll() is None):
            time.sleep(0.05)
        cluster.kill()
        _, err = sw.communicate(timeout=120)
    finally:
        cluster.kill()
    done = _index_folders(out)
    assert 2 <= len(done) < 16, "the scheduler must die mid-sweep for this test"
    lines = [ln for ln in err.replace("\r", "\n").splitlines()  # less the progress bar and the note on parquet
             if ln.strip() and not ln.startswith(("sweep: ", "note: "))]
    assert sw.returncode == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: --dask-scheduler"), lines
    assert f"{len(done)} of 16 points finished" in lines[0] and str(out) in lines[0]
    table = pd.read_csv(out / "results.csv")
    assert sorted(table["folder"]) == sorted(done) and table["error"].isna().all()


@pytest.mark.parametrize("case", ["plot_unknown", "plot_without_out", "out_in_file", "other_scenario",
                                  "empty_factor", "unknown_key", "repeated_factor", "plot_empty", "plot_text",
                                  "foreign_files"])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, case):
    scen, out = _scenario(tmp_path), tmp_path / "sw"
    base = ["sweep", str(scen), "--factor", "training.micro_batch_size=1", *FAST]
    if case == "plot_unknown":
        args, expect = base + ["--out", str(out), "--plot", "step_time_s,steptime"], "--plot steptime: not a summary metric"
    elif case == "plot_without_out":
        args, expect = base + ["--plot", "step_time_s"], "--plot needs --out"
    elif case == "out_in_file":
        (tmp_path / "f.txt").write_text("x")
        args, expect = base + ["--out", str(tmp_path / "f.txt" / "sub")], "cannot create the folder"
    elif case == "other_scenario":
        assert main(base + ["--out", str(out), "--json"]) == 0
        capsys.readouterr()
        other = tmp_path / "other.yaml"
        shutil.copy(SCEN, other)
        args, expect = ["sweep", str(other), *base[2:], "--out", str(out)], "holds the sweep of another scenario"
    elif case == "empty_factor":
        args, expect = ["sweep", str(scen), "--factor", "training.micro_batch_size=", *FAST], "expected dotted.key"
    elif case == "repeated_factor":  # the fresh-user trial: the first --factor's values used to vanish
        args, expect = base + ["--factor", "training.micro_batch_size=2"], "given more than once"
    elif case == "plot_empty":
        args, expect = base + ["--out", str(out), "--plot", ","], "name at least one metric"
    elif case == "plot_text":  # "oom" is a message column, never plottable
        args, expect = base + ["--out", str(out), "--plot", "oom"], "--plot oom: not a summary metric"
    elif case == "foreign_files":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        args, expect = base + ["--out", str(out)], "holds files that are not this sweep's (notes.txt)"
    else:
        args, expect = ["sweep", str(scen), "--factor", "training.micro_batchsize=1", *FAST], "micro_batchsize"
    before = sorted(p.name for p in out.iterdir()) if out.exists() else None
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expect in err[0], err
    assert (sorted(p.name for p in out.iterdir()) if out.exists() else None) == before  # nothing run or written


def test_a_table_from_an_older_simulator_is_recomputed_and_said(tmp_path, capsys):
    scen, out = _scenario(tmp_path), tmp_path / "sw"
    out.mkdir()
    (out / "results.csv").write_text("training.micro_batch_size,step_time_s,error,folder\n1,0.5,,micro_batch_size=1\n")
    assert main(["sweep", str(scen), "--factor", "training.micro_batch_size=1", *FAST, "--out", str(out),
                 "--json"]) == 0
    err = capsys.readouterr().err
    assert "written without a resume index (older simulator); recomputing every point" in err
    assert "0 of 1 points already done" in err
    assert pd.read_csv(out / "results.csv")["step_time_s"][0] != 0.5


def test_sweep_plot_writes_one_png_per_metric(tmp_path, capsys):
    import matplotlib.image

    scen, out = _scenario(tmp_path), tmp_path / "sw"
    assert main(["sweep", str(scen), "--factor", "training.micro_batch_size=1,2", "--factor", "name=a,b", *FAST,
                 "--out", str(out), "--plot", "step_time_s,tokens_per_s", "--json"]) == 0
    capsys.readouterr()
    for m in ("step_time_s", "tokens_per_s"):
        img = matplotlib.image.imread(out / f"sweep_{m}.png")
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


_REAL_RUN_POINT = sweep._run_point


def _dying_run_point(job):
    """``sweep._run_point``, except that the worker process running the point with seed 3 dies (module level: the
    pool pickles it by name)."""
    if job[2]["run.seed"] == 3:
        time.sleep(1.0)  # the points before it finish and are recorded first
        os._exit(1)
    return _REAL_RUN_POINT(job)


def test_a_killed_pool_worker_is_one_line_and_keeps_the_finished_points(tmp_path, monkeypatch, capsys):
    """A worker process that dies (as one the kernel kills for memory) ends the sweep with one error line, exit 2,
    the points finished before it recorded (the pool's workers are forked: they run the patched ``_run_point``)."""
    import multiprocessing

    if multiprocessing.get_start_method() != "fork":
        pytest.skip("needs forked pool workers")
    scen, out = _scenario(tmp_path), tmp_path / "sw"
    monkeypatch.setattr(sweep, "_run_point", _dying_run_point)
    assert main(["sweep", str(scen), "--factor", "run.seed=0,1,2,3", *FAST, "--workers", "2", "--out", str(out)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error")]
    assert len(err) == 1 and err[0].startswith("error: --workers: a worker process died (BrokenProcessPool"), err
    done = _index_folders(out)
    assert "seed=3" not in done and len(done) >= 1
    assert f"{len(done)} of 4 points finished" in err[0]
    assert sorted(pd.read_csv(out / "results.csv")["folder"]) == sorted(done)


def test_a_refused_combination_is_a_row_not_the_end_of_the_sweep(tmp_path):
    """With ``--out`` every point is hashed before the run; a point whose combination of values is refused (each
    value valid alone: micro-batch 3 with global batch 8) stopped the whole sweep. It is a row with its error."""
    df = sweep.run_sweep(_scenario(tmp_path), {"training.micro_batch_size": [4, 3], "training.global_batch_size": [8]},
                         base_overrides=["run.steps=1", "run.warmup_steps=0"], out_dir=tmp_path / "out",
                         progress=False)
    assert len(df) == 2 and pd.isna(df.error.iloc[0]) and df.step_time_s.iloc[0] > 0
    assert "global_batch_size" in df.error.iloc[1] and pd.isna(df.step_time_s.iloc[1])
