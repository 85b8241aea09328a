"""ZeRO-Offload policy: exact timings on a tiny graph, bytes conserved, mode ordering, errors."""

from __future__ import annotations

import dataclasses
import pytest

from hardware_models.host import HostCpuSpec, HostMemorySpec
from simulator import ScenarioError, load_scenario, run_scenario, scenario_from_dict
from simulator.api import simulate_graph
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.ops import OpKind
from simulator.policies.offload_optimizer import (
    cpu_step_times,
    cpu_threads,
    gradients,
    host_memory_oom,
    offload_optimizer,
    offload_parts,
    param_tensor_sizes,
)
from simulator.policies.registry import PolicyError
from tests.conftest import ROOT, make_hw

SPEC = TransformerSpec(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=4, vocab_size=16,
                       ffn_hidden_size=32, micro_batch_size=1, precision="bf16")
P = SPEC.num_parameters


BW = 1e10  # toy host: sustained DRAM bandwidth, bytes/s; no clock (compute never binds)


def toy_hw(host_mem: float = 1e12, pinned_limit: float = 0.0):
    hw = make_hw()
    cpu = HostCpuSpec("toy-cpu", 4, BW, stream_bandwidth_bytes_per_s=BW, per_core_bandwidth_bytes_per_s=BW)
    return dataclasses.replace(hw, host_cpu=cpu, host_memory=HostMemorySpec(host_mem, pinned_limit), launch_overhead_s=0.0)


def run(graph, hw, steps=3, warmup=1):
    return simulate_graph(graph, hw, steps, warmup)


def test_cpu_times_by_hand():
    """Toy model (fresh outputs under 32 MiB: no faults, no launch cost): foreach AdamW streams
    80 B/param, the casts 6 B/param, DeepSpeed's fused kernel 30 B/param, all at 10 GB/s."""
    t = cpu_step_times(P, len(param_tensor_sizes(build_gpt_step(SPEC))), "torch_foreach", toy_hw())
    assert t["cpu.adam"] == pytest.approx(80 * P / BW)
    assert t["cpu.grad_cast"] == pytest.approx(6 * P / BW)
    assert t["cpu.param_cast"] == pytest.approx(6 * P / BW)
    ds = cpu_step_times(P, len(param_tensor_sizes(build_gpt_step(SPEC))), "deepspeed_cpu_adam", toy_hw())
    assert ds["cpu.adam"] == pytest.approx(30 * P / BW)
    assert ds["cpu.grad_cast"] == 0.0  # current DeepSpeed casts on the GPU (test_deepspeed_gradient_path_by_hand)
    assert ds["cpu.param_cast"] == 0.0
    assert cpu_step_times(P, 1, "torch_fused", toy_hw())["cpu.adam"] == pytest.approx(28 * P / BW)


def test_param_tensor_sizes_add_up():
    sizes = param_tensor_sizes(build_gpt_step(SPEC))
    assert sum(sizes) == P and len(sizes) == 2 + 12 * SPEC.num_layers + 2  # wte, wpe, 12 per block, ln_f w + b


def test_param_tensor_sizes_follow_a_llama_layout():
    """Llama (GQA, SwiGLU, RMSNorm, untied head, no biases): per block ln1, QKV [h, (a + 2 g) d], proj, ln2,
    fc1 [h, 2 f], fc2 = 6 tensors; plus the token table, the final norm and the LM head (no position table)."""
    llama = dataclasses.replace(SPEC, bias=False, normalization="RMSNorm", position_embedding="rope", swiglu=True,
                                tied_embeddings=False)
    sizes = param_tensor_sizes(build_gpt_step(llama))
    assert len(sizes) == 6 * llama.num_layers + 3 and sum(sizes) == llama.num_parameters


