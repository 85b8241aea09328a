"""Data-parallel training on a cluster: buckets, collective pricing, exposed communication, ZeRO-1/2
memory, bad input (symmetric rank folding; one representative rank)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hardware_models.collectives import NcclConfig
from simulator.analysis.metrics import comm_exposure
from simulator.api import run_scenario, simulate_graph
from simulator.config.loader import load_scenario
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.op_graph import GraphBuilder
from simulator.graph.ops import CostClass, OpKind
from tests.conftest import ROOT, make_hw

B16 = ROOT / "scenarios/h200/gpt_184m_b16.yaml"
H100 = ["hardware.gpu=h100-sxm-80gb"]
DGX = H100 + ["hardware.cluster={preset: dgx-h100}"]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # the profile-for-another-GPU notice


# -- toy machine: alpha-beta collective model ------------------------------------------------------
class _ToyModel:
    """t = 10 us + bytes / 1 GB/s; host dispatch as given."""

    def __init__(self, dispatch_s: float = 0.0):
        self.profile = SimpleNamespace(host_dispatch_s=dispatch_s)
        self.calls: list = []

    def price(self, op, group, nbytes, nccl):
        self.calls.append((op, tuple(group), nbytes))
        return SimpleNamespace(time_s=10e-6 + nbytes / 1e9)


def _toy_hw(dispatch_s: float = 0.0):
    hw = make_hw()
    hw.collectives, hw.dp_group, hw.world_size = _ToyModel(dispatch_s), (0, 1), 2
    hw.nccl = NcclConfig(interference=False)  # these hand-worked cases price each side alone (see test_interference)
    return hw


def _toy_graph(b_waits_for_comm: bool):
    b = GraphBuilder()
    a = b.add("A", OpKind.COMPUTE, "compute", cost_class=CostClass.ELEMENTWISE, bytes_read=1e9)  # 1 ms at 1 TB/s
    c = b.add("AR", OpKind.COLLECTIVE, "comm.dp", deps=[a], meta={"collective": "all_reduce", "bytes": 1_000_000,
                                                                  "group": "dp"})
    b.add("B", OpKind.COMPUTE, "compute", deps=[c] if b_waits_for_comm else [], cost_class=CostClass.ELEMENTWISE,
          bytes_read=1e9)
    return b.build(samples_per_step=1.0)


def test_collective_priced_by_the_model_and_exposed_when_compute_waits():
    # A 1 ms; all-reduce 10 us + 1e6 B / 1 GB/s = 1.01 ms; B 1 ms after it: step 3.01 ms, exposed 1.01 ms
    hw = _toy_hw()
    s = simulate_graph(_toy_graph(True), hw, steps=1).summary
    assert s["step_time_s"] == pytest.approx(3.01e-3, rel=1e-9)
    assert s["exposed_comm_s"] == pytest.approx(1.01e-3, rel=1e-9)
    assert s["comm_s_by_group"] == {"dp": pytest.approx(1.01e-3, rel=1e-9)}
    assert hw.collectives.calls == [("all_reduce", (0, 1), 1_000_000)]


def test_overlapped_collective_hides_behind_compute():
    # B runs beside the all-reduce: step = 1 + 1.01 ms, exposed = the 10 us past B's end
    s = simulate_graph(_toy_graph(False), _toy_hw(), steps=1).summary
    assert s["step_time_s"] == pytest.approx(2.01e-3, rel=1e-9)
    assert s["exposed_comm_s"] == pytest.approx(10e-6, rel=1e-6)


def test_collective_launch_costs_the_profiles_host_dispatch():
    # host: A launched at 0, the all-reduce costs 5 ms of host time, so B launches at 5 ms
    r = simulate_graph(_toy_graph(False), _toy_hw(dispatch_s=5e-3), steps=1)
    b = r.spans[r.spans.name == "B"].iloc[0]
    assert b.start_s == pytest.approx(5e-3, rel=1e-9)


def test_collective_without_a_model_keeps_todays_pricing():
    hw = make_hw()  # no cluster: collectives is None
    s = simulate_graph(_toy_graph(True), hw, steps=1).summary
    assert s["world_size"] == 1 and s["data_parallel_size"] == 1


def test_exposed_comm_on_two_compute_ops_by_hand():
    # compute [0,1] and [2,3], all-reduce [0.5,2.5] -> compute idle with comm in flight = [1,2] = 1 s
    spans = pd.DataFrame({"stream": ["compute", "compute", "comm.dp"], "kind": ["compute", "compute", "collective"],
                          "start_s": [0.0, 2.0, 0.5], "end_s": [1.0, 3.0, 2.5]})
    steps = pd.DataFrame({"step": [0], "start_s": [0.0], "end_s": [3.0], "warmup": [False]})
    exposed, by_group = comm_exposure(spans, steps)
    assert exposed == pytest.approx(1.0) and by_group == {"dp": pytest.approx(2.0)}


# -- buckets on a tiny model worked out by hand --------------------------------------------------------
TINY = dict(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=4, vocab_size=16, ffn_hidden_size=32,
            micro_batch_size=1)
# gradients in backward order (fp32 bytes): ln_f.w/b 32 32, fc2.b 32, fc2.w 1024, fc1.b 128, fc1.w 1024,
# ln2.w/b 32 32, proj.b 32, proj.w 256, qkv.b 96, qkv.w 768, ln1.w/b 32 32, wte 512, wpe 128 (= 4 x 1048 params)


def _colls(g):
    return [o for o in g.ops if o.kind is OpKind.COLLECTIVE]


def test_ddp_buckets_by_hand():
    # first cap 100 B: 32+32+32+1024 = 1120 closes; cap 1000 B: 128+1024 = 1152; 32+32+32+256+96+768 = 1216;
    # the rest (32+32+512+128 = 704) flushed at the end of backward
    g = build_gpt_step(TransformerSpec(**TINY, data_parallel_size=8, ddp_first_bucket_bytes=100,
                                       ddp_bucket_cap_bytes=1000))
    assert sum(p.numel for p in g.param_groups) == 1048 == g.meta["num_parameters"]
    cs = _colls(g)
    assert [c.meta["bytes"] for c in cs] == [1120, 1152, 1216, 704]
    assert {c.meta["collective"] for c in cs} == {"all_reduce"} and {c.stream for c in cs} == {"comm.dp"}
    by_op = {p.name: p.grad_op for p in g.param_groups}
    assert cs[0].id == by_op["L0.fc2.weight"] + 1 and cs[1].id == by_op["L0.fc1.weight"] + 1
    assert cs[3].id == by_op["wpe.weight"] + 1
    adam = next(o for o in g.ops if o.name.endswith("adamw"))
    assert {c.id for c in cs} <= set(adam.deps)


def test_ddp_reduces_only_the_last_micro_batch_and_overlap_off_waits_for_backward():
    g = build_gpt_step(TransformerSpec(**{**TINY, "micro_batch_size": 1}, num_micro_batches=2, data_parallel_size=8,
                                       ddp_first_bucket_bytes=100, ddp_bucket_cap_bytes=1000))
    cs = _colls(g)
    second_mb = [o.id for o in g.ops if o.name == "input.h2d" or o.name.endswith("input.h2d")][1]
    assert len(cs) == 4 and min(c.id for c in cs) > second_mb
    assert all(p.grad_op > second_mb for p in g.param_groups)
    g2 = build_gpt_step(TransformerSpec(**TINY, data_parallel_size=8, ddp_first_bucket_bytes=100,
                                        ddp_bucket_cap_bytes=1000, overlap_grad_reduce=False))
    last_bwd = max(o.id for o in g2.ops if o.phase.value == "bwd" and o.kind is OpKind.COMPUTE)
    assert [c.meta["bytes"] for c in _colls(g2)] == [1120, 1152, 1216, 704]
    assert all(last_bwd in c.deps for c in _colls(g2))


def test_zero2_deepspeed_buckets_by_hand():
    # flush before overflowing 300 elements: 280 | 32+256+8 = 296 | 8+8+64+24+192 = 296 | 8+8+128+32 = 176;
    # then the step's 4-byte gradient-norm all-reduce (grad_norm.deepspeed_zero_step) and one all-gather per
    # parameter group of the 1048 fp32 parameters: weight decay 256+256+64+192+128+32 = 928, no decay (biases and
    # norms) 8+8+8+32+16+8+24+16 = 120 (graph.builders: zero_param_groups)
    g = build_gpt_step(TransformerSpec(**TINY, data_parallel_size=8, zero_stage=2, reduce_bucket_elements=300,
                                       overlap_grad_reduce=True))
    cs = _colls(g)
    assert [(c.meta["collective"], c.meta["bytes"]) for c in cs] == [
        ("reduce_scatter", 4 * 280), ("reduce_scatter", 4 * 296), ("reduce_scatter", 4 * 296),
        ("reduce_scatter", 4 * 176), ("all_reduce", 4), ("all_gather", 4 * 928), ("all_gather", 4 * 120)]
    assert [t.nbytes for c in cs[:4] for t in c.allocs] == [140, 148, 148, 88]  # ceil(bytes / 8)


# -- the 184M GPT on a DGX H100 ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs():
    short = ["run.steps=3", "run.warmup_steps=1"]
    return {k: run_scenario(load_scenario(B16, short + o)).summary for k, o in {
        "dp1": H100, "dp8": DGX, "dp16": H100 + ["hardware.cluster={preset: dgx-h100, nodes: 2}"],
        "dp8_no_overlap": DGX + ["ddp.overlap_grad_reduce=false"],
        "dp8_alone": DGX + ["nccl.interference=false"]}.items()}


def test_dp8_is_slower_per_gpu_by_exactly_the_exposed_communication(runs):
    # without interference (each side priced alone); with it, overlapped kernels are slower too (test_interference)
    one, eight = runs["dp1"], runs["dp8_alone"]
    assert runs["dp8"]["step_time_s"] - one["step_time_s"] > runs["dp8"]["exposed_comm_s"]
    assert eight["world_size"] == 8 and eight["data_parallel_size"] == 8
    assert eight["samples_per_s"] / 8 < one["samples_per_s"]
    assert eight["exposed_comm_s"] > 0 and eight["comm_s_by_group"]["dp"] > eight["exposed_comm_s"]
    extra = eight["step_time_s"] - one["step_time_s"]
    assert extra == pytest.approx(eight["exposed_comm_s"], rel=0.02, abs=2e-6), (extra, eight["exposed_comm_s"])
    assert eight["model_flops_per_step"] == one["model_flops_per_step"]


def test_two_nodes_expose_more_communication(runs):
    assert runs["dp16"]["exposed_comm_s"] > runs["dp8"]["exposed_comm_s"]
    assert runs["dp16"]["comm_s_by_group"]["dp"] > runs["dp8"]["comm_s_by_group"]["dp"]


def test_no_overlap_exposes_every_bucket(runs):
    r = runs["dp8_no_overlap"]
    assert r["exposed_comm_s"] == pytest.approx(r["comm_s_by_group"]["dp"], rel=1e-6)
    assert r["step_time_s"] - runs["dp1"]["step_time_s"] == pytest.approx(r["exposed_comm_s"], rel=0.02)


def test_summary_prints_the_parallel_layout_and_communication(runs):
    from simulator.cli import format_summary

    r = runs["dp8"]
    text = format_summary(r, "dp8")
    assert "parallel            8 GPUs, data parallel 8" in text
    assert (f"communication       dp {r['comm_s_by_group']['dp'] * 1e3:.2f} ms per step; exposed "
            f"{r['exposed_comm_s'] * 1e3:.2f} ms") in text
    assert "communication" not in format_summary(runs["dp1"], "dp1")


def test_dp_warnings(runs):
    w = runs["dp8"]["warnings"]
    assert any("folded symmetrically" in x for x in w) and any("arXiv 2507.03114" in x for x in w)


@pytest.mark.parametrize("precision", ["amp_fp32_params", "bf16"])
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_sharding_memory_formula(stage, precision):
    """Adam state 8 Psi/dp and (bf16) fp32 master 4 Psi/dp; DDP's bucket buffer (4 Psi) is gone."""
    # the same loss in both (bf16 without ZeRO defaults to Megatron's cross-entropy, under ZeRO to F.cross_entropy)
    common = ["run.steps=2", "run.warmup_steps=1", f"training.precision={precision}", "training.cross_entropy=pytorch"]
    z = run_scenario(load_scenario(B16, common + DGX + [f"zero_optimization.stage={stage}"])).summary
    d = run_scenario(load_scenario(B16, common + DGX)).summary
    P, dp = 185_759_744, 8
    shard = -(-P // dp)
    cat = z["peak_memory_by_category_bytes"]
    assert cat["optimizer"] == pytest.approx(8 * shard, rel=0.01)
    params = 4 * P if precision == "amp_fp32_params" else 2 * P + 4 * shard
    assert cat["params"] == pytest.approx(params, rel=0.01)
    if stage == 1:  # same activations and gradients as DDP, minus the bucket buffer and 7/8 of the states, plus
        # DeepSpeed's IPG buffer (contiguous_gradients; no overlap_comm: one) of reduce_bucket_size 5e8 elements in
        # the model dtype (fp32 parameters: 4 bytes, bf16: 2)
        saved = 4 * P + 8 * (P - shard) + (4 * (P - shard) if precision == "bf16" else 0)
        ipg = 500_000_000 * (4 if precision == "amp_fp32_params" else 2)
        assert d["peak_memory_bytes"] - z["peak_memory_bytes"] == pytest.approx(saved - ipg, rel=0.01)
    assert "shards nothing" not in " ".join(z["warnings"])


def _small(extra):
    base = ["model.num_layers=2", "model.hidden_size=512", "model.num_attention_heads=8", "model.seq_length=256",
            "training.micro_batch_size=2", "run.steps=2", "run.warmup_steps=1"]
    return load_scenario(B16, base + DGX + extra)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.floats(50e9, 900e9), st.floats(1.01, 4.0), st.sampled_from([True, False]))
