"""Megatron-LM ``--fp8-param-gather`` (``training.fp8_param_gather``): the block Linear weights are fp8 parameters
(1 B, plus the transpose where fp8 GEMMs are TN-only), the step casts the fp32 master shard to fp8 and the
parameter all-gather moves 1 B per fp8 element. Bytes worked by hand on the tiny model of
``test_megatron_optimizer_kernels``; the bad inputs as Megatron-LM's asserts."""
from __future__ import annotations

import pytest
import yaml

from simulator.graph.builders.sharding import ShardingSpec, fp8_weight_numel
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from tests.conftest import refused_in_one_line
from tests.simulator.graph.test_megatron_optimizer_kernels import TINY

P = 165_120  # TINY's parameters
# the fp8 weights: 2 layers x (qkv 64 x 192 + proj 64 x 64 + fc1 64 x 256 + fc2 256 x 64) = 2 x 49,152
F8 = 98_304
DIST = ShardingSpec(strategy="distributed_optimizer", shard_size=4)


def _graph(**kw):
    return build_gpt_step(TransformerSpec(**{**TINY, "fp8": "hybrid", "data_parallel_size": 4, "sharding": DIST,
                                             **kw}))


def _ops(g) -> dict:
    return {o.name: o for o in g.ops}


def test_fp8_weight_count_by_hand():
    assert fp8_weight_numel(TransformerSpec(**{**TINY, "fp8": "hybrid"})) == F8
    assert fp8_weight_numel(TransformerSpec(**TINY)) == 0


def test_parameters_and_workspace_by_hand():
    before = {t.name: t.nbytes for t in _graph().persistent}
    after = {t.name: t.nbytes for t in _graph(fp8_param_gather=True).persistent}
    assert before["params.bf16"] == 2 * P and sum(v for k, v in before.items() if k.startswith("workspace.")) == 2 * F8
    # bf16 for the rest (66,816 elements: 133,632 B), 1 B per fp8 weight element and 1 B for its transpose
    assert (after["params.bf16"], after["params.fp8"], after["params.fp8_transpose"]) == (133_632, F8, F8)
    assert not any(k.startswith("workspace.") for k in after)
    assert after["fp8.scaling_meta"] == before["fp8.scaling_meta"]  # the same fp8 tensors keep their scaling state
    # Blackwell (the GEMM reads either layout): no transpose
    b = {t.name: t.nbytes for t in _graph(fp8_param_gather=True, fp8_weight_copies=1).persistent}
    assert b["params.fp8"] == F8 and "params.fp8_transpose" not in b


def test_gemms_read_the_fp8_parameter_with_no_weight_cast():
    g = _ops(_graph(fp8_param_gather=True))
    assert not any(n.endswith("fp8_quantize_w") for n in g)
    assert sum(n.endswith("fp8_quantize_w") for n in _ops(_graph())) == 8  # 4 Linears x 2 layers
    gemms = [o for n, o in g.items() if n.endswith(".gemm") and o.dtype == "fp8"]
    assert gemms and all("params.fp8" in o.uses for o in gemms)


def test_step_cast_amax_and_all_gather_by_hand():
    g = _ops(_graph(fp8_param_gather=True))
    # this rank's quarter of the master weights: 16,704 bf16-parameter elements and 24,576 fp8 ones
    copy = g["opt.megatron.copy_main_to_model_params"]
    assert (copy.bytes_read, copy.bytes_written) == (4 * 16_704, 2 * 16_704)
    cast, q = g["opt.megatron.fp8.master_to_bf16"], g["opt.megatron.fp8.quantize_param_shard"]
    assert (cast.bytes_read, cast.bytes_written, cast.allocs[0].nbytes) == (98_304, 49_152, 49_152)
    assert (q.bytes_read, q.bytes_written) == (49_152, 24_576) and cast.id in q.deps
    amax = g["dp.fp8_param_amax.all_reduce"]
    assert (amax.meta["bytes"], amax.meta["group"], amax.dtype) == (32, "dp", "fp32")  # 8 fp8 weights x 4 B
    ag = [o for n, o in g.items() if "megatron.param_all_gather" in n]
    assert sum(o.meta["bytes"] for o in ag) == 2 * P - F8 == 231_936  # 2 B bf16 + 1 B fp8 per element
    assert sum(o.meta["bytes"] for n, o in _ops(_graph()).items() if "megatron.param_all_gather" in n) == 2 * P
    tr = [o for n, o in g.items() if "megatron.fp8_transpose" in n]
    assert sum(o.bytes_read for o in tr) == sum(o.bytes_written for o in tr) == F8
    assert all(set(o.deps) & {a.id for a in ag} for o in tr)  # after its bucket's all-gather
    assert not [n for n in _ops(_graph(fp8_param_gather=True, fp8_weight_copies=1)) if "fp8_transpose" in n]


