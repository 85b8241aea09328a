"""``--set KEY=null`` is "as if KEY were not written" for every optional key of the schema; a required one is
one missing-key line (exit 2)."""

import copy
import re
import typing
import warnings

import pytest

from hypothesis import given, settings, strategies as st
from pydantic import BaseModel

from simulator.cli import main
from simulator.config.errors import ScenarioError
from simulator.config.loader import read_yaml, scenario_from_dict
from simulator.config.overrides import apply_overrides
from simulator.config.schema import ScenarioConfig

BASES = ["scenarios/cluster/gpt_1p3b_dgx_h100_fsdp_tp2.yaml", "scenarios/cluster/gpt_1p3b_dgx_h100_tp2_dp4.yaml",
         "scenarios/h200/gpt_184m_b8.yaml"]


def _section(annotation) -> type[BaseModel] | None:
    models = [a for a in (annotation, *typing.get_args(annotation)) if isinstance(a, type) and issubclass(a, BaseModel)]
    return models[0] if len(models) == 1 else None


def _optional_paths(model: type[BaseModel], prefix: tuple = (), depth: int = 0) -> list[tuple]:
    """Every key path of the schema (sections and their keys, 3 deep) that has a default."""
    out = []
    for name, field in model.model_fields.items():
        path = (*prefix, name)
        # null is a value of its own (no prefetch) where the field admits it with another default
        null_is_a_value = type(None) in typing.get_args(field.annotation) and field.default is not None
        if not field.is_required() and not null_is_a_value:
            out.append(path)
        sub = _section(field.annotation)
        if sub is not None and depth < 2:
            out += _optional_paths(sub, path, depth + 1)
    return out


OPTIONAL = _optional_paths(ScenarioConfig)


def _without(data: dict, path: tuple) -> dict:
    """``data`` with the key at ``path`` deleted where it is written (a copy)."""
    out = copy.deepcopy(data)
    node = out
    for p in path[:-1]:
        node = node.get(p) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(path[-1], None)
    return out


