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


#: deepspeedai/DeepSpeed@0101896a docs/_tutorials/zero.md, "Training a 10B Parameter GPT-2 model": the ZeRO-2 config
DS_TUTORIAL_ZERO2 = {"stage": 2, "contiguous_gradients": True, "overlap_comm": True, "reduce_scatter": True,
                     "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8}


def test_deepspeed_zero2_tutorial_config_pastes_unedited():
    """DeepSpeed's own ZeRO-2 example was refused (reduce_scatter: unknown key). reduce_scatter true is
    DeepSpeed's default (deepspeed/runtime/zero/config.py), the reduce-scatter every ZeRO-2 run prices: the step
    is bit-identical to the config without it, and nothing is warned about it."""
    pasted = _dp_run({"zero_optimization": DS_TUTORIAL_ZERO2}, {})
    bare = _dp_run({"zero_optimization": {k: v for k, v in DS_TUTORIAL_ZERO2.items() if k != "reduce_scatter"}}, {})
    assert pasted.summary["step_time_s"] == bare.summary["step_time_s"]
    assert not any("reduce_scatter" in w for w in pasted.summary["warnings"])


#: a whole ds_config of the keys of DeepSpeed's config-json page at their usual values (HF-Trainer style ZeRO-2)
DS_CONFIG_ZERO2 = {
    "fp16": {"enabled": False}, "bf16": {"enabled": True}, "gradient_clipping": 1.0, "steps_per_print": 2000,
    "wall_clock_breakdown": False, "prescale_gradients": False,
    "zero_optimization": {**DS_TUTORIAL_ZERO2, "allgather_partitions": True, "round_robin_gradients": False,
                          "ignore_unused_parameters": True, "load_from_fp32_weights": True,
                          "stage3_gather_16bit_weights_on_model_save": True}}


def test_whole_deepspeed_zero2_config_accepted_and_no_effect_keys_warned():
    """Every key at DeepSpeed's default is the run without it; gradient_clipping is training.clip_grad; the keys
    acting outside a step (checkpoint saving / loading, logging) are accepted and each named once in the warnings
    as having no effect; the step is bit-identical to the scenario written in this simulator's own keys."""
    pasted = _dp_run(DS_CONFIG_ZERO2, {})
    own = _dp_run({"zero_optimization": {k: v for k, v in DS_TUTORIAL_ZERO2.items() if k != "reduce_scatter"},
                   "bf16": {"enabled": True}, "training": {"clip_grad": 1.0}}, {})
    assert pasted.summary["step_time_s"] == own.summary["step_time_s"]
    noted = [w.split(":")[0] for w in pasted.summary["warnings"] if "no effect on the training step" in w]
    assert noted == ["zero_optimization.stage3_gather_16bit_weights_on_model_save true",
                     "zero_optimization.load_from_fp32_weights true", "steps_per_print 2000",
                     "wall_clock_breakdown false"], pasted.summary["warnings"]
    cfg = _cfg(**{k: v for k, v in DS_CONFIG_ZERO2.items() if k != "fp16"})
    assert cfg.training.clip_grad == 1.0 and cfg.no_step_effect_notes
    assert _cfg(zero_optimization={"stage": 2}).no_step_effect_notes == ()


def test_allgather_partitions_false_has_no_effect_in_current_deepspeed():
    """Current DeepSpeed's ZeRO-1/2 optimizer takes no allgather_partitions (deepspeedai/DeepSpeed@02aa38c3
    stage_1_and_2.py DeepSpeedZeroOptimizer.__init__): false is accepted, bit-identical, and warned."""
    given = _dp_run({"zero_optimization": {"stage": 2, "allgather_partitions": False}}, {})
    bare = _dp_run(ZERO2, {})
    assert given.summary["step_time_s"] == bare.summary["step_time_s"]
    assert sum(w.startswith("zero_optimization.allgather_partitions false: accepted, no effect")
               for w in given.summary["warnings"]) == 1


@pytest.mark.parametrize("key,value,shown,allowed", [("reduce_scatter", False, "false", "true"),
                                                     ("round_robin_gradients", True, "true", "false")])
def test_deepspeed_zero_keys_off_their_defaults_refused_in_one_line(key, value, shown, allowed):
    with pytest.raises(ScenarioError) as e:
        scenario_from_dict(_merge(BASE, {"zero_optimization": {"stage": 2, key: value}}), "pasted.yaml")
    msg = str(e.value)
    assert msg.startswith(f"pasted.yaml: zero_optimization.{key}: {shown} is not modelled (DeepSpeed would ")
    assert msg.endswith(f"; allowed: {allowed}, DeepSpeed's default, or leave it out") and "\n" not in msg, msg


def test_gradient_clipping_beside_a_different_clip_grad_refused():
    with pytest.raises(ScenarioError) as e:
        scenario_from_dict({**BASE, "gradient_clipping": 1.0,
                            "training": {**BASE["training"], "clip_grad": 0.5}}, "pasted.yaml")
    assert str(e.value) == ("pasted.yaml: gradient_clipping: 1.0 contradicts training.clip_grad 0.5 (DeepSpeed's "
                            "gradient_clipping is training.clip_grad here; allowed: one of them, or both equal)")
    assert _cfg(gradient_clipping=0.5, training={**BASE["training"], "clip_grad": 0.5}).training.clip_grad == 0.5


def test_half_precision_section_disabled_for_the_precision_in_use_refused():
    """fp16: {enabled: false} beside training.precision bf16 is a ds_config's usual line (accepted); beside fp16 it
    contradicts the precision."""
    assert _cfg(fp16={"enabled": False}).fp16.enabled is False
    with pytest.raises(ScenarioError, match=r"fp16\.enabled: false contradicts training\.precision: fp16 \(allowed: "
                                            r"true, or leave it out\)$"):
        _cfg(fp16={"enabled": False}, training={**BASE["training"], "precision": "fp16"})


def test_loss_scaling_keys_of_a_disabled_fp16_section_accepted_and_warned():
    """A bf16 ds_config keeps "fp16": {"enabled": false, "loss_scale": 0, "initial_scale_power": 16, ...}: the
    keys were refused with a hint pointing at training.precision fp16, the wrong way; the section is off, so they
    act on nothing: accepted, each named in the warnings. In an enabled (or unmarked) section they are refused."""
    cfg = _cfg(fp16={"enabled": False, "loss_scale": 0, "initial_scale_power": 16})
    assert cfg.no_step_effect_notes == (
        "fp16.loss_scale 0: accepted, no effect on the training step (fp16.enabled false)",
        "fp16.initial_scale_power 16: accepted, no effect on the training step (fp16.enabled false)")
    assert cfg.fp16.enabled is False
    with pytest.raises(ScenarioError, match=r"fp16\.loss_scale: unknown key .*loss-scaling keys are read with "
                                            r"training\.precision fp16"):
        _cfg(fp16={"loss_scale": 0})


FP16 = {**BASE["training"], "precision": "fp16"}
#: DeepSpeed's own defaults (deepspeedai/DeepSpeed@088be89 deepspeed/runtime/constants.py FP16_*_DEFAULT), as a
#: ds_config running fp16 writes them (HF Transformers' ds_config_zero2.json: "loss_scale": 0, ...)
DS_FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
           "min_loss_scale": 1}


