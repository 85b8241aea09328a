"""Predicted vs measured: the four GEMMs of a Llama-2-7B layer on an H100, 1,024-4,096 tokens, TP 1/2/4/8.

Measured: tests/data/vidur/llama2_7b_h100_gemm_median_ms.csv (microsoft/vidur operator profiles, median per
call). Predicted: the shipped ``h100-sxm-80gb`` profile through ``simulate kernel``'s cost model. That profile's
GEMM parameters are fitted by scripts/build_h100_profile.py on the TP 1 and TP 2 rows only; the TP 4 and TP 8
rows (262 points per operator) are held out and are what these tolerances bound. Held-out median error
(median |error|), fitted profile vs the generic 70% profile it replaced:

    attn_pre_proj (QKV)      -13.3% (13.3%)   generic -11.1% (11.1%)   TP8 alone -18.0%
    attn_post_proj           +8.6%  (12.9%)   generic -17.9% (17.9%)
    mlp_up_proj (gate + up)  -6.3%  (6.9%)    generic -3.0%  (7.2%)
    mlp_down_proj            +6.1%  (11.1%)   generic -2.6%  (10.2%)

Table: ``python scripts/vidur_gemm_table.py``.
"""

from __future__ import annotations

import importlib.util

import pytest
import yaml

from simulator.paths import repo_root
from simulator.studies.kernel_validation import OPS, gemm_shape, summary_table, vidur_gemm_errors

pytestmark = pytest.mark.validation
HELD_OUT_TP = (4, 8)  # scripts/build_h100_profile.py FIT_TP = (1, 2)
TOLERANCE = 0.15  # each operator's held-out median |error| (issue 14: within 15% median, >= 1,024 tokens)
TOLERANCE_PER_TP = 0.20  # each operator at each held-out TP size (TP8 QKV is the worst, 18.0%)


@pytest.fixture(scope="module")
def errors():
    return vidur_gemm_errors()


@pytest.mark.parametrize("op", OPS)
def test_each_gemm_operator_within_15_percent_median_held_out(errors, op):
    held = errors[errors.tp.isin(HELD_OUT_TP)]
    row = summary_table(held).query("op == @op and tp == 'all'").iloc[0]
    assert row.points == 262 and row.median_abs_error <= TOLERANCE, row.to_dict()


@pytest.mark.parametrize("tp", HELD_OUT_TP)
@pytest.mark.parametrize("op", OPS)
def test_each_held_out_tp_size_within_20_percent_median(errors, op, tp):
    row = summary_table(errors[errors.tp == tp]).query("op == @op and tp == 'all'").iloc[0]
    assert row.points == 131 and row.median_abs_error <= TOLERANCE_PER_TP, row.to_dict()


def _build_script():
    spec = importlib.util.spec_from_file_location("build_h100_profile", repo_root() / "scripts/build_h100_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_shipped_profile_is_the_scripts_fit_on_tp1_tp2():
    """The shipped YAML is what the script fits now (no hand edits), fitted on TP 1 and 2 only."""
    script = _build_script()
    assert script.FIT_TP == (1, 2) and not set(script.FIT_TP) & set(HELD_OUT_TP)
    shipped = yaml.safe_load((repo_root() / "hardware_models/presets/profiles/h100-sxm-80gb.yaml").read_text())
    rebuilt = script.build(repo_root() / script.DATA)
    for dtype in ("bf16", "fp16"):
        for key in ("efficiency", "wave_overhead_s"):
            assert rebuilt["gemm"][dtype][key] == pytest.approx(shipped["gemm"][dtype][key], rel=1e-6)
    assert 0.7 < shipped["gemm"]["bf16"]["efficiency"] < 0.85 and shipped["provenance"]["script"] == \
        "scripts/build_h100_profile.py"


def test_h100_default_profile_is_the_fitted_one():
    from hardware_models import presets
    from simulator.config.loader import default_profile_for

    prof = default_profile_for(presets.get("gpus", "h100-sxm-80gb"), "h100-sxm-80gb",
                               presets.get("links", "pcie-gen5-x16"))
    assert prof.name == "h100-sxm-80gb" and prof.gemm["bf16"].wave_overhead_s > 0


def test_shapes_by_hand():
    """Llama-2-7B, 2,048 tokens on one of 4 TP ranks: QKV [2048, 4096] x [4096, 3 x 4096 / 4], output projection
    [2048, 1024] x [1024, 4096], gate + up [2048, 4096] x [4096, 2 x 11008 / 4], down [2048, 2752] x [2752, 4096]."""
    assert [gemm_shape(op, 2048, 4) for op in OPS] == [(2048, 3072, 4096), (2048, 4096, 1024), (2048, 5504, 4096),
                                                        (2048, 4096, 2752)]


def test_borrowed_h200_numbers_are_flagged_in_the_summary():
    """The H100 profile's memory-bound, fixed and attention numbers are the H200's: every H100 run says so."""
    import warnings

    from simulator.api import run_scenario
    from simulator.config.loader import load_scenario

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = run_scenario(load_scenario(repo_root() / "scenarios/h200/gpt_184m_b4.yaml",
                                       ["hardware.gpu=h100-sxm-80gb"])).summary
    assert s["profile"] == "h100-sxm-80gb"
    assert any(w.startswith("GPU profile 'h100-sxm-80gb': memory_bandwidth_bytes_per_s, kernel_fixed_s, "
                            "attention_efficiency not measured on this GPU, taken from 'h200-sxm-141gb-micro'")
               for w in s["warnings"])
