"""Recompute validation, activation offload, parameter offload with prefetch, and the what-if."""

from __future__ import annotations

import dataclasses

import pytest

from simulator import load_scenario, run_scenario, scenario_from_dict
from simulator.studies.whatif import largest_fitting, with_overrides
from simulator.api import resolve_hardware, simulate_graph
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.op_graph import GraphBuilder
from simulator.graph.ops import OpKind
from simulator.policies.offload_optimizer import offload_optimizer
from simulator.policies.offload_param import fetch_times, offload_param
from simulator.policies.recompute import offload_activations, recompute
from simulator.policies.registry import PolicyError
from tests.conftest import ROOT, make_hw
from tests.simulator.policies.test_offload_optimizer import toy_hw

FULL = TransformerSpec(num_layers=3, hidden_size=64, num_attention_heads=2, seq_length=32, vocab_size=64,
                       ffn_hidden_size=256, micro_batch_size=2, precision="bf16", recompute="full")


def test_recompute_on_a_model_without_blocks_is_an_error():
    b = GraphBuilder()
    b.add("embed", OpKind.COMPUTE, "compute", flops=1.0)
    with pytest.raises(PolicyError, match="no transformer blocks to recompute"):
        recompute(b.build(), "full")


def test_cpu_checkpointing_needs_full_recompute():
    g = build_gpt_step(dataclasses.replace(FULL, recompute="selective"))
    with pytest.raises(PolicyError, match="cpu_checkpointing: needs training.recompute_granularity: full"):
        recompute(g, "selective", cpu_checkpointing=True)


def test_activation_offload_bytes_and_memory():
    """Every block input goes D2H once and comes back H2D once, each on the compute stream (DeepSpeed's
    ``Tensor.to()``), from pageable memory, with a host wait after it; GPU peak does not grow."""
    g = build_gpt_step(FULL)
    g2 = offload_activations(g)
    T, h = FULL.micro_batch_size * FULL.seq_length, FULL.hidden_size
    d2h = [op for op in g2.ops if op.name.endswith("act_offload.d2h")]
    h2d = [op for op in g2.ops if op.name.endswith("act_offload.h2d")]
    assert len(d2h) == len(h2d) == FULL.num_layers
    assert sum(o.bytes_read for o in d2h) == sum(o.bytes_read for o in h2d) == FULL.num_layers * 2 * T * h
    assert {o.stream for o in d2h + h2d} == {"compute"} and not any(o.pinned for o in d2h + h2d)
    waits = [o for o in g2.ops if o.kind is OpKind.SYNC and o.name.endswith(".wait")]
    assert len(waits) == 2 * FULL.num_layers and all(o.stream == "host" for o in waits)
    assert sorted(w.deps[0] for w in waits) == sorted(o.id for o in d2h + h2d)
    hw = make_hw()
    a, b = simulate_graph(g, hw, 2, 1).summary, simulate_graph(g2, hw, 2, 1).summary
    assert b["peak_memory_bytes"] <= a["peak_memory_bytes"]
    assert b["peak_host_pageable_bytes"] == FULL.num_layers * 2 * T * h


def test_activation_offload_scenario_pays_its_copies():
    """GPT 184M b16 with full recompute on the H200 (bf16): the 12 block inputs (16 x 1024 x 1024 bf16 = 32 MiB
    each) go out and back at the measured pageable rates, not overlapped (DeepSpeed copies in line): by hand
    12 x (32 MiB / 12.88 GB/s + 32 MiB / 9.00 GB/s + 2 x 20.7 us) = 76.5 ms on top of the step; the rest of the
    growth is the launch-ahead lost at the 24 host waits (< 3%)."""
    cfg = load_scenario(ROOT / "scenarios/h200/gpt_184m_b16_ckpt.yaml")
    d = cfg.model_dump(mode="json", exclude_none=True)
    d["training"]["precision"] = "bf16"
    base = run_scenario(scenario_from_dict(d)).summary
    d["activation_checkpointing"] = {"cpu_checkpointing": True, "host_buffers": "reused"}  # copies only, no faults
    c2 = scenario_from_dict(d)
    off = run_scenario(c2).summary
    c = resolve_hardware(c2).copy
    n = 16 * 1024 * 1024 * 2
    copies = 12 * (n / c.pageable_d2h_bytes_per_s + n / c.pageable_h2d_bytes_per_s + 2 * c.latency_s)
    assert copies == pytest.approx(0.0765, abs=5e-4)
    assert copies <= off["step_time_s"] - base["step_time_s"] <= 1.03 * copies
    assert off["peak_memory_bytes"] <= base["peak_memory_bytes"]  # the peak is at the LM head, not the blocks
    assert off["peak_host_pageable_bytes"] == 12 * n  # all 12 bf16 block inputs on the host


