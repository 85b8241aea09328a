"""ZeRO-Infinity NVMe offload (``simulator/policies/offload_nvme.py``), worked by hand.

Model: 2 blocks, hidden 1024, vocab 32768, seq 512: P parameters (59.3M), on one DGX H100 (dp 8: shard =
ceil(P / 8) elements per rank) or on one GPU (shard = P).

Bytes per step and rank, optimizer on NVMe (DeepSpeed stage3.py / partitioned_optimizer_swapper.py):
backward writes the fp32 gradient partition (4 B/element); the step reads fp32 master weights, exp_avg,
exp_avg_sq and the gradient (16 B) and writes the three states back (12 B): read 16 shard, write 16 shard.
Parameters on NVMe add, per step, a read of every fetched partition (forward and backward: 2 x 2 B x shard)
and the write of the updated 16-bit partition (2 B x shard).
"""

from __future__ import annotations

import pytest

from simulator import load_scenario, run_scenario
from simulator.api import transformer_spec
from simulator.cli import main
from tests.simulator.policies.test_offload_shared_host import DP8

Z3_NVME = DP8.replace("name: off_dp8", "name: z3_nvme_dp8").replace("stage: 2", "stage: 3").replace(
    "offload_optimizer: {device: cpu, pin_memory: true, cpu_adam_impl: deepspeed_cpu_adam}",
    "offload_optimizer: {device: nvme, nvme_path: /local_nvme, pin_memory: true}")

#: one GPU, one slow drive of its own: 0.1 GB/s read, 0.05 GB/s write, no request latency (NVMe-bound)
ONE_GPU_SLOW = """name: nvme_one_gpu_slow
hardware:
  gpu: h100-sxm-80gb
  host: dgx-h100-host
  nvme: {storage: {name: slow, read_bandwidth_bytes_per_s: 0.1 GB/s, write_bandwidth_bytes_per_s: 0.05 GB/s}, drives: 1}
model: {num_layers: 2, hidden_size: 1024, num_attention_heads: 16, seq_length: 512, vocab_size: 32768}
training: {micro_batch_size: 2, precision: bf16}
zero_optimization:
  stage: 3
  offload_optimizer: {device: nvme, nvme_path: /local_nvme, pin_memory: true}
run: {steps: 2, warmup_steps: 1}
"""


def _cfg(tmp_path, text, overrides=()):
    p = tmp_path / "s.yaml"
    p.write_text(text)
    return load_scenario(p, list(overrides))


