"""``simulate search``: a tiny space worked out by hand (refused, pruned, ranked), what bounds a layout, and
the bad inputs (one line, exit 2)."""

from __future__ import annotations

import json
import math
import sys
import types

import pandas as pd
import pytest

from simulator.cli import main
from simulator.cli_search import OBJECTIVE_CHOICES
from simulator.config.loader import load_scenario
from simulator.studies import search
from tests.conftest import ROOT

TINY = ROOT / "tests" / "data" / "search" / "tiny_gpt_dgx_h100.yaml"
TP, PP = "parallelism.tensor_model_parallel_size", "parallelism.pipeline_model_parallel_size"
# the shrunk GPUs below are what these tests want: silence the loader's "far below the preset" warning
pytestmark = pytest.mark.filterwarnings("ignore:hardware.gpu.overrides.hbm_capacity_bytes")
#: GPU memory for the hand-worked space: between tp 1 x pp 1's 22 bytes/parameter and the others'
SMALL_GPU = "hardware.gpu.overrides.hbm_capacity_bytes=1.3e9"


@pytest.fixture(scope="module")
def hand_space():
    """tp {1, 2, 8} x pp {1, 2, 3} on 8 GPUs, 4 heads, 4 layers, global batch 8 (micro-batch 1 x dp 8), 1.3 GB GPUs."""
    return search.run_search(TINY, {TP: [1, 2, 8], PP: [1, 2, 3]}, base_overrides=[SMALL_GPU], progress=False,
                             log=lambda m: None)


def _status(result, tp, pp):
    t = result.table
    return t[(t[TP] == tp) & (t[PP] == pp)].iloc[0]


def test_refused_points_and_why(hand_space):
    """tp 8 does not divide the 4 heads (3 points, whatever pp), pp 3 does not divide the 4 layers (tp 1 and 2)."""
    assert hand_space.counts == {"ok": 3, "oom": 0, "pruned": 1, "refused": 5, "error": 0}
    for pp in (1, 2, 3):
        r = _status(hand_space, 8, pp)
        assert r.status == "refused" and "must divide model.num_attention_heads (4" in r.reason
    for tp in (1, 2):
        r = _status(hand_space, tp, 3)
        assert r.status == "refused" and "must divide model.num_layers 4" in r.reason


def test_pruned_by_memory_without_simulating(hand_space):
    """tp 1 x pp 1 holds every parameter: 18 B x 54,646,784 of model states (bf16 parameters, fp32 master, Adam,
    Megatron's fp32 grad buffer, whose views the gradients are: 22 B while a separate fp32 .grad was counted) plus
    the activations and working set at the start of backward, 0.4 GB context and 0.78% reserve = 1.42 GB, over
    1.3 GB even at -5%: pruned, never simulated. Each pipeline stage of tp 1 x pp 2 holds about half (29.45M on
    stage 0) and tp 2 x pp 1 27.37M: simulated, and they fit."""
    r = _status(hand_space, 1, 1)
    assert r.status == "pruned" and math.isnan(r.get("step_time_s", math.nan))
    from simulator.studies.memory_estimate import estimate_memory
    cats = estimate_memory(load_scenario(TINY, [SMALL_GPU, f"{TP}=1", f"{PP}=1"])).stages[0].by_category_bytes
    assert cats["params"] + cats["grad"] + cats["optimizer"] == 18 * 54_646_784
    dynamic = cats["activations"] + cats["transient"]
    assert r.est_peak_device_bytes == pytest.approx((18 * 54_646_784 + dynamic) * 1.0078 + 400e6, rel=1e-9)
    assert "estimated 1.42 GB on pipeline stage 0 > 1.30 GB" in r.reason
    for tp, pp in ((1, 2), (2, 1), (2, 2)):
        r = _status(hand_space, tp, pp)
        assert r.status == "ok" and r.peak_device_memory_bytes < 1.3e9
        assert r.est_peak_device_bytes == pytest.approx(r.peak_device_memory_bytes, rel=0.05)
    # the global batch stays 8: dp and micro-batches per step follow the layout
    assert [(_status(hand_space, tp, pp).data_parallel_size, _status(hand_space, tp, pp).micro_batches)
            for tp, pp in ((1, 2), (2, 1), (2, 2))] == [(4, 2), (4, 2), (2, 4)]
    assert hand_space.global_batch_size == 8 and "global batch fixed at 8" in hand_space.notes[0]


