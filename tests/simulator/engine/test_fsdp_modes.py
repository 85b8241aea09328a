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
from simulator.graph.builders.sharding import ShardingSpec, layer_param_sizes, root_param_sizes
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.ops import OpKind, Phase
from tests.conftest import ROOT

B16 = ROOT / "scenarios/h200/gpt_184m_b16.yaml"
DGX = ["hardware.gpu=h100-sxm-80gb", "hardware.cluster={preset: dgx-h100}"]
SMALL = ["model.num_layers=4", "training.micro_batch_size=8", "run.steps=2", "run.warmup_steps=1"]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TINY = dict(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=4, vocab_size=16, ffn_hidden_size=32,
            micro_batch_size=1, data_parallel_size=8)
ROOT_N, BLOCK_N = 176, 872
P2 = ROOT_N + 2 * BLOCK_N  # 1920: two blocks


def _colls(g):
    return [o for o in g.ops if o.kind is OpKind.COLLECTIVE]


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
    r, lines = _cli(["fsdp={sharding_strategy: NO_SHARD}", "run.steps=2", "run.warmup_steps=1"])
    assert r.returncode == 0, r.stderr