def test_swap_bytes_per_step_by_hand(tmp_path):
    cfg = _cfg(tmp_path, Z3_NVME)
    shard = -(-transformer_spec(cfg).num_parameters // 8)
    s = run_scenario(cfg).summary
    assert s["oom"] is None
    assert s["nvme_read_bytes_per_step"] == 16 * shard and s["nvme_write_bytes_per_step"] == 16 * shard
    # the node's 8 ranks alone on 8 x PM1733 (56.0 GB/s read, 30.4 GB/s write; the upstream links, 126 GB/s, do not bind)
    assert s["nvme_bound_s"] == pytest.approx(8 * (16 * shard / 56.0e9 + 16 * shard / 30.4e9), rel=1e-12)
    assert s["nvme_busy_s"] >= s["nvme_bound_s"] * (1 - 1e-9)  # one rank's share of the array: never faster
    assert any(w.startswith("NVMe offload: 8 x Samsung PM1733") for w in s["warnings"])
    p = run_scenario(_cfg(tmp_path, Z3_NVME, ["zero_optimization.offload_param.device=nvme",
                                              "zero_optimization.offload_param.nvme_path=/local_nvme"])).summary
    # + the forward and backward fetches: each unit's ceil(bytes / 8) partition, about 2 x 2 B x shard
    assert p["nvme_read_bytes_per_step"] == pytest.approx(16 * shard + 2 * 2 * shard, rel=1e-3)
    assert p["nvme_write_bytes_per_step"] == 16 * shard + 2 * shard  # + the updated 16-bit partition


def test_nvme_bound_step_time_by_hand(tmp_path):
    """One GPU, one slow drive: the step is the drive's time, 16 P / 0.1 GB/s + 16 P / 0.05 GB/s (28.5 s), plus at
    most the same step's GPU and CPU work, which is what the CPU-offload step takes (under 0.1 s)."""
    cfg = _cfg(tmp_path, ONE_GPU_SLOW)
    P = transformer_spec(cfg).num_parameters
    bound = 16 * P / 0.1e9 + 16 * P / 0.05e9
    s = run_scenario(cfg).summary
    cpu = run_scenario(_cfg(tmp_path, ONE_GPU_SLOW, ["zero_optimization.offload_optimizer.device=cpu"])).summary
    assert s["nvme_read_bytes_per_step"] == 16 * P and s["nvme_bound_s"] == pytest.approx(bound, rel=1e-12)
    assert bound <= s["step_time_s"] <= bound + cpu["step_time_s"]
    assert s["step_time_s"] == pytest.approx(bound, rel=5e-3)


def test_host_memory_holds_only_the_swap_buffers(tmp_path):
    """Pinned per rank: the 16-bit staging partition (2 B x shard) + 4 swap buffers of one sub-group (4 x 4 B x
    sub_group_size), not the 16 B x shard of CPU offload; with a 0.5 GB host, CPU offload of the node's 8 ranks
    (8 x 16 B x 7.4M = 0.95 GB) is out of host memory, NVMe offload with 1M-element sub-groups fits."""
    over = ["zero_optimization.sub_group_size=1000000"]
    cfg = _cfg(tmp_path, Z3_NVME, over)
    shard = -(-transformer_spec(cfg).num_parameters // 8)
    s = run_scenario(cfg).summary
    assert s["peak_host_pinned_bytes"] == 2 * shard + 4 * 4 * 1_000_000
    small = ["hardware.host.overrides.memory.capacity_bytes=0.5 GB"]
    assert run_scenario(_cfg(tmp_path, Z3_NVME, over + small)).summary["oom"] is None
    cpu = run_scenario(_cfg(tmp_path, Z3_NVME, small + ["zero_optimization.offload_optimizer.device=cpu"])).summary
    assert cpu["oom"] is not None and "host" in cpu["oom"]
    p = run_scenario(_cfg(tmp_path, Z3_NVME, over + ["zero_optimization.offload_param.device=nvme",
                                                     "zero_optimization.offload_param.nvme_path=/x"])).summary
    assert p["peak_host_pinned_bytes"] == 4 * 4 * 1_000_000 + 5 * 100_000_000 * 2  # + the parameter swap buffers


def test_sub_groups_swap_in_order_and_pipelining_overlaps_them(tmp_path):
    """4 sub-groups: without pipelining each swap-in starts after the previous swap-out ended; with pipeline_read
    the next swap-in runs while this sub-group steps; pipelined is never slower."""
    cfg0 = _cfg(tmp_path, Z3_NVME)
    sub = -(-(-(-transformer_spec(cfg0).num_parameters // 8)) // 4)
    base = [f"zero_optimization.sub_group_size={sub}", "zero_optimization.offload_optimizer.buffer_count=12"]
    serial = run_scenario(_cfg(tmp_path, Z3_NVME, base))
    piped = run_scenario(_cfg(tmp_path, Z3_NVME, base + ["zero_optimization.offload_optimizer.pipeline_read=true",
                                                         "zero_optimization.offload_optimizer.pipeline_write=true"]))
    for res, pipelined in ((serial, False), (piped, True)):
        sp = res.spans[res.spans.step == res.spans.step.max()].set_index("name")
        for k in range(1, 4):
            start_in = sp.loc[f"nvme.swap_in.sub_group{k}", "start_s"]
            if pipelined:
                adam_prev = res.spans[(res.spans.step == res.spans.step.max()) & (res.spans.name == "cpu.adam")]
                assert start_in < sorted(adam_prev.end_s)[k - 1]
            else:
                assert start_in >= sp.loc[f"nvme.swap_out.sub_group{k - 1}", "end_s"] - 1e-12
    assert piped.summary["step_time_s"] <= serial.summary["step_time_s"] * (1 + 1e-9)


def test_a_pasted_zero_infinity_block_runs(tmp_path):
    """DeepSpeedExamples@7d936b3 Megatron-LM-v1.1.5-ZeRO3/examples/ds_zero_stage_infinity_config.json's keys (but
    stage3_max_reuse_distance, not modelled): accepted; its aio settings' rate is stated in the warnings."""
    text = Z3_NVME.replace("""  offload_optimizer: {device: nvme, nvme_path: /local_nvme, pin_memory: true}
""", """  sub_group_size: 1e8
  reduce_bucket_size: 90000000
  offload_optimizer: {device: nvme, nvme_path: /nvme_data, buffer_count: 4, pipeline_read: false,
                      pipeline_write: false, pin_memory: true}
  offload_param: {device: nvme, nvme_path: /nvme_data, max_in_cpu: 1, pin_memory: true}
aio: {block_size: 1048576, queue_depth: 16, single_submit: false, overlap_events: true, thread_count: 2}
""")
    s = run_scenario(_cfg(tmp_path, text)).summary
    assert s["oom"] is None and s["nvme_read_bytes_per_step"] > 0
    assert any("aio settings reach" in w and "2 thread(s) x queue_depth 16 x 1048576 B overlapped" in w
               for w in s["warnings"])
    assert not any(w.startswith("aio.") for w in s["warnings"])  # single_submit at its default (false) is priced
    s = run_scenario(_cfg(tmp_path, text.replace("single_submit: false", "single_submit: true"))).summary
    assert any(w.startswith("aio.single_submit accepted, not priced") for w in s["warnings"])


@pytest.mark.parametrize(("overrides", "line"), [
    (["zero_optimization.offload_optimizer.nvme_path=null"], "offload_optimizer.device: nvme needs "
                                                              "offload_optimizer.nvme_path"),
    (["hardware.host=h200-measured-host"], "zero_optimization.offload_optimizer.device: nvme needs NVMe drives, "
                                           "and hardware.host 'h200-measured-host' names none"),
    (["zero_optimization.stage=2"], "offload_optimizer.device: nvme needs zero_optimization.stage 3, got stage 2"),
    (["zero_optimization.offload_optimizer.pipeline_read=true"], "offload_optimizer.buffer_count: 4 is too few"),
    (["zero_optimization.offload_optimizer.cpu_adam_impl=torch_foreach"], "DeepSpeed steps a swapped sub-group "
                                                                          "with DeepSpeedCPUAdam"),
    (["zero_optimization.offload_optimizer.device=cpu", "zero_optimization.offload_optimizer.nvme_path=null",
      "zero_optimization.sub_group_size=1000"], "sub_group_size is modelled with offload_optimizer.device: nvme"),
    (["zero_optimization.offload_param.device=nvme", "zero_optimization.offload_param.nvme_path=/x",
      "zero_optimization.offload_param.buffer_size=1000"], "offload_param.buffer_size: 1000 elements is too small"),
    (["hardware.nvme.storage.name=x", "hardware.nvme.storage.read_bandwidth_bytes_per_s=1 GB/s"],
     "hardware.nvme: storage 'x' has no write_bandwidth_bytes_per_s"),
])
def test_bad_nvme_input_is_one_line_exit_2(tmp_path, capsys, overrides, line):
    p = tmp_path / "s.yaml"
    p.write_text(Z3_NVME)
    args = ["run", str(p)]
    for o in overrides:
        args += ["--set", o]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and line in err and "Traceback" not in err


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_zero3_offload_moves_fp16_partitions_off_the_gpu_like_bf16(tmp_path, device):
    """ZeRO-3 with the optimizer and the parameters offloaded: the 16-bit parameter and gradient partitions
    (``params.{half}.partition``, ``grad.{half}.partition``) leave the GPU whatever the 16-bit dtype; fp16 kept both
    (2 x 2 B x shard) while bf16 dropped them (the policies filtered the bf16 names only)."""
    over = [f"zero_optimization.offload_optimizer.device={device}", f"zero_optimization.offload_param.device={device}"]
    if device == "nvme":
        over.append("zero_optimization.offload_param.nvme_path=/x")
    peaks = {pr: run_scenario(_cfg(tmp_path, Z3_NVME, over + [f"training.precision={pr}"])).summary["peak_memory_bytes"]
             for pr in ("bf16", "fp16")}
    assert peaks["fp16"] == peaks["bf16"]


def test_cpu_offload_without_an_impl_says_which_cpu_adam_is_priced(tmp_path):
    """device cpu without cpu_adam_impl prices torch_foreach and says a DeepSpeed run would step with
    DeepSpeedCPUAdam (zero_force_ds_cpu_optimizer); given, or with device nvme (DeepSpeedCPUAdam), no line."""
    from simulator.api import run_warnings
    from simulator.config.loader import resolve_hardware

    def lines(over):
        cfg = _cfg(tmp_path, Z3_NVME, over)
        return [w for w in run_warnings(resolve_hardware(cfg), cfg) if "cpu_adam_impl not given" in w]

    cpu = "zero_optimization.offload_optimizer={device: cpu, pin_memory: true}"
    assert len(lines([cpu])) == 1 and "zero_force_ds_cpu_optimizer" in lines([cpu])[0]
    assert lines([cpu, "zero_optimization.offload_optimizer.cpu_adam_impl=torch_foreach"]) == []
    assert lines([]) == []
