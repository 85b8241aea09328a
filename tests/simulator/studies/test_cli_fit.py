"""``simulate fit``: the largest micro-batch that fits and the smallest world that fits, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

DP8 = str(ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml")


def _fit(*args):
    return subprocess.run([sys.executable, "-m", "simulator", "fit", *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def test_largest_micro_batch_that_fits():
    out = _fit(DP8, "--largest", "training.micro_batch_size=8,16,32", "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    fits = {p["value"]: p["fits"] for p in d["points"]}
    assert d["largest"] == max(v for v, ok in fits.items() if ok)
    assert fits[8] and not fits[32]  # 1.3B on 80 GB H100s: micro-batch 32 needs ~97 GB
    dev = {p["value"]: p["peak_device_memory_bytes"] for p in d["points"]}
    assert dev[8] < dev[16] < dev[32]


def test_smallest_world_that_fits():
    out = _fit(DP8, "--smallest", "hardware.cluster.nodes=1,2", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["smallest"] == 1


FSDP_TP2 = str(ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_fsdp_tp2.yaml")
#: a 22.7B-per-TP-rank GPT: 56 layers of h 8192 (TP2: 6 h^2 + 9.5 h = 402,731,008 per layer and rank), the vocab-
#: parallel table 16384 x 8192, the learned positions 1024 x 8192 and ln_f 2 h: P_tp = 22,695,559,168
BIG = ["model.num_layers=56", "model.hidden_size=8192", "model.num_attention_heads=64", "training.micro_batch_size=1"]
P_TP = 56 * (6 * 8192 ** 2 + 9.5 * 8192) + 16384 * 8192 + 1024 * 8192 + 2 * 8192


def test_smallest_world_that_fits_is_more_than_one_node():
    """FSDP FULL_SHARD x TP2 of a 45B GPT: Adam's fp32 moments alone are 8 P_tp / dp bytes per GPU (45.39 GB on
    one DGX, dp 4), with the fp32 parameter and gradient shards (4 + 4 P_tp / dp) beside them: one node does not
    fit 85.52 GB, two do (dp 8: the moments 22.70 GB). Before, the only smallest-world test was a model that fits
    one node."""
    from simulator.api import run_scenario
    from simulator.config.loader import load_scenario

    out = _fit(FSDP_TP2, "--smallest", "hardware.cluster.nodes=1,2,4", *(a for x in BIG for a in ("--set", x)),
               "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert {p["value"]: p["fits"] for p in d["points"]} == {1: False, 2: True, 4: True} and d["smallest"] == 2
    assert "out of memory" in d["points"][0]["oom"]
    for nodes in (1, 2):
        s = run_scenario(load_scenario(FSDP_TP2, [*BIG, f"hardware.cluster.nodes={nodes}", "run.steps=2",
                                                  "run.warmup_steps=1"])).summary
        assert s["peak_memory_by_category_bytes"]["optimizer"] == pytest.approx(8 * P_TP / (4 * nodes), rel=1e-6)


def test_bad_fit_input_is_one_line():
    for args, msg in ((["--largest", "training.nope=1,2"], "training.nope: unknown key"),
                      (["--largest", "training.micro_batch_size"], "expected dotted.key=v1,v2"),
                      ([], "one of the arguments --largest --smallest is required")):
        out = _fit(DP8, *args)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and msg in lines[0], out.stderr


def test_a_value_refused_with_the_other_keys_is_a_row_with_its_reason_and_the_others_carry_none():
    """Micro-batch 16 is valid alone, but 16 x dp 8 = 128 does not divide the global batch 64: a row, not exit 2."""
    out = _fit(DP8, "--largest", "training.micro_batch_size=8,16", "--set", "training.global_batch_size=64")
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines()[1:-1]}
    assert "64 must be a multiple of micro_batch_size x data_parallel_size (128)" in rows["16"]
    assert "(" not in rows["8"] and "nan" not in out.stdout
    assert out.stdout.strip().endswith("largest that fits: 8")


A100_40 = "rank_overrides=[{dp_rank: 3, gpu: a100-sxm4-40gb}]"


def test_fit_reports_the_tightest_rank_class_when_a_replica_runs_on_a_smaller_gpu():
    """One replica of the DGX H100 (80 GB) job on an A100 40GB (42.95 GB of HBM): the capacity shown is that
    class's, named in the table, and a micro-batch whose peak fits 80 GB but not 40 GB does not fit (micro-batch 12:
    51.7 GB)."""
    out = _fit(DP8, "--largest", "training.micro_batch_size=8,12", "--set", A100_40, "--json")
    assert out.returncode == 0, out.stderr
    pts = {p["value"]: p for p in json.loads(out.stdout)["points"]}
    for p in pts.values():
        assert p["gpu_memory_capacity_bytes"] == 42_949_672_960  # the A100 40GB preset (40 GiB)
        assert p["memory_binding_class"] == "dp_rank 3"
    assert pts[8]["fits"] and not pts[12]["fits"]
    assert 42.95e9 < pts[12]["peak_device_memory_bytes"] < 80e9
    table = _fit(DP8, "--largest", "training.micro_batch_size=8,12", "--set", A100_40).stdout
    row12 = next(line for line in table.splitlines() if line.startswith("12 "))
    assert " no " in row12 and "/ 42.95 GB [dp_rank 3]" in row12, table


def test_a_value_its_field_refuses_stops_fit_before_any_point_runs():
    """nodes 0 is refused by the schema alone (nodes > 0): one line, exit 2, and no table (nothing simulated),
    as ``simulate search`` refuses such a value of --space (studies.search.check_values)."""
    out = _fit(DP8, "--smallest", "hardware.cluster.nodes=0,1")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == (f"error: {DP8}: --smallest hardware.cluster.nodes=0: "
                                  "hardware.cluster.nodes: Input should be greater than 0 "
                                  "(got 0)")


def test_fit_prints_and_returns_the_runs_warnings_once():
    """The text prints each distinct warning of the points once (the DGX H100 host's generic dispatch time on every
    value; the H100's generic power model) before the answer line; --json has them as ``warnings`` and each point its
    own. Before: neither."""
    host = ("host '2x Intel Xeon Platinum 8480C (DGX H100)' has no measured dispatch time per op: the generic 10 us "
            "is assumed (set hardware.launch_overhead_s or calibrate the host)")
    out = _fit(DP8, "--largest", "training.micro_batch_size=8,16")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    warns = [ln for ln in lines if ln.startswith("warning (")]
    assert f"warning (every value): {host}" in warns and len(warns) == len(set(warns)) == 5
    assert sum(w.startswith("warning (every value): energy and power are from the generic power model of NVIDIA H100")
               for w in warns) == 1
    assert lines[-1] == "largest that fits: 16" and lines[3:-1] == warns
    d = json.loads(_fit(DP8, "--largest", "training.micro_batch_size=8,16", "--json").stdout)
    assert host in d["warnings"] and len(d["warnings"]) == 5
    assert all(p["warnings"] == d["warnings"] for p in d["points"])
