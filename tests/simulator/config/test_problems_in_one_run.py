"""Bad keys / values and the checks between settings come in one run (``loader.scenario_errors``): a check whose
inputs are valid is reported beside the key errors; one reading a bad value is skipped."""

import copy
import re
import warnings

import pytest
from hypothesis import given, settings, strategies as st

from simulator.config.errors import ScenarioError
from simulator.config.loader import load_scenario, scenario_from_dict

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


def test_a_misspelt_sequence_parallel_leaves_the_tensor_parallel_layout_checked():
    """Final fresh-user check: a misspelt ``sequence_parallel`` (the key meant is unknown) hid the TP layout rules,
    which ran in the same check as the sequence-parallel ones."""
    lines = problems(training={"micro_batch_size": -8},
                     parallelism={"sequence_paralel": True, "tensor_model_parallel_size": 3})
    assert len(lines) == 3 and lines[0].startswith("s.yaml: parallelism.sequence_paralel: unknown key")
    assert lines[2] == ("s.yaml: parallelism.tensor_model_parallel_size: 3 must divide the 8 GPUs per node of "
                        "hardware.cluster 'dgx-h100' (TP ranks are consecutive inside a node; allowed: a divisor of 8)")


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


BREAKERS = ["parallelism.tensor_model_parallel_size=8", "parallelism.pipeline_model_parallel_size=3",
            "parallelism.virtual_pipeline_model_parallel_size=2", "training.global_batch_size=24",
            "parallelism.context_parallel_size=2", "parallelism.expert_model_parallel_size=2",
            "parallelism.sequence_parallel=true", "training.precision=amp_fp32_params", "zero_optimization.stage=3",
            "model.num_query_groups=3", "training.fp8=hybrid", "ddp.use_distributed_optimizer=true",
            "run.warmup_steps=9", "model.num_attention_heads=24", "parallelism.data_parallel_size=2",
            "fsdp.sharding_strategy=FULL_SHARD", "parallelism.tp_comm_overlap=true"]
SCENARIOS = ["scenarios/cluster/gpt_1p3b_dgx_h100_tp2_dp4.yaml", "scenarios/cluster/gpt_1p3b_dgx_h100_fsdp_tp2.yaml",
             "scenarios/h200/gpt_184m_b8.yaml"]


def _lines(scenario: str, sets: list[str]) -> set[str]:
    """The problems of ``scenario`` with ``sets`` (empty when it loads), without the command-line marks."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            load_scenario(scenario, sets)
            return set()
        except ScenarioError as exc:
            return set(re.sub(r" \(from the command line: [^)]*\)", "", str(exc)).split("\n"))


@settings(max_examples=60, deadline=None)
@given(scenario=st.sampled_from(SCENARIOS), sets=st.lists(st.sampled_from(BREAKERS), max_size=4, unique=True),
       where=st.sampled_from(["model.", "parallelism.", "training.", "run.", ""]))
def test_an_unknown_key_hides_no_check_between_settings(scenario, sets, where):
    """An unknown key (no key near its name: it stands for nothing) beside any mix of settings: exactly its own
    line more than the same settings without it, however many checks between them fail."""
    without, with_it = _lines(scenario, sets), _lines(scenario, sets + [f"{where}zz_not_a_key=1"])
    extra = [line for line in with_it if "zz_not_a_key: unknown key" in line]
    assert len(extra) == 1 and with_it - set(extra) == without


#: bad values of keys that no check reads before deciding another (the parallel sizes and the cluster are: a bad
#: tp skips the world-size check, which then no longer hides a later true problem, so the sets may differ)
BAD_VALUES = {"training.micro_batch_size": "-8", "model.num_layers": "many", "model.seq_length": "-1",
              "training.precision": "bf17", "run.steps": "0", "zero_optimization.stage": "9",
              "model.hidden_size": "true", "training.global_batch_size": "-1", "model.num_attention_heads": "0"}


@settings(max_examples=60, deadline=None)
@given(scenario=st.sampled_from(SCENARIOS), sets=st.lists(st.sampled_from(BREAKERS), max_size=4, unique=True),
       bad=st.sampled_from(sorted(BAD_VALUES)))
def test_a_bad_value_adds_no_problem_of_its_own_but_its_line(scenario, sets, bad):
    """A bad value beside any mix of settings: its own line, and otherwise only problems that the same settings
    without it have (a check that reads it is skipped, never run on another value)."""
    without, with_it = _lines(scenario, sets), _lines(scenario, sets + [f"{bad}={BAD_VALUES[bad]}"])
    own = {line for line in with_it if line.startswith(f"{scenario}: {bad}: ")}
    assert len(own) == 1 and with_it - own <= without


def test_a_sections_check_reading_the_keys_written_beside_an_unknown_key():
    # fsdp version 2 has no sharding_strategy (the file writes one): FsdpConfig's check reads which keys are written
    with pytest.raises(ScenarioError) as exc:
        load_scenario("scenarios/cluster/gpt_1p3b_dgx_h100_fsdp_tp2.yaml", ["fsdp.version=2", "fsdp.zz_not_a_key=1"])
    lines = str(exc.value).split("\n")
    assert len(lines) == 2 and "fsdp.zz_not_a_key: unknown key" in lines[0]
    assert ": fsdp: fsdp.sharding_strategy is FSDP1's (FullyShardedDataParallel); fsdp.version 2" in lines[1]


def test_deepspeed_keys_problems_come_with_the_others():
    """A ds_config pasted beside a bad model key: a bad ``gradient_clipping``, ``prescale_gradients: true`` (not
    modelled) and a bad fp16 key come in the same round, each naming the key written. Before, the first DeepSpeed
    refusal hid the others and dropped ``gradient_clipping`` unchecked (one more run per problem), and a bad
    ``gradient_clipping`` alone was named ``training.clip_grad``, a key the file does not have."""
    data = {**copy.deepcopy(BASE), "gradient_clipping": -1.0, "prescale_gradients": True,
            "fp16": {"enabled": False, "hysteresis": 0}}
    data["model"]["num_layers"] = "many"
    with pytest.raises(ScenarioError) as exc:
        scenario_from_dict(data, "s.yaml")
    assert str(exc.value).split("\n") == [
        "s.yaml: prescale_gradients: true is not modelled (DeepSpeed would divide each gradient bucket by the "
        "data-parallel size before its all-reduce instead of after it); allowed: false, DeepSpeed's default, or "
        "leave it out",
        "s.yaml: fp16.hysteresis: 0 is refused by DeepSpeed (deepspeed/runtime/precision_config.py, "
        "fp16/loss_scaler.py); allowed: an integer >= 1, DeepSpeed's default 2",
        "s.yaml: model.num_layers: Input should be a valid integer (got 'many')",
        "s.yaml: gradient_clipping: Input should be greater than or equal to 0 (got -1.0)"]
    # gradient_clipping contradicting training.clip_grad, beside another refused DeepSpeed key: both
    data = {**copy.deepcopy(BASE), "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 1, "reduce_scatter": False}}
    data["training"]["clip_grad"] = 0.5
    with pytest.raises(ScenarioError) as exc:
        scenario_from_dict(data, "s.yaml")
    lines = str(exc.value).split("\n")
    assert len(lines) == 2 and lines[0].startswith("s.yaml: zero_optimization.reduce_scatter: false is not modelled")
    assert lines[1].startswith("s.yaml: gradient_clipping: 1.0 contradicts training.clip_grad 0.5")