def test_dpu_loses_the_training_threads_core():
    """DPU: the pool of 4 threads shares a core with the training thread: 3 threads. A per-core
    bandwidth of 1 GB/s binds: foreach adam 80 B/param / 3 GB/s (overlap: / 4 GB/s)."""
    hw = toy_hw()
    hw = dataclasses.replace(hw, host_cpu=dataclasses.replace(hw.host_cpu, per_core_bandwidth_bytes_per_s=1e9))
    assert cpu_threads(hw, "delayed_param_update") == 3 and cpu_threads(hw, "overlap") == 4
    dpu = cpu_step_times(P, 1, "torch_foreach", hw, mode="delayed_param_update")["cpu.adam"]
    assert dpu == pytest.approx(80 * P / 3e9)
    assert cpu_step_times(P, 1, "torch_foreach", hw, mode="overlap")["cpu.adam"] == pytest.approx(80 * P / 4e9)


def test_gradient_bytes_conserved():
    """D2H moves every gradient once (2 B/param), H2D every weight once, host holds 12 + 2 + 2 B/param."""
    g = offload_optimizer(build_gpt_step(SPEC), toy_hw(), mode="overlap")
    d2h = sum(op.bytes_read for op in g.ops if op.name.startswith("offload.d2h"))
    h2d = sum(op.bytes_read for op in g.ops if op.name.startswith("offload.h2d"))
    assert d2h == 2 * P and h2d == 2 * P
    host = sum(t.nbytes for t in g.persistent if t.device.startswith("host"))
    gpu = sum(t.nbytes for t in g.persistent if t.device == "gpu")
    assert host == 16 * P and gpu == 2 * P
    assert sum(x["bytes"] for x in gradients(build_gpt_step(SPEC))) == 2 * P
    assert not any(op.name.endswith("grad_accum") or op.name.endswith("adamw") for op in g.ops)
    bucketed = offload_optimizer(build_gpt_step(SPEC), toy_hw(), mode="overlap", bucket_elems=600)
    assert sum(op.bytes_read for op in bucketed.ops if op.name.startswith("offload.d2h")) == 2 * P
    assert bucketed.meta["offload_optimizer"]["grad_copies"] < g.meta["offload_optimizer"]["grad_copies"]


def test_exact_timings_on_tiny_graph():
    """CPU ops take their model time; the upload takes 2P bytes / 1 GB/s; the step adds them serially."""
    hw = toy_hw()
    g = offload_optimizer(build_gpt_step(SPEC), hw, mode="serial")
    r = run(g, hw)
    s = r.spans[r.spans.step == 1]
    t = cpu_step_times(P, len(param_tensor_sizes(build_gpt_step(SPEC))), "torch_foreach", hw)
    for name, sec in t.items():
        assert float(s[s.name == name].duration_s.iloc[0]) == pytest.approx(sec, rel=1e-9)
    parts = offload_parts(r.spans, r.steps)
    assert parts["offload_h2d_s"] == pytest.approx(2 * P / 1e9, rel=1e-6)
    assert parts["offload_cpu_optimizer_s"] == pytest.approx(sum(t.values()), rel=1e-9)
    # serial: step = GPU fwd/bwd + D2H after backward + CPU + upload, nothing overlapping
    step = r.summary["step_time_s"]
    assert step == pytest.approx(parts["offload_gpu_fwd_bwd_s"] + sum(t.values()) + 2 * P / 1e9, rel=1e-6)
    d2h = s[s.name.str.startswith("offload.d2h")]
    bwd_end = s[(s.phase == "bwd") & (s.stream == "compute")].end_s.max()
    assert d2h.start_s.min() >= bwd_end - 1e-15  # serial copies wait for the end of backward


def test_overlap_copies_run_during_backward():
    hw = toy_hw()
    r = run(offload_optimizer(build_gpt_step(SPEC), hw, mode="overlap"), hw)
    s = r.spans[r.spans.step == 1]
    bwd_end = s[(s.phase == "bwd") & (s.stream == "compute")].end_s.max()
    assert s[s.name.str.startswith("offload.d2h")].start_s.min() < bwd_end


