"""Names users paste from Megatron-LM, DeepSpeed and llm-foundry configurations (issue 11): each is accepted with
the meaning it has there and the run says what it is simulated as, or refused naming where it lives here."""

from __future__ import annotations

import pytest

from simulator.api import resolve_hardware, run_scenario, run_warnings
from simulator.config.errors import ScenarioError
from simulator.config.loader import scenario_from_dict

BASE = {
    "name": "pasted",
    "hardware": {"gpu": "h100-sxm-80gb"},
    "model": {"num_layers": 2, "hidden_size": 512, "num_attention_heads": 8, "seq_length": 512, "vocab_size": 1000},
    "training": {"micro_batch_size": 1, "precision": "bf16"},
    "run": {"steps": 2, "warmup_steps": 1},
}


def _cfg(model=None, **top):
    return scenario_from_dict({**BASE, "model": {**BASE["model"], **(model or {})}, **top})


@pytest.mark.parametrize("megatron,ours", [("fused", "flash"), ("auto", "flash"), ("local", "unfused")])
def test_megatron_attention_backend_names_run_as_ours(megatron, ours):
    """NVIDIA/Megatron-LM@157006d examples/llama/train_llama3_8b_h100_fp8.sh passes --attention-backend fused;
    megatron/core/transformer/enums.py AttnBackend allows flash, fused, unfused, local, auto. Each runs exactly as
    the backend it is simulated as (same step time to the bit) and the warnings say which."""
    alias, own = run_scenario(_cfg({"attention_backend": megatron})), run_scenario(_cfg({"attention_backend": ours}))
    assert alias.summary["step_time_s"] == own.summary["step_time_s"]
    assert alias.summary["peak_memory_bytes"] == own.summary["peak_memory_bytes"]
    notes = [w for w in alias.summary["warnings"] if w.startswith(f"model.attention_backend {megatron} ")]
    assert len(notes) == 1 and f"is simulated as attention_backend {ours}" in notes[0], alias.summary["warnings"]
    assert not any(w.startswith("model.attention_backend ") for w in own.summary["warnings"])


def test_local_backend_keeps_the_unfused_scope():
    """local is the unfused path, so what unfused refuses (grouped-query attention) local refuses too."""
    with pytest.raises(ScenarioError, match="attention_backend: unfused with group_query_attention"):
        _cfg({"attention_backend": "local", "group_query_attention": True, "num_query_groups": 2})


def test_unknown_attention_backend_still_refused_with_the_choices():
    with pytest.raises(ScenarioError, match=r"model\.attention_backend: Input should be 'flash'.*'local'"):
        _cfg({"attention_backend": "sdpa"})


DS_COUNTS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
             "stage3_param_persistence_threshold", "stage3_max_live_parameters")


@pytest.mark.parametrize("key", DS_COUNTS)
def test_deepspeed_counts_written_as_floats_are_their_integers(key):
    """microsoft/DeepSpeedExamples@7d936b3 Megatron-LM-v1.1.5-ZeRO3/examples/ds_zero_stage_infinity_config.json
    writes "stage3_prefetch_bucket_size": 5e7 and "stage3_max_live_parameters": 1e9 (JSON numbers, floats in YAML
    1.2); DeepSpeed reads them as the integers. 2e8 here is the integer 200,000,000 exactly."""
    cfg = _cfg(zero_optimization={"stage": 3, key: 2e8})
    value = getattr(cfg.zero_optimization, key)
    assert value == 200_000_000 and type(value) is int
    assert cfg == _cfg(zero_optimization={"stage": 3, key: 200_000_000})


@pytest.mark.parametrize("bad,match", [(5.5e-1, "valid integer"), (True, "expected a number, got true"),
                                       (-1e3, "greater than")])
def test_deepspeed_counts_still_refuse_what_is_not_a_count(bad, match):
    with pytest.raises(ScenarioError, match=rf"zero_optimization\.reduce_bucket_size: .*{match}"):
        _cfg(zero_optimization={"stage": 2, "reduce_bucket_size": bad})
