"""Where a key pasted from a DeepSpeed ``ds_config``, an llm-foundry ``fsdp_config`` or a Megatron-LM launch script
lives in a scenario, or why it has none: the hint an unknown-key error ends with (``loader.format_validation_error``).

Every key named here is refused (the schema forbids extra keys); the hint only tells the user what to write instead,
or that the setting is not modelled. Names are the frameworks' own: DeepSpeed's configuration JSON
(https://www.deepspeed.ai/docs/config-json/; ``zero_optimization`` keys of deepspeed/runtime/zero/config.py, the
legacy ``cpu_offload*`` keys of DeepSpeed before 0.3.16), llm-foundry / Composer ``fsdp_config``
(composer/utils/parallelism.py ``FSDPConfig``), Megatron-LM arguments in their underscore form
(megatron/training/arguments.py), torchtitan's ``[training]`` mixed-precision dtypes, NeMo's ``model.fp8*``
Transformer Engine keys (NVIDIA/NeMo examples/nlp/language_modeling/conf/megatron_gpt_config.yaml: ``fp8: False``,
``fp8_e4m3``, ``fp8_hybrid``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

_NO_STEP_EFFECT = "it does not change a training step (checkpointing / logging); remove it"
#: DeepSpeed's fp16 loss-scaler keys in a section that is neither in use nor disabled (``FP16_LOSS_SCALING``)
_FP16_LOSS_SCALING = ("DeepSpeed's fp16 loss-scaling keys are read with training.precision fp16 (or fp16.enabled: "
                      "true), where dynamic loss scaling is priced, and accepted beside fp16.enabled: false (no "
                      "effect); otherwise remove it")
#: where fp8 training is set: ``training.fp8`` takes the format (``schema.TrainingConfig.fp8``), not true / false
_FP8_TAIL = ("training.fp8 here, set to the format: hybrid (e4m3 forward, e5m2 gradients) or e4m3, not true / "
             "false (with training.precision bf16)")
_FP8 = "fp8 is " + _FP8_TAIL


def _number(v) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _integer(v) -> bool:
    """An integer, or a float with an integral value (a JSON number: 1e3 is 1000), as DeepSpeed's pydantic reads it."""
    return _number(v) and v == int(v)


