"""ZeRO-Offload with several ranks on one host: each rank's CPU Adam gets its share of the host.

Hand-worked host (SHARED): 2 sockets x 8 cores = 16 cores; per socket 4 channels x 625 MT/s x 8 B
= 20 GB/s, sustained fraction 1.0; one core streams at most 3 GB/s; no clock (compute never binds);
no dispatch cost. DeepSpeed CPUAdam on ``n`` parameters streams 30 B/param, its in-place gradient
cast 6 B/param: 36 B/param.

* 1 rank, pinned state on one NUMA node: min(16 x 3, 20) = 20 GB/s -> 36 n / 20e9 s.
* 8 ranks (DeepSpeed: one CPUAdam per rank, cores / ranks = 2 threads each), 4 ranks per NUMA
  node: each capped at 2 x 3 = 6 GB/s, 4 x 6 = 24 > 20 GB/s, so max-min gives 5 GB/s each
  -> 36 n / 5e9 s: exactly 4x the lone rank (not 8x: the lone rank's pinned memory sits on one
  of the two nodes, the 8 ranks use both).
"""

from __future__ import annotations

import dataclasses

import pytest

from hardware_models.host import HostCpuSpec, HostMemorySpec
from hardware_models.host_kernels import shared_stream_bandwidth
from simulator import load_scenario, run_scenario
from simulator.policies.offload_optimizer import cpu_step_times, cpu_threads, host_memory_oom
from tests.conftest import make_hw

SHARED = HostCpuSpec("shared", 16, 1e10, sockets=2, memory_channels_per_socket=4, memory_rate_mt_per_s=625,
                     sustained_bandwidth_fraction=1.0, per_core_bandwidth_bytes_per_s=3e9)


def _hw():
    return dataclasses.replace(make_hw(), host_cpu=SHARED, launch_overhead_s=0.0)


def test_shared_bandwidth_by_hand():
    assert shared_stream_bandwidth(SHARED, 1, 16, 1) == 20e9
    assert shared_stream_bandwidth(SHARED, 8, 2) == 5e9  # 4 ranks x 6 GB/s capped by 20 GB/s per node
    assert shared_stream_bandwidth(SHARED, 2, 8) == 20e9  # one rank per node, 24 GB/s cap > 20
    assert shared_stream_bandwidth(SHARED, 4, 1) == 3e9  # 1 thread each: its own cap binds (6 < 20)


def test_eight_ranks_take_4x_the_lone_rank_by_hand():
    n = 1_000_000_000
    hw = _hw()
    assert cpu_threads(hw, "overlap", 8) == 2 and cpu_threads(hw, "overlap", 1) == 16
    one = cpu_step_times(n, 1, "deepspeed_cpu_adam", hw, ranks=1)
    eight = cpu_step_times(n, 1, "deepspeed_cpu_adam", hw, ranks=8)
    assert sum(one.values()) == pytest.approx(30 * n / 20e9, rel=1e-12)  # the kernel's 30 B (no host cast)
    assert sum(eight.values()) == pytest.approx(30 * n / 5e9, rel=1e-12)
    assert sum(eight.values()) / sum(one.values()) == pytest.approx(4.0, rel=1e-12)


def test_threads_above_the_cores_per_rank_time_share_them():
    """16 cores, 8 ranks asking 8 threads each (64 threads): each rank's step runs on its 2 cores, as without the
    setting, and the run says the host is oversubscribed; 2 threads each fit and are not flagged."""
    from simulator.policies.offload_optimizer import oversubscribed_threads

    hw = _hw()
    over = dataclasses.replace(hw, host_cpu=dataclasses.replace(hw.host_cpu, threads_used=8))
    fit = dataclasses.replace(hw, host_cpu=dataclasses.replace(hw.host_cpu, threads_used=2))
    assert cpu_threads(over, "overlap", 8) == cpu_threads(hw, "overlap", 8) == 2
    n = 1_000_000_000
    assert cpu_step_times(n, 1, "deepspeed_cpu_adam", over, ranks=8) == cpu_step_times(n, 1, "deepspeed_cpu_adam", hw,
                                                                                         ranks=8)
    assert "8 x 8 ranks = 64 CPU-step threads on 16 cores: oversubscribed" in oversubscribed_threads(over, 8)
    assert oversubscribed_threads(fit, 8) is None and oversubscribed_threads(over, 1) is None


def test_host_memory_counts_every_rank_of_the_node():
    """10 GB pinned + 2 GB pageable per rank fit a 90 GB host alone; 8 ranks need 96 GB: short by 6."""
    hw = dataclasses.replace(_hw(), host_memory=HostMemorySpec(90e9))
    assert host_memory_oom(10e9, 2e9, hw, ranks=1) is None
    msg = host_memory_oom(10e9, 2e9, hw, ranks=8)
    assert "offload buffers for the node's 8 ranks need 96.00 GB (pinned 80.00 GB" in msg
    assert msg.endswith("short by 6.00 GB")


