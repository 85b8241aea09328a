"""Megatron-LM ``--grad-reduce-in-bf16`` (``ddp.grad_reduce_in_bf16``): with bf16 the contiguous grad buffer, its
accumulation and every data-parallel / model-parallel reduction of it are bf16, 2 B per parameter, and the step
casts the shard it updates into fresh fp32 main grads. Bytes worked by hand on the tiny model of
``test_megatron_optimizer_kernels``; the bad inputs as Megatron-LM treats them."""
from __future__ import annotations

import pytest
import yaml

from simulator.api import ineffective_setting_warnings
from simulator.config.loader import scenario_from_dict
from simulator.graph.builders.sharding import ShardingSpec
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from tests.conftest import refused_in_one_line
from tests.simulator.graph.test_megatron_optimizer_kernels import TINY

P = 165_120  # TINY's parameters (test_megatron_optimizer_kernels.test_parameter_count_by_hand)


def _graph(**kw):
    return build_gpt_step(TransformerSpec(**{**TINY, **kw}))


def _ops(**kw) -> dict:
    return {o.name: o for o in _graph(**kw).ops}


def test_buffer_memset_accumulation_and_cast_by_hand():
    on, off = _ops(grad_reduce_in_bf16=True), _ops()
    assert on["opt.megatron.zero_grad_buffer"].bytes_written == 2 * P  # 330,240 B (fp32: 660,480)
    assert off["opt.megatron.zero_grad_buffer"].bytes_written == 4 * P
    cast = on["opt.megatron.copy_model_grads_to_main_grads"]
    assert (cast.bytes_read, cast.bytes_written, cast.allocs[0].nbytes) == (2 * P, 4 * P, 4 * P)
    assert "opt.megatron.copy_model_grads_to_main_grads" not in off  # .float() of the fp32 main_grad: a view
    assert cast.id in on["opt.clip_grad.l2norm"].deps and on["opt.adamw"].bytes_read == 16 * P
    accum = {n: o.bytes_written for n, o in on.items() if n.endswith(".grad_accum")}
    assert accum and {n: off[n].bytes_written for n in accum} == {n: 2 * b for n, b in accum.items()}
    assert {n: o.dtype for n, o in on.items() if n.endswith(".grad_accum")} == {n: off[n].dtype for n in accum}


def test_persistent_buffer_is_two_bytes_per_parameter():
    for kw, nbytes in (({}, 4 * P), ({"grad_reduce_in_bf16": True}, 2 * P)):
        g = _graph(data_parallel_size=2, **kw)
        assert {t.name: t.nbytes for t in g.persistent}["grad.ddp_buckets"] == nbytes


def test_ddp_all_reduce_moves_bf16_by_hand():
    for flag, nbytes, dt in ((False, 4 * P, "fp32"), (True, 2 * P, "bf16")):
        ops = _ops(data_parallel_size=2, grad_reduce_in_bf16=flag)
        ar = [o for o in ops.values() if o.meta and o.meta.get("group") == "dp"]
        assert sum(o.meta["bytes"] for o in ar) == nbytes and {o.dtype for o in ar} == {dt}


def test_distributed_optimizer_reduce_scatters_bf16_and_casts_its_shard_by_hand():
    # dp 4: the reduce-scatter moves the whole 2 B buffer (330,240 B), the cast reads this rank's quarter
    # (41,280 elements: 82,560 B) into 165,120 B of fp32 main grads; the param all-gather stays bf16 (2 B)
    sh = ShardingSpec(strategy="distributed_optimizer", shard_size=4)
    ops = _ops(data_parallel_size=4, sharding=sh, grad_reduce_in_bf16=True)
    rs = [o for n, o in ops.items() if "megatron.grad_reduce_scatter" in n]
    ag = [o for n, o in ops.items() if "megatron.param_all_gather" in n]
    assert sum(o.meta["bytes"] for o in rs) == 2 * P and {o.dtype for o in rs} == {"bf16"}
    assert sum(o.meta["bytes"] for o in ag) == 2 * P
    cast = ops["opt.megatron.copy_model_grads_to_main_grads"]
    assert (cast.bytes_read, cast.bytes_written) == (2 * P / 4, 4 * P / 4) == (82_560, 165_120)
    assert ops["opt.megatron.zero_grad_buffer"].bytes_written == 2 * P  # the whole buffer, not sharded
    fp32 = _ops(data_parallel_size=4, sharding=sh)
    assert sum(o.meta["bytes"] for n, o in fp32.items() if "megatron.grad_reduce_scatter" in n) == 4 * P


def test_sequence_parallel_and_tied_embedding_reductions_are_bf16():
    def ln(flag):
        o = next(o for n, o in _ops(tensor_parallel_size=2, sequence_parallel=True, grad_reduce_in_bf16=flag).items()
                 if "layernorm_grads.all_reduce" in n)
        return o.meta["bytes"], o.dtype
    # 896 sequence-parallel elements (test_megatron_optimizer_kernels: 2 x 384 + the final LN's 128)
    assert ln(False) == (4 * 896, "fp32") and ln(True) == (2 * 896, "bf16")

    import copy

    from simulator.api import build_graph
    from tests.simulator.graph.test_pipeline_parallel import BASE
    for flag, eb, dt in ((False, 4, "fp32"), (True, 2, "bf16")):
        d = copy.deepcopy(BASE)
        d["training"]["precision"] = "bf16"
        d["ddp"] = {"grad_reduce_in_bf16": flag}
        op = next(o for o in build_graph(scenario_from_dict(d), 0).ops if o.name == "pp.embedding_grads.all_reduce")
        assert (op.meta["bytes"], op.dtype) == (eb * 1024 * 512, dt)  # V 1024 x h 512


