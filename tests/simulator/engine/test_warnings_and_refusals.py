"""Summary ``warnings`` and refusals of multi-GPU keys (issue 9 items 10 and 11)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from simulator.cli import format_summary
from simulator.config.errors import ScenarioError
from simulator.config.loader import load_scenario
from simulator.api import run_scenario
from tests.conftest import ROOT

B4 = ROOT / "scenarios/h200/gpt_184m_b4.yaml"


def test_data_parallel_above_one_is_refused_in_one_line():
    r = subprocess.run([sys.executable, "-m", "simulator", "run", str(B4), "--set", "parallelism.data_parallel_size=8"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    line = r.stderr.strip()
    assert "\n" not in line and "parallelism.data_parallel_size" in line
    assert "needs hardware.cluster" in line and "allowed: 1" in line


def test_fitted_h200_run_has_no_warnings():
    s = run_scenario(load_scenario(B4)).summary
    assert s["warnings"] == [] and s["launch_overhead_source"] == "host"


@pytest.mark.filterwarnings("ignore::UserWarning")  # the profile-for-another-GPU notice (once per process)
def test_generic_profile_is_flagged_in_summary_and_text():
    s = run_scenario(load_scenario(B4, ["hardware.gpu=a100-sxm4-80gb"])).summary
    assert s["profile"] == "generic:a100-sxm4-80gb"
    assert any("generic GPU profile 'generic:a100-sxm4-80gb'" in w for w in s["warnings"])
    text = format_summary(s, "b4")
    assert "warning             generic GPU profile" in text


def test_zero_stage_without_offload_warns_that_nothing_is_sharded():
    s = run_scenario(load_scenario(B4, ["zero_optimization.stage=2"])).summary
    assert any(w.startswith("zero_optimization.stage 2 without offload shards nothing") for w in s["warnings"])


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_h100_keeps_the_hosts_dispatch_time():
    """Swapping the GPU keeps the measured host's dispatch time (it used to drop to a generic 10 us,
    predicting an H100 18% faster than the H200 at batch 4: 17.66 vs 21.57 ms)."""
    h200 = run_scenario(load_scenario(B4)).summary
    h100 = run_scenario(load_scenario(B4, ["hardware.gpu=h100-sxm-80gb"])).summary
    assert h100["launch_overhead_source"] == "host"
    # batch 4 is host-bound: with the same host the H100's higher peak cannot make it much faster
    assert h100["step_time_s"] > 0.97 * h200["step_time_s"]


def test_scenario_key_data_parallel_refused_by_loader():
    with pytest.raises(ScenarioError, match="parallelism.data_parallel_size: 2 > 1 needs hardware.cluster"):
        load_scenario(B4, ["parallelism.data_parallel_size=2"])


def test_bf16_on_a_gpu_without_bf16_is_refused_in_one_line():
    """As tf32: V100 has no bf16 tensor cores (was priced at the fp16 rate with a warning)."""
    v100 = ROOT / "scenarios/validation/MLM20-GPT2-1.2B-1xV100.yaml"
    r = subprocess.run([sys.executable, "-m", "simulator", "run", str(v100), "--set", "training.precision=bf16"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert ("training.precision: bf16 needs bf16 tensor cores, which NVIDIA Tesla V100 SXM2 32GB has not "
            "(Ampere and later have them; allowed: fp16, amp_fp32_params, fp32 on this GPU)") in r.stderr


def test_autocast_on_a_gpu_without_bf16_is_fp16_autocast_and_says_so():
    v100 = ROOT / "scenarios/validation/MLM20-GPT2-1.2B-1xV100.yaml"
    w = run_scenario(load_scenario(v100, ["training.precision=amp_fp32_params", "run.steps=2",
                                          "model.num_layers=2"])).summary["warnings"]
    assert any("stands for torch.autocast(fp16) with a GradScaler" in x for x in w)


def test_fp16_on_a_v100_and_sequence_parallel_without_tp():
    from simulator.api import run_scenario
    from simulator.config.loader import load_scenario

    v100 = ROOT / "scenarios/validation/MLM20-GPT2-1.2B-1xV100.yaml"
    w16 = run_scenario(load_scenario(v100, ["run.steps=2", "model.num_layers=2"])).summary  # fp16: runs
    assert w16["step_time_s"] > 0 and not any("bf16" in x for x in w16["warnings"])
    dgx = ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml"
    sp = run_scenario(load_scenario(dgx, ["parallelism.sequence_parallel=true", "run.steps=2", "model.num_layers=2"]))
    assert any("sequence_parallel has no effect" in x for x in sp.summary["warnings"])


def test_tp_not_dividing_the_node_names_tp_not_dp():
    r = subprocess.run([sys.executable, "-m", "simulator", "run", str(ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml"),
                        "--set", "training.precision=bf16", "--set", "parallelism.tensor_model_parallel_size=16"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "tensor_model_parallel_size: 16 must divide the 8 GPUs per node" in r.stderr


def test_a_dataloader_on_a_cluster_flags_the_shared_host(tmp_path):
    """Eight ranks share one host's cores; the folded rank gets all of them: flagged, not silent."""
    p = tmp_path / "dl_dp.yaml"
    p.write_text("name: dl_dp\nhardware: {gpu: h100-sxm-80gb, host: dgx-h100-host, cluster: {preset: dgx-h100}}\n"
                 "model: {num_layers: 2, hidden_size: 1024, num_attention_heads: 16, seq_length: 1024, "
                 "vocab_size: 32768}\ntraining: {micro_batch_size: 8}\n"
                 "dataloader: {num_workers: 2, sample: {bytes: 8200 B, cost: {distribution: constant, mean_s: 6 ms}}}\n"
                 "run: {steps: 3}\n")
    w = run_scenario(load_scenario(p)).summary["warnings"]
    assert any("shared by 8 ranks per node" in x for x in w)