def test_overlapped_gathers_transpose_before_the_forward_reads_them():
    sh = ShardingSpec(strategy="distributed_optimizer", shard_size=4, overlap_param_gather=True, bucket_elements=40_000)
    g = _graph(fp8_param_gather=True, sharding=sh)
    ops = _ops(g)
    tr = [o for n, o in ops.items() if "megatron.fp8_transpose" in n]
    ag = {o.id: o for n, o in ops.items() if "megatron.param_all_gather" in n}
    assert len(ag) > 1 and sum(o.bytes_written for o in tr) == F8
    assert all(set(o.deps) <= set(ag) and o.deps for o in tr)
    first_gemm = min(o.id for n, o in ops.items() if n.endswith(".gemm") and o.dtype == "fp8")
    assert min(o.id for o in tr) < first_gemm


def test_one_data_parallel_rank_casts_and_transposes_without_collectives():
    spec = TransformerSpec(**{**TINY, "fp8": "hybrid", "fp8_param_gather": True})
    ops = {o.name: o for o in build_gpt_step(spec).ops}
    q = ops["opt.megatron.fp8.quantize_param_shard"]
    assert (q.bytes_read, q.bytes_written) == (2 * F8, F8)
    t = ops["opt.megatron.fp8_transpose"]
    assert (t.bytes_read, t.bytes_written) == (F8, F8) and q.id in t.deps
    assert "dp.fp8_param_amax.all_reduce" not in ops


def test_spec_refuses_it_without_fp8_or_megatrons_optimizer():
    with pytest.raises(ValueError, match="fp8_param_gather needs fp8"):
        TransformerSpec(**{**TINY, "fp8_param_gather": True})
    with pytest.raises(ValueError, match="fp8_param_gather needs fp8"):
        TransformerSpec(**{**TINY, "precision": "amp_fp32_params", "fp8": "hybrid", "fp8_param_gather": True})


SCEN = {"name": "x", "hardware": {"gpu": "h100-sxm-80gb"},
        "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16, "vocab_size": 1000},
        "training": {"micro_batch_size": 2, "precision": "bf16", "fp8": "hybrid", "fp8_param_gather": True},
        "ddp": {"use_distributed_optimizer": True}}


@pytest.mark.parametrize("drop,add,needle", [
    ("fp8", {}, "needs training.fp8"),
    ("ddp", {}, "needs ddp.use_distributed_optimizer: true"),
    (None, {"model": {"num_experts": 4, "add_bias_linear": False}}, "model.num_experts is not modelled yet"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, drop, add, needle):
    d = yaml.safe_load(yaml.safe_dump(SCEN))
    if drop == "fp8":
        del d["training"]["fp8"]
    elif drop == "ddp":
        del d["ddp"]
    for k, v in add.items():
        d[k] = {**d[k], **v}
    err = refused_in_one_line(tmp_path, capsys, d)
    assert "training.fp8_param_gather" in err and needle in err


def test_ddp_spelling_points_to_the_training_key():
    from simulator.config.foreign_keys import FOREIGN_KEY_HINTS
    assert "training.fp8_param_gather: true" in FOREIGN_KEY_HINTS["ddp.fp8_param_gather"]
    assert "training.fp8_param_gather" not in FOREIGN_KEY_HINTS


def test_step_peak_estimate_holds_the_bf16_master_copy_beside_the_main_grads():
    # one micro-batch of 128 tokens: the peak is the step, where quantize_param_shard's bf16 copy of the fp8
    # master shard (2 B x 1/8 of the fp8 weights, 0.30 GB) sits beside the fresh fp32 main grads of the bf16 buffer;
    # without it the estimate was 3.6% under the simulated peak
    from simulator.api import run_scenario
    from simulator.config.loader import load_scenario
    from simulator.studies.memory_estimate import estimate_memory
    from tests.conftest import ROOT
    cfg = load_scenario(ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml", [
        "run.steps=2", "run.warmup_steps=1", "ddp.use_distributed_optimizer=true", "training.precision=bf16",
        "training.fp8=hybrid", "training.fp8_param_gather=true", "ddp.grad_reduce_in_bf16=true",
        "training.micro_batch_size=1", "model.seq_length=128"])
    est = estimate_memory(cfg)
    assert est.peak_device_bytes == pytest.approx(run_scenario(cfg).summary["peak_device_memory_bytes"], rel=1e-4)
    from simulator.api import transformer_spec
    cast = 2 * fp8_weight_numel(transformer_spec(cfg)) / 8
    assert est.stages[0].by_category_bytes["transient"] == pytest.approx(cast)
