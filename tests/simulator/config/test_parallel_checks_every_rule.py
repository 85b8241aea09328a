"""The context-, pipeline- and expert-parallel checks tell every rule a value breaks, one line each, in one run
(``errors.refuse_each``), as the tensor-parallel check does: ``simulate run FILE --set ...`` exits 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT

PP = ROOT / "scenarios" / "cluster" / "gpt_16x2048_pp4_dp2_dgx_h100.yaml"  # 16 layers, pp 4, one DGX H100
DP = ROOT / "scenarios" / "cluster" / "gpt_1p3b_dgx_h100_dp8.yaml"  # 24 layers, seq 1024, dp 8


def _errors(path, *sets: str) -> list[str]:
    argv = [sys.executable, "-m", "simulator", "run", str(path)]
    for s in sets:
        argv += ["--set", s]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("path,sets,expected", [
    # vpp 3 without the interleaved schedule, and pp 4 x vpp 3 = 12 not dividing 16 layers
    (PP, ("parallelism.virtual_pipeline_model_parallel_size=3", "parallelism.pipeline_schedule=1f1b"),
     ("virtual_pipeline_model_parallel_size: 3 > 1 needs pipeline_schedule interleaved_1f1b",
      "pipeline_model_parallel_size: pp 4 x virtual 3 = 12 must divide model.num_layers 16")),
    # ep 3 divides neither the 8 experts nor tp x dp = 8
    (DP, ("training.precision=bf16", "model.num_experts=8", "model.moe_router_topk=2", "model.add_bias_linear=false",
          "parallelism.expert_model_parallel_size=3"),
     ("expert_model_parallel_size: 3 must divide model.num_experts (8)",
      "expert_model_parallel_size: 3 x expert_tensor_parallel_size 1 must divide tensor_model_parallel_size x "
      "data_parallel_size 1 x 8")),
    # cp 3 divides neither the world of 8 nor seq_length 1024 / 2
    (DP, ("training.precision=bf16", "parallelism.context_parallel_size=3"),
     ("context_parallel_size: tp 1 x pp 1 x cp 3 = 3 must divide the world size 8",
      "context_parallel_size: 2 x 3 must divide model.seq_length 1024")),
])
def test_a_value_breaking_two_rules_gets_two_lines(path, sets, expected):
    lines = _errors(path, *sets)
    assert len(lines) == len(expected), lines
    for want in expected:
        assert sum(want in line for line in lines) == 1, (want, lines)