def _outcome(data: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return scenario_from_dict(data, "s.yaml").model_dump()
        except ScenarioError as exc:  # the same problems, whoever removed the key
            return re.sub(r" \(from the command line: [^)]*\)", "", str(exc))


def test_the_optional_paths_cover_every_section():
    assert len(OPTIONAL) > 150 and {p[0] for p in OPTIONAL} >= {"parallelism", "training", "run", "fsdp", "ddp",
                                                                 "hardware", "model", "zero_optimization", "dvfs"}
    assert ("training", "optimizer", "impl") in OPTIONAL and ("parallelism", "sequence_parallel") in OPTIONAL


@settings(max_examples=60, deadline=None)
@given(base=st.sampled_from(BASES), paths=st.lists(st.sampled_from(OPTIONAL), min_size=1, max_size=3))
def test_null_is_as_if_the_key_were_not_written(base, paths):
    data = read_yaml(base)
    expected = data
    for p in paths:
        expected = _without(expected, p)
    assert _outcome(apply_overrides(data, [f"{'.'.join(p)}=null" for p in paths])) == _outcome(expected)


def test_null_on_keys_the_files_write_resets_them_to_the_default():
    data = read_yaml(BASES[0])  # FSDP FULL_SHARD, tp 2, 4 steps
    cfg = scenario_from_dict(apply_overrides(data, ["parallelism.tensor_model_parallel_size=null", "run.steps=null",
                                                    "fsdp.sharding_strategy=null", "hardware.host=~"]), "s.yaml")
    assert cfg.parallelism.tensor_model_parallel_size == 1 and cfg.parallelism.data_parallel_size == 8
    assert cfg.run.steps == 5 and cfg.fsdp.sharding_strategy == "FULL_SHARD"
    assert cfg.hardware.host == "h200-measured-host"
    # a key of a section the file does not have creates no section
    assert scenario_from_dict(apply_overrides(data, ["dvfs.kind=null"]), "s.yaml").dvfs is None
    # where null is a documented value (PyTorch FSDP backward_prefetch=None: on demand) it is kept, not the default
    assert ("fsdp", "backward_prefetch") not in OPTIONAL and scenario_from_dict(
        apply_overrides(data, ["fsdp.backward_prefetch=null"]), "s.yaml").fsdp.backward_prefetch is None
    # a misspelt key given null is still named, not dropped
    with pytest.raises(ScenarioError, match="parallelism.tensor_model_paralel_size: unknown key"):
        scenario_from_dict(apply_overrides(data, ["parallelism.tensor_model_paralel_size=null"]), "s.yaml")


def test_null_on_a_required_key_is_one_missing_key_line(capsys):
    assert main(["run", BASES[2], "--set", "training.micro_batch_size=null"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {BASES[2]}: training.micro_batch_size: required key is missing (from the command line: "
                   "training.micro_batch_size=...)")


def test_null_says_which_default_the_key_took():
    """``--set KEY=null`` is as if KEY were not written, and says what it became: the schema's default
    (``training.precision`` -> amp_fp32_params), the value derived from the other settings
    (``parallelism.data_parallel_size`` -> 8 on one DGX), or unset for the run to resolve (``training.clip_grad``:
    the framework's default); ``hardware.host=~`` names the preset it falls back to (the H200 test host, on a DGX
    H100 scenario). Before, all of them fell back silently."""
    from simulator.config.loader import load_scenario

    path = "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_scenario(path, ["training.precision=null", "parallelism.data_parallel_size=null",
                                   "training.clip_grad=null", "hardware.host=~", "run.steps=2", "run.warmup_steps=1"])
    notes = [str(w.message) for w in caught if "is not written, so" in str(w.message)]
    assert cfg.training.precision == "amp_fp32_params" and cfg.parallelism.data_parallel_size == 8
    assert notes == [
        "--set training.precision=null: training.precision is not written, so it takes the schema's default: "
        "'amp_fp32_params'",
        "--set parallelism.data_parallel_size=null: parallelism.data_parallel_size is not written, so it is derived "
        "from the other settings: 8",
        "--set training.clip_grad=null: training.clip_grad is not written, so it is left unset: the run resolves it "
        "from the other settings (see its documentation)",
        "--set hardware.host=~: hardware.host is not written, so it takes the schema's default: 'h200-measured-host'"]


def test_null_on_a_section_the_validators_fill_says_it_was_derived():
    """``--set fsdp.offload_policy=null`` on a scenario with torchtitan's ``training.enable_cpu_offload: true``
    removes the key, and the validator fills it back in (``CPUOffloadPolicy()``): the run offloads anyway, which
    the note says. Before, the section was skipped and the offload kept in silence."""
    from simulator.config.loader import load_scenario

    path = "scenarios/cluster/gpt_1p3b_dgx_h100_fsdp2_offload.yaml"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_scenario(path, ["fsdp.offload_policy=null"])
    notes = [str(w.message) for w in caught if "is not written, so" in str(w.message)]
    assert cfg.fsdp.offload_policy is not None
    assert notes == ["--set fsdp.offload_policy=null: fsdp.offload_policy is not written, so it is derived from "
                     "training.enable_cpu_offload: true (torchtitan's CPUOffloadPolicy()): {'kind': 'cpu', "
                     "'pin_memory': True}; only --set training.enable_cpu_offload=false turns the offload off"]


def test_the_set_the_offload_note_names_turns_the_offload_off():
    """What the note above says is true: ``--set training.enable_cpu_offload=false`` on that scenario leaves no
    offload policy (the run keeps its states on the GPU), and nulling ``fsdp.offload_policy`` with it says so
    (null: OffloadPolicy, no offload), not that the run resolves it. Before, the note named only 'the other
    settings' and, with both, 'left unset: the run resolves it'."""
    from simulator.config.loader import load_scenario

    path = "scenarios/cluster/gpt_1p3b_dgx_h100_fsdp2_offload.yaml"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_scenario(path, ["training.enable_cpu_offload=false", "fsdp.offload_policy=null"])
    notes = [str(w.message) for w in caught if "is not written, so" in str(w.message)]
    assert cfg.fsdp.offload_policy is None and cfg.fsdp.cpu_offload is False
    assert notes == ["--set fsdp.offload_policy=null: fsdp.offload_policy is not written, so it is null: no offload "
                     "(OffloadPolicy)"]


def test_null_on_a_section_with_schema_defaults_says_it_took_them():
    """``--set aio=null`` (``aio`` not in the file) notes the defaults taken, as ``hardware.nvme=null`` and
    ``training.clip_grad=null`` note theirs; before, only a section was silent."""
    from simulator.config.loader import load_scenario
    from simulator.config.sections.nvme import AIO_DEFAULTS

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_scenario("scenarios/h200/gpt_184m_b8.yaml", ["aio=null"])
    notes = [str(w.message) for w in caught if "is not written, so" in str(w.message)]
    assert cfg.aio.model_dump() == {k: AIO_DEFAULTS[k] for k in cfg.aio.model_dump()}
    assert notes == [f"--set aio=null: aio is not written, so it takes the schema's defaults: {cfg.aio.model_dump()}"]


def test_null_on_parallelism_names_the_derived_data_parallel_size():
    """``--set parallelism=null`` on PP4 x DP2 over 8 GPUs leaves tp 1, pp 1 (the schema's defaults) and
    data_parallel_size derived from the world size: 8 / (1 x 1) = 8, and the note says so. Before, it was silent
    (the section differed from its default in the derived dp, so it was skipped), though the step went 337 -> 222 ms."""
    from simulator.config.loader import load_scenario

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_scenario("scenarios/cluster/gpt_16x2048_pp4_dp2_dgx_h100.yaml", ["parallelism=null"])
    notes = [str(w.message) for w in caught if "is not written, so" in str(w.message)]
    p = cfg.parallelism
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size) == (1, 1, 8)
    assert notes == ["--set parallelism=null: parallelism is not written, so it takes the schema's defaults, with "
                     f"data_parallel_size 8 derived from the other settings: {p.model_dump()}"]