def test_ranking_where_the_answer_is_clear():
    """A launch-bound tiny model with the global batch fixed: each doubling of tp halves dp, doubles the
    micro-batches per step (and the kernels launched) and adds 4 TP all-reduces per block: tp 1 > tp 2 > tp 4,
    by tokens/s, by MFU and (ascending) by step time; the TP share grows with tp."""
    ranks = {}
    for objective in OBJECTIVE_CHOICES:
        res = search.run_search(TINY, {TP: [4, 1, 2]}, objective=objective, progress=False, log=lambda m: None)
        ranks[objective] = list(res.best(3)[TP])
        t = res.table.set_index(TP)
    assert ranks == {o: [1, 2, 4] for o in OBJECTIVE_CHOICES}
    assert t.loc[1, "tokens_per_s"] > 1.5 * t.loc[2, "tokens_per_s"] > 1.5 * t.loc[4, "tokens_per_s"]
    assert math.isnan(t.loc[1].get("exposed_tp_share", math.nan)) and 0 < t.loc[2, "exposed_tp_share"] < t.loc[4, "exposed_tp_share"]
    assert set(search.OBJECTIVES) == set(OBJECTIVE_CHOICES)


def test_bounds_of_a_row_by_hand():
    row = {"step_time_s": 1.0, "breakdown_s.compute": 0.5, "breakdown_s.exposed_comm_tp": 0.3,
           "breakdown_s.idle": 0.15, "breakdown_s.optimizer": 0.05, "pipeline_parallel_size": 2,
           "gpu_memory_capacity_bytes": 80e9, "peak_device_memory_bytes": 78e9}
    b = search.bounds(row)
    assert (b["compute_share"], b["exposed_tp_share"], b["idle_share"], b["optimizer_share"]) == (0.5, 0.3, 0.15, 0.05)
    assert b["headroom_bytes"] == 2e9 and b["bound"] == "tp comm 30%; memory (2.0 GB free)"
    b = search.bounds({**row, "breakdown_s.exposed_comm_tp": 0.0, "breakdown_s.idle": 0.0,
                       "breakdown_s.pipeline_wait": 0.45})
    assert b["bound"] == "pipeline bubble 45%; memory (2.0 GB free)"
    # one pipeline stage, a slower replica: the others' idle time is named with the straggler
    one = {**row, "pipeline_parallel_size": 1, "breakdown_s.exposed_comm_tp": 0.0, "breakdown_s.idle": 0.45,
           "peak_device_memory_bytes": 40e9}
    assert search.bounds(one)["bound"] == "host-bound / idle 45%"
    assert search.bounds({**one, "straggler": "dp_rank 1"})["bound"] == "host-bound / idle (straggler dp_rank 1) 45%"