def test_no_effect_outside_bf16_as_megatron():
    # Megatron-LM reads --grad-reduce-in-bf16 only under --bf16: fp16's buffer stays fp16, fp32 stays fp32
    assert _ops(precision="fp16", grad_reduce_in_bf16=True).keys() == _ops(precision="fp16").keys()
    assert not TransformerSpec(**{**TINY, "precision": "amp_fp32_params", "grad_reduce_in_bf16": True}
                               ).megatron_half_grads


SCEN = {"name": "x", "hardware": {"gpu": "h100-sxm-80gb"},
        "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16, "vocab_size": 1000},
        "training": {"micro_batch_size": 2, "precision": "bf16"}}


def _scenario(**sections) -> dict:
    d = yaml.safe_load(yaml.safe_dump(SCEN))
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v}
    return d


@pytest.mark.parametrize("extra,needle", [
    ({"zero_optimization": {"stage": 1}}, "zero_optimization.stage"),
    ({"fsdp": {"sharding_strategy": "FULL_SHARD"}, "training": {"precision": "amp_fp32_params"}}, "fsdp"),
])
def test_outside_megatrons_optimizer_is_one_line_exit_2(tmp_path, capsys, extra, needle):
    err = refused_in_one_line(tmp_path, capsys, _scenario(ddp={"grad_reduce_in_bf16": True}, **extra))
    assert "ddp.grad_reduce_in_bf16" in err and needle in err


@pytest.mark.parametrize("training,ddp,line", [
    ({"precision": "fp16"}, {}, "ddp.grad_reduce_in_bf16 has no effect with training.precision fp16"),
    ({"precision": "amp_fp32_params"}, {}, "ddp.grad_reduce_in_bf16 has no effect with training.precision "
                                           "amp_fp32_params"),
    ({}, {"accumulate_allreduce_grads_in_fp32": True},
     "ddp.accumulate_allreduce_grads_in_fp32 true has no effect with ddp.grad_reduce_in_bf16"),
])
def test_what_megatron_ignores_is_a_warning(training, ddp, line):
    cfg = scenario_from_dict(_scenario(training=training, ddp={"grad_reduce_in_bf16": True, **ddp}))
    assert [w for w in ineffective_setting_warnings(cfg) if "grad_reduce_in_bf16" in w] == [
        next(w for w in ineffective_setting_warnings(cfg) if w.startswith(line))]
    plain = scenario_from_dict(_scenario(ddp={"grad_reduce_in_bf16": True}))
    assert not [w for w in ineffective_setting_warnings(plain) if "grad_reduce_in_bf16" in w]


def test_accumulate_false_with_bf16_is_accepted_beside_it():
    # Megatron-LM sets accumulate_allreduce_grads_in_fp32 = False itself under --grad-reduce-in-bf16
    cfg = scenario_from_dict(_scenario(ddp={"grad_reduce_in_bf16": True, "accumulate_allreduce_grads_in_fp32": False}))
    assert cfg.ddp.grad_reduce_in_bf16


def test_training_spelling_points_to_the_ddp_key():
    from simulator.config.foreign_keys import FOREIGN_KEY_HINTS
    assert "ddp.grad_reduce_in_bf16: true" in FOREIGN_KEY_HINTS["training.grad_reduce_in_bf16"]
    assert "ddp.grad_reduce_in_bf16" not in FOREIGN_KEY_HINTS


@pytest.mark.parametrize("sharding", [None, ShardingSpec(strategy="distributed_optimizer", shard_size=4)])
def test_moe_expert_gradient_reductions_are_bf16_by_hand(sharding):
    """MoE, dp 4, ep 2 (edp 2): each expert weight's gradient is reduced over edp out of Megatron's bf16 expert
    buffer: 2 B per element and labelled bf16, as the dense buckets (fp32 without the flag). L=2, h=64, f=256,
    E=4 experts, 2 local: fc1 2 x 64 x 256 = 32,768 elements (65,536 B in bf16), fc2 the same."""
    moe = dict(TINY, bias=False, num_experts=4, expert_parallel_size=2, data_parallel_size=4, sharding=sharding)
    for flag, eb, dt in ((False, 4, "fp32"), (True, 2, "bf16")):
        ops = [o for o in build_gpt_step(TransformerSpec(**moe, grad_reduce_in_bf16=flag)).ops
               if o.name.startswith("edp.grad_")]
        assert len(ops) == 4 and {o.meta["group"] for o in ops} == {"edp"}
        assert [(o.meta["bytes"], o.dtype) for o in ops] == [(eb * 32_768, dt)] * 4
