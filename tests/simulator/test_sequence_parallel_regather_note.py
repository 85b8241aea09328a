"""The sequence-parallel re-gather warning is Megatron's (fresh-user trial): on PyTorch 2-D parallelism (an ``fsdp``
section: DTensor tensor parallelism, torchtitan's ``apply_tp``) the gathered input of the column-parallel matmuls is
what autograd saves, which the builder builds, so there is nothing to warn about."""

from __future__ import annotations

import warnings

from simulator import load_scenario, run_scenario
from simulator.api import sequence_parallel_regather_note, transformer_spec
from tests.conftest import ROOT

SMALL = ["model.num_layers=2", "run.steps=2", "run.warmup_steps=1"]


def _warnings(path, sets):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_scenario(load_scenario(path, SMALL + sets)).summary["warnings"]


def test_fsdp_tp_sequence_parallel_has_no_megatron_regather_warning():
    cfg = load_scenario(ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_fsdp_tp2_sp_offload.yaml", SMALL)
    assert not transformer_spec(cfg).sp_regathers_inputs  # the gathered [s, b, h] inputs are kept, as DTensor does
    got = _warnings(ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_fsdp_tp2_sp_offload.yaml", [])
    assert not [w for w in got if "re-gather" in w]


def test_megatron_blocking_sequence_parallel_keeps_the_warning():
    # the same 1.3B at tp 2 under Megatron's DDP with the blocking column-parallel backward (Megatron 2020)
    path = ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_tp2_dp4.yaml"
    sets = ["parallelism.sequence_parallel=true", "parallelism.async_tensor_model_parallel_allreduce=false"]
    cfg = load_scenario(path, SMALL + sets)
    assert sequence_parallel_regather_note(cfg) in _warnings(path, sets)