@pytest.mark.parametrize("pcie", [1e7, 1e8, 1e9])
def test_overlap_never_slower_than_serial_and_dpu_fastest(pcie):
    hw = toy_hw()
    hw = dataclasses.replace(hw, profile=dataclasses.replace(hw.profile, h2d_bytes_per_s=pcie, d2h_bytes_per_s=pcie,
                                                             duplex_bytes_per_s=2 * pcie))
    t = {m: run(offload_optimizer(build_gpt_step(SPEC), hw, mode=m), hw, steps=5, warmup=2).summary["step_time_s"]
         for m in ("serial", "overlap")}
    assert t["overlap"] <= t["serial"] * (1 + 1e-9)


def test_scenario_modes_ordering():
    """On the measured H200 setup: serial >= overlap >= DPU (the DPU period hides the GPU work)."""
    t = {}
    for m in ("serial", "overlap", "dpu"):
        t[m] = run_scenario(load_scenario(ROOT / f"scenarios/h200/gpt_184m_b16_offload_{m}.yaml")).summary
    assert t["serial"]["step_time_s"] >= t["overlap"]["step_time_s"] >= t["dpu"]["step_time_s"]
    assert t["dpu"]["step_time_s"] == pytest.approx(t["dpu"]["offload_cpu_optimizer_s"], rel=0.05)


def test_memory_moves_to_host():
    base = run_scenario(load_scenario(ROOT / "scenarios/h200/gpt_184m_b16.yaml")).summary
    off = run_scenario(load_scenario(ROOT / "scenarios/h200/gpt_184m_b16_offload_overlap.yaml")).summary
    P184 = 185759744
    assert off["peak_memory_bytes"] < base["peak_memory_bytes"]
    assert "optimizer" not in off["peak_memory_by_category_bytes"]
    assert off["peak_host_pinned_bytes"] == 16 * P184  # master + moments + two bf16 staging buffers
    assert off["peak_host_pageable_bytes"] == 8 * P184  # fp32 grads + the sqrt temporary during the step


# -- errors -----------------------------------------------------------------------------------------
def _cfg(**zero):
    import yaml

    d = yaml.safe_load(open(ROOT / "scenarios/h200/gpt_184m_b16_offload_overlap.yaml"))
    d["zero_optimization"] = {**d["zero_optimization"], **zero}
    return d


@pytest.mark.parametrize("device", ["gpu1", "disk"])
def test_unknown_offload_device_is_one_line(device):
    with pytest.raises(ScenarioError) as e:
        scenario_from_dict(_cfg(offload_optimizer={"device": device}))
    msg = str(e.value)
    assert "\n" not in msg and "zero_optimization.offload_optimizer.device" in msg and "allowed: none, cpu" in msg


def test_pinned_larger_than_host_memory_is_an_oom_result():
    """185.76M params x 16 B pinned = 2.97 GB > a 2 GB host: an out-of-memory result naming the
    host pinned pool and the first buffer that did not fit, like a GPU OOM (no exception)."""
    d = _cfg()
    d["hardware"]["host"] = {"preset": "h200-measured-host", "overrides": {"memory": {"capacity_bytes": "2 GB"}}}
    oom = run_scenario(scenario_from_dict(d)).summary["oom"]
    assert oom.startswith("out of memory on host.pinned: peak demand 2.97 GB exceeds the capacity 2.00 GB")
    assert "first allocation over capacity: " in oom and "\n" not in oom


def test_host_buffers_together_over_capacity_is_an_oom_result():
    """A 3.5 GB host: the pinned pool (2.97 GB) fits, but pinned + pageable (fp32 gradients +
    sqrt temporary, 8 B/param = 1.49 GB) = 4.46 GB does not."""
    d = _cfg()
    d["hardware"]["host"] = {"preset": "h200-measured-host", "overrides": {"memory": {"capacity_bytes": "3.5 GB"}}}
    s = run_scenario(scenario_from_dict(d)).summary
    assert s["oom"].startswith("out of memory on host: offload buffers need 4.46 GB (pinned 2.97 GB")
    assert "short by 0.96 GB" in s["oom"]
    assert host_memory_oom(1.0, 1.0, toy_hw(host_mem=2.0)) is None


