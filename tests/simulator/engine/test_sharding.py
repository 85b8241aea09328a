"""Sharded data parallelism: DeepSpeed ZeRO-3, PyTorch FSDP, Megatron-LM distributed optimizer.

Collective byte counts on a tiny model worked out by hand (exact), the prefetch schedule's issue
order, memory per rank by the ZeRO paper's formula (Rajbhandari et al., SC20, section 5: stage 3
holds (2 + 2 + K) Psi / Nd bytes, K = 12 for mixed-precision Adam), prefetch that overlaps, and the
one-line refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest

from simulator.api import run_scenario
from simulator.config.loader import load_scenario
from simulator.graph.builders.sharding import (ShardingSpec, backward_param_order, megatron_buckets,
                                               zero3_prefetch_depth)
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.ops import OpKind, Phase
from tests.conftest import ROOT

B16 = ROOT / "scenarios/h200/gpt_184m_b16.yaml"
DGX = ["hardware.gpu=h100-sxm-80gb", "hardware.cluster={preset: dgx-h100}"]
SMALL = ["model.num_layers=4", "training.micro_batch_size=8", "run.steps=2", "run.warmup_steps=1"]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# 1 layer, h 8, f 32, V 16, s 4, biases, tied: P = 1048. Root (wte 128, wpe 32, ln_f 16) = 176, block = 872.
TINY = dict(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=4, vocab_size=16, ffn_hidden_size=32,
            micro_batch_size=1, data_parallel_size=8)
P = 1048


def _colls(g):
    return [o for o in g.ops if o.kind is OpKind.COLLECTIVE]


def _zero3(threshold=0, depth=1, layers=1):
    sh = ShardingSpec("zero3", 8, fwd_prefetch_depth=depth, bwd_prefetch_depth=depth, reshard_root=True,
                      persistence_threshold=threshold)
    return build_gpt_step(TransformerSpec(**{**TINY, "num_layers": layers}, precision="bf16", zero_stage=3,
                                          sharding=sh))


def test_zero3_moves_3_psi_16bit_per_step():
    # forward all-gather (root 2 x 176, block 2 x 872), the same in backward, one reduce-scatter of 2 x 1048
    g = _zero3()
    cs = _colls(g)
    # ... and the step's 8-byte fp64 gradient-norm all-reduce (stage3.py get_grad_norm_direct; grad_norm.py)
    assert [(c.name, c.meta["bytes"]) for c in cs if c.phase is Phase.OPT] == [("zero.grad_norm.all_reduce", 8)]
    cs = [c for c in cs if c.phase is not Phase.OPT]
    assert [(c.name, c.meta["collective"], c.meta["bytes"]) for c in cs] == [
        ("root.fwd.param_all_gather", "all_gather", 352), ("L0.fwd.param_all_gather", "all_gather", 1744),
        ("root.bwd.param_all_gather", "all_gather", 352), ("L0.bwd.param_all_gather", "all_gather", 1744),
        ("zero3.grad_reduce_scatter.0", "reduce_scatter", 2 * P)]
    n = 8
    assert sum(c.meta["bytes"] for c in cs) * (n - 1) / n == 3 * (n - 1) / n * P * 2  # 3(n-1)/n Psi, 16-bit


def test_zero3_persistence_threshold_keeps_small_params_whole():
    # threshold 8: the norms (8 each), proj and fc2 biases stay whole: 48 per block + ln_f 16 = 64 elements,
    # gathered once after the step; qkv (24) and fc1 (32) biases are still gathered with their block
    g = _zero3(threshold=8)
    by = {c.name: c.meta["bytes"] for c in _colls(g)}
    assert by["L0.fwd.param_all_gather"] == by["L0.bwd.param_all_gather"] == 2 * (872 - 48)
    assert by["root.fwd.param_all_gather"] == 2 * (176 - 16)
    assert by["zero3.persistent_param_all_gather"] == 2 * 64
    assert by.pop("zero.grad_norm.all_reduce") == 8  # the step's fp64 norm (grad_norm.deepspeed_zero_step)
    assert sum(by.values()) == 2 * (3 * P - 64)
    assert {t.name: t.nbytes for t in g.persistent}["params.bf16.persistent"] == 2 * 64


def test_zero3_prefetch_depth_from_the_buckets():
    assert zero3_prefetch_depth(100, 10, 250, 10**9) == 2
    assert zero3_prefetch_depth(100, 10, 99, 10**9) == 0  # a block larger than the bucket: on demand
    assert zero3_prefetch_depth(100, 10, 10**9, 150) == 0  # two live blocks would exceed max_live
    assert zero3_prefetch_depth(100, 10, 10**9, 250) == 1
    assert zero3_prefetch_depth(100, 3, 10**9, 10**9) == 3


def test_prefetch_window_issue_order():
    # depth 1, 3 blocks: the gather of block k is issued when block k-1 starts and waits for block k-2's end
    g = _zero3(depth=1, layers=3)
    ag = [o for o in _colls(g) if o.meta["collective"] == "all_gather" and o.phase is Phase.FWD]
    assert [o.name for o in ag] == ["root.fwd.param_all_gather", "L0.fwd.param_all_gather",
                                    "L1.fwd.param_all_gather", "L2.fwd.param_all_gather"]
    first = {k: min(o.id for o in g.ops if o.layer == k and o.phase is Phase.FWD and o.kind is OpKind.COMPUTE)
             for k in range(3)}
    last = {k: max(o.id for o in g.ops if o.layer == k and o.phase is Phase.FWD and o.kind is OpKind.COMPUTE)
            for k in range(3)}
    embed = next(o.id for o in g.ops if o.name == "fwd.embed")
    assert ag[2].deps == (embed,) and ag[3].deps == (last[0],)  # L1 after the embedding, L2 after block 0
    assert ag[2].id < first[0] and ag[3].id < first[1]
    assert ag[1].id in g.ops[first[0]].deps and ag[3].id in g.ops[first[2]].deps
    d0 = _zero3(depth=0, layers=3)
    ag0 = [o for o in _colls(d0) if o.name == "L2.fwd.param_all_gather"][0]
    first2 = min(o.id for o in d0.ops if o.layer == 2 and o.phase is Phase.FWD and o.kind is OpKind.COMPUTE)
    assert ag0.id == first2 - 1  # on demand: issued right before its block


def _fsdp(strategy="full_shard", prefetch="pre", layers=2, param_bytes=2, grad_bytes=4, replicate=1, **kw):
    sh = ShardingSpec(strategy, 8 // replicate if replicate > 1 else 8, replicate, bwd_prefetch=prefetch,
                      reshard_after_forward=strategy != "shard_grad_op", param_bytes=param_bytes,
                      sharded_param_bytes=4, grad_bytes=grad_bytes, **kw)
    return build_gpt_step(TransformerSpec(**{**TINY, "num_layers": layers, "data_parallel_size": 8},
                                          precision="amp_fp32_params", sharding=sh))


def test_fsdp_full_shard_bytes_and_backward_prefetch_order():
    # DEFAULT mixed precision: bf16 gathers (root 352, blocks 1744), fp32 reduce-scatters (blocks 3488, root 704);
    # the root is not resharded after forward (no backward gather)
    names = {}
    for pf in ("pre", "post", None):
        cs = _colls(_fsdp(prefetch=pf))
        names[pf] = [c.name for c in cs if c.phase is Phase.BWD]
        assert [c.meta["bytes"] for c in cs if c.phase is Phase.FWD] == [352, 1744, 1744]
        assert sorted(c.meta["bytes"] for c in cs if c.phase is Phase.BWD) == [704, 1744, 1744, 3488, 3488]
    assert names["pre"] == names["post"] == ["L1.bwd.param_all_gather", "L0.bwd.param_all_gather",
                                             "fsdp.grad_reduce_scatter.0", "fsdp.grad_reduce_scatter.1",
                                             "fsdp.grad_reduce_scatter.2"]
    assert names[None] == ["L1.bwd.param_all_gather", "fsdp.grad_reduce_scatter.0", "L0.bwd.param_all_gather",
                           "fsdp.grad_reduce_scatter.1", "fsdp.grad_reduce_scatter.2"]
    g_pre, g_post = _fsdp(prefetch="pre"), _fsdp(prefetch="post")

    def l0_gather_dep(g):  # what its cast to the bf16 low-precision shard (the gather's only dep) waits for
        cast = next(o for o in g.ops if o.name == "L0.bwd.param_all_gather").deps
        assert g.ops[cast[0]].name == "L0.bwd.fsdp.low_precision_shard" and len(cast) == 1
        return g.ops[g.ops[cast[0]].deps[0]]

    # BACKWARD_PRE issues it as block 1's backward starts, BACKWARD_POST after block 1's gradients
    assert l0_gather_dep(g_pre).layer == -1
    assert l0_gather_dep(g_post).layer == 1 and l0_gather_dep(g_post).phase is Phase.BWD


def test_fsdp_pure_full_shard_is_3_psi_and_shard_grad_op_skips_the_backward_gather():
    pure = _colls(_fsdp(grad_bytes=2))
    assert sum(c.meta["bytes"] for c in pure) == 2 * 2 * (2 * 872 + 176) + 2 * (2 * 872 + 176) - 2 * 176
    sgo = _fsdp("shard_grad_op")
    assert not [c for c in _colls(sgo) if c.meta["collective"] == "all_gather" and c.phase is Phase.BWD]
    fwd_w = next(o for o in sgo.ops if o.name == "L0.fwd.fc1.gemm").uses[1]
    assert fwd_w in next(o for o in sgo.ops if o.name == "L0.bwd.fc1.dgrad").uses  # kept from forward


@pytest.mark.parametrize("strategy", ["shard_grad_op", "full_shard"])
def test_fsdp_fp32_gathered_params_live_until_the_units_backward(strategy):
    """fp32 param_dtype under autocast: the GEMMs read bf16 casts (saved for backward), yet FSDP keeps the unit's
    unsharded fp32 flat parameter (4 x 872 = 3488 bytes per block) until its post-backward reshard: kept from
    forward by SHARD_GRAD_OP, gathered again by FULL_SHARD; a backward GEMM of the block reads it (was: its last
    reader the forward cast, so SHARD_GRAD_OP showed FULL_SHARD's peak)."""
    g = _fsdp(strategy, param_bytes=4)
    fwd_gather = next(o for o in g.ops if o.name == "L0.fwd.param_all_gather")
    assert [a.nbytes for a in fwd_gather.allocs] == [4 * 872]
    kept = fwd_gather.allocs[0].name if strategy == "shard_grad_op" else next(
        o for o in g.ops if o.name == "L0.bwd.param_all_gather").allocs[0].name
    readers = [o for o in g.ops if kept in o.uses]
    assert any(o.phase is Phase.BWD and o.layer == 0 and o.name.endswith(".dgrad") for o in readers)


def test_hybrid_shard_reduces_shards_across_nodes():
    cs = _colls(_fsdp("hybrid_shard", replicate=2, layers=1))  # shards of 4 ranks, 2 replicas: ceil(872 / 4) = 218
    ar = [c for c in cs if c.meta["group"] == "dp_replicate"]
    assert [(c.meta["collective"], c.meta["bytes"]) for c in ar] == [("all_reduce", 4 * 218), ("all_reduce", 4 * 44)]
    assert {c.meta["group"] for c in cs} == {"dp_shard", "dp_replicate"}
    assert {c.stream for c in ar} == {"comm.dp_replicate"}


def test_megatron_distributed_optimizer_buckets_by_hand():
    # backward order: ln_f 8 8 | fc2.b 8, fc2.w 256, fc1.b 32 -> 312 | fc1.w 256, ln2 8 8, proj.b 8, proj.w 64 -> 344
    # | qkv.b 24, qkv.w 192, ln1 8 8, wte 128 -> 360 | wpe 32
    spec = TransformerSpec(**TINY, precision="bf16",
                           sharding=ShardingSpec("distributed_optimizer", 8, grad_bytes=4, bucket_elements=300))
    assert [sum(backward_param_order(spec)[i][2] for i in b)
            for b in megatron_buckets([k for *_, k in backward_param_order(spec)], 300)] == [312, 344, 360, 32]
    cs = _colls(build_gpt_step(spec))
    assert [(c.meta["collective"], c.meta["bytes"], c.phase) for c in cs] == (
        [("reduce_scatter", 4 * n, Phase.BWD) for n in (312, 344, 360, 32)]
        + [("all_reduce", 4, Phase.OPT)]  # the squared gradient norm over every rank (clip_grad, Megatron's 1.0)
        + [("all_gather", 2 * n, Phase.OPT) for n in (312, 344, 360, 32)])
    g = build_gpt_step(TransformerSpec(**TINY, precision="bf16", sharding=ShardingSpec(
        "distributed_optimizer", 8, grad_bytes=4, bucket_elements=300, overlap_param_gather=True)))
    ag = [c for c in _colls(g) if c.meta["collective"] == "all_gather"]
    assert [c.phase for c in ag] == [Phase.FWD] * 4 and [c.meta["bytes"] for c in ag] == [64, 720, 688, 624]
    embed = next(o for o in g.ops if o.name == "fwd.embed")
    first = min(o.id for o in g.ops if o.layer == 0 and o.kind is OpKind.COMPUTE)
    assert set(embed.deps) >= {ag[0].id, ag[1].id}  # wpe and wte
    assert set(g.ops[first].deps) >= {ag[1].id, ag[2].id, ag[3].id}  # block 0 spans three buckets


@pytest.mark.parametrize("kw", [dict(), dict(tied_embeddings=False), dict(bias=False, normalization="RMSNorm",
                                position_embedding="rope", swiglu=True)])
def test_backward_param_order_is_the_builders(kw):
    spec = TransformerSpec(**{**TINY, "num_layers": 2}, **kw)
    g = build_gpt_step(spec)
    assert [(p.name, p.numel) for p in g.param_groups] == [(n, k) for n, _, k in backward_param_order(spec)]


# -- memory per rank and step time on a small model (engine) -------------------------------------------
def _run(extra):
    return run_scenario(load_scenario(B16, SMALL + DGX + extra))


def _end_of_step_bytes(r) -> int:
    """Live tensor bytes after the last step (transients freed): the model states."""
    c = r.counters[(r.counters.metric == "memory_bytes") & (r.counters.scope == "gpu0.hbm")]
    return int(c.sort_values("t_s").value.iloc[-1])


@pytest.fixture(scope="module")
def runs():
    z3 = ["training.precision=bf16", "zero_optimization.stage=3"]
    return {k: _run(v) for k, v in {
        "zero3": z3 + ["zero_optimization.stage3_param_persistence_threshold=0"],
        "zero3_on_demand": z3 + ["zero_optimization.stage3_param_persistence_threshold=0",
                                 "zero_optimization.stage3_prefetch_bucket_size=1"],
        "fsdp": ["fsdp={sharding_strategy: FULL_SHARD}"],
        "fsdp_no_prefetch": ["fsdp={sharding_strategy: FULL_SHARD, backward_prefetch: null}"],
        "megatron": ["training.precision=bf16", "ddp.use_distributed_optimizer=true"],
    }.items()}


def _psi(r) -> int:
    return r.summary["num_parameters"]


def test_zero3_memory_is_the_zero_paper_formula(runs):
    r = runs["zero3"]
    psi, nd = _psi(r), 8
    assert _end_of_step_bytes(r) == pytest.approx((2 + 2 + 12) * psi / nd, rel=0.01)
    cat = r.summary["peak_memory_by_category_bytes"]
    assert cat["optimizer"] == pytest.approx(8 * psi / nd, rel=0.01)


def test_fsdp_and_megatron_memory_formulas(runs):
    psi, nd = _psi(runs["fsdp"]), 8
    # FSDP: fp32 shard + Adam moments persist; the fp32 sharded gradients live from backward to the step
    assert _end_of_step_bytes(runs["fsdp"]) == pytest.approx(12 * psi / nd, rel=0.01)
    assert runs["fsdp"].summary["peak_memory_by_category_bytes"]["optimizer"] == pytest.approx(8 * psi / nd, rel=0.01)
    # Megatron distributed optimizer: bf16 params and fp32 grad buffer whole, 12 bytes/param sharded (6 + 12/d)
    assert _end_of_step_bytes(runs["megatron"]) == pytest.approx((6 + 12 / nd) * psi, rel=0.01)


def test_prefetch_overlaps_the_gathers(runs):
    for fast, slow in (("zero3", "zero3_on_demand"), ("fsdp", "fsdp_no_prefetch")):
        a, b = runs[fast].summary, runs[slow].summary
        assert a["step_time_s"] < b["step_time_s"], (fast, a["step_time_s"], b["step_time_s"])
        assert a["exposed_comm_s"] < b["exposed_comm_s"]


def test_hybrid_shard_two_nodes_runs_with_both_groups():
    s = run_scenario(load_scenario(B16, SMALL + ["hardware.gpu=h100-sxm-80gb",
                                                 "hardware.cluster={preset: dgx-h100, nodes: 2}",
                                                 "fsdp={sharding_strategy: HYBRID_SHARD}"])).summary
    assert set(s["comm_s_by_group"]) == {"dp_shard", "dp_replicate"}
    assert s["data_parallel_size"] == 16


@pytest.mark.parametrize("sets,needle", [
    (["fsdp={sharding_strategy: FULL_SHARD}", "zero_optimization.stage=2"], "fsdp: exclusive with zero_optimization"),
    (["fsdp={sharding_strategy: FULL_SHARD}", "ddp.use_distributed_optimizer=true"],
     "fsdp: exclusive with ddp.use_distributed_optimizer"),
    (["fsdp={cpu_offload: true}", "parallelism.pipeline_model_parallel_size=2",
      "model.untie_embeddings_and_output_weights=true"],
     "fsdp.cpu_offload with pipeline_model_parallel_size > 1 is not modelled yet"),
    (["fsdp={sharding_strategy: FULL_SHARD}", "training.precision=bf16"], "fsdp: training.precision bf16 is not"),
    (["fsdp={sharding_strategy: ZERO}"], "sharding_strategy"),
    (["ddp.overlap_param_gather=true"], "ddp.overlap_param_gather needs ddp.use_distributed_optimizer"),
    (["ddp.use_distributed_optimizer=true", "zero_optimization.stage=1"],
     "ddp.use_distributed_optimizer: exclusive with zero_optimization.stage 1"),
    (["ddp.use_distributed_optimizer=true"], "ddp.use_distributed_optimizer needs training.precision bf16"),
])
def test_bad_input_one_line_exit_2(sets, needle):
    args = [a for s in DGX + sets for a in ("--set", s)]
    r = subprocess.run([sys.executable, "-m", "simulator", "run", str(B16), *args], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    lines = [x for x in r.stderr.strip().splitlines() if not x.startswith("warning")]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr


# -- gradient accumulation: ZeRO-2/3 and FSDP reduce every micro-batch ----------------------------------------
def _accum(m: int, **kw):
    return build_gpt_step(TransformerSpec(**{**TINY, **kw}, num_micro_batches=m))


@pytest.mark.parametrize("kw", [
    dict(precision="bf16", zero_stage=2),
    dict(precision="bf16", zero_stage=3, sharding=ShardingSpec("zero3", 8, reshard_root=True)),
    dict(sharding=ShardingSpec("full_shard", 8, param_bytes=4, sharded_param_bytes=4, grad_bytes=4)),
])
def test_sharded_strategies_reduce_every_micro_batch(kw):
    """Three micro-batches: every collective of the one-micro-batch step runs three times (the gathers of
    ZeRO-3/FSDP and the gradient reduce-scatters), and the reduced shards of micro-batches 1 and 2 are
    added into the step's shards by one elementwise pass each (reads partial + shard, writes the shard)."""
    one, three = _colls(_accum(1, **kw)), _colls(_accum(3, **kw))
    passes = lambda cs: sorted(c.meta["bytes"] for c in cs if c.phase is not Phase.OPT)  # noqa: E731
    assert passes(three) == sorted(3 * passes(one))
    # the optimizer's parameter all-gather (ZeRO-1/2) or persistent gather (ZeRO-3) stays once per step
    assert [c.meta["bytes"] for c in three if c.phase is Phase.OPT] == [c.meta["bytes"] for c in one
                                                                       if c.phase is Phase.OPT]
    rs = [c for c in one if c.meta["collective"] == "reduce_scatter"]
    shard_bytes = sum(a.nbytes for c in rs for a in c.allocs) or 2 * -(-P // 8)  # ZeRO-3: the 16-bit partition
    g = _accum(3, **kw)
    acc = [o for o in g.ops if o.name.endswith("grad.shard_accum")]
    assert len(acc) == 2 and all(o.bytes_written == shard_bytes and o.bytes_read == 2 * shard_bytes for o in acc)
    # each accumulation waits for that micro-batch's reductions (the epilogue's wait for the reduction stream)
    for o in acc:
        assert {c.id for c in _colls(g) if c.meta["collective"] == "reduce_scatter"} & set(o.deps)


def test_zero2_accumulation_frees_full_gradients_each_micro_batch():
    """ZeRO-2 with 2 micro-batches on 8 ranks: a gradient tensor per micro-batch, each freed by its
    reduce-scatter (read by it), so 2 x the buckets' gradient tensors appear, none held into the step."""
    g = _accum(2, precision="bf16", zero_stage=2)
    grads = {a.name for o in g.ops for a in o.allocs if a.name.startswith("grad.") and ".mb" in a.name}
    assert {t.rsplit(".mb", 1)[1] for t in grads} == {"0", "1"}
    opt = [o for o in g.ops if o.phase is Phase.OPT]
    assert not any(t in grads for o in opt for t in o.uses)


@pytest.mark.parametrize("overlap", [False, True])
def test_zero2_one_micro_batch_reduces_each_bucket_in_backward(overlap):
    """ZeRO-2, one micro-batch, 300-element buckets (test_data_parallel: 280 | 296 | 296 | 176 elements): each
    reduce-scatter depends only on its own bucket's gradients (DeepSpeed reduces from the backward hook whatever
    overlap_comm), reads (frees) them and keeps a ceil(bytes / 8) shard, all 16-bit in bf16; without overlap_comm the compute stream
    waits for each one before going on."""
    g = _accum(1, precision="bf16", zero_stage=2, reduce_bucket_elements=300, overlap_grad_reduce=overlap)
    rs = [c for c in _colls(g) if c.meta["collective"] == "reduce_scatter"]
    assert [c.meta["bytes"] for c in rs] == [2 * 280, 2 * 296, 2 * 296, 2 * 176]  # bf16 (the model dtype)
    assert [a.nbytes for c in rs for a in c.allocs] == [70, 74, 74, 44]
    last_bwd = max(o.id for o in g.ops if o.phase is Phase.BWD and o.kind is OpKind.COMPUTE)
    assert all(c.uses for c in rs) and all(last_bwd not in c.deps for c in rs[:3])
    assert all(c.id < last_bwd for c in rs[:3])  # reduced while backward still runs
    waited = {d for o in g.ops if o.kind is OpKind.COMPUTE and o.phase is Phase.BWD for d in o.deps}
    assert all((c.id in waited) != overlap for c in rs[:3])


def test_zero2_one_micro_batch_holds_less_gradient_memory_than_zero1():
    """GPT 1.3B cut to 4 layers (P = 270.6M) on a DGX H100, bf16, full recompute, one micro-batch of 1: ZeRO-1's
    peak is the end of backward with the whole gradients (bf16, DeepSpeed's model dtype: 0.54 GB); ZeRO-2 frees
    each 5M-element bucket's gradients after its reduce-scatter, so no gradient category is large at its peak
    (was: the same peak)."""
    def run(*sets):
        cfg = load_scenario(ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml", [
            "model.num_layers=4", "training.micro_batch_size=1", "run.steps=2", "run.warmup_steps=1",
            "training.precision=bf16", "training.recompute_granularity=full", *sets])
        return run_scenario(cfg).summary
    z1 = run("zero_optimization.stage=1")
    z2 = run("zero_optimization.stage=2", "zero_optimization.reduce_bucket_size=5000000")
    P = z1["num_parameters"]
    assert z1["peak_memory_by_category_bytes"]["grad"] > 0.95 * 2 * P
    # at most: the shards, two buckets and the tied embedding's gradient (made first by the head, reduced last)
    assert z2["peak_memory_by_category_bytes"].get("grad", 0) <= 2 * -(-P // 8) + 2 * 2 * 5_000_000 + 2 * 32768 * 2048
    assert z2["peak_memory_bytes"] < z1["peak_memory_bytes"] - 0.4 * 2 * P


def test_zero1_accumulation_still_reduces_once():
    one, two = _colls(_accum(1, precision="bf16", zero_stage=1)), _colls(_accum(2, precision="bf16", zero_stage=1))
    assert [c.meta["bytes"] for c in one] == [c.meta["bytes"] for c in two]


def test_accumulation_runs_and_shards_memory():
    """GPT 4 layers on a DGX H100 at 2 micro-batches (global batch 128): ZeRO-2 holds less gradient memory
    than ZeRO-1 (the shards plus one micro-batch's unreduced buckets instead of whole fp32 gradients) and takes
    longer (a reduce-scatter per micro-batch where ZeRO-1 reduces once)."""
    def run(*sets):
        cfg = load_scenario(B16, [*DGX, *SMALL, "training.precision=bf16", "training.global_batch_size=128", *sets])
        return run_scenario(cfg).summary
    z1, z2 = run("zero_optimization.stage=1"), run("zero_optimization.stage=2")
    # the wait for micro-batch 0's reduce-scatters belongs to its backward (was booked in the next forward)
    assert z2["phase_s"]["fwd_s"] == pytest.approx(z1["phase_s"]["fwd_s"], rel=1e-9)
    assert z2["peak_device_memory_bytes"] < z1["peak_device_memory_bytes"]
    assert z2["step_time_s"] > z1["step_time_s"]
    z3 = run("zero_optimization.stage=3")
    assert z3["peak_device_memory_bytes"] < z2["peak_device_memory_bytes"]


def test_zero3_with_tensor_parallelism_shards_each_tp_ranks_parameters():
    """ZeRO-3 on 4 data-parallel x 2 tensor-parallel ranks: each TP rank's own parameters are partitioned over
    its data-parallel group. By hand (TINY, t = 2): the vocabulary padded to 128 t = 256 rows, 128 per rank;
    root = 128 x 8 (token rows) + 32 (positions) + 16 (final norm) = 1072; block per TP rank = QKV 8 x 24 / 2 +
    12 bias, proj 8 x 8 / 2 + 8, fc1 8 x 32 / 2 + 16, fc2 32 x 8 / 2 + 8, two norms 32 = 460; so the gathers are
    2 x 1072 and 2 x 460 bytes (16-bit) each pass, the reduce-scatter 2 x 1532, and the persistent states
    (2 + 2 + 4 + 4 + 4) bytes x 1532 / 4 per rank."""
    sh = ShardingSpec("zero3", 4, reshard_root=True)
    g = build_gpt_step(TransformerSpec(**{**TINY, "data_parallel_size": 4}, tensor_parallel_size=2, precision="bf16",
                                       zero_stage=3, sharding=sh))
    dp = [(c.name, c.meta["bytes"]) for c in _colls(g) if c.meta["group"] == "dp"]
    assert dp == [("root.fwd.param_all_gather", 2144), ("L0.fwd.param_all_gather", 920),
                  ("root.bwd.param_all_gather", 2144), ("L0.bwd.param_all_gather", 920),
                  ("zero3.grad_reduce_scatter.0", 3064), ("zero.grad_norm.all_reduce", 8)]
    assert sum(t.nbytes for t in g.persistent) == 16 * 1532 // 4


def _stage_spec(p, r, v=1, **kw):
    return TransformerSpec(**{**TINY, "num_layers": 4, "data_parallel_size": 2}, pipeline_parallel_size=p,
                           pipeline_rank=r, virtual_pipeline_size=v, num_micro_batches=2 * p,
                           pipeline_schedule="1f1b" if v == 1 else "interleaved_1f1b", **kw)


@pytest.mark.parametrize("v,kw", [(1, {}), (1, dict(tied_embeddings=False)), (2, {})])
def test_backward_param_order_per_pipeline_chunk_is_the_builders(v, kw):
    """With a pipeline each model chunk's order is its own: the last rank's head (the tied token table's copy, or
    the untied LM head) and final norm, its blocks in reverse, the embeddings on chunk 0; the builder finishes the
    chunks' gradients in the order of their last backward passes."""
    from simulator.graph.builders.pipeline import Action, stage_actions

    for r in range(2):
        spec = _stage_spec(2, r, v, **kw)
        done = [spec.model_chunks[a.chunk] for a in stage_actions(spec.pipeline_schedule, 2, 4, r, v)
                if isinstance(a, Action) and a.kind == "B" and a.last]
        want = [(n, k) for c in done for n, _, k in backward_param_order(spec, c)]
        assert [(p.name, p.numel) for p in build_gpt_step(spec).param_groups] == want
    last = backward_param_order(_stage_spec(2, 1, **kw), 1)
    assert last[0][0] == ("lm_head.weight" if kw else "wte.weight") and last[-1][0] == "L2.ln1.bias"


@pytest.mark.parametrize("v", [1, 2])
def test_distributed_optimizer_with_pipeline_shards_each_stage(v):
    """Megatron distributed optimizer on 2 stages x 2 data-parallel ranks: each stage reduce-scatters its own
    gradients (4 bytes x its parameters) and all-gathers its 16-bit parameters after the step (2 bytes x them),
    and holds 2 P (bf16) + 4 P (fp32 grad buffer) + 12 ceil(P / 2) (master, Adam moments), P its parameters.
    By hand (TINY, 4 layers of 872, h 8): stage 0 = 2 blocks + token table 128 + positions 32 = 1904; stage 1 =
    2 blocks + final norm 16 + the tied table's copy 128 = 1888."""
    want = {0: 1904, 1: 1888}
    for r in range(2):
        spec = _stage_spec(2, r, v, precision="bf16", sharding=ShardingSpec("distributed_optimizer", 2, grad_bytes=4))
        assert spec.rank_num_parameters == want[r]
        g = build_gpt_step(spec)
        cs = [c for c in _colls(g) if c.meta["group"] == "dp"]
        P = want[r]
        assert sum(c.meta["bytes"] for c in cs if c.meta["collective"] == "reduce_scatter") == 4 * P
        assert sum(c.meta["bytes"] for c in cs if c.meta["collective"] == "all_gather") == 2 * P
        assert len({c.name for c in cs}) == len(cs)  # bucket names unique across the chunks' buffers
        assert sum(t.nbytes for t in g.persistent) == 2 * P + 4 * P + 12 * -(-P // 2)


def test_zero3_block_granular_prefetch_is_flagged_when_the_bucket_is_below_a_block():
    """DeepSpeed's default stage3_prefetch_bucket_size (5e7 elements) is just below one GPT-1.3B block (12 h^2 + 13 h
    = 50,357,248 at h 2048, minus the persistent small parameters): the model prefetches whole blocks, so none, and
    says that exposed communication is an upper bound; a bucket of a block or more prefetches and drops the flag."""
    dp8 = ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml"
    sets = ["training.precision=bf16", "zero_optimization.stage=3", "run.steps=2", "run.warmup_steps=1"]
    small = run_scenario(load_scenario(dp8, sets)).summary
    big = run_scenario(load_scenario(dp8, [*sets, "zero_optimization.stage3_prefetch_bucket_size=1000000000"])).summary
    flag = [w for w in small["warnings"] if "prefetch is modelled a whole block at a time" in w]
    assert len(flag) == 1 and "50,331,648" in flag[0]
    assert not [w for w in big["warnings"] if "prefetch is modelled a whole block" in w]
    assert big["exposed_comm_s"] < small["exposed_comm_s"]


# -- 2-D FSDP + TP (PyTorch DeviceMesh: FSDP over the dp group, TP inside), FSDP with pipelines ---------------
def test_fsdp_with_tensor_parallelism_shards_each_tp_ranks_parameters():
    """FULL_SHARD (DEFAULT mixed precision: bf16 gathers, fp32 reduce-scatters) on 4 data-parallel x 2
    tensor-parallel ranks under torch.autocast (fp32 parameters). Each TP rank's own parameters (TINY, t = 2: root
    1072, block 460, as in the ZeRO-3 + TP test) are FSDP flat parameters sharded over its dp group: gathers 2 x 1072
    (root, forward only: the root is not resharded) and 2 x 460 forward and backward, reduce-scatters 4 x 460 and
    4 x 1072; the TP all-reduces (b s h = 32 elements, bf16) are those of Megatron's column/row split; the
    persistent states are the fp32 shard and the two Adam moments, 4 x ceil(1532 / 4) = 1532 bytes each."""
    sh = ShardingSpec("full_shard", 4, param_bytes=2, sharded_param_bytes=4, grad_bytes=4)
    g = build_gpt_step(TransformerSpec(**{**TINY, "data_parallel_size": 4}, tensor_parallel_size=2, sharding=sh))
    dp = [(c.name, c.meta["bytes"]) for c in _colls(g) if c.meta["group"] == "dp"]
    assert dp == [("root.fwd.param_all_gather", 2144), ("L0.fwd.param_all_gather", 920),
                  ("L0.bwd.param_all_gather", 920), ("fsdp.grad_reduce_scatter.0", 1840),
                  ("fsdp.grad_reduce_scatter.1", 4288)]
    tp = [c.meta["bytes"] for c in _colls(g) if c.meta["group"] == "tp"]
    assert tp.count(2 * 4 * 8) == 6  # embedding, proj, fc2 forward; LM-head, fc1, qkv input gradients
    assert [(t.name, t.nbytes) for t in g.persistent] == [("params.fp32.shard", 1532), ("optimizer.exp_avg", 1532),
                                                          ("optimizer.exp_avg_sq", 1532)]
    with pytest.raises(ValueError, match="no_shard with tensor parallelism"):
        TransformerSpec(**{**TINY, "data_parallel_size": 4}, tensor_parallel_size=2,
                        sharding=ShardingSpec("no_shard", 4, param_bytes=4, sharded_param_bytes=4, grad_bytes=4))


def test_fsdp_with_tensor_parallelism_runs_and_is_no_longer_refused():
    """The scenario refusal "fsdp: tensor_model_parallel_size > 1 is not modelled yet" is gone: FSDP over dp 4 x
    TP 2 on one DGX H100 under amp_fp32_params runs, with dp and tp collectives, its model states 12 bytes per
    parameter of a TP rank divided by dp 4 (the fp32 shard and Adam moments); NO_SHARD with it is refused in one
    line (sequence parallelism with it is modelled: test_fsdp_modes.py)."""
    tp2 = ["parallelism.tensor_model_parallel_size=2", "fsdp={sharding_strategy: FULL_SHARD}"]
    r = _run(tp2)
    assert set(r.summary["comm_s_by_group"]) == {"dp", "tp"} and r.summary["data_parallel_size"] == 4
    cfg = load_scenario(B16, SMALL + DGX + tp2)
    from simulator.api import transformer_spec
    P = transformer_spec(cfg).rank_num_parameters
    assert _end_of_step_bytes(r) == pytest.approx(12 * P / 4, rel=0.01)
    args = [a for s in DGX + tp2 + ["fsdp={sharding_strategy: NO_SHARD, mixed_precision: FULL}"] for a in ("--set", s)]
    p = subprocess.run([sys.executable, "-m", "simulator", "run", str(B16), *args], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    lines = [x for x in p.stderr.strip().splitlines() if not x.startswith("warning")]
    assert p.returncode == 2 and len(lines) == 1 and "with sharding_strategy NO_SHARD is not modelled yet" in lines[0], p.stderr


def _fsdp_stage(strategy, r, m=3):
    sh = ShardingSpec(strategy, 2, param_bytes=2, sharded_param_bytes=4, grad_bytes=4,
                      reshard_after_forward=strategy == "full_shard")
    return TransformerSpec(**{**TINY, "num_layers": 4, "data_parallel_size": 2}, tied_embeddings=False,
                           pipeline_parallel_size=2, pipeline_rank=r, num_micro_batches=m, sharding=sh)


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op"])
def test_fsdp_with_pipeline_gathers_per_stage_and_reduces_once(strategy):
    """FSDP per stage under 1F1B (p 2, m 3, dp 2; torch.distributed.pipelining keeps a unit gathered after a
    backward and syncs gradients at the last one). By hand (TINY, 4 layers, untied: block 872): stage 0 runs F0 F1
    B0 F2 B1 B2, stage 1 F0 B0 F1 B1 F2 B2. FULL_SHARD reshards the blocks after every forward: stage 0 gathers them
    in F0, F1 (F2 finds them kept from B0), B0 and B1 (B2 finds them kept from B1): 4 forward + 4 backward block
    gathers; stage 1 in F0 only, then in every backward: 2 + 6. SHARD_GRAD_OP gathers each block once per step.
    The root (stage 0: token table 128 + positions 32 = 160; stage 1: LM head 128 + final norm 16 = 144) is
    gathered once; every unit's fp32 gradient is reduce-scattered once per step (4 x 872, 4 x 160 or 4 x 144)."""
    block, roots = 2 * 872, {0: 320, 1: 288}
    gathers = {("full_shard", 0): (4, 4), ("full_shard", 1): (2, 6), ("shard_grad_op", 0): (2, 0),
               ("shard_grad_op", 1): (2, 0)}
    for r in range(2):
        cs = [c for c in _colls(build_gpt_step(_fsdp_stage(strategy, r))) if c.meta["group"] == "dp"]
        ag = [c for c in cs if c.meta["collective"] == "all_gather"]
        assert [c.meta["bytes"] for c in ag if c.name.startswith("root")] == [roots[r]]
        fwd = [c for c in ag if not c.name.startswith("root") and c.phase is Phase.FWD]
        bwd = [c for c in ag if c.phase is Phase.BWD]
        assert (len(fwd), len(bwd)) == gathers[strategy, r]
        assert {c.meta["bytes"] for c in fwd + bwd} == {block}
        rs = [c.meta["bytes"] for c in cs if c.meta["collective"] == "reduce_scatter"]
        assert rs == [4 * 872, 4 * 872, 2 * roots[r]]
        P = 2 * 872 + roots[r] // 2  # the stage's parameters: fp32 shard + Adam moments, ceil(P / 2) each
        assert sum(t.nbytes for t in build_gpt_step(_fsdp_stage(strategy, r)).persistent) == 12 * -(-P // 2)


def test_fsdp_with_pipeline_runs_and_is_no_longer_refused():
    """The refusal "fsdp: with parallelism.pipeline_model_parallel_size > 1 is not modelled yet" is gone: FSDP
    FULL_SHARD over dp 4 x pp 2 runs (amp_fp32_params, untied embeddings); SHARD_GRAD_OP moves fewer bytes. Tied embeddings are refused in one line."""
    pp = ["parallelism.pipeline_model_parallel_size=2", "training.global_batch_size=64",
          "model.untie_embeddings_and_output_weights=true"]
    full = _run(pp + ["fsdp={sharding_strategy: FULL_SHARD}"]).summary
    sgo = _run(pp + ["fsdp={sharding_strategy: SHARD_GRAD_OP}"]).summary
    assert full["pipeline_parallel_size"] == 2 and full["data_parallel_size"] == 4
    assert set(full["comm_s_by_group"]) == {"dp", "pp"}
    assert sgo["comm_s_by_group"]["dp"] < full["comm_s_by_group"]["dp"]
    args = [a for s in DGX + pp[:2] + ["fsdp={sharding_strategy: FULL_SHARD}"] for a in ("--set", s)]
    p = subprocess.run([sys.executable, "-m", "simulator", "run", str(B16), *args], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    lines = [x for x in p.stderr.strip().splitlines() if not x.startswith("warning")]
    assert p.returncode == 2 and len(lines) == 1 and "untie_embeddings_and_output_weights: true" in lines[0], p.stderr


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("precision,grad_bytes", [("bf16", 2), ("fp16", 2), ("amp_fp32_params", 4)])
def test_zero12_gradients_are_in_the_model_dtype(zero, precision, grad_bytes):
    """DeepSpeed ZeRO-1/2 (``stage_1_and_2.DeepSpeedZeroOptimizer``; ``engine.get_data_types``: the gradient
    accumulation dtype is the model dtype under ZeRO, ``communication_data_type`` bf16 / fp16): with bf16 / fp16
    the gradients, their reduce-scatter and the reduced partition are 16-bit, so a step moves 2 P bytes of
    gradients per rank (4 P with fp32 parameters under autocast); the tiny model, one bucket: exactly. Before the
    fix every ZeRO-1/2 gradient was fp32 (4 P bytes reduce-scattered in bf16 too)."""
    g = build_gpt_step(TransformerSpec(**TINY, precision=precision, zero_stage=zero))
    rs = [c for c in _colls(g) if c.meta["collective"] == "reduce_scatter"]
    assert sum(c.meta["bytes"] for c in rs) == grad_bytes * P
    assert {c.dtype for c in rs} == {"fp32" if grad_bytes == 4 else precision}  # the label says what moves
    grads = {t.name: t.nbytes for o in g.ops for t in o.allocs if t.name.startswith("grad.")
             and not t.name.startswith("grad.shard") and not o.name.startswith("opt.")}  # (step copies: test_grad_norm)
    # the weight matrices' .grad tensors (wte 16 x 8, qkv 8 x 24, proj 8 x 8, fc1 8 x 32, fc2 32 x 8 = 896 elements)
    assert grads == {k: grad_bytes * n for k, n in {"grad.wte": 128, "grad.L0.qkv": 192, "grad.L0.proj": 64,
                                                     "grad.L0.fc1": 256, "grad.L0.fc2": 256}.items()}
    if zero == 2:
        shards = [t.nbytes for o in rs for t in o.allocs]
        assert shards == [-(-grad_bytes * P // 8)]