@pytest.mark.parametrize("section", [DS_FP16, {k: v for k, v in DS_FP16.items() if k != "enabled"},
                                     {**DS_FP16, "loss_scale": 0.0, "loss_scale_window": 1e3}])
def test_fp16_loss_scaling_at_deepspeeds_defaults_is_the_same_run_silently(section):
    """An fp16 ds_config pasted with its loss-scaling keys at DeepSpeed's defaults (enabled, or unmarked beside
    training.precision fp16): accepted without a word, the same step to the bit as without them. Before, each key was
    refused as unknown ("not modelled: remove it"), five lines for the section every fp16 ds_config has."""
    cfg = _cfg(fp16=section, training=FP16)
    assert cfg.no_step_effect_notes == ()
    assert not [w for w in run_warnings(resolve_hardware(cfg), cfg) if "fp16." in w]
    plain = _cfg(fp16={"enabled": True}, training=FP16)
    assert run_scenario(cfg).summary["step_time_s"] == run_scenario(plain).summary["step_time_s"]


def test_fp16_loss_scaling_at_other_accepted_values_is_warned_once_each():
    """Values DeepSpeed accepts change the loss scale's course over steps, not one step's work (a static scale keeps
    the overflow check and the unscale): one warning line each, the step unchanged."""
    cfg = _cfg(fp16={"enabled": True, "loss_scale": 128, "hysteresis": 4}, training=FP16)
    assert cfg.no_step_effect_notes == (
        "fp16.loss_scale 128: accepted, no effect on the training step (a static loss scale: the overflow check and "
        "the unscale by 1 / loss_scale run as with dynamic scaling, as priced)",
        "fp16.hysteresis 4: accepted, no effect on the training step (DeepSpeed reads it for dynamic loss scaling "
        "only, and fp16.loss_scale 128 is static)")
    dyn = _cfg(fp16={"initial_scale_power": 12, "min_loss_scale": 2}, training=FP16)
    assert dyn.no_step_effect_notes == tuple(
        f"fp16.{k} {v}: accepted, no effect on the training step (it steers the dynamic loss scale from step to step: "
        "which overflow skips an update and when the scale grows, not one step's work)"
        for k, v in (("initial_scale_power", 12), ("min_loss_scale", 2)))
    again = type(dyn).model_validate(dyn.model_dump())  # a dump keeps them, and their warnings
    assert again.no_step_effect_notes == dyn.no_step_effect_notes
    plain = _cfg(fp16={"enabled": True}, training=FP16)
    assert run_scenario(cfg).summary["step_time_s"] == run_scenario(plain).summary["step_time_s"]