def test_needs_bf16_and_a_zero_stage():
    d = _cfg()
    d["training"]["precision"] = "amp_fp32_params"
    with pytest.raises(PolicyError, match="needs training.precision bf16 or fp16"):
        run_scenario(scenario_from_dict(d))
    with pytest.raises(ScenarioError, match="stage >= 1"):
        scenario_from_dict(_cfg(stage=0))
    with pytest.raises(ScenarioError, match="contradicts overlap_comm"):
        scenario_from_dict(_cfg(offload_optimizer={"device": "cpu", "mode": "serial"}))


@pytest.mark.parametrize("mode", ["overlap", "delayed_param_update"])
def test_a_side_stream_mode_with_overlap_comm_false_is_refused(mode):
    # trial finding: overlap_comm false beside mode overlap ran the overlapped copies (389.22 ms, as with true)
    oo = {"device": "cpu", "pin_memory": True, "mode": mode, "cpu_adam_impl": "torch_foreach"}
    with pytest.raises(ScenarioError, match=f"mode: {mode} contradicts overlap_comm: false.*allowed: mode serial"):
        scenario_from_dict(_cfg(overlap_comm=False, offload_optimizer=oo))
    # without a mode, overlap_comm false selects serial (the copies after backward), which runs
    assert scenario_from_dict(_cfg(overlap_comm=False, offload_optimizer={**oo, "mode": None})
                              ).zero_optimization.offload_mode == "serial"


def test_policy_rejects_graph_without_builder_spec():
    g = build_gpt_step(SPEC).with_changes(model=None)
    with pytest.raises(PolicyError, match="needs a graph from the model builder"):
        offload_optimizer(g, toy_hw())
    assert any(op.kind == OpKind.MEMCPY_D2H for op in offload_optimizer(build_gpt_step(SPEC), toy_hw()).ops)


