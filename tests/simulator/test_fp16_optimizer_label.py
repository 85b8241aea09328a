"""A DeepSpeed config with ZeRO stage 0 and fp16, or bf16 without a pipeline, runs under DeepSpeed's ``FP16_Optimizer``
(deepspeedai/DeepSpeed@007cca6a deepspeed/runtime/engine.py ``_do_optimizer_sanity_check``: ``FP16`` /
``DDP_BFLOAT16``), now built (``graph/builders/fp16_optimizer.py``): the run names it (summary
``data_parallel_strategy``, the parallel line) and no longer says it prices Megatron-LM's DDP instead; the ``ddp``
bucket keys it does not read are warned; what it is not modelled with is refused in one line."""

from __future__ import annotations

import pytest

from simulator.api import build_graph, data_parallel_strategy, ineffective_setting_warnings, run_scenario
from simulator.cli import main
from simulator.config.errors import ScenarioError
from simulator.config.loader import load_scenario
from tests.conftest import ROOT

DP8 = ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml"  # ddp {bucket_cap_mb: 25 (the default), overlap_grad_reduce} given
PP2 = ROOT / "scenarios/cluster/gpt_16x2048_pp4_dp2_dgx_h100.yaml"
SMALL = ["model.num_layers=2", "model.hidden_size=256", "model.num_attention_heads=4", "model.seq_length=128",
         "model.vocab_size=4096", "training.micro_batch_size=2", "run.steps=2", "run.warmup_steps=1"]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # the profile-for-another-GPU notice


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_zero0_16bit_without_pipeline_runs_fp16_optimizer_and_says_so(precision, capsys):
    cfg = load_scenario(DP8, [*SMALL, "zero_optimization={stage: 0}", f"training.precision={precision}"])
    s = run_scenario(cfg).summary
    assert s["data_parallel_strategy"] == data_parallel_strategy(cfg) == "DeepSpeed FP16_Optimizer"
    assert not [w for w in s["warnings"] if "not modelled" in w and "FP16_Optimizer" in w]
    assert not [w for w in s["warnings"] if "priced as Megatron-LM's DDP" in w]
    names = [o.name for o in build_graph(cfg).ops]
    assert "fp16opt.grad_all_reduce.0" in names and not any(n.startswith("ddp.grad_all_reduce") for n in names)
    lines = [w for w in ineffective_setting_warnings(cfg) if w.startswith("ddp.")]
    # the pasted default bucket_cap_mb 25 asks for nothing: only overlap_grad_reduce true, which does not run, is named
    assert [w.split(" has no effect with ")[0] for w in lines] == ["ddp.overlap_grad_reduce true"]
    assert all("DeepSpeed FP16_Optimizer" in w for w in lines)
    main(["run", str(DP8), *sum((["--set", o] for o in [*SMALL, "zero_optimization={stage: 0}",
                                                         f"training.precision={precision}"]), [])])
    out = capsys.readouterr().out
    assert [ln for ln in out.splitlines() if ln.startswith("parallel ")][0].endswith(
        "DeepSpeed FP16_Optimizer: fp32 master weights and optimizer state replicated, 16-bit gradients all-reduced "
        "over the data-parallel ranks")


@pytest.mark.parametrize("path,overrides,strategy", [
    (DP8, ["training.precision=fp16"], "DDP"),  # no DeepSpeed section: Megatron-LM's DDP is what runs
    (DP8, ["zero_optimization={stage: 1}", "training.precision=fp16"], "DeepSpeed ZeRO-1"),
    (PP2, ["zero_optimization={stage: 0}", "training.precision=bf16"], "DeepSpeed BF16_Optimizer"),
    (PP2, ["zero_optimization={stage: 0}", "training.precision=fp16"], "DeepSpeed FP16_Optimizer"),  # fp16 pipeline
])
def test_the_wrapper_deepspeed_picks_is_named(path, overrides, strategy):
    assert data_parallel_strategy(load_scenario(path, overrides)) == strategy


@pytest.mark.parametrize("extra,what", [
    (["model.num_experts=4"], "model.num_experts"),
    (["parallelism.context_parallel_size=2", "parallelism.data_parallel_size=4"], "context_parallel_size 2"),
])
def test_what_fp16_optimizer_is_not_modelled_with_is_refused_in_one_line(extra, what):
    with pytest.raises(ScenarioError, match=rf"zero_optimization.stage: 0 with training.precision fp16 is "
                                            rf"DeepSpeed's FP16_Optimizer, which is not modelled with {what}"):
        load_scenario(DP8, ["zero_optimization={stage: 0}", "training.precision=fp16", *extra])


def test_a_megatron_runs_resolved_config_stays_megatron():
    """The resolved config (``SimulationResult.config``, ``config.resolved.yaml``) of a Megatron-LM bf16 run carries
    no zero_optimization section (``api.resolved_config``): re-run, it is the same DDP, not FP16_Optimizer."""
    from simulator.config.loader import scenario_from_dict

    cfg = load_scenario(DP8, [*SMALL, "training.precision=bf16"])
    again = scenario_from_dict(run_scenario(cfg).config)
    assert data_parallel_strategy(cfg) == data_parallel_strategy(again) == "DDP"
    ds = load_scenario(DP8, [*SMALL, "training.precision=bf16", "zero_optimization={stage: 0}"])
    assert data_parallel_strategy(scenario_from_dict(run_scenario(ds).config)) == "DeepSpeed FP16_Optimizer"


@pytest.mark.parametrize("path,dump", [(DP8, {}), (DP8, {"mode": "json"}), (DP8, {"exclude_none": True}),
                                       (PP2, {}), (PP2, {"mode": "json", "exclude_none": True})])
