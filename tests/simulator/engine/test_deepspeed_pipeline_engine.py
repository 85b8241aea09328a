"""DeepSpeed's pipeline engine (``PipelineEngine``) settings that run differently there than a plain reading suggests
(issue 11): overlap_comm is turned off under a pipeline, ``data_types.grad_accum_dtype`` (BF16_Optimizer) is refused
with a hint, and ZeRO stage 0 with bf16 runs BF16_Optimizer (graph/builders/bf16_optimizer.py), not Megatron's DDP."""

from __future__ import annotations

import pytest

from simulator.api import build_graph, run_scenario, transformer_spec
from simulator.config.errors import ScenarioError
from simulator.config.loader import load_scenario
from tests.conftest import ROOT

PP = ROOT / "scenarios/cluster/gpt_16x2048_pp4_dp2_dgx_h100.yaml"
#: 2 stages x 4 replicas on one DGX H100, 4 small blocks, 2 micro-batches per replica
SMALL = ["parallelism.pipeline_model_parallel_size=2", "model.num_layers=4", "model.hidden_size=512",
         "model.num_attention_heads=8", "model.seq_length=256", "model.vocab_size=8192", "training.micro_batch_size=2",
         "training.global_batch_size=16", "run.steps=2", "run.warmup_steps=1"]
R = 3_000_000  # reduce_bucket_size: one IPG buffer is R x 2 B = 6,000,000 B in bf16
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # the profile-for-another-GPU notice


def _z1(overlap: bool) -> list[str]:
    return SMALL + ["zero_optimization.stage=1", f"zero_optimization.reduce_bucket_size={R}",
                    f"zero_optimization.overlap_comm={str(overlap).lower()}"]


def test_overlap_comm_is_off_under_a_pipeline_as_deepspeed_turns_it_off():
    """deepspeedai/DeepSpeed@007cca6a ``deepspeed/runtime/engine.py`` ``_configure_zero_optimizer``: with a
    ``PipelineModule`` overlap_comm is set to False ("Pipeline parallelism does not support overlapped communication,
    will be disabled."). So the last stage (which runs its backward through ``DeepSpeedEngine.backward``) holds one
    IPG buffer, not the double buffer of overlap_comm: the builder's spec says (1 buffer, allocated by the backward),
    the peak is the same as with overlap_comm false (it was 2 x R x 2 = 12,000,000 B, one buffer = 6,000,000 B more),
    and the run says why."""
    on, off = (load_scenario(PP, _z1(v)) for v in (True, False))
    spec = transformer_spec(on, pipeline_rank=1)
    assert spec.zero_ipg == (1, False) and spec.overlap_grad_reduce is False
    assert spec.zero_ipg == transformer_spec(off, pipeline_rank=1).zero_ipg
    s_on, s_off = run_scenario(on).summary, run_scenario(off).summary
    assert s_on["peak_memory_bytes"] == s_off["peak_memory_bytes"]
    assert s_on["step_time_s"] == s_off["step_time_s"]
    assert any(w.startswith("zero_optimization.overlap_comm true has no effect with pipeline_model_parallel_size 2")
               for w in s_on["warnings"])


def test_overlap_comm_still_doubles_the_ipg_buffer_without_a_pipeline():
    """Without a pipeline overlap_comm keeps its two IPG buffers (``DeepSpeedZeroOptimizer.backward``)."""
    cfg = load_scenario(PP, [k for k in _z1(True) if not k.startswith("parallelism.pipeline")]
                        + ["parallelism.pipeline_model_parallel_size=1"])
    assert transformer_spec(cfg).zero_ipg == (2, False)


def test_grad_accum_dtype_is_refused_naming_bf16_optimizer(tmp_path):
    """``data_types.grad_accum_dtype: fp32`` with bf16 and ZeRO-1 makes DeepSpeed build BF16_Optimizer
    (``_do_optimizer_sanity_check``), which is not built: the key is refused with a hint that says so."""
    y = tmp_path / "s.yaml"
    y.write_text(PP.read_text() + "data_types: {grad_accum_dtype: fp32}\n")
    with pytest.raises(ScenarioError, match=r"data_types: unknown key .*BF16_Optimizer .* remove it"):
        load_scenario(y)


def test_explicit_zero_stage_0_with_a_pipeline_and_bf16_runs_bf16_optimizer(tmp_path):
    """A DeepSpeed config with ``zero_optimization: {stage: 0}``, bf16 and a pipeline runs BF16_Optimizer in
    DeepSpeed (ZeRO off, model and accumulation dtype bf16, a PipelineModule -> BFLOAT16): its states and its one
    bf16 all-reduce are built in place of Megatron-LM's DDP (no fp32 grad buffer, no bucketed all-reduces), no
    longer flagged, and the peak is lower (fp32 master and moments partitioned over dp, bf16 gradients). Without a
    zero_optimization section (a Megatron-LM run) Megatron's DDP as before."""
    y = tmp_path / "s.yaml"
    y.write_text(PP.read_text() + "zero_optimization: {stage: 0}\n")
    ds, meg = load_scenario(y, SMALL), load_scenario(PP, SMALL)
    assert transformer_spec(ds).deepspeed_bf16_optimizer and not transformer_spec(meg).deepspeed_bf16_optimizer
    names = [o.name for o in build_graph(ds).ops]
    assert "bf16opt.grad_all_reduce" in names and not any(n.startswith("ddp.grad_all_reduce") for n in names)
    assert not any("megatron." in n for n in names)
    r_ds, r_meg = run_scenario(ds).summary, run_scenario(meg).summary
    # no flag of BF16_Optimizer itself (the ddp keys it does not read are named: test_bf16_optimizer_label.py)
    assert not any("BF16_Optimizer" in w for w in r_ds["warnings"] + r_meg["warnings"] if not w.startswith("ddp."))
    spec = transformer_spec(ds)  # stage 0 holds the peak in both
    P, dp = spec.rank_num_parameters, spec.data_parallel_size
    states = {t.name: t.nbytes for t in build_graph(ds).persistent}
    assert states["grad.bf16_optimizer.hp_flat"] == 2 * P and states["params.master_fp32"] == 4 * -(-P // dp)
    assert r_ds["peak_memory_bytes"] < r_meg["peak_memory_bytes"]


@pytest.mark.parametrize("extra,what", [(["parallelism.virtual_pipeline_model_parallel_size=2"],
                                         "pipeline_schedule interleaved_1f1b"),
                                        (["parallelism.pipeline_schedule=zero_bubble_h1"],
                                         "pipeline_schedule zero_bubble_h1")])
def test_bf16_optimizer_outside_deepspeeds_pipeline_schedules_is_refused(tmp_path, extra, what):
    """DeepSpeed's pipeline engine has one schedule (1F1B-like TrainSchedule): BF16_Optimizer with an interleaved
    or split-backward schedule is refused in one line naming the key."""
    y = tmp_path / "s.yaml"
    y.write_text(PP.read_text() + "zero_optimization: {stage: 0}\n")
    with pytest.raises(ScenarioError, match=rf"zero_optimization.stage: 0 with bf16 .*BF16_Optimizer.* {what}"):
        load_scenario(y, SMALL + ["training.global_batch_size=32"] + extra)
