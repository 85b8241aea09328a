"""Names users paste from Megatron-LM, DeepSpeed and llm-foundry configurations (issue 11): each is accepted with
the meaning it has there and the run says what it is simulated as, or refused naming where it lives here."""

from __future__ import annotations

import pytest

from simulator.api import resolve_hardware, run_scenario, run_warnings
from simulator.config.errors import ScenarioError
from simulator.config.foreign_keys import FOREIGN_KEY_HINTS
from simulator.config.loader import scenario_from_dict
from tests.simulator.graph.test_flash_dropout_note import BASE as TINY_H100_BF16

BASE = {**TINY_H100_BF16, "name": "pasted"}  # 2 layers of h 512, seq 512, one H100, bf16, 2 steps


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


@pytest.mark.parametrize("bad,match", [(5.5e-1, "valid integer"), (True, r"expected a number \(got true\)"),
                                       (-1e3, "greater than")])
def test_deepspeed_counts_still_refuse_what_is_not_a_count(bad, match):
    with pytest.raises(ScenarioError, match=rf"zero_optimization\.reduce_bucket_size: .*{match}"):
        _cfg(zero_optimization={"stage": 2, "reduce_bucket_size": bad})


def _nested(path: str, value) -> dict:
    head, _, rest = path.partition(".")
    return {head: _nested(rest, value) if rest else value}


def _merge(a: dict, b: dict) -> dict:
    return {**a, **{k: _merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
                    for k, v in b.items()}}


@pytest.mark.parametrize("path", sorted(FOREIGN_KEY_HINTS))
def test_every_framework_key_is_refused_with_its_hint(path):
    """Each key of the table is really refused (so the hint is never shown for a key the schema accepts), in one
    line naming the key, the allowed keys and the hint."""
    base = _merge(BASE, {"fsdp": {"version": 2}}) if path.startswith("activation_checkpoint.") else BASE  # its scope
    with pytest.raises(ScenarioError) as e:
        scenario_from_dict(_merge(base, _nested(path, 1)), "pasted.yaml")
    msg = str(e.value)
    assert msg.startswith(f"pasted.yaml: {path}: unknown key (allowed: ") and "\n" not in msg
    assert msg.endswith(f"; {FOREIGN_KEY_HINTS[path]}"), msg


def test_llm_foundry_activation_checkpointing_names_its_key_here():
    """mosaicml/llm-foundry@39393a2 scripts/train/yamls/pretrain/mpt-30b.yaml fsdp_config: activation_checkpointing."""
    with pytest.raises(ScenarioError, match="activation_checkpointing: true is training.recompute_granularity: full"):
        _cfg(fsdp={"sharding_strategy": "FULL_SHARD", "activation_checkpointing": True})


def test_unlisted_unknown_key_keeps_the_spelling_hint():
    """DeepSpeedExamples' own typo stage3_param_persitance_threshold gets the close match, not a table hint."""
    with pytest.raises(ScenarioError, match=r"did you mean 'stage3_param_persistence_threshold'\?$"):
        _cfg(zero_optimization={"stage": 3, "stage3_param_persitance_threshold": 1e5})


CLUSTER = {"gpu": "h100-sxm-80gb", "host": "dgx-h100-host", "cluster": {"preset": "dgx-h100", "nodes": 1}}


def test_float8_over_fsdp_refused_as_what_it_is():
    """pytorch/torchtitan@01424cb llama3_405b.toml: FSDP x TP8 with converters float8. FSDP takes fp32 parameters
    (amp_fp32_params) and Megatron fp8 needs bf16, so the run was refused by each rule in turn, each pointing at the
    other; it is refused once, naming float8 over FSDP."""
    with pytest.raises(ScenarioError, match=r"training\.fp8: e4m3 with fsdp is not modelled \(torchtitan"):
        _cfg(hardware=CLUSTER, training={"micro_batch_size": 1, "precision": "amp_fp32_params", "fp8": "e4m3"},
             fsdp={"sharding_strategy": "FULL_SHARD"})


DP = {"hardware": CLUSTER,
      "model": {"num_layers": 2, "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 1024,
                "vocab_size": 32000}}
FSDP = {"training": {"micro_batch_size": 1, "precision": "amp_fp32_params"}, "fsdp": {"sharding_strategy": "FULL_SHARD"}}
ZERO2 = {"zero_optimization": {"stage": 2}}
ZERO3 = {"zero_optimization": {"stage": 3}}
DISTOPT = {"ddp": {"use_distributed_optimizer": True}}


def _dp_run(setup: dict, ddp: dict):
    top = _merge(_merge(DP, {"training": {"micro_batch_size": 1, "precision": "bf16"}}), setup)
    top = _merge(top, {"ddp": ddp}) if ddp else top
    return run_scenario(scenario_from_dict(_merge(BASE, top)))


