"""``simulate sweep``: every point's whole scenario checked before any runs, and each point's warnings listed."""

import json

import pytest
import yaml

from simulator.cli import main
from simulator.studies.sweep import run_sweep

TINY = {"name": "tiny", "hardware": {"gpu": "h100-sxm-80gb", "host": "dgx-h100-host",
                                     "cluster": {"preset": "dgx-h100", "nodes": 1}},
        "model": {"num_layers": 8, "hidden_size": 256, "num_attention_heads": 8, "seq_length": 128,
                  "vocab_size": 1024},
        "training": {"micro_batch_size": 1, "precision": "bf16"}, "run": {"steps": 2, "warmup_steps": 1}}


def scenario(tmp_path, data=TINY):
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(data))
    return str(p)


def test_a_set_valid_only_with_a_factors_values_is_taken(tmp_path, capsys):
    # virtual stages need pp > 1: valid on every point (pp 2 or 4), not with the file's pp 1 alone
    s = scenario(tmp_path)
    rc = main(["sweep", s, "--set", "parallelism.virtual_pipeline_model_parallel_size=2",
               "--set", "training.global_batch_size=32", "--factor", "parallelism.pipeline_model_parallel_size=2,4",
               "--factor", "training.micro_batch_size=1,2", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    rows = json.loads(out.out)
    assert [(r["parallelism.pipeline_model_parallel_size"], r["training.micro_batch_size"]) for r in rows] == [
        (2, 1), (2, 2), (4, 1), (4, 2)] and all(r["error"] is None for r in rows)


def test_a_refused_combination_is_one_line_before_any_point_runs(tmp_path, capsys):
    # tp 8 alone (8 heads) and 2 heads alone (tp 1) are valid; tp 8 with 2 heads is not
    s, out = scenario(tmp_path), tmp_path / "out"
    rc = main(["sweep", s, "--factor", "parallelism.tensor_model_parallel_size=2,8",
               "--factor", "model.num_attention_heads=8,2", "--out", str(out)])
    cap = capsys.readouterr()
    assert rc == 2 and cap.out == ""
    assert cap.err.strip() == (
        f"error: sweep point parallelism.tensor_model_parallel_size=8, model.num_attention_heads=2: {s}: "
        "parallelism.tensor_model_parallel_size: 8 must divide model.num_attention_heads (2; Megatron splits it over "
        "the TP ranks) (set by --factor parallelism.tensor_model_parallel_size); nothing was run")
    assert not (out / "index.jsonl").exists()


def test_each_points_warnings_are_listed_with_the_points_they_apply_to(tmp_path, capsys):
    one_gpu = {**TINY, "hardware": {"gpu": "h100-sxm-80gb", "host": "dgx-h100-host"}}
    s = scenario(tmp_path, one_gpu)
    df = run_sweep(s, {"model.attention_backend": ["flash", "fused"], "training.micro_batch_size": [1, 2]},
                   progress=False)
    fused = [w for w in df.attrs["warnings"] if w.startswith("model.attention_backend fused")]
    assert len(fused) == 1 and df.attrs["warnings"][fused[0]] == [2, 3]  # the fused points, rows 2 and 3
    assert all(fused[0] in df["warnings"][i] for i in (2, 3)) and not any(
        fused[0] in (df["warnings"][i] or "") for i in (0, 1))
    assert main(["sweep", s, "--factor", "model.attention_backend=flash,fused",
                 "--factor", "training.micro_batch_size=1,2"]) == 0
    lines = capsys.readouterr().out.strip().split("\n")
    n = list(df.attrs["warnings"]).index(fused[0]) + 1
    assert f"warning [{n}] (2 of 4 points: attention_backend=fused, micro_batch_size=1; attention_backend=fused, " \
           f"micro_batch_size=2): {fused[0]}" in lines
    marks = [line.split()[-1].split(",") for line in lines[1:5]]  # the table's warnings column
    assert [str(n) in m for m in marks] == [False, False, True, True]
    # --json: each point's warnings a list (as run --json's), the same warnings the table joins with "; "
    assert main(["sweep", s, "--factor", "model.attention_backend=flash,fused",
                 "--factor", "training.micro_batch_size=1,2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [fused[0] in r["warnings"] for r in rows] == [False, False, True, True]
    for r, joined in zip(rows, df["warnings"]):
        assert isinstance(r["warnings"], list) and all(w in (joined or "") for w in r["warnings"])
        assert sum(map(len, r["warnings"])) + 2 * max(len(r["warnings"]) - 1, 0) == len(joined or "")


def test_a_null_factor_value_is_the_key_not_written(tmp_path, capsys):
    one_gpu = {**TINY, "hardware": {"gpu": "h100-sxm-80gb", "host": "dgx-h100-host"},
               "training": {**TINY["training"], "global_batch_size": 4}}
    s = scenario(tmp_path, one_gpu)
    assert main(["sweep", s, "--factor", "training.global_batch_size=null,4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    # null: the default, micro_batch_size x data_parallel_size = 1 sample per step; 4: four micro-batches
    assert [r["error"] for r in rows] == [None, None]
    per_step = [r["samples_per_s"] * r["step_time_s"] for r in rows]
    assert per_step == pytest.approx([1, 4], rel=1e-6)  # the summary rounds its rates