#: Two blocks whose bf16 inputs are 16 x 1024 x 1024 x 2 B = 32 MiB each (8,192 pages): 64 MiB in all, mmap-ed.
BIG = TransformerSpec(num_layers=2, hidden_size=1024, num_attention_heads=8, seq_length=1024, vocab_size=64,
                      ffn_hidden_size=4096, micro_batch_size=16, precision="bf16", recompute="full")
PAGES = 16 * 1024 * 1024 * 2 // 4096


def _cpu(pf: float = 1e-6):
    from hardware_models.host import HostCpuSpec

    return HostCpuSpec("pf-cpu", 4, 1e10, page_fault_s=pf)


def test_fresh_checkpoint_buffers_fault_inside_the_d2h_copy():
    """fresh: each D2H copy carries its buffer's 8,192 faults as host time, 8.192 ms at 1 us a page; the H2D
    copies read resident pages (no faults); reused: none; prefaulted: a host op of the same seconds before
    each D2H copy, which then has none."""
    g = build_gpt_step(BIG)
    fresh = offload_activations(g, "fresh", _cpu())
    d2h = [o for o in fresh.ops if o.name.endswith("act_offload.d2h")]
    h2d = [o for o in fresh.ops if o.name.endswith("act_offload.h2d")]
    assert [o.host_s for o in d2h] == pytest.approx([PAGES * 1e-6] * 2, rel=1e-12)
    assert all(o.host_s == 0 for o in h2d)
    assert fresh.meta["activation_offload"]["first_touch_s"] == pytest.approx(2 * PAGES * 1e-6, rel=1e-12)
    assert fresh.meta["page_fault_s"] == fresh.meta["activation_offload"]["first_touch_s"]  # host_page_fault_s
    reused = offload_activations(g, "reused", _cpu())
    assert all(o.host_s == 0 for o in reused.ops if "act_offload" in o.name)
    pre = offload_activations(g, "prefaulted", _cpu())
    touch = {o.id: o for o in pre.ops if o.name.endswith("act_offload.prefault")}
    assert [o.host_s for o in touch.values()] == pytest.approx([PAGES * 1e-6] * 2, rel=1e-12)
    assert all(o.stream == "host" and o.kind is OpKind.HOST for o in touch.values())
    pd2h = [o for o in pre.ops if o.name.endswith("act_offload.d2h")]
    assert all(o.host_s == 0 and set(o.deps) & set(touch) for o in pd2h)


def test_small_checkpoint_buffers_come_from_the_heap():
    """FULL's three 8 KiB block inputs total far under glibc's 32 MiB mmap threshold: no faults in any mode."""
    for mode in ("fresh", "prefaulted"):
        g = offload_activations(build_gpt_step(FULL), mode, _cpu())
        assert g.meta["activation_offload"]["first_touch_s"] == 0
        assert all(o.host_s == 0 for o in g.ops if "act_offload" in o.name)


def test_unknown_host_buffers_is_refused():
    with pytest.raises(PolicyError, match="activation_checkpointing.host_buffers: unknown 'pinned'; allowed: fresh, "
                                          "prefaulted, reused"):
        offload_activations(build_gpt_step(FULL), "pinned")


