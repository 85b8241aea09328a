"""ZeRO-3 with the optimizer (and the parameters) offloaded to the host over dp 8 ranks of one DGX H100.

Model: 2 blocks, hidden 1024, vocab 32768, seq 512 (P parameters, shard = ceil(P / 8)).

* ZeRO-3 + offload_optimizer: the builder's reduce-scatters carry 16-bit gradients (2 P bytes), so
  this rank's gradient shard is 2 P / 8 bytes (cast to fp32 on the GPU and copied as 4 P / 8 with
  deepspeed_cpu_adam); the
  GPU keeps its 16-bit partition (2 P / 8), no whole-model copy; the shard is uploaded into it after
  the CPU step and only the persistent parameters are all-gathered then.
* + offload_param: no 16-bit partition on the GPU; every forward / backward parameter all-gather of
  ``b`` bytes reads an H2D fetch of ``ceil(b / 8)`` bytes, which runs at half the Gen5 link rate
  (2 GPUs per PCIe switch uplink): ``latency + 2 ceil(b / 8) / 63 GB/s`` when alone on the link.
"""

from __future__ import annotations

import pytest

from simulator import load_scenario, run_scenario
from simulator.api import build_graph, transformer_spec
from simulator.config.loader import resolve_hardware
from simulator.graph.ops import OpKind
from simulator.policies import apply_graph_policies
from tests.simulator.policies.test_offload_shared_host import DP8

Z3 = DP8.replace("name: off_dp8", "name: off_z3_dp8").replace("stage: 2", "stage: 3")  # the shared-host case at ZeRO-3


def _graph(tmp_path, overrides=()):
    p = tmp_path / "z3.yaml"
    p.write_text(Z3)
    cfg = load_scenario(p, list(overrides))
    return cfg, apply_graph_policies(build_graph(cfg), cfg, resolve_hardware(cfg))


def test_zero3_optimizer_offload_keeps_16bit_gradients_and_the_partition(tmp_path):
    cfg, g = _graph(tmp_path)
    P = transformer_spec(cfg).num_parameters
    shard = -(-P // 8)
    rs = [op for op in g.ops if (op.meta or {}).get("collective") == "reduce_scatter"]
    assert sum(op.meta["bytes"] for op in rs) == 2 * P
    d2h = [op for op in g.ops if op.kind == OpKind.MEMCPY_D2H and op.name.startswith("offload.d2h.grad.shard")]
    # deepspeed_cpu_adam with fp32 master weights: each 16-bit shard cast to fp32 on the GPU, then copied (4 B per
    # element; deepspeedai/DeepSpeed@ea78ab68 stage3.py _offload_grad_partition_at_boundary)
    assert sum(-(-op.meta["bytes"] // 8) for op in rs) == 2 * shard
    assert sum(op.bytes_read for op in d2h) == 4 * shard
    cast = [op for op in g.ops if op.name.startswith("offload.grad_cast.shard")]
    assert len(cast) == len(d2h) and sum(op.bytes_written for op in cast) == 4 * shard
    gpu = {t.name: t.nbytes for t in g.persistent if t.device == "gpu"}
    assert "params.bf16" not in gpu and gpu["params.bf16.partition"] == 2 * shard and "grad.bf16.partition" not in gpu
    opt_gathers = [op for op in g.ops if (op.meta or {}).get("collective") == "all_gather" and op.phase.value == "opt"]
    assert [op.name for op in opt_gathers] == ["zero3.persistent_param_all_gather"]


def test_zero3_param_offload_fetches_each_partition_before_its_gather(tmp_path):
    cfg, g = _graph(tmp_path, ["zero_optimization.offload_param.device=cpu"])
    gathers = [op for op in g.ops if (op.meta or {}).get("collective") == "all_gather" and op.phase.value != "opt"]
    fetches = {op.id: op for op in g.ops if op.name.endswith("offload_param.fetch")}
    assert len(gathers) == len(fetches) == 6  # root + 2 blocks, forward and backward
    for ga in gathers:
        f = [fetches[d] for d in ga.deps if d in fetches]
        assert len(f) == 1 and f[0].bytes_read == -(-ga.meta["bytes"] // 8) and f[0].kind == OpKind.MEMCPY_H2D
        assert f[0].allocs[0].name in ga.uses
    assert not any(op.name.startswith("offload.h2d.params") for op in g.ops)
    assert not any(t.name == "params.bf16.partition" for t in g.persistent)
    res = run_scenario(cfg)
    assert res.summary["oom"] is None and res.summary["exposed_param_fetch_s"] > 0
    assert any("offload_param.prefetch_depth does not apply" in w for w in res.summary["warnings"])
    hw = resolve_hardware(cfg)
    sp = res.spans[(res.spans.step == res.spans.step.max()) & (res.spans.name == "L0.fwd.offload_param.fetch")]
    nbytes = -(-[ga for ga in gathers if ga.name == "L0.fwd.param_all_gather"][0].meta["bytes"] // 8)
    assert float(sp.duration_s.iloc[0]) == pytest.approx(hw.copy.latency_s + nbytes / (hw.copy.h2d_bytes_per_s / 2),
                                                         rel=1e-9)


def test_zero3_param_offload_counts_every_rank_in_host_memory(tmp_path):
    """A host of 1 GB: the 8 ranks' pinned states (8 x 16 B x shard) do not fit: an OOM result naming the host."""
    _graph(tmp_path)
    p = tmp_path / "z3.yaml"
    res = run_scenario(load_scenario(p, ["zero_optimization.offload_param.device=cpu",
                                         "hardware.host.overrides.memory.capacity_bytes=1 GB"]))
    oom = res.summary["oom"]
    assert oom is not None and "host" in oom and "8 ranks" in oom


def test_zero3_param_offload_summary_reports_the_fetches_worked_out_by_hand(tmp_path):
    """The 6 fetches (root + 2 blocks, forward and backward) run one after another on the rank's H2D stream, each
    alone on its half of the Gen5 uplink: ``offload_param_fetch_s = sum(latency + 2 ceil(b / 8) / 63 GB/s)``. The
    post-step upload is gone (``offload_h2d_s`` 0), so the offload line names the fetches, not a 0.0 ms upload."""
    from simulator.cli import format_summary

    cfg, g = _graph(tmp_path, ["zero_optimization.offload_param.device=cpu"])
    hw = resolve_hardware(cfg)
    fetches = [op for op in g.ops if op.name.endswith("offload_param.fetch")]
    want = sum(hw.copy.latency_s + op.bytes_read / (hw.copy.h2d_bytes_per_s / 2) for op in fetches)
    s = run_scenario(cfg).summary
    assert len(fetches) == 6 and s["offload_h2d_s"] == 0.0
    assert s.get("offload_param_fetch_s") == pytest.approx(want, rel=1e-9)
    line = next(ln for ln in format_summary(s, "z3").splitlines() if ln.startswith("offload parts"))
    assert "parameter upload" not in line
    assert f"parameter fetches H2D {want * 1e3:.1f} ms busy, {s['exposed_param_fetch_s'] * 1e3:.1f} ms exposed" in line