def test_cli_prints_the_ranking_and_json(capsys, tmp_path):
    out = tmp_path / "s"
    assert main(["search", str(TINY), "--space", f"{TP}=1,2", "--json", "--top", "1", "--out", str(out),
                 "--workers", "2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["objective"] == "tokens_per_s" and doc["counts"]["ok"] == 2 and len(doc["best"]) == 1
    assert doc["best"][0][TP] == 1 and doc["best"][0]["rank"] == 1 and len(doc["points"]) == 2
    assert (out / "search.csv").is_file() and (out / "index.jsonl").is_file()
    # each point's warnings a list, as run --json's; search.csv keeps them joined with "; "
    csv = pd.read_csv(out / "search.csv")
    for p, joined in zip(doc["points"], csv["warnings"]):
        assert isinstance(p["warnings"], list) and p["warnings"] and all(w in joined for w in p["warnings"])
        assert sum(map(len, p["warnings"])) + 2 * (len(p["warnings"]) - 1) == len(joined)
    assert doc["best"][0]["warnings"] == next(p for p in doc["points"] if p["rank"] == 1)["warnings"]
    # the same command again reuses both simulated points
    assert main(["search", str(TINY), "--space", f"{TP}=1,2", "--out", str(out)]) == 0
    cap = capsys.readouterr()
    assert "2 of 2 points already done" in cap.err
    text = cap.out.splitlines()
    assert text[0].startswith("search: 2 points: 0 refused by the schema, 0 pruned")
    assert any(line.split()[:3] == ["1", "1", "8"] for line in text)  # rank 1: tp 1, dp 8


@pytest.mark.parametrize("case", ["empty_space", "no_values", "unknown_key", "wrong_type", "out_of_range",
                                  "derived_dp", "repeated_key", "nothing_fits", "all_refused", "not_a_section"])
def test_bad_input_is_one_line_exit_2(case, capsys):
    args = {
        "empty_space": [],
        "no_values": ["--space", f"{TP}="],
        "unknown_key": ["--space", "parallelism.tensor_parallel_size=1,2"],
        "wrong_type": ["--space", "training.micro_batch_size=1,two"],
        "out_of_range": ["--space", f"{TP}=0,1"],
        "derived_dp": ["--space", "parallelism.data_parallel_size=1,2"],
        "repeated_key": ["--space", f"{TP}=1", "--space", f"{TP}=2"],
        "nothing_fits": ["--space", f"{TP}=1,2", "--space", f"{PP}=1,2", "--set", "model.hidden_size=20480"],
        "all_refused": ["--space", f"{TP}=8,16"],
        "not_a_section": ["--space", "training.micro_batch_size.x=1"],
    }[case]
    assert main(["search", str(TINY), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    expect = {
        "empty_space": "search: empty space",
        "no_values": f"--space '{TP}=': expected dotted.key=v1,v2",
        "unknown_key": "unknown key 'tensor_parallel_size' under parallelism",
        "wrong_type": ("--space training.micro_batch_size=two: training.micro_batch_size: Input should be a valid "
                       "integer (got 'two')"),
        "out_of_range": f"--space {TP}=0: {TP}: Input should be greater than 0 (got 0)",
        "derived_dp": "not a search key: derived from the world size",
        "repeated_key": "given more than once",
        "nothing_fits": "no point of the space fits in GPU memory (4 pruned by the memory estimate, 0 out of memory "
                        "when simulated, 0 refused by the schema); the smallest shortfall is",
        "all_refused": "none of the 2 points is accepted by the schema",
        "not_a_section": "training.micro_batch_size is a value, not a section",
    }[case]
    assert expect in err[0], err[0]
    if case == "unknown_key":
        assert "did you mean 'tensor_model_parallel_size'?" in err[0]
    if case == "all_refused":  # each point's own refusal, not the first one's alone
        assert f"{TP}=8" in err[0] and f"{TP}=16" in err[0] and err[0].count("; ") >= 1, err[0]


def test_every_bad_space_value_is_reported_in_one_round(capsys):
    """Each refused value of each --space gets its line, in the order given (only the first was reported);
    the accepted values (1, 8) none."""
    args = ["--space", f"{TP}=0,-1,abc,1", "--space", "training.micro_batch_size=0,8"]
    assert main(["search", str(TINY), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {TINY}: --space {TP}=0: {TP}: Input should be greater than 0 (got 0)",
                   f"error: {TINY}: --space {TP}=-1: {TP}: Input should be greater than 0 (got -1)",
                   f"error: {TINY}: --space {TP}=abc: {TP}: Input should be a valid integer (got 'abc')",
                   f"error: {TINY}: --space training.micro_batch_size=0: training.micro_batch_size: Input should be "
                   "greater than 0 (got 0)"]


def test_a_preset_name_not_in_the_catalogue_is_bad_input_not_a_refused_layout(capsys):
    """A fresh user's typo in a preset --space value dropped that point as 'refused' and the search went on (exit
    0); every such name is now its own line before anything runs, beside the other bad values, exit 2."""
    args = ["--space", "hardware.cluster.network=ib-ndr-rail,nosuch,nosuch2", "--space", f"{TP}=0,1"]
    assert main(["search", str(TINY), *args]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error: ")]  # (a one-node warning)
    net = "hardware.cluster.network"
    assert [ln.split(": ")[2:4] for ln in err] == [[f"--space {net}=nosuch", net], [f"--space {net}=nosuch2", net],
                                                   [f"--space {TP}=0", TP]], err
    assert "'nosuch'" in err[0] and "ib-ndr-rail" in err[0]  # the known names listed


def test_unreachable_dask_scheduler_is_one_line(monkeypatch, capsys):
    pytest.importorskip("dask.distributed")
    from simulator import cli

    monkeypatch.setattr(cli, "DASK_CONNECT_TIMEOUT_S", 1)
    assert main(["search", str(TINY), "--space", f"{TP}=1,2", "--dask-scheduler", "tcp://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --dask-scheduler tcp://127.0.0.1:1: cannot connect")


class FutureCancelledError(Exception):
    """What ``dask.distributed`` raises from ``Future.result()`` once the client lost its scheduler (its name is
    in the error line)."""


class _FakeFuture:
    def __init__(self, key: str, fn, arg, lost: bool):
        self.key, self._fn, self._arg, self._lost = key, fn, arg, lost

    def result(self):
        if self._lost:
            raise FutureCancelledError(f"{self.key} cancelled for reason: scheduler-connection-lost.")
        return self._fn(self._arg)

    def release(self):
        pass


class _FakeClient:
    """A one-thread cluster that runs each task (a batch of points, ``sweep.point_batches``) when its result is
    asked for, in this process, and whose scheduler is lost from the ``lost_from``-th task on (0-based; None:
    never): every result from there raises, as a real client's do."""

    def __init__(self, lost_from: int | None):
        self.lost_from, self.points_run, self.closed = lost_from, 0, False

    def nthreads(self):
        return {"tcp://127.0.0.1:40000": 1}

    def map(self, fn, batches, pure=True):
        def counted(batch):
            self.points_run += len(batch)
            return fn(batch)
        return [_FakeFuture(f"_run_points-{i}", counted, b, self.lost_from is not None and i >= self.lost_from)
                for i, b in enumerate(batches)]

    def cancel(self, futures):
        pass

    def close(self):
        self.closed = True


def _without_dask(monkeypatch):
    """No dask installed: ``import dask`` fails; the sweep's ``from dask.distributed import as_completed`` gets a
    stand-in yielding the futures in submission order (as a one-thread cluster finishes them)."""
    fake = types.ModuleType("dask.distributed")
    fake.as_completed = lambda futures: iter(list(futures))
    monkeypatch.setitem(sys.modules, "dask", None)
    monkeypatch.setitem(sys.modules, "dask.distributed", fake)


#: the 4 layouts tp {1, 2} x pp {1, 2} of TINY all fit and are simulated, one step each
LOST_SPACE = ["--space", f"{TP}=1,2", "--space", f"{PP}=1,2", "--set", "run.steps=1", "--set", "run.warmup_steps=0"]


def test_scheduler_lost_mid_search_is_one_line_and_keeps_the_finished_simulations(tmp_path, monkeypatch, capsys):
    """4 simulations on a one-thread cluster, one point per task (ceil(4 / 8)); the scheduler is lost at the third
    task: one error line counting 2 of the 4 simulations finished and naming the best of them, exit 2; search.csv
    ranks the 2 finished (tp 1 x pp 1, tp 1 x pp 2: product order) and marks the other 2 unfinished; index.jsonl and
    results.csv hold the 2, and the same command then simulates only the other 2."""
    from simulator import cli

    _without_dask(monkeypatch)
    lost = _FakeClient(lost_from=2)
    monkeypatch.setattr(cli, "dask_client", lambda address: lost)
    out = tmp_path / "s"
    args = ["search", str(TINY), *LOST_SPACE, "--out", str(out), "--dask-scheduler", "tcp://127.0.0.1:8786", "--json"]
    assert main(args) == 2
    io = capsys.readouterr()
    lines = [ln for ln in io.err.splitlines() if ln.strip() and not ln.startswith("note: ")]  # less: no parquet writer
    assert len(lines) == 1, io.err
    line = lines[0]
    assert json.loads(io.out) == {"error": line.removeprefix("error: "), "errors": [line.removeprefix("error: ")],
                                  "exit_status": 2}  # --json: the same line as a JSON object on stdout
    assert line.startswith("error: --dask-scheduler: the Dask cluster failed (FutureCancelledError: _run_points-2 "
                           "cancelled for reason: scheduler-connection-lost.); 2 of 4 simulations finished (best "
                           "finished: "), line
    assert line.endswith(f", kept in {out} (index.jsonl, results.csv, search.csv); the same command resumes from them")
    assert lost.closed and lost.points_run == 2
    t = pd.read_csv(out / "search.csv")
    assert list(zip(t[TP], t[PP], t.status)) == [(1, 1, "ok"), (1, 2, "ok"), (2, 1, "unfinished"), (2, 2, "unfinished")]
    assert t.reason.iloc[2].startswith("not simulated: --dask-scheduler: the Dask cluster failed")
    best = t[t["rank"] == 1].iloc[0]
    assert sorted(t["rank"].dropna()) == [1, 2] and t.loc[t.status == "ok", "tokens_per_s"].max() == best.tokens_per_s
    assert f"(best finished: tp={best[TP]} pp={best[PP]}, tokens_per_s {best.tokens_per_s:.4g})" in line
    assert len(pd.read_csv(out / "results.csv")) == 2 and len((out / "index.jsonl").read_text().splitlines()) == 2

    whole = _FakeClient(lost_from=None)
    monkeypatch.setattr(cli, "dask_client", lambda address: whole)
    assert main(args) == 0
    capsys.readouterr()
    assert whole.points_run == 2  # the 2 unfinished only
    t = pd.read_csv(out / "search.csv")
    assert list(t.status) == ["ok"] * 4 and sorted(t["rank"]) == [1, 2, 3, 4]


def test_scheduler_lost_without_out_carries_the_finished_points(monkeypatch):
    """The same loss at the second task, no out_dir: ``SearchFailed`` counts 1 of 4 simulations, says they are not
    kept, and its result holds the one finished point ranked 1 and three unfinished."""
    _without_dask(monkeypatch)
    with pytest.raises(search.SearchFailed) as info:
        search.run_search(TINY, {TP: [1, 2], PP: [1, 2]}, base_overrides=["run.steps=1", "run.warmup_steps=0"],
                          client=_FakeClient(lost_from=1), progress=False, log=lambda m: None)
    msg = str(info.value)
    assert "; 1 of 4 simulations finished (best finished: tp=1 pp=1, tokens_per_s " in msg and "\n" not in msg
    assert msg.endswith(", not kept (give --out DIR to keep finished simulations)")
    t = info.value.result.table
    assert list(t.status) == ["ok", "unfinished", "unfinished", "unfinished"] and t["rank"].iloc[0] == 1


def test_nothing_fits_names_the_smallest_shortfall():
    """Every point over a 0.3 GB GPU (below the CUDA context alone): the smallest shortfall is the point with the
    smallest estimate, tp 2 x pp 2 (a quarter of the model per GPU)."""
    with pytest.raises(search.NothingFits) as info:
        search.run_search(TINY, {TP: [1, 2], PP: [1, 2]}, base_overrides=["hardware.gpu.overrides.hbm_capacity_bytes=3e8"],
                          progress=False, log=lambda m: None)
    t = info.value.result.table
    assert list(t.status) == ["pruned"] * 4
    best = t.loc[t.est_peak_device_bytes.idxmin()]
    assert (best[TP], best[PP]) == (2, 2)
    assert f"the smallest shortfall is {(best.est_peak_device_bytes - 3e8) / 1e9:.2f} GB (estimated, tp=2, pp=2)" \
        in str(info.value)


def test_point_hash_of_a_cluster_scenario_is_stable():
    """The resume index's hash covers the resolved hardware; a cluster's collective model and topology have
    the default repr (a memory address), which made every cluster point look changed on a re-run."""
    from simulator.studies.sweep import point_hash

    assert point_hash(TINY, [f"{TP}=2"]) == point_hash(TINY, [f"{TP}=2"]) != point_hash(TINY, [f"{TP}=4"])
    assert point_hash(TINY, []) != point_hash(TINY, ["hardware.cluster.network=ib-ndr-rail",
                                                     "hardware.cluster.nodes=2"])


def test_report_names_the_layouts_behind_each_reason():
    """A refusal or pruning reason names its layouts (the first three, then '...'), by the columns' short names."""
    import pandas as pd

    from simulator.studies.search import SearchResult, format_search

    TPK, ZK = "parallelism.tensor_model_parallel_size", "zero_optimization.stage"
    rows = [{TPK: tp, ZK: z, "status": "refused", "reason": "too big", "rank": None} for tp in (8, 16) for z in (0, 1)]
    rows.append({TPK: 1, ZK: 0, "status": "pruned", "reason": "over", "rank": None})
    res = SearchResult(pd.DataFrame(rows), "tokens_per_s", [TPK, ZK], 8)
    text = format_search(res).splitlines()
    assert "refused (4: tp=8 zero=0; tp=8 zero=1; tp=16 zero=0; ...): too big" in text
    assert "pruned (1: tp=1 zero=0): over" in text


def test_the_searchs_own_nulls_stay_silent(recwarn, tmp_path):
    """The search writes ``parallelism.data_parallel_size=null`` itself: no point's row and no warning shown
    (with ``--out``, its points' hashes load them too) says "--set parallelism.data_parallel_size=null ..."."""
    result = search.run_search(TINY, {TP: [1, 2]}, out_dir=tmp_path, progress=False, log=lambda m: None)
    rows = result.table[result.table["status"] == "ok"]
    assert len(rows) == 2
    assert not any("data_parallel_size=null" in str(w) for w in rows["warnings"])
    assert not any("data_parallel_size=null" in str(w.message) for w in recwarn.list)


def test_text_report_lists_the_shown_layouts_warnings_once(capsys):
    """The text report prints each distinct warning of the layouts shown once, with the ranks that gave it: tp 2 x
    pp 4 on 8 GPUs is dp 1 (8 / (2 x 4)), so its ZeRO-1 shards nothing, flagged as a single-GPU ZeRO run is (with
    data_parallel_size 1, not "one GPU"); tp 1 x pp 4 (dp 2) is not. Before, the text printed no warnings and
    the flag said "on one GPU"."""
    assert main(["search", str(TINY), "--space", f"{TP}=1,2", "--space", f"{PP}=4", "--space",
                 "zero_optimization.stage=1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    warns = [ln for ln in lines if ln.startswith("warning (")]
    assert len(warns) == len(set(warns)) and warns == lines[-len(warns):]
    assert ("warning (every layout shown): host '2x Intel Xeon Platinum 8480C (DGX H100)' has no measured dispatch "
            "time per op: the generic 10 us is assumed (set hardware.launch_overhead_s or calibrate the host)") in warns
    flag = [w for w in warns if "shards nothing" in w]
    assert flag == ["warning (rank 2): zero_optimization.stage 1 without offload shards nothing with data_parallel_size "
                    "1: ZeRO stages only partition model states across data-parallel ranks (fewer tensor / pipeline / "
                    "context-parallel ranks of the 8 GPUs for data_parallel_size > 1); the step is priced unsharded, "
                    "without DeepSpeed's ZeRO step norm, fp32 partition copy and unscale mul_ "
                    "(grad_norm.deepspeed_zero_step), which DeepSpeed runs on one GPU too whatever training.clip_grad"]
    rank2 = next(ln for ln in lines if ln.split()[:5] == ["2", "2", "4", "1", "1"])  # rank, tp, pp, zero, dp
    assert rank2


def test_text_report_explains_its_short_columns(capsys):
    """A fresh user read the table's ``m`` as memory: the line above the table says what each short column is, with
    its unit, and ``m`` holds the count it names (global batch 8 / (micro-batch 1 x dp 4) = 2 micro-batches at tp 2
    on 8 GPUs; 8 / (1 x 8) = 1 at tp 1)."""
    assert main(["search", str(TINY), "--space", f"{TP}=1,2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["rank", "tp"])
    assert lines[head - 1] == search.SEARCH_LEGEND
    assert ("m = micro-batches per step (global batch / (micro-batch size x dp), the gradient-accumulation count, not "
            "memory)") in lines[head - 1] and "1 GB = 1e9 bytes" in lines[head - 1]
    rows = [dict(zip(lines[head].split()[:4], ln.split()[:4])) for ln in lines[head + 1:head + 3]]
    assert sorted(rows, key=lambda r: r["tp"]) == [{"rank": "1", "tp": "1", "dp": "8", "m": "1"},
                                                   {"rank": "2", "tp": "2", "dp": "4", "m": "2"}]
