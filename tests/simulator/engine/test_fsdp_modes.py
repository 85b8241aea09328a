"""PyTorch FSDP modes that were refused: NO_SHARD with a bf16 ``MixedPrecision``, FSDP + TP with sequence
parallelism, and ``CPUOffload(offload_params=True)``.

Byte counts on the tiny model of ``test_sharding.py`` worked out by hand (exact): 1 layer (or 2), h 8, f 32,
V 16, s 4, biases, tied embeddings: P = 1048 per layer count 1; root (wte 128, wpe 32, ln_f 16) = 176,
block = 872."""

from __future__ import annotations

import subprocess
import sys

import pytest

from simulator.api import run_scenario, transformer_spec
from simulator.config.loader import load_scenario
from simulator.graph.builders.sharding import LOW_PRECISION_SHARD, ShardingSpec, layer_param_sizes, root_param_sizes
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.ops import OpKind
from tests.conftest import ROOT
from tests.simulator.engine.test_sharding import B16, DGX, SMALL, _colls

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TINY = dict(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=4, vocab_size=16, ffn_hidden_size=32,
            micro_batch_size=1, data_parallel_size=8)
ROOT_N, BLOCK_N = 176, 872
P2 = ROOT_N + 2 * BLOCK_N  # 1920: two blocks


