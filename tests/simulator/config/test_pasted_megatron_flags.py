"""Megatron-LM launch-script flags written as keys (underscore form, megatron/training/arguments.py) are refused
saying what to write here: ``--disable-bias-linear`` is ``add_bias_linear: false``, ``--recompute-activations`` is
``recompute_granularity: selective``, ``--make-vocab-size-divisible-by`` is explained (the padding the builder does),
the learning-rate schedule (``--lr`` ...) changes no step. Before: no hint, or "did you mean 'lora'?" for
``training.lr``."""

from __future__ import annotations

import pytest

from simulator.config.errors import ScenarioError
from simulator.config.loader import scenario_from_dict
from tests.simulator.config.test_pasted_framework_names import BASE, _merge, _nested
from tests.simulator.graph.test_tensor_parallel import _spec


def _line(path: str, value) -> str:
    with pytest.raises(ScenarioError) as e:
        scenario_from_dict(_merge(BASE, _nested(path, value)), "launch.yaml")
    (line,) = str(e.value).splitlines()
    assert line.startswith(f"launch.yaml: {path}: unknown key (allowed: "), line
    return line


def test_disable_bias_linear_names_add_bias_linear_false():
    assert _line("model.disable_bias_linear", True).endswith(
        "; Megatron-LM's --disable-bias-linear is add_bias_linear: false here (model.add_bias_linear)")
    scenario_from_dict(_merge(BASE, {"model": {"add_bias_linear": False}}))  # and what it names is accepted


@pytest.mark.parametrize("section", ["training", "model"])
def test_recompute_activations_names_selective_recompute(section):
    line = _line(f"{section}.recompute_activations", True)
    assert "is training.recompute_granularity: selective here" in line
    cfg = scenario_from_dict(_merge(BASE, {"training": {"recompute_granularity": "selective"}}))
    assert cfg.training.recompute_granularity == "selective"


def test_make_vocab_size_divisible_by_explains_the_padding():
    line = _line("model.make_vocab_size_divisible_by", 128)
    assert "padded as Megatron pads it at its default 128 with tensor_model_parallel_size > 1" in line
    assert "50304 for GPT-2's 50257" in line
    # what the line claims of the builder: a multiple of 128 x tp at tp > 1, the vocabulary as written at tp 1
    assert _spec(vocab_size=50257, tensor_parallel_size=2).padded_vocab_size == 50432  # 197 x 256
    assert _spec(vocab_size=50257).padded_vocab_size == 50257
    assert -(-50257 // 128) * 128 == 50304  # the figure the line gives (Megatron's _vocab_size_with_padding at tp 1)


@pytest.mark.parametrize("key", ["lr", "min_lr", "lr_warmup_iters"])
def test_learning_rate_keys_say_they_change_no_step(key):
    line = _line(f"training.{key}", 3e-4)
    assert "did you mean" not in line and "(learning-rate schedule) changes no step's work or time" in line
    assert f"--{key.replace('_', '-')} " in line