def test_more_nvlink_bandwidth_is_never_slower(bw, factor, overlap):
    def step(b):
        cfg = _small([f"hardware.cluster.overrides={{nvlink_bytes_per_s: {b}}}", f"ddp.overlap_grad_reduce={overlap}"])
        return run_scenario(cfg).summary["step_time_s"]

    assert step(bw * factor) <= step(bw) + 1e-12


@pytest.mark.parametrize("sets,needle", [
    (["parallelism.data_parallel_size=8"], "parallelism.data_parallel_size: 8 > 1 needs hardware.cluster"),
    (DGX + ["parallelism.data_parallel_size=4"], "parallelism.data_parallel_size: 4 does not match the world size 8"),
    (["hardware.cluster={preset: dgx-h100}"], "hardware.gpu: 'h200-sxm-141gb' is not the GPU of cluster"),
    (H100 + ["hardware.cluster={preset: dgx-nope}"], "hardware.cluster.preset: unknown cluster preset"),
    (H100 + ["hardware.cluster={preset: dgx-h100, nodes: 2, network: nope}"], "hardware.cluster.network: unknown"),
    (H100 + ["hardware.cluster={preset: dgx-h100, collective_profile: nope}"], "hardware.cluster.collective_profile"),
    (DGX + ["zero_optimization.stage=3"], "zero_optimization.stage: 3 with data_parallel_size > 1 needs training.precision bf16"),
    (DGX + ["nccl.algo=Foo"], "nccl.algo: 'Foo' is not modelled"),
    (["hardware.gpu=a100-sxm4-80gb", "hardware.cluster={preset: dgx-a100}", "nccl.algo=NVLS"], "nccl.algo: NVLS needs"),
])
def test_bad_input_one_line_exit_2(sets, needle):
    args = [a for s in sets for a in ("--set", s)]
    r = subprocess.run([sys.executable, "-m", "simulator", "run", str(B16), *args], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    lines = [x for x in r.stderr.strip().splitlines() if not x.startswith("warning")]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr


def test_gradient_as_bucket_view_keeps_the_buckets_and_drops_the_grad_copies():
    """DDP's fp32 buckets (4 bytes/param) persist either way; without the view the ``.grad`` tensors
    are a second copy allocated in backward, with it they are views (PyTorch DDP docs)."""
    small = DGX + ["training.micro_batch_size=1", "model.seq_length=128", "run.steps=2"]
    peak = {v: run_scenario(load_scenario(B16, small + [f"ddp.gradient_as_bucket_view={v}"])).summary
            for v in ("false", "true")}
    params = peak["true"]["peak_memory_by_category_bytes"]["params"] // 4  # fp32 parameters
    assert peak["true"]["peak_memory_by_category_bytes"]["grad"] == 4 * params
    assert peak["false"]["peak_memory_by_category_bytes"]["grad"] > 1.9 * 4 * params
    assert peak["false"]["peak_memory_bytes"] > peak["true"]["peak_memory_bytes"]


def test_gradient_as_bucket_view_does_not_lower_a_forward_peak():
    """At the end of forward the buckets are already allocated, view or not (the fresh-user report)."""
    runs = {v: run_scenario(load_scenario(B16, DGX + ["run.steps=2", f"ddp.gradient_as_bucket_view={v}"])).summary
            for v in ("false", "true")}
    assert runs["true"]["peak_memory_bytes"] == runs["false"]["peak_memory_bytes"]


@pytest.mark.parametrize("overlap,buffers", [(False, 1), (True, 2)])
def test_deepspeed_zero1_ipg_buffers_add_exactly_their_bytes(overlap, buffers):
    """DeepSpeed ZeRO-1's IPG buffers (microsoft/DeepSpeed@cde57d2 ``deepspeed/runtime/zero/stage_1_and_2.py``,
    ``DeepSpeedZeroOptimizer.backward``: ``torch.empty(reduce_bucket_size, dtype=self.dtype)``, a second with
    ``overlap_comm``; ``contiguous_gradients`` default true). A 2-layer GPT, bf16, 8-way ZeRO-1, reduce_bucket_size
    R = 3,000,000 elements: the buffers live from the backward's start to the last reduce-scatter, so they are
    part of the peak (start of backward or end of backward) and the peak grows by exactly buffers x R x 2 bytes:
    6,000,000 B (one, overlap_comm false) or 12,000,000 B (two). With contiguous_gradients false: no buffer."""
    R = 3_000_000
    common = ["zero_optimization.stage=1", "training.precision=bf16", f"zero_optimization.reduce_bucket_size={R}",
              f"zero_optimization.overlap_comm={str(overlap).lower()}"]
    on = run_scenario(_small(common)).summary["peak_memory_bytes"]
    off = run_scenario(_small(common + ["zero_optimization.contiguous_gradients=false"])).summary["peak_memory_bytes"]
    assert on - off == buffers * R * 2


def test_deepspeed_zero2_gradients_live_in_the_ipg_buffer():
    """ZeRO-2 with IPG buffers, by hand on the graph: each micro-batch's backward allocates its own buffer of
    buffers x R x 2 bytes (bf16; DeepSpeed releases it in ``independent_gradient_partition_epilogue``), every
    gradient no larger than R is copied into it (``reduce_independent_p_g_buckets_and_remove_grads``) and has no
    tensor of its own, one larger than R (the tied 32,768 x 512 = 16.8M-element embedding with R = 4M) keeps its own
    (DeepSpeed's ``extra_large_param_to_reduce``), and every reduce-scatter reads the buffer. Without
    contiguous_gradients every weight gradient is its own tensor and no buffer exists."""
    from simulator.api import transformer_spec
    from simulator.engine.memory import category

    R = 4_000_000
    base = ["zero_optimization.stage=2", "training.precision=bf16", f"zero_optimization.reduce_bucket_size={R}",
            "training.global_batch_size=32"]  # micro-batch 2 x dp 8 x 2 micro-batches
    g = build_gpt_step(transformer_spec(_small(base)))
    allocs = [(op.name, t.name, t.nbytes) for op in g.ops for t in op.allocs]
    bufs = [a for a in allocs if a[0] == "zero.ipg_buffer.alloc"]
    assert [n for *_, n in bufs] == [R * 2, R * 2]  # overlap_comm false: one per micro-batch's backward
    assert {category(t) for op, t, _ in allocs if op == "zero.ipg_buffer.alloc"} == {"grad"}  # not activations
    grads = [(t, n) for op, t, n in allocs if t.startswith("grad.") and ".shard" not in t and "ipg_buffer" not in t
             and not op.startswith("opt.")]  # (the step's fp64 / fp32 copies: grad_norm.deepspeed_zero_step)
    assert grads and {t.split(".mb")[0] for t, _ in grads} == {"grad.wte"}  # only the oversized embedding
    assert [n for _, n in grads] == [2 * 32768 * 512] * 2
    rs = [op for op in g.ops if op.name.startswith("zero.grad_reduce_scatter")]
    assert rs and all(any(u.startswith("grad.ipg_buffer") for u in op.uses) for op in rs)
    g_off = build_gpt_step(transformer_spec(_small(base + ["zero_optimization.contiguous_gradients=false"])))
    names = [t.name for op in g_off.ops for t in op.allocs]
    assert not any(n.startswith("grad.ipg_buffer") for n in names)
    assert sum(n.startswith("grad.L0.") for n in names) == 2 * 4  # qkv, proj, fc1, fc2 weights per micro-batch