def _cli(sets):
    args = [a for s in DGX + sets for a in ("--set", s)]
    r = subprocess.run([sys.executable, "-m", "simulator", "run", str(B16), *args], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    return r, [x for x in r.stderr.strip().splitlines() if not x.startswith("warning")]


def _max_counter(r, metric: str, scope: str = "gpu0.hbm") -> int:
    c = r.counters[(r.counters.metric == metric) & (r.counters.scope == scope)]
    return int(c.value.max()) if len(c) else 0


# -- 3. NO_SHARD with MixedPrecision(param_dtype=bf16, reduce_dtype=...) --------------------------------------
def _no_shard(param_bytes=2, grad_bytes=4, m=1):
    sh = ShardingSpec("no_shard", 8, param_bytes=param_bytes, sharded_param_bytes=4, grad_bytes=grad_bytes,
                      reshard_after_forward=True, reshard_root=True)
    return build_gpt_step(TransformerSpec(**TINY, num_micro_batches=m, sharding=sh))


def test_no_shard_bf16_casts_each_unit_before_forward_and_backward():
    """DEFAULT (param bf16, reduce fp32): FSDP keeps the fp32 flat parameters whole (4 P) with the Adam moments
    (4 P each); before each unit's forward and again before its backward (``_use_low_precision_shard``, freed by
    ``post_reshard``) the unit's fp32 parameters are cast into a bf16 copy: reads 4 n, writes 2 n (root n = 176,
    blocks 872); the GEMMs read that copy (no per-GEMM weight cast of autocast); no all-gathers; one fp32
    all-reduce per unit of its gradients: 4 x 872 twice, 4 x 176 (sum 4 P, DDP's volume)."""
    g = _no_shard()
    casts = [(o.name, o.bytes_read, o.bytes_written) for o in g.ops if o.name.endswith("param_cast")]
    assert casts == [("root.fwd.param_cast", 4 * 176, 2 * 176), ("L0.fwd.param_cast", 4 * 872, 2 * 872),
                     ("L1.fwd.param_cast", 4 * 872, 2 * 872), ("root.bwd.param_cast", 4 * 176, 2 * 176),
                     ("L1.bwd.param_cast", 4 * 872, 2 * 872), ("L0.bwd.param_cast", 4 * 872, 2 * 872)]
    assert all(o.stream == "compute" for o in g.ops if o.name.endswith("param_cast"))
    assert not [o for o in g.ops if o.name.endswith(".cast_w")]
    cs = _colls(g)
    assert [(c.meta["collective"], c.meta["bytes"]) for c in cs] == [("all_reduce", 4 * 872), ("all_reduce", 4 * 872),
                                                                     ("all_reduce", 4 * 176)]
    assert [(t.name, t.nbytes) for t in g.persistent] == [("params.fp32", 4 * P2), ("optimizer.exp_avg", 4 * P2),
                                                          ("optimizer.exp_avg_sq", 4 * P2)]
    fc1 = next(o for o in g.ops if o.name == "L0.fwd.fc1.gemm")
    l0 = next(o for o in g.ops if o.name == "L0.fwd.param_cast")
    assert fc1.uses[1] == l0.allocs[0].name  # the GEMM reads the unit's bf16 copy


def test_no_shard_bf16_reduce_casts_the_reduced_gradient_back_to_fp32():
    """PURE (param bf16, reduce bf16): the gradients are all-reduced in bf16 (2 x 872 twice, 2 x 176), then each
    is cast to the parameters' dtype (``_cast_grad_to_param_dtype``: reads 2 n, writes the fp32 ``.grad`` 4 n) on the
    data-parallel stream right after its all-reduce; the optimizer reads those fp32 gradients."""
    g = _no_shard(grad_bytes=2)
    assert [c.meta["bytes"] for c in _colls(g)] == [2 * 872, 2 * 872, 2 * 176]
    back = [o for o in g.ops if o.name.startswith("fsdp.grad_cast_fp32")]
    assert [(o.stream, o.bytes_read, o.bytes_written) for o in back] == [
        ("comm.dp", 2 * 872, 4 * 872), ("comm.dp", 2 * 872, 4 * 872), ("comm.dp", 2 * 176, 4 * 176)]
    adam = next(o for o in g.ops if o.name.endswith("adamw"))
    assert set(adam.uses) == {o.allocs[0].name for o in back}


def test_no_shard_bf16_memory_by_hand():
    """Engine run (the 4-layer GPT of B16 on a DGX H100, dp 8, NO_SHARD). The ``params`` category's peak:
    FULL (fp32 everywhere): the fp32 parameters only, 4 P (autocast's per-GEMM copies are activations).
    DEFAULT: 4 P + the bf16 unit copies live at once: the root (the tied token table serves the embedding and
    the LM head, so its copy lives through the pass) + two blocks (the running one and the one cast ahead, FSDP's
    prefetch of one unit): 4 P + 2 (root + 2 block). Both keep fp32 grads 4 P and moments 8 P."""
    full = run_scenario(load_scenario(B16, SMALL + DGX + ["fsdp={sharding_strategy: NO_SHARD, mixed_precision: FULL}"]))
    cfg = load_scenario(B16, SMALL + DGX + ["fsdp={sharding_strategy: NO_SHARD}"])
    bf16 = run_scenario(cfg)
    spec = transformer_spec(cfg)
    P = spec.num_parameters
    root, block = sum(root_param_sizes(spec).values()), sum(layer_param_sizes(spec).values())
    assert _max_counter(full, "memory_bytes.params") == 4 * P
    assert _max_counter(bf16, "memory_bytes.params") == 4 * P + 2 * (root + 2 * block)
    # the same fp32 .grad tensors (reduce_dtype fp32) and Adam moments in both
    assert _max_counter(bf16, "memory_bytes.grad") == _max_counter(full, "memory_bytes.grad") > 0
    assert _max_counter(bf16, "memory_bytes.optimizer") == _max_counter(full, "memory_bytes.optimizer") >= 8 * P
    assert not bf16.summary.get("oom")


def test_no_shard_bf16_refusals_and_runs():
    r, lines = _cli(["fsdp={sharding_strategy: NO_SHARD, mixed_precision: PURE}", "training.global_batch_size=256"])
    assert r.returncode == 2 and len(lines) == 1 and "reduce_dtype bf16 with gradient accumulation" in lines[0], \
        r.stderr
    r, lines = _cli(["fsdp={sharding_strategy: NO_SHARD}", "parallelism.pipeline_model_parallel_size=2",
                     "model.untie_embeddings_and_output_weights=true"])
    assert r.returncode == 2 and len(lines) == 1 and "NO_SHARD with param_dtype bf16 and pipeline" in lines[0], \
        r.stderr
    r, lines = _cli(["fsdp={sharding_strategy: NO_SHARD}", "run.steps=2", "run.warmup_steps=1"])
    assert r.returncode == 0, r.stderr


# -- 2. FSDP over dp x Megatron-style TP with sequence parallelism inside ----------------------------------------
def _fsdp_tp(sp: bool):
    sh = ShardingSpec("full_shard", 4, param_bytes=2, sharded_param_bytes=4, grad_bytes=4)
    return build_gpt_step(TransformerSpec(**{**TINY, "num_layers": 1, "data_parallel_size": 4}, tensor_parallel_size=2,
                                          sequence_parallel=sp, sharding=sh))


def test_fsdp_tp_sequence_parallel_bytes_by_hand():
    """FULL_SHARD (DEFAULT) over dp 4 x TP 2 with sequence parallelism, 1 layer. dp: exactly the collectives of
    FSDP + TP without SP (each TP rank's flat parameters, root 1072 and block 460 elements, sharded over dp 4).
    tp: every all-reduce of b s h (2 x 4 x 8 = 64 bytes bf16) becomes a reduce-scatter or an all-gather of the same
    64 bytes (Korthikanti et al. 2023, section 4.2.2): forward embedding RS, per layer AG (ln1) RS (proj) AG (ln2)
    RS (fc2), AG (ln_f); backward the mirror (RS lm_head, AG fc2, RS fc1, AG proj, RS qkv, AG embedding); the
    vocab-parallel cross-entropy's three fp32 all-reduces (4 x 4 bytes) stay. The TP-replicated parameters
    (LayerNorm weight and bias, row-parallel proj / fc2 biases: 16 + 16 + 8 + 8 = 48 elements per block; ln_f 16)
    have per-rank partial gradients: each unit's are all-reduced over TP in param_dtype bf16 before its
    reduce-scatter (FSDP2 ``FSDPParam._get_grad_inner_tensor``: Partial -> Replicate): 96 bytes for the block, 32
    for the root, in place of Megatron's end-of-step fp32 all-reduce (4 x 64 = 256 bytes). LayerNorms run on
    T / t = 2 tokens: ln1 reads 4 x 2 x 8 = 64 bytes (fp32 residual under autocast), half of the 128 without SP."""
    sp, base = _fsdp_tp(True), _fsdp_tp(False)
    dp = lambda g: [(c.name, c.meta["bytes"]) for c in _colls(g) if c.meta["group"] == "dp"]  # noqa: E731
    assert dp(sp) == dp(base) == [("root.fwd.param_all_gather", 2144), ("L0.fwd.param_all_gather", 920),
                                  ("L0.bwd.param_all_gather", 920), ("fsdp.grad_reduce_scatter.0", 1840),
                                  ("fsdp.grad_reduce_scatter.1", 4288)]
    tp = [(c.meta["collective"], c.meta["bytes"]) for c in _colls(sp) if c.meta["group"] == "tp"]
    RS, AG, AR = "reduce_scatter", "all_gather", "all_reduce"
    assert tp == [(RS, 64), (AG, 64), (RS, 64), (AG, 64), (RS, 64), (AG, 64), (AR, 16), (AR, 16), (AR, 16),
                  (RS, 64), (AG, 64), (RS, 64), (AG, 64), (RS, 64), (AR, 96), (AG, 64), (AR, 32)]
    assert not [o for o in sp.ops if "layernorm_grads" in o.name]
    spec = TransformerSpec(**{**TINY, "num_layers": 1, "data_parallel_size": 4}, tensor_parallel_size=2,
                           sequence_parallel=True, precision="bf16")
    assert (96 + 32) // 2 == spec.sequence_parallel_params  # the same parameters as Megatron's all-reduce
    ops = {o.name: o for o in sp.ops}
    for ar, rs in (("L0.bwd.tp.sp_grads.all_reduce", "fsdp.grad_reduce_scatter.0"),
                   ("bwd.tp.sp_grads.all_reduce", "fsdp.grad_reduce_scatter.1")):
        assert ops[ar].id in ops[rs].deps
    assert ops["L0.fwd.ln1"].bytes_read == 64 and {o.name: o for o in base.ops}["L0.fwd.ln1"].bytes_read == 128


def test_fsdp_tp_sequence_parallel_runs_on_the_bundled_2d_scenario():
    """The bundled 1.3B FSDP x TP2 scenario with ``sequence_parallel: true`` runs (was refused in one line): dp and
    tp collectives, less peak memory than without SP (activations of the LayerNorm / residual region / t), and the
    same dp traffic."""
    s2d = ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_fsdp_tp2.yaml"
    small = ["model.num_layers=4", "run.steps=2", "run.warmup_steps=1"]
    a = run_scenario(load_scenario(s2d, small)).summary
    b = run_scenario(load_scenario(s2d, small + ["parallelism.sequence_parallel=true"])).summary
    assert set(b["comm_s_by_group"]) == {"dp", "tp"}
    assert b["peak_memory_bytes"] < a["peak_memory_bytes"]
    assert not b.get("oom")


# -- 1. CPUOffload(offload_params=True) ------------------------------------------------------------------------
def _offloaded(strategy: str, dp: int, impl: str = "torch_single"):
    from simulator.config.loader import resolve_hardware
    from simulator.policies.offload_fsdp import fsdp_cpu_offload
    sh = ShardingSpec(strategy, dp, param_bytes=2, sharded_param_bytes=4, grad_bytes=4,
                      reshard_after_forward=strategy == "full_shard")
    g = build_gpt_step(TransformerSpec(**{**TINY, "num_layers": 1, "data_parallel_size": dp}, sharding=sh))
    hw = resolve_hardware(load_scenario(B16, DGX))
    return g, fsdp_cpu_offload(g, hw, impl=impl)


@pytest.mark.parametrize("strategy,dp,h2d,d2h", [
    # FULL_SHARD: the root (176) is gathered once (forward: FSDP keeps the root gathered), the block (872) in
    # forward and again in backward; each gather reads this rank's fp32 shard, ceil(n / dp) x 4 bytes, copied H2D
    ("full_shard", 2, [4 * 88, 4 * 436, 4 * 436], [4 * 436, 4 * 88]),
    ("full_shard", 4, [4 * 44, 4 * 218, 4 * 218], [4 * 218, 4 * 44]),
    ("shard_grad_op", 2, [4 * 88, 4 * 436], [4 * 436, 4 * 88]),  # kept gathered from forward to backward
])
def test_fsdp_cpu_offload_bytes_per_rank_per_step_by_hand(strategy, dp, h2d, d2h):
    """H2D per step = 4 x (shard(root) + k x shard(block)), k = 2 for FULL_SHARD, 1 for SHARD_GRAD_OP; D2H = the
    reduce-scattered gradient shards cast to fp32 (``_cast_grad_to_param_dtype`` before ``_offload_grad``),
    4 x (shard(block) + shard(root)). dp 2: H2D 352 + 1744 + 1744 = 3840, D2H 2096; dp 4: 1920 and 1048. The GPU
    keeps no parameter, gradient or optimizer shard; the host holds the fp32 parameter and gradient shards (pinned,
    4 x ceil(1048 / dp) each) and the two Adam moments (pageable, the same each); AdamW runs on the CPU."""
    base, g = _offloaded(strategy, dp)
    fetch = [o for o in g.ops if o.kind is OpKind.MEMCPY_H2D and o.name.endswith("fsdp_offload.fetch")]
    down = [o for o in g.ops if o.kind is OpKind.MEMCPY_D2H]
    assert len([o for o in g.ops if o.kind is OpKind.MEMCPY_H2D]) == len(fetch) + 1  # + the input batch
    assert [o.bytes_read for o in fetch] == h2d and [o.bytes_read for o in down] == d2h
    gathers = [o for o in _colls(g) if o.meta["collective"] == "all_gather"]
    assert len(gathers) == len(fetch)
    for ga, f in zip(gathers, fetch):  # bf16 param_dtype: fetch -> cast to the low-precision shard -> gather
        cast = next(g.ops[d] for d in ga.deps if g.ops[d].name.endswith(LOW_PRECISION_SHARD))
        assert f.id in cast.deps and f.allocs[0].name in cast.uses and f.allocs[0].device == "gpu"
        assert cast.bytes_read == f.bytes_read and cast.allocs[0].name in ga.uses
    rs = [o for o in _colls(g) if o.meta["collective"] == "reduce_scatter"]
    for r, d in zip(rs, down):
        assert r.id in d.deps and r.allocs[0].name in d.uses
    shard = 4 * -(-1048 // dp)
    assert sorted((t.name, t.device, t.nbytes) for t in g.persistent) == sorted([
        ("params.fp32.shard.host", "host_pinned", shard), ("grad.fp32.shard.host", "host_pinned", shard),
        ("optimizer.exp_avg.host", "host_pageable", shard), ("optimizer.exp_avg_sq.host", "host_pageable", shard)])
    assert not [o for o in g.ops if o.name.endswith("adamw")]
    cpu = [o for o in g.ops if o.name == "cpu.adam"]
    assert len(cpu) == 1 and cpu[0].stream == "host" and cpu[0].meta["params"] == shard // 4
    assert all(d.id in g.ops[next(o.id for o in g.ops if o.name == "offload.bwd_done")].deps for d in down)
    assert sum(o.bytes_read for o in fetch) == {2: 3840, 4: 1920}[dp] or strategy == "shard_grad_op"
    assert g.meta["fsdp_cpu_offload"]["h2d_bytes_per_step"] == sum(h2d)
    assert g.meta["fsdp_cpu_offload"]["d2h_bytes_per_step"] == sum(d2h) == 4 * (-(-872 // dp) + -(-176 // dp))


def test_fsdp_cpu_offload_cpu_step_is_the_host_model():
    """The CPU AdamW is the host roofline of ``offload_optimizer.cpu_step_times`` over this rank's flat-parameter
    shards (one flat parameter per unit: the root and the block), for the implementation asked."""
    from simulator.config.loader import resolve_hardware
    from simulator.policies.offload_optimizer import cpu_step_times
    hw = resolve_hardware(load_scenario(B16, DGX))
    for impl in ("torch_single", "torch_foreach", "torch_fused"):
        _, g = _offloaded("full_shard", 2, impl)
        op = next(o for o in g.ops if o.name == "cpu.adam")
        want = cpu_step_times(524, 2, impl, hw, tensor_elements=[436, 88], pin_memory=True)["cpu.adam"]
        assert op.host_s == pytest.approx(want, rel=1e-12) and op.meta["impl"] == impl


OFF = ["fsdp={sharding_strategy: FULL_SHARD, cpu_offload: true}"]


def test_fsdp_cpu_offload_engine_run_moves_the_states_to_the_host():
    """dp 8 on a DGX H100 (4-layer GPT of B16): no model-state bytes stay on the GPU after the step (FSDP alone
    keeps 12 bytes per parameter / 8); this rank's pinned host buffers are its fp32 parameter and gradient shards,
    8 x ceil(P / 8) bytes (the engine's pool is per rank; ``host_memory_oom`` counts the node's 8 ranks); the CPU
    step is in the summary and the step is slower than with the states on the GPU."""
    cfg = load_scenario(B16, SMALL + DGX + OFF)
    r = run_scenario(cfg)
    plain = run_scenario(load_scenario(B16, SMALL + DGX + ["fsdp={sharding_strategy: FULL_SHARD}"]))
    P = transformer_spec(cfg).num_parameters
    c = r.counters[(r.counters.metric == "memory_bytes") & (r.counters.scope == "gpu0.hbm")]
    assert int(c.sort_values("t_s").value.iloc[-1]) == 0
    s = r.summary
    assert s["peak_host_pinned_bytes"] == 8 * -(-P // 8)
    assert s["offload_cpu_optimizer_s"] > 0 and s["step_time_s"] > plain.summary["step_time_s"]
    assert s["peak_memory_bytes"] < plain.summary["peak_memory_bytes"] and not s["oom"]
    assert s["fsdp_cpu_offload"]["impl"] == "torch_fused"  # training.optimizer.impl fused of B16
    assert 0 <= s["exposed_param_fetch_s"] <= s["offload_param_fetch_s"] and s["offload_param_fetch_s"] > 0


def test_fetch_exposure_interval_arithmetic_by_hand():
    """Fetch [0, 10] against compute/collectives [2, 3], [5, 7], [9, 12]: exposed 2 + 2 + 2 = 6; fetches [0, 1],
    [4, 6] against [0.5, 5]: 0.5 + 1 = 1.5."""
    from simulator.policies.offload_param import _minus, _union
    assert _minus(_union([(0, 10)]), _union([(2, 3), (9, 12), (5, 7)])) == 6
    assert _minus(_union([(4, 6), (0, 1)]), _union([(0.5, 5)])) == 1.5
    assert _union([(0, 2), (1, 3), (5, 6)]) == [(0, 3), (5, 6)]


def test_fsdp_cpu_offload_host_memory_is_a_capacity():
    """A 1 GB host: the 8 ranks' host states (16 bytes per parameter / 8 each, 8 ranks) do not fit: an
    out-of-memory result naming the host and the FSDP states, not a crash."""
    r = run_scenario(load_scenario(B16, SMALL + DGX + OFF + ["hardware.host.overrides.memory.capacity_bytes=1 GB"]))
    oom = r.summary["oom"]
    assert oom is not None and "host" in oom and "8 ranks" in oom and "fsdp" in oom.lower(), oom


@pytest.mark.parametrize("sets,needle", [
    (["fsdp={sharding_strategy: FULL_SHARD, cpu_offload: true}", "training.global_batch_size=256"],
     "fsdp.cpu_offload with gradient accumulation"),
    (["fsdp={sharding_strategy: NO_SHARD, cpu_offload: true}"], "fsdp.cpu_offload with sharding_strategy NO_SHARD"),
    (["fsdp={cpu_offload: {offload_params: true, cpu_adam_impl: deepspeed_cpu_adam}}"],
     "fsdp.cpu_offload: cpu_adam_impl 'deepspeed_cpu_adam' (allowed: torch_single, torch_foreach, torch_fused"),
    (["fsdp={cpu_offload: cpu}"], "fsdp.cpu_offload: 'cpu' (allowed: true, false or"),
])
def test_fsdp_cpu_offload_refusals_one_line(sets, needle):
    r, lines = _cli(sets)
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr


def test_fsdp_cpu_offload_refuses_experts_and_accumulation_in_the_policy():
    """The rewrite itself refuses a graph with several micro-batches (the config refuses it first, in one line)."""
    from simulator.config.loader import resolve_hardware
    from simulator.policies.offload_fsdp import fsdp_cpu_offload
    from simulator.policies.registry import PolicyError
    sh = ShardingSpec("full_shard", 2, param_bytes=2, sharded_param_bytes=4, grad_bytes=4)
    g = build_gpt_step(TransformerSpec(**{**TINY, "data_parallel_size": 2}, num_micro_batches=2, sharding=sh))
    with pytest.raises(PolicyError, match="gradient accumulation"):
        fsdp_cpu_offload(g, resolve_hardware(load_scenario(B16, DGX)))
    r, lines = _cli(["fsdp={cpu_offload: true}", "model.num_experts=8", "training.precision=bf16", "model.add_bias_linear=false"])
    assert r.returncode == 2 and len(lines) == 1 and "fsdp.cpu_offload with model.num_experts" in lines[0], r.stderr


def test_bf16_fsdp_mixed_precision_needs_bf16_tensor_cores_on_every_gpu():
    """FSDP's DEFAULT mixed precision gathers and computes in bf16: a V100 (fp16 tensor cores only) replica was
    priced silently; refused as for training.precision bf16. FULL (fp32) runs there."""
    v100 = "rank_overrides=[{dp_rank: 1, gpu: v100-sxm2-32gb}]"
    r, lines = _cli(["fsdp={sharding_strategy: FULL_SHARD}", "training.precision=amp_fp32_params", v100, *SMALL])
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "v100-sxm2-32gb has no bf16 rate, which fsdp.mixed_precision DEFAULT needs" in lines[0]
    r, _ = _cli(["fsdp={sharding_strategy: FULL_SHARD, mixed_precision: FULL}", "training.precision=amp_fp32_params",
                 v100, *SMALL])
    assert r.returncode == 0, r.stderr


def test_cpu_adam_impl_without_offload_params_is_flagged():
    r, _ = _cli(["fsdp={sharding_strategy: FULL_SHARD, cpu_offload: {offload_params: false, cpu_adam_impl: "
                 "torch_fused}}", "training.precision=amp_fp32_params", *SMALL])
    assert r.returncode == 0, r.stderr
    assert "fsdp.cpu_offload.cpu_adam_impl torch_fused has no effect with offload_params false" in r.stdout


def test_fsdp_cpu_offload_at_dp1_counts_every_rank_of_the_node():
    """dp 1 x cp 2 x tp 4 on the DGX: FSDP shards over the 2 context-parallel ranks, and each of the node's 8 ranks
    keeps its shard of its TP quarter on the one host (the CPU step was priced for 8 ranks sharing it, but the host
    memory check counted 1 rank, as if dp 1 meant one rank). On a 1 GB host one rank's states (~0.18 GB) fit,
    the node's 8 do not."""
    cp = ["parallelism.tensor_model_parallel_size=4", "parallelism.context_parallel_size=2"]
    r = run_scenario(load_scenario(B16, SMALL + DGX + OFF + cp + ["hardware.host.overrides.memory.capacity_bytes=1 GB"]))
    s = r.summary
    assert (s["peak_host_pinned_bytes"] + s["peak_host_pageable_bytes"]) < 1e9 / 4
    oom = s["oom"]
    assert oom is not None and "for the node's 8 ranks" in oom, oom
    assert s["fsdp_cpu_offload"]["ranks_per_host"] == 8
