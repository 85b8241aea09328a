"""A value a policy refuses (``PolicyError``: ZeRO-Offload's rewrite needs bf16 / fp16 weights, refused under
``training.precision: amp_fp32_params``, ``policies/offload_optimizer.py``) is a fit row that does not fit, with
the policy's line as its reason, as a value the schema refuses. Before, the what-if API (``largest_fitting``,
``fitting_values``) raised it from the first such value (a traceback) and ``simulate fit`` lost the other rows."""

from __future__ import annotations

import contextlib
import io

from simulator.cli import main
from simulator.config.loader import load_scenario
from simulator.studies.whatif import largest_fitting
from tests.conftest import ROOT

DP8 = str(ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml")  # amp_fp32_params, 8 GPUs
WHY = ("zero_optimization.offload_optimizer: needs training.precision bf16 or fp16 (16-bit weights on the GPU), "
       "got amp_fp32_params")
SETS = ["--set", "zero_optimization.stage=2", "--set", "run.steps=2"]


def _main(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def test_a_policy_refusal_is_a_row_of_the_what_if_table():
    cfg = load_scenario(DP8, ["zero_optimization.stage=2"])
    df = largest_fitting(cfg, "zero_optimization.offload_optimizer.device", ["none", "cpu"])
    assert list(df["fits"]) == [True, False]
    assert list(df["error"].isna()) == [True, False] and df["error"][1] == WHY
    assert df.attrs["largest"] == "none"


def test_simulate_fit_shows_the_row_and_refuses_in_one_line_when_every_value_is_refused():
    rc, out, err = _main("fit", DP8, *SETS, "--largest", "zero_optimization.offload_optimizer.device=none,cpu")
    assert rc == 0, err
    assert "Traceback" not in err and f"({WHY})" in out
    rc, out, err = _main("fit", DP8, *SETS, "--set", "zero_optimization.offload_optimizer.device=cpu",
                         "--largest", "training.micro_batch_size=1,2")
    assert rc == 2 and "Traceback" not in err
    assert err.splitlines() == [f"error: {DP8}: {WHY}"]
