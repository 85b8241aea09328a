"""``training.clip_grad`` not given under a DeepSpeed config (a ``zero_optimization`` section) is DeepSpeed's
``gradient_clipping`` default 0 (deepspeedai/DeepSpeed@ac2f3a34 ``deepspeed/runtime/constants.py``
``GRADIENT_CLIPPING_DEFAULT = 0.``), not Megatron-LM's ``--clip-grad`` 1.0 (``config.schema.clip_grad_of``).
ZeRO-1/2 still run their step norm whatever the value (``grad_norm.deepspeed_zero_step``)."""

from __future__ import annotations

import copy

import pytest

from simulator.api import build_graph, resolve_hardware, resolved_config, run_warnings
from simulator.config.loader import scenario_from_dict
from simulator.config.schema import clip_grad_of

BASE = {
    "name": "dsclip",
    "hardware": {"gpu": "h100-sxm-80gb", "cluster": {"preset": "dgx-h100", "nodes": 1}, "launch_overhead_s": 0},
    "model": {"num_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "seq_length": 256, "vocab_size": 1024},
    "training": {"micro_batch_size": 2, "precision": "bf16"},
    "run": {"steps": 3, "warmup_steps": 1},
}


def _cfg(zero=None, clip=None, **par):
    d = copy.deepcopy(BASE)
    if zero is not None:
        d["zero_optimization"] = zero
    if clip is not None:
        d["training"]["clip_grad"] = clip
    if par:
        d["parallelism"] = par
    return scenario_from_dict(d)


def _names(cfg) -> set[str]:
    return {o.name for o in build_graph(cfg).ops}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_zero_defaults_to_no_clipping(stage):
    assert clip_grad_of(_cfg({"stage": stage})) == 0.0
    assert clip_grad_of(_cfg({"stage": stage}, clip=0.5)) == 0.5  # a value given wins


def test_megatron_default_without_deepspeed_and_after_a_dump():
    """No DeepSpeed section: Megatron's 1.0, also once the resolved config is validated again (``resolved_config``
    leaves out the zero_optimization section the scenario did not give, which would make it DeepSpeed's
    FP16_Optimizer). A stage-0 section with bf16 and no pipeline is FP16_Optimizer: DeepSpeed's 0."""
    cfg = _cfg()
    assert clip_grad_of(cfg) == 1.0
    assert clip_grad_of(scenario_from_dict(resolved_config(cfg))) == 1.0
    assert clip_grad_of(_cfg({"stage": 0})) == 0.0  # DeepSpeed's FP16_Optimizer (DDP_BFLOAT16)
    ds = _cfg({"stage": 2})
    assert clip_grad_of(scenario_from_dict(resolved_config(ds))) == 0.0


def test_bf16_optimizer_defaults_to_no_clipping():
    assert clip_grad_of(_cfg({"stage": 0}, pipeline_model_parallel_size=2)) == 0.0


def test_bf16_optimizer_reads_no_clip_coefficient_by_default():
    """BF16_Optimizer (stage 0, bf16, a pipeline): ``clip_tensors_by_global_norm`` only with clip_grad > 0."""
    assert "bf16opt.clip_coef.item" not in _names(_cfg({"stage": 0}, pipeline_model_parallel_size=2))
    assert "bf16opt.clip_coef.item" in _names(_cfg({"stage": 0}, clip=1.0, pipeline_model_parallel_size=2))


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_norm_priced_whatever_the_value(stage):
    off, on = build_graph(_cfg({"stage": stage})), build_graph(_cfg({"stage": stage}, clip=1.0))
    assert "zero.grad_norm.all_reduce" in {o.name for o in off.ops}
    assert [(o.name, o.bytes_read) for o in off.ops] == [(o.name, o.bytes_read) for o in on.ops]


def test_one_gpu_zero_flags_the_unpriced_zero_step_norm():
    d = copy.deepcopy(BASE)
    del d["hardware"]["cluster"]
    d["zero_optimization"] = {"stage": 2}
    cfg = scenario_from_dict(d)
    assert not any("norm" in n for n in _names(cfg) if n.startswith("opt."))
    ws = [w for w in run_warnings(resolve_hardware(cfg), cfg) if "shards nothing on one GPU" in w]
    assert len(ws) == 1 and "deepspeed_zero_step" in ws[0]