@pytest.mark.parametrize("setup,ddp,expect", [
    (ZERO2, {"bucket_cap_mb": 1.0, "first_bucket_mb": 0.5}, "ddp.bucket_cap_mb, ddp.first_bucket_mb have no effect"),
    (FSDP, {"bucket_cap_mb": 1.0}, "ddp.bucket_cap_mb has no effect with fsdp"),
    (DISTOPT, {"bucket_cap_mb": 1.0}, "ddp.bucket_cap_mb has no effect with ddp.use_distributed_optimizer"),
    (FSDP, {"overlap_grad_reduce": False}, "ddp.overlap_grad_reduce false has no effect with fsdp"),
    (ZERO3, {"overlap_grad_reduce": False}, "ddp.overlap_grad_reduce false has no effect with zero_optimization"),
    ({}, {"bucket_size": 100_000}, "ddp.bucket_size has no effect without ddp.use_distributed_optimizer"),
])
def test_ddp_keys_the_reduction_does_not_read_are_flagged(setup, ddp, expect):
    """Each flagged key really changes nothing: the step time is bit-identical without it (found pasting a DeepSpeed
    / llm-foundry configuration beside the ddp section of a Megatron one)."""
    given, bare = _dp_run(setup, ddp), _dp_run(setup, {})
    assert given.summary["step_time_s"] == bare.summary["step_time_s"]
    assert sum(w.startswith(expect) for w in given.summary["warnings"]) == 1, given.summary["warnings"]
    assert not any(w.startswith("ddp.") and "no effect" in w for w in bare.summary["warnings"])


@pytest.mark.parametrize("setup,ddp", [({}, {"bucket_cap_mb": 1.0}), (DISTOPT, {"bucket_size": 100_000}),
                                       (DISTOPT, {"overlap_grad_reduce": False})])
def test_ddp_keys_that_act_are_not_flagged(setup, ddp):
    given, bare = _dp_run(setup, ddp), _dp_run(setup, {})
    assert given.summary["step_time_s"] != bare.summary["step_time_s"]
    assert not any(w.startswith("ddp.") and "no effect" in w for w in given.summary["warnings"])


def test_ddp_defaults_pasted_under_zero_are_not_flagged():
    """bucket_cap_mb: 25 and overlap_grad_reduce: true are what runs anyway (scenarios/cluster/gpt_1p3b_dgx_h100_dp8
    writes them; --set zero_optimization.stage=2 over it must not warn about them)."""
    cfg = _cfg(**_merge(DP, {**ZERO2, "ddp": {"bucket_cap_mb": 25.0, "first_bucket_mb": 1.0}}))
    assert not any(w.startswith("ddp.") for w in run_warnings(resolve_hardware(cfg), cfg))


@pytest.mark.parametrize("top", [{"prescale_gradients": False}, {"gradient_predivide_factor": 1.0},
                                 {"gradient_predivide_factor": 1}, {"prescale_gradients": False,
                                                                    "gradient_predivide_factor": 1.0}])
def test_deepspeed_scaling_keys_at_their_defaults_are_accepted(top):
    """A ds_config pasted whole writes "prescale_gradients": false, "gradient_predivide_factor": 1.0
    (deepspeedai/DeepSpeed@088be89 deepspeed/runtime/constants.py defaults): what every run prices, so the
    scenario is the one without them."""
    assert _cfg(zero_optimization={"stage": 2}, **top) == _cfg(zero_optimization={"stage": 2})


@pytest.mark.parametrize("key,value,shown", [("prescale_gradients", True, "true"),
                                             ("gradient_predivide_factor", 8.0, "8.0"),
                                             ("prescale_gradients", "yes", "'yes'")])
def test_deepspeed_scaling_keys_elsewhere_are_refused_in_one_line(key, value, shown):
    with pytest.raises(ScenarioError) as e:
        scenario_from_dict({**BASE, key: value}, "pasted.yaml")
    msg = str(e.value)
    assert msg.startswith(f"pasted.yaml: {key}: {shown} is not modelled (") and "\n" not in msg
    assert msg.endswith("DeepSpeed's default, or leave it out"), msg


@pytest.mark.parametrize("path,value", [("fp8", True), ("model.fp8", True), ("training.fp8_format", "hybrid"),
                                        ("model.fp8_hybrid", True), ("model.fp8_e4m3", True)])
def test_fp8_hints_name_the_key_and_a_value_the_schema_accepts(path, value):
    """A NeMo ``model.fp8: true`` (NVIDIA/NeMo megatron_gpt_config.yaml) or Megatron's ``fp8_format`` got "did you
    mean training.fp8?" or "'fp8_param_gather'?" (fresh-user trial): training.fp8 takes the format, so the hint
    names it with its values, and what it names is accepted where true is not."""
    with pytest.raises(ScenarioError) as e:
        scenario_from_dict(_merge(BASE, _nested(path, value)), "pasted.yaml")
    hint = str(e.value).rpartition("; ")[2]
    fmt = "e4m3" if path.endswith("e4m3") else "hybrid"
    assert f"training.fp8: {fmt}" in hint or ("training.fp8 here, set to the format: hybrid" in hint
                                              and "or e4m3" in hint), hint
    assert _cfg(training={**BASE["training"], "fp8": fmt}).training.fp8 == fmt
    with pytest.raises(ScenarioError, match=r"training\.fp8: Input should be 'hybrid' or 'e4m3' \(got true\)"):
        _cfg(training={**BASE["training"], "fp8": True})