def test_deepspeed_2020_copies_each_tile_while_the_next_runs(monkeypatch):
    """DeepSpeed 0.3's CPUAdam, with the tile shrunk to ceil(P / 3) elements (toy model): three tile ops of
    34 B/param x n_k / 10 GB/s each, and after each an H2D copy of 2 n_k bytes that waits only for its
    tile; no per-layer upload. The step's CPU-Adam figure is the CPU ops plus the last copy (the earlier
    copies hide under the next tile when the link is faster than the host's 2 B per 34 B); DeepSpeed 0.3 casts the
    gradients to fp32 on the GPU, so no CPU gradient cast is charged."""
    import simulator.policies.offload_optimizer as oo

    tile = -(-P // 3)
    monkeypatch.setattr(oo, "DS2020_TILE_ELEMENTS", tile)
    hw = toy_hw()
    g = offload_optimizer(build_gpt_step(SPEC), hw, impl="deepspeed_cpu_adam_2020")
    adam = [op for op in g.ops if op.name == "cpu.adam"]
    copies = [op for op in g.ops if op.name.startswith("offload.h2d.params")]
    ns = [tile, tile, P - 2 * tile]
    assert [op.meta["params"] for op in adam] == ns
    assert [op.host_s for op in adam] == pytest.approx([34 * n / BW for n in ns])
    assert [c.name for c in copies] == ["offload.h2d.params.tile0", "offload.h2d.params.tile1", "offload.h2d.params.tile2"]
    assert [c.bytes_read for c in copies] == [2.0 * n for n in ns]
    assert [c.deps for c in copies] == [(a.id,) for a in adam]
    assert adam[1].deps == (adam[0].id,)
    res = run(g, hw)
    parts = offload_parts(res.spans, res.steps)
    sp = res.spans[res.spans.step == res.spans.step.max()]
    last = sp[sp.name == "offload.h2d.params.tile2"]
    cpu = sp[sp.name.isin(("cpu.grad_cast", "cpu.adam", "cpu.param_cast"))]
    assert parts["offload_cpu_optimizer_s"] == pytest.approx(
        34 * P / BW + float(last.end_s.iloc[0]) - float(cpu.end_s.max()), rel=1e-9)  # no CPU grad cast in DS 0.3
    assert float(last.duration_s.iloc[0]) == pytest.approx(hw.copy.latency_s + 2 * ns[2] / hw.copy.h2d_bytes_per_s)


def test_deepspeed_2020_refuses_delayed_param_update():
    with pytest.raises(PolicyError, match="deepspeed_cpu_adam_2020 .* predates delayed_param_update"):
        offload_optimizer(build_gpt_step(SPEC), toy_hw(), mode="delayed_param_update", impl="deepspeed_cpu_adam_2020")


def test_fp16_offloads_like_bf16():
    """fp16 (the 2020 ZeRO-Offload runs): the same 2 B weights on the GPU (the builder's params.fp16, not a
    second params.bf16 copy) and the same host buffers as bf16."""
    g16 = offload_optimizer(build_gpt_step(dataclasses.replace(SPEC, precision="fp16")), toy_hw())
    g = offload_optimizer(build_gpt_step(SPEC), toy_hw())
    gpu16 = {t.name: t.nbytes for t in g16.persistent if t.device == "gpu"}
    assert gpu16 == {"params.fp16": 2 * P}
    assert {t.name: t.nbytes for t in g.persistent if t.device == "gpu"} == {"params.bf16": 2 * P}
    assert ({t.name: t.nbytes for t in g16.persistent if t.device != "gpu"}
            == {t.name: t.nbytes for t in g.persistent if t.device != "gpu"})


@pytest.mark.parametrize("dp", [1, 2])
def test_deepspeed_gradient_path_by_hand(dp):
    """Current DeepSpeed (cpu_adam_impl deepspeed_cpu_adam) with fp32 master weights casts each gradient to fp32 on
    the GPU and copies the fp32 tensor (stage_1_and_2.py async_inplace_copy_grad_to_fp32_buffer_from_gpu): per
    parameter 2 B read + 4 B written by the cast, on the copy's stream just before its copy, then 4 B D2H (the
    torch loops copy the 2 B bf16 gradient and cast it on the host); no host cast (0 s); the host holds the fp32
    gradient partition (4 B) beside master 4 + moments 8 + the bf16 parameter staging 2 = 18 B/param, nothing
    per step. With 2 data-parallel ranks the same per element of this rank's reduced shard (P/2 elements)."""
    from simulator.policies.offload_optimizer import offload_parts

    hw = toy_hw() if dp == 1 else dataclasses.replace(toy_hw(), dp_group=(0, 1))
    spec = dataclasses.replace(SPEC, data_parallel_size=dp, zero_stage=2) if dp > 1 else SPEC
    shard = -(-P // dp)
    g = offload_optimizer(build_gpt_step(spec), hw, impl="deepspeed_cpu_adam")
    cast = [op for op in g.ops if op.name.startswith("offload.grad_cast.")]
    d2h = [op for op in g.ops if op.name.startswith("offload.d2h.grad.")]
    assert len(cast) == len(d2h) > 0
    assert sum(op.bytes_read for op in d2h) == 4 * shard
    assert sum(op.bytes_read for op in cast) == 2 * shard and sum(op.bytes_written for op in cast) == 4 * shard
    for c, copy in zip(cast, d2h):
        assert c.stream == copy.stream == "d2h" and c.kind == OpKind.COMPUTE and copy.deps[0] == c.id
    assert next(op for op in g.ops if op.name == "cpu.grad_cast").host_s == 0.0
    host = {t.name: t.nbytes for t in g.persistent if t.device.startswith("host")}
    assert host["offload.grad_partition.fp32"] == 4 * shard and sum(host.values()) == 18 * shard
    assert not any(a.name == "grad.fp32.host" for op in g.ops for a in op.allocs)
    torch = offload_optimizer(build_gpt_step(spec), hw, impl="torch_foreach")
    assert sum(op.bytes_read for op in torch.ops if op.name.startswith("offload.d2h.grad.")) == 2 * shard
    assert not any(op.name.startswith("offload.grad_cast.") for op in torch.ops)
    low = offload_optimizer(build_gpt_step(spec), hw, impl="deepspeed_cpu_adam", master="bf16")
    assert sum(op.bytes_read for op in low.ops if op.name.startswith("offload.d2h.grad.")) == 2 * shard
    assert not any(op.name.startswith("offload.grad_cast.") for op in low.ops)


def test_deepspeed_2020_gradient_path_by_hand():
    """DeepSpeed 0.3's stage2.py with cpu_offload, one bucket per gradient (no reduce_bucket_size): each gradient
    of n elements gets a GPU pass of 22 n B read + 20 n B written (ipg copy, div_, fp64 norm, overflow sum, fp32
    cast: DS03_PREP_*) on the reduction stream, then an fp32 D2H copy of 4 n bytes after it, and the training
    thread waits for that copy (a host SYNC) before it launches anything else. The CPU step has no gradient cast
    (0 s) and begins with the fp32 unscale: 8 B/param at 10 GB/s."""
    from simulator.policies.offload_optimizer import DS03_PREP_READ, DS03_PREP_WRITE

    hw = toy_hw()
    g = offload_optimizer(build_gpt_step(SPEC), hw, impl="deepspeed_cpu_adam_2020")
    ops = g.ops
    prep = [op for op in ops if op.name.startswith("offload.grad_prep.")]
    d2h = [op for op in ops if op.name.startswith("offload.d2h.grad.")]
    sync = [op for op in ops if op.name.startswith("offload.grad_sync.")]
    assert len(prep) == len(d2h) == len(sync) == len(gradients(build_gpt_step(SPEC)))
    assert sum(op.bytes_read for op in d2h) == 4 * P
    assert sum(op.bytes_read for op in prep) == DS03_PREP_READ * P
    assert sum(op.bytes_written for op in prep) == DS03_PREP_WRITE * P
    for p_, c, s in zip(prep, d2h, sync):
        assert p_.stream == c.stream == "d2h" and c.deps == (p_.id,)
        assert s.stream == "host" and s.kind == OpKind.SYNC and s.deps == (c.id,)
    unscale = next(op for op in ops if op.name == "cpu.unscale_grads")
    assert unscale.host_s == pytest.approx(8 * P / BW)
    assert next(op for op in ops if op.name == "cpu.grad_cast").host_s == 0.0
    cast = next(op for op in ops if op.name == "cpu.grad_cast")
    adam = next(op for op in ops if op.name == "cpu.adam")
    assert cast.deps == (unscale.id,) and adam.deps == (cast.id,)  # the unscale runs first
    host = {t.name: t for t in g.persistent if t.device.startswith("host")}
    assert host["offload.grad_partition.fp32"].nbytes == 4 * P and "offload.grad_staging.bf16" not in host


def test_deepspeed_2020_with_data_parallel_is_refused():
    spec = dataclasses.replace(SPEC, data_parallel_size=2)
    with pytest.raises(PolicyError, match="deepspeed_cpu_adam_2020 models DeepSpeed 0.3's ZeRO-Offload on one GPU"):
        offload_optimizer(build_gpt_step(spec), toy_hw(), impl="deepspeed_cpu_adam_2020")


def test_deepspeed_2020_backward_waits_for_each_gradient_copy():
    """The training thread blocks on each fp32 gradient copy (DeepSpeed 0.3's per-gradient ``float(x.sum())`` and
    per-bucket ``torch.cuda.synchronize()``): no GPU op the host launches after a copy's sync starts before that
    copy ends, so the copies do not overlap the rest of backward."""
    hw = toy_hw()
    g = offload_optimizer(build_gpt_step(SPEC), hw, impl="deepspeed_cpu_adam_2020")
    res = run(g, hw)
    sp = res.spans[res.spans.step == res.spans.step.max()]
    start = dict(zip(sp.op_id, sp.start_s))
    end = dict(zip(sp.op_id, sp.end_s))
    syncs = [op for op in g.ops if op.name.startswith("offload.grad_sync.")]
    later = [op for op in g.ops if op.kind == OpKind.COMPUTE and op.stream == "compute"]
    checked = 0
    for s in syncs:
        copy_end = end[s.deps[0]]
        for op in later:
            if op.id > s.id:
                assert start[op.id] >= copy_end - 1e-15
                checked += 1
    assert checked > 0