DGX8 = ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml"  # its ddp section sets overlap_grad_reduce: true


@pytest.mark.parametrize("sets,line", [
    (["parallelism.cp_comm_type=a2a"], "parallelism.cp_comm_type a2a has no effect with context_parallel_size 1"),
    (["zero_optimization.overlap_comm=true"], "zero_optimization.overlap_comm true has no effect with stage 0"),
    (["zero_optimization.stage=2", "zero_optimization.overlap_comm=true",
      "zero_optimization.stage3_prefetch_bucket_size=1000"],
     "zero_optimization.stage3_prefetch_bucket_size has no effect with stage 2"),
    (["zero_optimization.stage=1", "ddp.overlap_grad_reduce=false",
      "zero_optimization.stage3_max_live_parameters=10",
      "zero_optimization.stage3_param_persistence_threshold=5"],
     "zero_optimization.stage3_max_live_parameters, stage3_param_persistence_threshold have no effect with stage 1"),
    (["zero_optimization.stage=2", "ddp.overlap_grad_reduce=false", "zero_optimization.overlap_comm=true"],
     ("ddp.overlap_grad_reduce false has no effect with zero_optimization.stage 2: DeepSpeed's "
      "zero_optimization.overlap_comm governs (in force: true)")),
    (["zero_optimization.stage=1"], "ddp.overlap_grad_reduce true has no effect with zero_optimization.stage 1"),
    (["fsdp.forward_prefetch=true"], "fsdp.forward_prefetch true gives the same schedule here as limit_all_gathers"),
    (["parallelism.async_tensor_model_parallel_allreduce=false"],
     "parallelism.async_tensor_model_parallel_allreduce has no effect with tensor_model_parallel_size 1"),
    (["zero_optimization.contiguous_gradients=false"], "zero_optimization.contiguous_gradients has no effect with stage 0"),
    (["activation_checkpointing.host_buffers=reused"],
     "activation_checkpointing.host_buffers reused has no effect without cpu_checkpointing"),
    (["fsdp.sharding_strategy=FULL_SHARD", "training.precision=amp_fp32_params", "training.optimizer.impl=foreach",
      "fsdp.cpu_offload.offload_params=true", "fsdp.cpu_offload.cpu_adam_impl=torch_fused"],
     "training.optimizer.impl foreach has no effect: AdamW runs on the CPU as fsdp.cpu_offload.cpu_adam_impl torch_fused"),
])
def test_settings_without_effect_are_flagged_once(sets, line):
    from simulator.api import ineffective_setting_warnings

    w = ineffective_setting_warnings(load_scenario(DGX8, sets))
    assert len(w) == 1 and w[0].startswith(line), w