def test_fp16_loss_scaling_values_deepspeed_refuses_are_refused_each_in_one_line():
    """deepspeed/runtime/precision_config.py (loss_scale a finite number >= 0) and fp16/loss_scaler.py
    (_validated_dynamic_loss_args: scale_window and the hysteresis integers > 0): such a run never starts, so there
    is no step to price. Every bad key in one round, one line each, in a disabled section too."""
    with pytest.raises(ScenarioError) as e:
        scenario_from_dict({**BASE, "training": FP16, "fp16": {"enabled": True, "loss_scale": -1, "hysteresis": 0,
                                                               "min_loss_scale": 0.5, "loss_scale_window": True}},
                           "ds.yaml")
    why = "is refused by DeepSpeed (deepspeed/runtime/precision_config.py, fp16/loss_scaler.py); allowed:"
    assert str(e.value).split("\n") == [
        f"ds.yaml: fp16.loss_scale: -1 {why} a number >= 0 (0: dynamic loss scaling; > 0: that static scale), "
        "DeepSpeed's default 0",
        f"ds.yaml: fp16.loss_scale_window: true {why} an integer >= 1, DeepSpeed's default 1000",
        f"ds.yaml: fp16.hysteresis: 0 {why} an integer >= 1, DeepSpeed's default 2",
        f"ds.yaml: fp16.min_loss_scale: 0.5 {why} an integer >= 1, DeepSpeed's default 1"]
    with pytest.raises(ScenarioError, match=r"^pasted\.yaml: fp16\.initial_scale_power: '16' is refused by DeepSpeed"):
        scenario_from_dict({**BASE, "fp16": {"enabled": False, "initial_scale_power": "16"}}, "pasted.yaml")