DP8 = """name: off_dp8
hardware: {gpu: h100-sxm-80gb, host: dgx-h100-host, cluster: {preset: dgx-h100, nodes: 1}}
model: {num_layers: 2, hidden_size: 1024, num_attention_heads: 16, seq_length: 512, vocab_size: 32768}
training: {micro_batch_size: 2, precision: bf16}
zero_optimization:
  stage: 2
  overlap_comm: true
  offload_optimizer: {device: cpu, pin_memory: true, cpu_adam_impl: deepspeed_cpu_adam}
run: {steps: 3, warmup_steps: 1}
"""


def test_cluster_offload_runs_shares_the_host_and_says_so(tmp_path):
    """dp 8 on one DGX H100: allowed; each rank updates 1/8 of the parameters with 112 / 8 = 14
    threads and a max-min share of its socket's bandwidth, priced as cpu_step_times gives it, and
    the summary names what is assumed."""
    p = tmp_path / "dp8.yaml"
    p.write_text(DP8)
    res = run_scenario(load_scenario(p))
    s = res.summary
    assert s["oom"] is None
    assert any("shared by 8 ranks per node" in w and "behind one PCIe switch share its uplink" in w for w in s["warnings"])
    spans = res.spans[res.spans.step == res.spans.step.max()]
    names = set(spans.name)
    assert "offload.h2d.params.shard" in names and any(n.startswith("zero.param_all_gather") for n in names)
    from simulator.api import build_graph, transformer_spec
    from simulator.config.loader import resolve_hardware

    cfg = load_scenario(p)
    hw = resolve_hardware(cfg)
    P = transformer_spec(cfg).num_parameters
    shard = -(-P // 8)
    from simulator.graph.builders.transformer import build_gpt_step
    from simulator.policies.offload_optimizer import param_tensor_sizes

    sizes = [n * shard / P for n in param_tensor_sizes(build_gpt_step(transformer_spec(cfg)))]
    want = cpu_step_times(shard, len(sizes), "deepspeed_cpu_adam", hw, tensor_elements=sizes, ranks=8)
    assert s["offload_cpu_optimizer_s"] == pytest.approx(sum(want.values()), rel=1e-9)
    alone = cpu_step_times(shard, len(sizes), "deepspeed_cpu_adam", hw, tensor_elements=sizes, ranks=1)
    assert sum(want.values()) > sum(alone.values())  # the shared host is slower than a host of its own
    assert build_graph(cfg).model.data_parallel_size == 8


def test_uplink_sharers_on_a_dgx_h100_by_hand():
    """DGX H100: 4 PCIe switches, GPUs 2j and 2j+1 behind switch j (presets/clusters/dgx-h100.yaml)."""
    from hardware_models.host_links import uplink_share

    topo = _dp8_hw(load_scenario).collectives.topo
    up = uplink_share(topo, 0, range(8))
    assert (up.uplink, up.sharers) == ("n0.pcie0->n0.cpu0", 2)
    assert up.share_of(50e9) == 25e9  # uplink = GPU link (Gen5 x16 both): half each
    assert uplink_share(topo, 0, [0]).sharers == 1
    assert uplink_share(topo, 5, range(8)).uplink == "n0.pcie2->n0.cpu1"
    assert uplink_share(topo, 2, [0, 1, 4]).sharers == 1  # switch 1's partner is not in the job


def _dp8_hw(load, tmp=None):
    import tempfile
    from pathlib import Path

    from simulator.config.loader import resolve_hardware

    p = Path(tempfile.mkdtemp()) / "dp8.yaml"
    p.write_text(DP8)
    return resolve_hardware(load(p))


def test_two_ranks_on_one_switch_copy_at_half_the_rate(tmp_path):
    """The shard upload (one H2D copy of 2 x shard bytes, alone on the link) takes latency + bytes /
    (63 GB/s / 2) with 2 GPUs behind each switch; with a switch per GPU, latency + bytes / min(63 GB/s, the rank's
    share of host DRAM)."""
    p = tmp_path / "dp8.yaml"
    p.write_text(DP8)

    def upload(overrides):
        r = run_scenario(load_scenario(p, overrides))
        sp = r.spans[(r.spans.step == r.spans.step.max()) & (r.spans.name == "offload.h2d.params.shard")]
        return float(sp.duration_s.iloc[0]), r

    shared, _ = upload([])
    alone, _ = upload(["hardware.cluster.overrides.pcie_switches=8"])
    from simulator.config.loader import resolve_hardware

    hw = resolve_hardware(load_scenario(p))
    lat, rate = hw.copy.latency_s, hw.copy.h2d_bytes_per_s
    from simulator.api import transformer_spec

    nbytes = 2 * -(-transformer_spec(load_scenario(p)).num_parameters // 8)
    # alone on its switch the copy meets the host DRAM: the 8 ranks' uploads read it at once, 4 per socket, and each
    # gets a quarter of the socket's sustained bandwidth (host_dram_share; 61.4 GB/s on the 8480C, below 63 GB/s)
    from hardware_models.host_kernels import host_dram_share

    assert alone == pytest.approx(lat + nbytes / min(rate, host_dram_share(hw.host_cpu, 8)), rel=1e-6)
    assert shared == pytest.approx(lat + nbytes / (rate / 2), rel=1e-6)  # the shared uplink binds before the DRAM
