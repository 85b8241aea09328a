"""``training.optimizer.impl: single``: the per-tensor AdamW loop (``torch.optim.AdamW(foreach=False)``,
Composer's ``DecoupledAdamW`` that llm-foundry's ``decoupled_adamw`` runs), eight unfused elementwise kernels
over fp32 tensors, against the fused kernel; worked out by hand on a tiny model, and bad input."""

from __future__ import annotations

import pytest

from hardware_models.host_kernels import adamw_passes
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.ops import CostClass, Phase
from tests.conftest import refused_in_one_line

TINY = dict(num_layers=1, hidden_size=8, num_attention_heads=4, seq_length=4, vocab_size=16, ffn_hidden_size=32,
            micro_batch_size=2)


def _opt_kernels(**kw):
    g = build_gpt_step(TransformerSpec(**{**TINY, **kw}))
    return g, [op for op in g.ops if op.phase == Phase.OPT and op.cost_class == CostClass.OPTIMIZER]


def test_single_is_eight_chained_passes_of_80_bytes_per_parameter():
    """Per fp32 element (bytes read / written): mul_ weight decay 4/4, lerp_ exp_avg 8/4, mul_ exp_avg_sq 4/4,
    addcmul_ 8/4, sqrt 4/4 (fresh), div 4/4 (fresh), add_ eps 4/4, addcdiv_ params 12/4: 48 read + 32 written."""
    g, ops = _opt_kernels(optimizer_impl="single")
    P = TransformerSpec(**TINY).num_parameters
    assert [op.name for op in ops] == ["opt.adamw.0.mul_", "opt.adamw.1.lerp_", "opt.adamw.2.mul_",
                                       "opt.adamw.3.addcmul_", "opt.adamw.4.sqrt", "opt.adamw.5.div",
                                       "opt.adamw.6.add_", "opt.adamw.7.addcdiv_"]
    assert [(op.bytes_read / P, op.bytes_written / P) for op in ops] == [
        (4, 4), (8, 4), (4, 4), (8, 4), (4, 4), (4, 4), (4, 4), (12, 4)]
    assert sum(op.bytes_read + op.bytes_written for op in ops) == 80 * P
    assert sum(p.bytes for p in adamw_passes("torch_single")) == 80  # the same passes as the CPU's for-loop
    for prev, op in zip(ops, ops[1:]):  # one after the other on the stream
        assert prev.id in op.deps
    assert all(op.dtype == "fp32" for op in ops)


def test_foreach_is_the_eight_multi_tensor_passes_in_place():
    """torch's ``_multi_tensor_adamw`` (``foreach=True``, PyTorch's default on CUDA): the same eight passes as the
    per-tensor loop, 80 bytes per fp32 element, the sqrt into a new list and the div in place (was one 28-byte
    kernel, as if fused)."""
    _, ops = _opt_kernels(optimizer_impl="foreach")
    P = TransformerSpec(**TINY).num_parameters
    assert [op.name for op in ops] == ["opt.adamw.0.mul_", "opt.adamw.1.lerp_", "opt.adamw.2.mul_",
                                       "opt.adamw.3.addcmul_", "opt.adamw.4.sqrt", "opt.adamw.5.div",
                                       "opt.adamw.6.add_", "opt.adamw.7.addcdiv_"]
    assert sum(op.bytes_read + op.bytes_written for op in ops) == 80 * P


def test_fused_is_one_kernel_of_28_bytes_per_parameter():
    _, ops = _opt_kernels(optimizer_impl="fused")
    P = TransformerSpec(**TINY).num_parameters
    assert [(op.name, op.bytes_read, op.bytes_written) for op in ops] == [("opt.adamw", 16 * P, 12 * P)]


def test_single_prices_80_over_28_of_the_fused_step_on_the_mpt_fsdp_case():
    """The MPT-7B FSDP scenario (8 ranks, one 1/8 fp32 shard each, 832,357,376 parameters): the optimizer phase
    of the per-tensor loop is 80 / 28 of the fused kernel's at the profile's optimizer bandwidth, plus 7 more
    kernels' fixed time (without the yaml's gradient clipping, whose norm and mul_ run in the same phase)."""
    from simulator.api import run_scenario
    from simulator.config.loader import load_scenario
    from tests.conftest import ROOT

    path = ROOT / "scenarios/validation/MOSAIC-MPT7B-8xH100-noAC.yaml"
    cfg = load_scenario(path, overrides=["training.clip_grad=0"])
    assert cfg.training.optimizer.impl == "single"  # Composer DecoupledAdamW (mpt-7b.yaml decoupled_adamw)
    single = run_scenario(cfg).summary["phase_s"]["opt_s"]
    fused = run_scenario(load_scenario(path, overrides=["training.clip_grad=0", "training.optimizer.impl=fused"])
                         ).summary["phase_s"]["opt_s"]
    share = 6_658_859_008 / 8
    # h100-sxm-80gb.yaml memory_bandwidth_bytes_per_s.optimizer, an H200 rate scaled by the HBM peaks 3.35 / 4.8
    bw = 4_133_973_795_831.095 * 3.35 / 4.8
    assert fused == pytest.approx(28 * share / bw, rel=1e-3)
    assert single == pytest.approx(80 * share / bw, rel=1e-3)


def test_fsdp_cpu_offload_with_single_steps_the_cpu_shards_with_torch_single():
    from simulator.config.sections.fsdp import FsdpConfig

    assert FsdpConfig(cpu_offload=True).cpu_adam_impl("single") == "torch_single"


BASE = {
    "name": "single",
    "hardware": {"gpu": "h100-sxm-80gb"},
    "model": {"num_layers": 2, "hidden_size": 512, "num_attention_heads": 8, "seq_length": 512, "vocab_size": 1000},
    "training": {"micro_batch_size": 1, "precision": "bf16", "optimizer": {"impl": "single"}},
    "run": {"steps": 2, "warmup_steps": 1},
}


@pytest.mark.parametrize("impl", ["single", "foreach"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_unfused_with_half_parameters_is_refused_in_one_line(tmp_path, capsys, precision, impl):
    training = {**BASE["training"], "precision": precision, "optimizer": {"impl": impl}}
    err = refused_in_one_line(tmp_path, capsys, {**BASE, "training": training})
    assert (f"training.optimizer.impl: {impl} needs fp32 parameters (allowed training.precision: amp_fp32_params, "
            f"fp32, tf32; got {precision})") in err, err


@pytest.mark.parametrize("impl,per", [("single", "8 per parameter tensor"), ("foreach", "8 per multi-tensor-apply chunk")])
def test_unfused_optimizer_launches_not_counted_is_flagged(impl, per):
    from simulator.api import run_warnings, resolve_hardware
    from simulator.config.loader import scenario_from_dict

    cfg = scenario_from_dict({**BASE, "training": {**BASE["training"], "precision": "amp_fp32_params",
                                                   "optimizer": {"impl": impl}}})
    w = [x for x in run_warnings(resolve_hardware(cfg), cfg) if x.startswith("training.optimizer.impl")]
    assert len(w) == 1 and f"their kernel launches ({per}) are not counted" in w[0], w
    fused = scenario_from_dict({**BASE, "training": {**BASE["training"], "optimizer": {"impl": "fused"}}})
    assert not any(x.startswith("training.optimizer.impl") for x in run_warnings(resolve_hardware(fused), fused))