def test_every_dump_of_a_megatron_run_reloads_as_megatron(path, dump):
    """Any ``model_dump`` of a bf16 run without a zero_optimization section leaves the section out
    (``ScenarioConfig._dump_without_unwritten_deepspeed``): reloaded, a data-parallel run is DDP, not FP16_Optimizer,
    and a pipeline is Megatron's, not BF16_Optimizer; a DeepSpeed run's dump keeps its section."""
    from simulator.config.loader import scenario_from_dict

    cfg = load_scenario(path, ["training.precision=bf16"])
    assert "zero_optimization" not in cfg.model_dump(**dump)
    assert data_parallel_strategy(scenario_from_dict(cfg.model_dump(**dump))) == data_parallel_strategy(cfg)
    ds = load_scenario(path, ["training.precision=bf16", "zero_optimization={stage: 0}"])
    assert data_parallel_strategy(scenario_from_dict(ds.model_dump(**dump))) == data_parallel_strategy(ds) == (
        "DeepSpeed FP16_Optimizer" if path == DP8 else "DeepSpeed BF16_Optimizer")


def test_megatrons_grad_buffer_keys_are_warned_under_fp16_optimizer():
    """ddp.accumulate_allreduce_grads_in_fp32 / grad_reduce_in_bf16 shape Megatron-LM's grad buffer, which
    FP16_Optimizer does not keep: one line names both (the run is the same without them)."""
    cfg = load_scenario(DP8, [*SMALL, "zero_optimization={stage: 0}", "training.precision=bf16",
                              "ddp.grad_reduce_in_bf16=true", "ddp.accumulate_allreduce_grads_in_fp32=true"])
    lines = [w for w in ineffective_setting_warnings(cfg) if "grad_reduce_in_bf16" in w]
    assert lines == ["ddp.accumulate_allreduce_grads_in_fp32, ddp.grad_reduce_in_bf16 have no effect with DeepSpeed "
                     "FP16_Optimizer: Megatron-LM's grad buffer is not used (DeepSpeed keeps the .grad in the model "
                     "dtype, training.precision bf16)"]
    plain = load_scenario(DP8, [*SMALL, "zero_optimization={stage: 0}", "training.precision=bf16"])
    assert [o.name for o in build_graph(cfg).ops] == [o.name for o in build_graph(plain).ops]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_megatrons_distributed_optimizer_beside_a_stage0_deepspeed_config_is_refused(precision):
    """A zero_optimization section at stage 0 with 16-bit training is DeepSpeed's FP16_Optimizer; Megatron-DeepSpeed
    builds no distributed optimizer under --deepspeed (microsoft/Megatron-DeepSpeed@8fd352da
    megatron/optimizer/__init__.py get_megatron_optimizer: ``if args.deepspeed: return optimizer``), so
    ddp.use_distributed_optimizer beside it is refused in one line, as beside BF16_Optimizer (it ran Megatron's
    distributed optimizer without a word)."""
    with pytest.raises(ScenarioError, match=r"ddp.use_distributed_optimizer: Megatron-LM's optimizer, but "
                                            rf"zero_optimization stage 0 with {precision} runs DeepSpeed's "
                                            r"FP16_Optimizer .*allowed: omit it, or no zero_optimization section"):
        load_scenario(DP8, ["zero_optimization={stage: 0}", f"training.precision={precision}",
                            "ddp.use_distributed_optimizer=true"])
    assert data_parallel_strategy(load_scenario(DP8, [f"training.precision={precision}",
                                                      "ddp.use_distributed_optimizer=true"])) == (
        "Megatron distributed optimizer")  # no DeepSpeed section: Megatron-LM's, as before


@pytest.mark.parametrize("path,extra,owner", [
    (DP8, [*SMALL, "training.precision=fp16"], "DeepSpeed FP16_Optimizer: the engine's all-reduces of 500M-element "
                                               "buckets"),
    (PP2, ["training.precision=bf16"], "DeepSpeed BF16_Optimizer: one all-reduce of the whole gradient buffer"),
    (DP8, [*SMALL, "training.precision=fp32", "model.attention_backend=unfused"], "DeepSpeed ZeRO off: ddp's buckets"),
])
def test_zero_bucket_sizes_at_stage_0_are_named(path, extra, owner):
    """A pasted ds_config at stage 0 with reduce_bucket_size / allgather_bucket_size: DeepSpeed's engine all-reduces
    in MEMORY_OPT_ALLREDUCE_SIZE buckets whatever they are (deepspeedai/DeepSpeed@007cca6a deepspeed/runtime/engine.py
    ``_backward_epilogue``: ``self.allreduce_gradients()`` with its default bucket_size; both keys are read by the
    ZeRO optimizers only), and the graph is the same without them: one line names both."""
    z = "zero_optimization={stage: 0, reduce_bucket_size: 1000, allgather_bucket_size: 1000}"
    cfg = load_scenario(path, [*extra, z])
    lines = [w for w in ineffective_setting_warnings(cfg) if "bucket_size" in w and w.startswith("zero_optimization")]
    assert len(lines) == 1 and lines[0].startswith(
        "zero_optimization.reduce_bucket_size, zero_optimization.allgather_bucket_size have no effect with stage 0 ("
        + owner), lines
    plain = load_scenario(path, [*extra, "zero_optimization={stage: 0}"])
    assert [(o.name, o.bytes_read) for o in build_graph(cfg).ops] == [(o.name, o.bytes_read) for o in build_graph(plain).ops]