def test_null_on_an_optional_section_says_it_is_left_out():
    """``--set activation_checkpoint=null`` on torchtitan's 405B scenario (full AC) removes the section: the note
    says what it became (left out, its default none) and what that means (training.recompute_granularity decides:
    none here), where it said the run "resolves it from the other settings" (fresh-user trial)."""
    from simulator.config.loader import load_scenario

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_scenario("scenarios/cluster/llama3_405b_torchtitan_fsdp_tp8_128xh100.yaml",
                            ["activation_checkpoint=null", "dvfs=null"])
    notes = [str(w.message) for w in caught if str(w.message).startswith("--set ")]
    assert cfg.activation_checkpoint is None and cfg.training.recompute_granularity is None
    assert notes == [
        "--set activation_checkpoint=null: the activation_checkpoint section is left out (its default, none): no "
        "torchtitan activation checkpointing: training.recompute_granularity decides the recompute (none)",
        "--set dvfs=null: the dvfs section is left out (its default, none): no DVFS policy: the GPUs run at their "
        "default clocks and power limit"]


def test_null_on_a_key_a_section_check_requires_names_the_command_line(capsys):
    """``model.vocab_size`` is required by the model section's own check (architecture decoder), not by its field:
    its line named ``model: vocab_size`` and so not the ``--set`` it came from (fresh-user trial)."""
    assert main(["run", BASES[2], "--set", "model.vocab_size=null"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {BASES[2]}: model.vocab_size: required key is missing (architecture decoder) (from the "
                   "command line: model.vocab_size=...)")