def test_fresh_buffer_faults_add_to_the_step():
    """The blocking D2H copies sit on the critical path (the host waits for each): fresh costs exactly the
    faults more than reused, 2 x 8.192 ms; prefaulted moves them onto the host ahead of the copy, beside the
    queued kernels: between reused and fresh."""
    hw = dataclasses.replace(make_hw(), host_cpu=_cpu())
    g = build_gpt_step(BIG)
    t = {m: simulate_graph(offload_activations(g, m, _cpu()), hw, 2, 1).summary["step_time_s"]
         for m in ("fresh", "prefaulted", "reused")}
    assert t["fresh"] - t["reused"] == pytest.approx(2 * PAGES * 1e-6, rel=1e-9)
    assert t["reused"] <= t["prefaulted"] <= t["fresh"]


def _param_graph(depth: int, pcie: float):
    spec = dataclasses.replace(FULL, recompute="none")
    hw = toy_hw()
    hw = dataclasses.replace(hw, profile=dataclasses.replace(hw.profile, h2d_bytes_per_s=pcie, d2h_bytes_per_s=pcie,
                                                             duplex_bytes_per_s=2 * pcie))
    g = offload_param(offload_optimizer(build_gpt_step(spec), hw), depth)
    return g, hw, spec


def test_param_offload_fetches_each_block_twice():
    g, hw, spec = _param_graph(1, 1e9)
    fetches = [op for op in g.ops if op.name.endswith("offload_param.fetch")]
    assert len(fetches) == 2 * spec.num_layers
    assert all(op.bytes_read == 2 * spec.layer_params for op in fetches)
    assert not any(op.name.startswith("offload.h2d.params.L") for op in g.ops)


def test_prefetch_depth_hides_fetches_when_pcie_keeps_up():
    """On-demand fetching (depth 0) exposes every fetch; depth 2 hides them when PCIe is fast."""
    ex = {}
    for depth in (0, 2):
        g, hw, _ = _param_graph(depth, 1e11)
        r = simulate_graph(g, hw, 3, 1)
        ex[depth] = fetch_times(r.spans, r.steps, "offload_param.fetch")[1]
    assert ex[0] > 0 and ex[2] < ex[0]


def test_exposed_fetch_grows_when_pcie_cannot_keep_up():
    ex = []
    for pcie in (1e11, 1e8):
        g, hw, _ = _param_graph(1, pcie)
        r = simulate_graph(g, hw, 3, 1)
        ex.append(fetch_times(r.spans, r.steps, "offload_param.fetch")[1])
    assert ex[1] > 10 * ex[0]


def test_negative_prefetch_depth():
    with pytest.raises(PolicyError, match="prefetch_depth: must be >= 0"):
        _param_graph(-1, 1e9)
    import yaml

    d = yaml.safe_load(open(ROOT / "scenarios/h200/gpt_184m_b16_offload_overlap.yaml"))
    d["zero_optimization"].update(stage=3, offload_param={"device": "cpu", "prefetch_depth": -2})
    from simulator import ScenarioError

    with pytest.raises(ScenarioError, match="prefetch_depth must be >= 0"):
        scenario_from_dict(d)


def test_largest_fitting_with_and_without_offload():
    """On a GPU cut to 16 GB, offload frees the optimizer state: a deeper model fits."""
    base = load_scenario(ROOT / "scenarios/h200/gpt_184m_b16.yaml")
    base = with_overrides(base, **{"hardware.gpu": {"preset": "h200-sxm-141gb", "overrides": {"hbm_capacity_bytes": "8 GB"}},
                                   "training.micro_batch_size": 2})
    off = with_overrides(base, **{"training.precision": "bf16",
                                  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    a = largest_fitting(base, "model.num_layers", [12, 48, 96])
    b = largest_fitting(off, "model.num_layers", [12, 48, 96])
    assert list(a.columns[:3]) == ["value", "fits", "peak_memory_bytes"]
    assert a.attrs["largest"] is not None and b.attrs["largest"] > a.attrs["largest"]
    assert a.oom.dropna().str.contains("out of memory on gpu0.hbm").all()
