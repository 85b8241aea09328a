"""Bad keys / values and the checks between settings come in one run (``loader.scenario_errors``): a check whose
inputs are valid is reported beside the key errors; one reading a bad value is skipped."""

import copy

import pytest

from simulator.config.errors import ScenarioError
from simulator.config.loader import scenario_from_dict

BASE = {"name": "t", "hardware": {"gpu": "h100-sxm-80gb", "cluster": {"preset": "dgx-h100", "nodes": 1}},
        "model": {"num_layers": 24, "hidden_size": 1536, "num_attention_heads": 12, "seq_length": 1024,
                  "vocab_size": 32768},
        "training": {"micro_batch_size": 8, "precision": "bf16"},
        "parallelism": {"tensor_model_parallel_size": 2}}


def problems(**changes) -> list[str]:
    """The error lines of BASE with ``section={key: value}`` changes (a value None deletes the key)."""
    data = copy.deepcopy(BASE)
    for section, keys in changes.items():
        for k, v in keys.items():
            data[section].pop(k) if v is None else data[section].__setitem__(k, v)
    with pytest.raises(ScenarioError) as exc:
        scenario_from_dict(data, "s.yaml")
    return str(exc.value).split("\n")


def test_a_bad_value_and_a_check_between_settings_in_one_run():
    lines = problems(training={"micro_batch_size": -8}, parallelism={"tensor_model_parallel_size": 8})
    assert lines == ["s.yaml: training.micro_batch_size: Input should be greater than 0 (got -8)",
                     "s.yaml: parallelism.tensor_model_parallel_size: 8 must divide model.num_attention_heads (12; "
                     "Megatron splits it over the TP ranks)"]


def test_a_misspelt_key_and_the_world_size_check_in_one_run():
    lines = problems(training={"micro_batch_sise": 8}, parallelism={"data_parallel_size": 3})
    assert len(lines) == 2 and lines[0].startswith("s.yaml: training.micro_batch_sise: unknown key")
    # 8 GPUs / tp 2 = 4 replicas; the check reads only the cluster and tp, both valid
    assert lines[1].startswith("s.yaml: parallelism.data_parallel_size: 3 does not match the world size 8")


def test_a_check_reading_a_bad_value_is_skipped():
    # pp 2 x virtual 2 with 8 / 16 = 0.5 micro-batches: the interleaving check reads micro_batch_size, which is bad
    lines = problems(training={"micro_batch_size": -16, "global_batch_size": 8},
                     parallelism={"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2})
    assert lines == ["s.yaml: training.micro_batch_size: Input should be greater than 0 (got -16)"]
    # with the misspelt key meant for tensor_model_parallel_size (not written), the world-size check is not run
    lines = problems(parallelism={"tensor_model_parallel_size": None, "tensor_model_paralel_size": 2,
                                  "data_parallel_size": 4})
    assert len(lines) == 1 and "did you mean 'tensor_model_parallel_size'" in lines[0]


def test_every_failing_check_between_settings_at_once():
    # 24 layers / (pp 2 x virtual 2) fine, 1 micro-batch per step not a multiple of pp 2; gbs 24 not a multiple of 16
    lines = problems(training={"global_batch_size": 24},
                     parallelism={"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2})
    assert len(lines) == 2
    assert lines[0].startswith("s.yaml: parallelism.pipeline_schedule: interleaved_1f1b needs the micro-batches per "
                               "step (global_batch_size / (micro_batch_size x data_parallel_size) = 1)")
    assert lines[1] == ("s.yaml: training.global_batch_size: 24 must be a multiple of micro_batch_size x "
                        "data_parallel_size (16)")


def test_a_sections_own_check_beside_a_bad_key_of_it():
    # heads 7 do not divide hidden 1536 (ModelConfig's check) and num_layers is not a number
    lines = problems(model={"num_attention_heads": 7, "num_layers": "many"})
    assert "s.yaml: model.num_layers: Input should be a valid integer (got 'many')" in lines
    assert any("num_attention_heads (7) must divide hidden_size (1536)" in line for line in lines)
