"""``simulate fit``: the largest micro-batch that fits and the smallest world that fits, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys

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