@pytest.mark.parametrize("sets", [
    [], ["zero_optimization.stage=3", "training.precision=bf16", "zero_optimization.stage3_prefetch_bucket_size=1000"],
    ["zero_optimization.stage=2", "zero_optimization.overlap_comm=true"],
    ["fsdp.forward_prefetch=true", "fsdp.limit_all_gathers=false"],
    ["parallelism.context_parallel_size=2", "training.precision=bf16", "parallelism.cp_comm_type=a2a"],
    ["parallelism.tensor_model_parallel_size=2", "parallelism.async_tensor_model_parallel_allreduce=false",
     "training.precision=bf16"],
    ["zero_optimization.stage=2", "zero_optimization.overlap_comm=true", "zero_optimization.contiguous_gradients=false"],
    ["fsdp.sharding_strategy=FULL_SHARD", "training.precision=amp_fp32_params", "training.optimizer.impl=foreach",
     "fsdp.cpu_offload.offload_params=true"],
])
def test_settings_with_effect_are_not_flagged(sets):
    from simulator.api import ineffective_setting_warnings

    assert ineffective_setting_warnings(load_scenario(DGX8, sets)) == []


def test_forward_prefetch_with_limit_all_gathers_is_really_the_same_run():
    """The warning's claim: FSDP with limit_all_gathers (default) gives the same step with and without
    forward_prefetch (both a one-unit forward prefetch), and the line reaches the summary."""
    fast = ["run.steps=2", "run.warmup_steps=1", "model.num_layers=2"]
    on = run_scenario(load_scenario(DGX8, [*fast, "fsdp.forward_prefetch=true"])).summary
    off = run_scenario(load_scenario(DGX8, [*fast, "fsdp.forward_prefetch=false"])).summary
    assert on["step_time_s"] == off["step_time_s"]
    assert sum("fsdp.forward_prefetch true gives the same schedule" in x for x in on["warnings"]) == 1
    assert not any("forward_prefetch" in x for x in off["warnings"])


def test_pageable_copies_without_a_pageable_rate_are_flagged():
    """ZeRO-Offload with DeepSpeed's default pin_memory false on a DGX H100 (PCIe Gen5 preset: no pageable rate
    for that host): priced at the pinned rate, and the run says so; the measured H200 host has the rates."""
    from simulator.api import run_warnings
    from simulator.config.loader import resolve_hardware

    sets = ["training.precision=bf16", "zero_optimization.stage=2", "zero_optimization.offload_optimizer.device=cpu"]
    cfg = load_scenario(ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml", sets)
    w = [x for x in run_warnings(resolve_hardware(cfg), cfg) if "pageable" in x]
    assert len(w) == 1 and w[0].startswith("zero_optimization.offload_optimizer.pin_memory false copies")
    pinned = load_scenario(ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml",
                           sets + ["zero_optimization.offload_optimizer.pin_memory=true"])
    assert not [x for x in run_warnings(resolve_hardware(pinned), pinned) if "pageable" in x]
    h200 = load_scenario(ROOT / "scenarios/h200/gpt_184m_b16_offload_serial.yaml",
                         ["zero_optimization.offload_optimizer.pin_memory=false"])
    assert not [x for x in run_warnings(resolve_hardware(h200), h200) if "pageable" in x]


NVME = ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_zero3_nvme.yaml"  # 50,331,648 parameters per block
UNIT = 50_331_648


@pytest.mark.parametrize("sets,head,fix", [
    ([], "stage3_prefetch_bucket_size 50,000,000 elements holds less than one block's 50,331,648 parameters",
     "(stage3_prefetch_bucket_size of at least 50,331,648 gives the other bound)"),
    ([f"zero_optimization.stage3_prefetch_bucket_size={UNIT}", "zero_optimization.stage3_max_live_parameters=60000000"],
     "stage3_max_live_parameters 60,000,000 holds less than two blocks' 100,663,296 (the one in use and the one "
     "fetched ahead)", "(stage3_max_live_parameters of at least 100,663,296 gives the other bound)"),
])
def test_no_prefetch_names_the_key_that_stops_it(sets, head, fix):
    """ZeRO-3 prefetches no block when one does not fit the bucket or two the live limit
    (``sharding.zero3_prefetch_depth``): the warning names the key that stops it, not both. Before, it read
    "bucket (or stage3_max_live_parameters 1,000,000,000) holds less than one block" whichever it was."""
    from simulator.api import run_warnings
    from simulator.config.loader import resolve_hardware

    cfg = load_scenario(NVME, sets)
    got = [w for w in run_warnings(resolve_hardware(cfg), cfg) if "no block is prefetched" in w]
    assert len(got) == 1, got
    assert got[0].split(": prefetch is modelled", 1)[0] == "zero_optimization." + head
    assert got[0].endswith(fix)
