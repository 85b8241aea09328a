"""``simulate kernel``: one kernel's price, against hand-worked values and the H200 GEMM microbenchmarks."""

from __future__ import annotations

import json

import pytest

from hardware_models import presets
from simulator.cli import main
from simulator.studies.kernels import price_kernel
from tests.conftest import ROOT

MEAS = json.loads((ROOT / "tests/data/h200/measurements.json").read_text())["micro"]["gemm"]
DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


def test_elementwise_on_a_generic_profile_by_hand():
    """Generic profile: 2 us fixed + bytes / (80% of the HBM peak) (simulator.config.loader.generic_profile)."""
    gpu = presets.get("gpus", "a100-sxm4-80gb")
    r = price_kernel("a100-sxm4-80gb", "elementwise", [10**9])
    assert r["time_s"] == pytest.approx(2e-6 + 1e9 / (0.8 * gpu.hbm_bandwidth_bytes_per_s), rel=1e-12)
    assert r["bound"] == "memory" and r["flops"] == 0 and r["bytes"] == 1e9
    assert r["profile"] == "generic:a100-sxm4-80gb"


def test_gemm_reports_flops_bytes_and_compute_bound():
    r = price_kernel("h200-sxm-141gb", "gemm", [8192, 8192, 8192])
    assert r["flops"] == 2 * 8192**3 and r["bytes"] == 2 * 3 * 8192**2 and r["bound"] == "compute"
    assert 0 < r["efficiency"] <= 1


def test_a_skinny_gemm_is_at_least_its_operand_traffic_over_hbm():
    """m = 1 x 8192 x 8192 bf16 on an H100 reads a 134 MB weight: at least 134 MB / 3.35 TB/s = 40 us (the tile model
    alone gave 24.3 us, 5.5 TB/s); m = 8192 stays compute-bound on the tile model."""
    gpu = presets.get("gpus", "h100-sxm-80gb")
    r = price_kernel("h100-sxm-80gb", "gemm", [1, 8192, 8192])
    assert r["bytes"] == 2 * (8192 + 8192**2 + 8192)
    assert r["bound"] == "memory" and r["time_s"] >= r["bytes"] / gpu.hbm_bandwidth_bytes_per_s
    big = price_kernel("h100-sxm-80gb", "gemm", [8192, 8192, 8192])
    assert big["bound"] == "compute" and big["time_s"] > 1e-3


@pytest.mark.validation
def test_large_h200_gemms_within_20_percent_of_the_microbenchmarks():
    """In sample: the H200 profile's GEMM tile model was fitted on these (scripts/build_h200_profile.py).
    GEMMs under 0.1 ms sit on the benchmark's ~26 us dispatch floor, not device time, and are left out."""
    errs = []
    for g in MEAS:
        if g["median_s"] < 1e-4:
            continue
        r = price_kernel("h200-sxm-141gb", "gemm", [g["m"], g["n"], g["k"]], DTYPES[g["dtype"]])
        errs.append((g["m"], g["n"], g["k"], g["dtype"], r["time_s"] / g["median_s"] - 1))
    assert len(errs) >= 15
    worst = max(errs, key=lambda e: abs(e[-1]))
    assert abs(worst[-1]) <= 0.20, f"worst {worst} (tolerance 20%)"


def test_json_and_bad_input(capsys):
    assert main(["kernel", "h200-sxm-141gb", "--gemm", "4096,4096,4096", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"time_s", "flops", "bytes", "efficiency", "bound"} <= set(out)
    for argv, needle in ((["kernel", "nope", "--gemm", "1,2,3"], "unknown gpu preset 'nope'"),
                         (["kernel", "h200-sxm-141gb", "--gemm", "1,2"], "expected 3 comma-separated integers"),
                         (["kernel", "h200-sxm-141gb", "--elementwise", "4 TB/s"], "--elementwise")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err


def test_a_dtype_the_gpu_lacks_is_one_line(capsys):
    """The fresh-user trial found a traceback for fp8 on a V100."""
    assert main(["kernel", "v100-sxm2-32gb", "--gemm", "8192,8192,8192", "--dtype", "fp8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no fp8 rate (allowed: fp16, fp32)" in err[0]


def test_another_gpus_profile_is_flagged(capsys):
    """The H200's fitted profile on an H100 is allowed (a what-if) but said, in ``--json`` and on stderr."""
    from simulator.cli import main

    assert main(["kernel", "h100-sxm-80gb", "--gemm", "4096,4096,4096", "--profile", "h200-sxm-141gb", "--json"]) == 0
    out = capsys.readouterr()
    assert "belongs to GPU preset 'h200-sxm-141gb', not 'h100-sxm-80gb'" in out.err
    assert "warning" in __import__("json").loads(out.out)
    assert "warning" not in price_kernel("h200-sxm-141gb", "gemm", [4096, 4096, 4096], "bf16", "h200-sxm-141gb-micro")