#: DeepSpeed's fp16 loss-scaling keys: dotted scenario path -> (DeepSpeed's default, whether a value is one DeepSpeed
#: accepts, what it accepts). Defaults: deepspeedai/DeepSpeed@088be89 deepspeed/runtime/constants.py
#: (FP16_LOSS_SCALE_DEFAULT = 0: dynamic loss scaling, FP16_INITIAL_SCALE_POWER_DEFAULT = 16,
#: FP16_LOSS_SCALE_WINDOW_DEFAULT = 1000, FP16_HYSTERESIS_DEFAULT = 2, FP16_MIN_LOSS_SCALE_DEFAULT = 1). Values:
#: @0ac46845 deepspeed/runtime/precision_config.py DeepSpeedFP16Config (loss_scale a finite number >= 0, the others
#: int), @18fd4c97 deepspeed/runtime/fp16/loss_scaler.py ``_validated_dynamic_loss_args`` (scale_window and
#: delayed_shift, the hysteresis, integers > 0; min_scale > 0). None of them changes one step's work (the run prices
#: a step without overflow): a static loss scale (> 0) keeps the overflow check and the unscale by 1 / loss_scale
#: (FP16_Optimizer.step: ``overflow_checker.has_overflow``, ``unscale_and_clip_grads``), and the other four steer the
#: dynamic scale from step to step (which overflow skips an update, when the scale grows).
FP16_LOSS_SCALING: dict[str, tuple[int, Callable[[object], bool], str]] = {
    "fp16.loss_scale": (0, lambda v: _number(v) and v >= 0, "a number >= 0 (0: dynamic loss scaling; > 0: that "
                        "static scale)"),
    "fp16.initial_scale_power": (16, _integer, "an integer (the first dynamic scale is 2 ** it)"),
    "fp16.loss_scale_window": (1000, lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    "fp16.hysteresis": (2, lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    "fp16.min_loss_scale": (1, lambda v: _integer(v) and v >= 1, "an integer >= 1"),
}


#: dotted scenario path of an unknown key -> what to write instead, or why it is not accepted
FOREIGN_KEY_HINTS: dict[str, str] = {
    # DeepSpeed top-level keys (ds_config.json) pasted at the scenario's top level
    "train_micro_batch_size_per_gpu": "DeepSpeed's train_micro_batch_size_per_gpu is training.micro_batch_size here",
    "train_batch_size": "DeepSpeed's train_batch_size is training.global_batch_size here",
    "gradient_accumulation_steps": "DeepSpeed's gradient_accumulation_steps is implied here: set "
                                   "training.global_batch_size = micro_batch_size x data-parallel size x its value",
    "algorithms": "Composer's algorithms.gradient_clipping (clipping_type norm, clipping_threshold) is "
                  "training.clip_grad here, priced as FSDP's clip_grad_norm_; other Composer algorithms are not "
                  "modelled",
    **{k: _FP16_LOSS_SCALING for k in FP16_LOSS_SCALING},
    "optimizer": "DeepSpeed's optimizer section is training.optimizer here (AdamW only)",
    "scheduler": "DeepSpeed's scheduler section (WarmupLR, WarmupDecayLR, OneCycle, LRRangeTest) sets the learning "
                 "rate from step to step, which changes no step's work or time (the optimizer step is the same at "
                 "any learning rate): it has no key here; remove it",
    "data_types": "DeepSpeed's data_types.grad_accum_dtype is not modelled: the gradients are accumulated in the "
                  "model dtype (DeepSpeed's default; ZeRO stage 0 with bf16 and a pipeline is BF16_Optimizer with "
                  "its bf16 buffer, modelled); with bf16, ZeRO-1 and grad_accum_dtype fp32 DeepSpeed builds "
                  "BF16_Optimizer with an fp32 gradient accumulation buffer of every parameter, "
                  "which is not (deepspeed/runtime/engine.py _do_optimizer_sanity_check); remove it",
    "communication_data_type": "DeepSpeed's communication_data_type is not modelled: the gradients are reduced in "
                               "the model dtype (DeepSpeed's default with fp16 / bf16 enabled, deepspeed/runtime/"
                               "engine.py communication_data_type); remove it",
    # fp8: one key here, training.fp8, whose value is Megatron-LM's --fp8-format (the schema's Literal), not a switch
    "fp8": _FP8,
    "training.fp8_format": "Megatron-LM's --fp8-format is " + _FP8_TAIL,
    "model.fp8": "NeMo's model.fp8 with fp8_hybrid / fp8_e4m3 is " + _FP8_TAIL,
    "model.fp8_hybrid": "NeMo's model.fp8_hybrid: true is training.fp8: hybrid here",
    "model.fp8_e4m3": "NeMo's model.fp8_e4m3: true is training.fp8: e4m3 here",
    # DeepSpeed zero_optimization keys that are not modelled, and the legacy offload names
    "zero_optimization.cpu_offload": "DeepSpeed's legacy cpu_offload: true is offload_optimizer: {device: cpu} "
                                     "here (zero_optimization.offload_optimizer)",
    "zero_optimization.cpu_offload_params": "DeepSpeed's legacy cpu_offload_params: true is offload_param: "
                                            "{device: cpu} here (zero_optimization.offload_param)",
    "zero_optimization.cpu_offload_use_pin_memory": "DeepSpeed's legacy cpu_offload_use_pin_memory is pin_memory "
                                                    "under zero_optimization.offload_optimizer / offload_param here",
    # Megatron-LM arguments written as keys beside the ones modelled (megatron/training/arguments.py)
    "training.grad_reduce_in_bf16": "Megatron-LM's --grad-reduce-in-bf16 is ddp.grad_reduce_in_bf16: true here (the "
                                    "DDP config's grad_reduce_in_fp32: false)",
    "ddp.fp8_param_gather": "Megatron-LM's --fp8-param-gather is training.fp8_param_gather: true here (beside "
                            "training.fp8; the DDP config's fp8_param_gather follows it)",
    "model.disable_bias_linear": "Megatron-LM's --disable-bias-linear is add_bias_linear: false here "
                                 "(model.add_bias_linear)",
    # arguments.py validate_args: --recompute-activations sets recompute_granularity = 'selective'
    **{f"{sec}.recompute_activations": "Megatron-LM's --recompute-activations is training.recompute_granularity: "
                                       "selective here (what Megatron sets it to)" for sec in ("training", "model")},
    # arguments.py _vocab_size_with_padding pads to a multiple of make_vocab_size_divisible_by x tp at every tp; the
    # builder pads at tp > 1 only (graph.builders.transformer.TransformerSpec.padded_vocab_size)
    "model.make_vocab_size_divisible_by": "Megatron-LM's --make-vocab-size-divisible-by is not a key here: the "
                                          "vocabulary is padded as Megatron pads it at its default 128 with "
                                          "tensor_model_parallel_size > 1 (to a multiple of 128 x tp), but not at tp "
                                          "1 (there write model.vocab_size padded to a multiple of 128, e.g. 50304 "
                                          "for GPT-2's 50257, to price Megatron's padding); other values are not "
                                          "modelled; remove it",
    # Megatron-LM's learning-rate schedule arguments: the optimizer step's work is the same at any learning rate
    **{f"training.{k}": f"Megatron-LM's --{k.replace('_', '-')} (learning-rate schedule) changes no step's work or "
                        "time: it has no key here; remove it"
       for k in ("lr", "min_lr", "lr_decay_style", "lr_decay_iters", "lr_warmup_iters", "lr_warmup_fraction")},
    # torchtitan [training] keys: its FSDP2 MixedPrecisionPolicy (pytorch/torchtitan@81c12433
    # torchtitan/models/llama3/infra/parallelize.py apply_fsdp), under no autocast (config.sections.fsdp.precision_problem)
    "training.mixed_precision_param": "torchtitan's mixed_precision_param is fsdp.mixed_precision.param_dtype here "
                                      "(with fsdp.version 2): bfloat16 is param_dtype bf16 with training.precision "
                                      "amp_fp32_params; float32 is param_dtype fp32 with training.precision fp32 "
                                      "(tf32 with torch.backends.cuda.matmul.allow_tf32), as torchtitan runs FSDP "
                                      "without autocast",
    "training.mixed_precision_reduce": "torchtitan's mixed_precision_reduce is fsdp.mixed_precision.reduce_dtype here "
                                       "(with fsdp.version 2): float32 is fp32, bfloat16 bf16",
    # llm-foundry / Composer fsdp_config keys
    "fsdp.activation_checkpointing": "llm-foundry's fsdp_config.activation_checkpointing: true is "
                                     "training.recompute_granularity: full here (every block recomputed)",
    "fsdp.activation_checkpointing_reentrant": "not modelled (reentrant and non-reentrant checkpointing are priced "
                                               "alike); remove it",
    "fsdp.activation_cpu_offload": "llm-foundry's activation_cpu_offload is not modelled; remove it (DeepSpeed's "
                                   "activation_checkpointing.cpu_checkpointing is)",
    "fsdp.verbose": _NO_STEP_EFFECT,
    "fsdp.state_dict_type": _NO_STEP_EFFECT,
    "fsdp.sync_module_states": "it acts at start-up, not in a step; remove it",
    "fsdp.use_orig_params": "not modelled (the flat parameters are priced either way); remove it",
}


#: DeepSpeed keys accepted at DeepSpeed's default only, which is what every run prices; dotted scenario path ->
#: (the default, what another value would do, or None where another value leaves a step unchanged: accepted, and the
#: run's warnings say so, ``NO_STEP_EFFECT_KEYS``). Defaults: deepspeedai/DeepSpeed@088be89
#: deepspeed/runtime/constants.py (PRESCALE_GRADIENTS_DEFAULT = False, GRADIENT_PREDIVIDE_FACTOR_DEFAULT = 1.0: each
#: gradient bucket divided by the data-parallel size after its all-reduce, engine.py allreduce_bucket's postscale
#: path); @1b88ac36 deepspeed/runtime/zero/config.py DeepSpeedZeroConfig (reduce_scatter = True,
#: allgather_partitions = True, round_robin_gradients = False, ignore_unused_parameters = True).
DEFAULT_ONLY_KEYS: dict[str, tuple[object, str | None]] = {
    "prescale_gradients": (False, "DeepSpeed would divide each gradient bucket by the data-parallel size before its "
                                  "all-reduce instead of after it"),
    "gradient_predivide_factor": (1.0, "DeepSpeed would divide each gradient bucket by it before its all-reduce and "
                                       "by data-parallel size / it after, one more scale kernel per bucket"),
    # ZeRO-1/2 reduce each gradient bucket with a reduce-scatter (stage_1_and_2.py); false all-reduces the bucket
    "zero_optimization.reduce_scatter": (True, "DeepSpeed would all-reduce each gradient bucket instead of "
                                               "reduce-scattering it; the reduce-scatter is modelled"),
    "zero_optimization.round_robin_gradients": (False, "DeepSpeed would reorder the gradient partitions so that the "
                                                       "ranks' ZeRO-Offload copies to the host run in parallel; the "
                                                       "copies are modelled in the default order"),
    # not an argument of current DeepSpeed's ZeRO-1/2 optimizer (@02aa38c3 deepspeed/runtime/zero/stage_1_and_2.py
    # DeepSpeedZeroOptimizer.__init__, which the engine builds without it): the updated partitions are all-gathered
    # (all_gather_dp_groups) whatever its value
    "zero_optimization.allgather_partitions": (True, None),
    # terminates on unused parameters when false (stage 2); the simulated model uses every parameter
    "zero_optimization.ignore_unused_parameters": (True, None),
}

#: DeepSpeed keys that act outside a training step (checkpointing, logging): any value accepted, the run's warnings
#: naming the key (deepspeedai/DeepSpeed@1b88ac36 deepspeed/runtime/zero/config.py: gather_16bit_weights_on_model_save,
#: alias stage3_gather_16bit_weights_on_model_save, "Consolidate the weights before saving the model by
#: save_16bit_model()"; load_from_fp32_weights, elastic_checkpoint: checkpoint loading; runtime/config.py
#: steps_per_print, wall_clock_breakdown: logging)
NO_STEP_EFFECT_KEYS: dict[str, str] = {
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "acts when the model is saved",
    "zero_optimization.gather_16bit_weights_on_model_save": "acts when the model is saved",
    "zero_optimization.load_from_fp32_weights": "acts when a checkpoint is loaded",
    "zero_optimization.elastic_checkpoint": "acts when a checkpoint is saved or loaded",
    "steps_per_print": "logging",
    "wall_clock_breakdown": "logging (timers)",
}


class DefaultOnlyKeyError(ValueError):
    """A ``DEFAULT_ONLY_KEYS`` key at another value: ``key`` and ``detail`` (the line without the key)."""

    def __init__(self, key: str, detail: str):
        super().__init__(f"{key}: {detail}")
        self.key, self.detail = key, detail


def _pop(data: dict, path: str) -> tuple[dict, object]:
    """``data`` without the key at dotted ``path`` (copied where changed) and its value; ``_MISSING`` when absent."""
    head, _, rest = path.partition(".")
    if head not in data:
        return data, _MISSING
    if not rest:
        out = dict(data)
        return out, out.pop(head)
    sub = data[head]
    if not isinstance(sub, dict):
        return data, _MISSING
    new, value = _pop(sub, rest)
    return ({**data, head: new} if value is not _MISSING else data), value


_MISSING = object()


def _shown(v) -> str:
    return str(v).lower() if isinstance(v, bool) else repr(v) if isinstance(v, str) else str(v)


def _is_default(v, default) -> bool:
    return v is default if isinstance(default, bool) else (
        isinstance(v, (int, float)) and not isinstance(v, bool) and v == default)


def no_step_effect_keys(data) -> dict[str, object]:
    """Dotted key -> value of each DeepSpeed key of ``data`` (a scenario mapping) accepted although it leaves the step
    unchanged (the keys ``drop_default_only_keys`` drops: a ``NO_STEP_EFFECT_KEYS`` key at any value, a
    ``DEFAULT_ONLY_KEYS`` key without effect at another value, the loss-scaling keys of a disabled fp16 section and
    those of the fp16 section in use at another of DeepSpeed's values). A dump puts them back (``put_keys``) so that a
    config validated again warns as the scenario did."""
    if not isinstance(data, dict):
        return {}
    found = {key: _pop(data, key)[1] for key in NO_STEP_EFFECT_KEYS}
    for key, (default, other) in DEFAULT_ONLY_KEYS.items():
        if other is None and not _is_default(v := _pop(data, key)[1], default):
            found[key] = v
    in_use = _fp16_in_use(data)
    for key in _fp16_scaling_keys(data):
        v = _pop(data, key)[1]
        default, ok, _ = FP16_LOSS_SCALING[key]
        if ok(v) and not (in_use and v == default):
            found[key] = v
    return {k: v for k, v in found.items() if v is not _MISSING}


def _fp16_scaling_note(key: str, v, keys: dict[str, object]) -> str:
    """Why the loss-scaling key ``key`` at ``v`` of the fp16 section in use leaves one step unchanged."""
    if key == "fp16.loss_scale":
        return ("a static loss scale: the overflow check and the unscale by 1 / loss_scale run as with dynamic "
                "scaling, as priced")
    static = keys.get("fp16.loss_scale")
    if _number(static) and static > 0:
        return f"DeepSpeed reads it for dynamic loss scaling only, and fp16.loss_scale {_shown(static)} is static"
    return ("it steers the dynamic loss scale from step to step: which overflow skips an update and when the scale "
            "grows, not one step's work")


def no_step_effect_notes(keys: dict[str, object], fp16_in_use: bool = False) -> tuple[str, ...]:
    """One warning line per key of ``keys`` (``no_step_effect_keys``); ``fp16_in_use``: the scenario's fp16 section
    is in use (its loss-scaling keys were not dropped as those of a disabled section)."""
    out = []
    for key, v in keys.items():
        if key in NO_STEP_EFFECT_KEYS:
            why = f"{NO_STEP_EFFECT_KEYS[key]}; DeepSpeed's key"
        elif key in DEFAULT_ONLY_KEYS:
            why = f"current DeepSpeed prices the same step as at its default {_shown(DEFAULT_ONLY_KEYS[key][0])}"
        elif fp16_in_use:
            why = _fp16_scaling_note(key, v, keys)
        else:
            why = "fp16.enabled false"
        out.append(f"{key} {_shown(v)}: accepted, no effect on the training step ({why})")
    return tuple(out)


def put_keys(data: dict, keys: dict[str, object]) -> dict:
    """``data`` (a dumped scenario) with the dotted ``keys`` put back; a key whose section the dump left out is not
    (adding the section would change what the scenario runs: ``ScenarioConfig._dump_without_unwritten_deepspeed``)."""
    for path, v in keys.items():
        *parents, leaf = path.split(".")
        node = data
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node[leaf] = v
    return data


def _fp16_in_use(data: dict) -> bool:
    """Whether the DeepSpeed ``fp16`` section of ``data`` is the one the run uses: ``enabled: true``, or no
    ``enabled`` beside ``training.precision: fp16``."""
    f, tr = data.get("fp16"), data.get("training")
    if not isinstance(f, dict):
        return False
    return f.get("enabled") is True or (f.get("enabled") is None and isinstance(tr, dict)
                                        and tr.get("precision") == "fp16")


def _fp16_scaling_keys(data: dict) -> list[str]:
    """The loss-scaling keys (``FP16_LOSS_SCALING``) written in an fp16 section that is in use (``_fp16_in_use``) or
    disabled (``fp16.enabled: false``, as a ds_config running bf16 writes it beside them: they act on nothing); in
    any other section they stay unknown keys (``FOREIGN_KEY_HINTS``)."""
    f = data.get("fp16")
    if not (isinstance(f, dict) and (f.get("enabled") is False or _fp16_in_use(data))):
        return []
    return [k for k in FP16_LOSS_SCALING if k[5:] in f]


def deepspeed_key_problems(data: dict) -> tuple[dict, list[DefaultOnlyKeyError]]:
    """``data`` (a scenario mapping) without the DeepSpeed keys accepted here, and every problem of those keys.

    Dropped: the ``DEFAULT_ONLY_KEYS`` written at their DeepSpeed defaults (or, for those without effect, at any
    value), the ``NO_STEP_EFFECT_KEYS``, and the fp16 loss-scaling keys (``FP16_LOSS_SCALING``) of a section in use or
    disabled at a value DeepSpeed accepts (``no_step_effect_keys`` names those not at the default in the warnings);
    DeepSpeed's top-level ``gradient_clipping`` moved to ``training.clip_grad``, its meaning here (the global-norm clip
    threshold, 0 = none: DeepSpeed's GRADIENT_CLIPPING_DEFAULT, @ac2f3a34 deepspeed/runtime/constants.py), whose field
    checks its value. Each key with a problem is dropped too, so that the rest of the scenario is validated in the
    same round.

    Returns:
        ``(data without those keys, problems)``: one ``DefaultOnlyKeyError`` per modelled key at another value, fp16
        loss-scaling key at a value DeepSpeed refuses, or ``gradient_clipping`` beside a different
        ``training.clip_grad``, in that order.
    """
    out, problems = data, []
    for key, (default, other) in DEFAULT_ONLY_KEYS.items():
        out, v = _pop(out, key)
        if v is _MISSING or other is None or _is_default(v, default):
            continue
        problems.append(DefaultOnlyKeyError(key, f"{_shown(v)} is not modelled ({other}); allowed: "
                                                 f"{_shown(default)}, DeepSpeed's default, or leave it out"))
    for key in NO_STEP_EFFECT_KEYS:
        out = _pop(out, key)[0]
    for key in _fp16_scaling_keys(out):
        out, v = _pop(out, key)
        default, ok, allowed = FP16_LOSS_SCALING[key]
        if not ok(v):
            problems.append(DefaultOnlyKeyError(key, f"{_shown(v)} is refused by DeepSpeed (deepspeed/runtime/"
                                                     f"precision_config.py, fp16/loss_scaler.py); allowed: {allowed}, "
                                                     f"DeepSpeed's default {default}"))
    out, clip = _pop(out, "gradient_clipping")
    tr = out.get("training")
    if clip is not _MISSING and isinstance(tr, dict):  # no training mapping: its own error
        given = tr.get("clip_grad")
        if given is not None and given != clip:
            problems.append(DefaultOnlyKeyError("gradient_clipping", f"{_shown(clip)} contradicts training.clip_grad "
                                                f"{_shown(given)} (DeepSpeed's gradient_clipping is training.clip_grad "
                                                "here; allowed: one of them, or both equal)"))
        else:
            out = {**out, "training": {**tr, "clip_grad": clip}}
    return out, problems


def drop_default_only_keys(data: dict) -> dict:
    """``data`` without the DeepSpeed keys accepted here (``deepspeed_key_problems``).

    Raises:
        DefaultOnlyKeyError: the first of ``deepspeed_key_problems`` (one line naming the key and what is allowed);
            ``loader.scenario_errors`` reports them all.
    """
    out, problems = deepspeed_key_problems(data)
    if problems:
        raise problems[0]
    return out


#: the words for a value ``"auto"`` that is not one here: the placeholder of a ds_config written for the Hugging Face
#: Trainer, which fills it from its TrainingArguments when it launches DeepSpeed (huggingface/transformers
#: src/transformers/integrations/deepspeed.py HfTrainerDeepSpeedConfig.trainer_config_process / fill_match)
HF_AUTO_NOTE = ("'auto' is Hugging Face Trainer's placeholder, filled from its TrainingArguments at launch "
                "(transformers HfTrainerDeepSpeedConfig): write the value")


def hf_auto_note(value) -> str | None:
    """``HF_AUTO_NOTE`` for a refused value that is the string ``"auto"`` (any case), else None."""
    return HF_AUTO_NOTE if isinstance(value, str) and value.strip().lower() == "auto" else None


def foreign_key_hint(path: str) -> str | None:
    """What to write instead of the unknown key at dotted ``path`` (``fsdp.activation_checkpointing``), or why it
    is not modelled; None for a key no framework in ``FOREIGN_KEY_HINTS`` uses there."""
    return FOREIGN_KEY_HINTS.get(path)
