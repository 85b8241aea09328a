"""FSDP2 (``fsdp.version: 2``) and HSDP with an explicit shard degree (torchtitan's
``data_parallel_shard_degree`` / ``data_parallel_replicate_degree``): group membership, collective and copy
bytes on a tiny model worked out by hand, and the one-line refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest

from simulator.config.loader import load_scenario, resolve_hardware
from simulator.graph.builders.sharding import ShardingSpec
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.ops import OpKind, Phase
from tests.conftest import ROOT

B16 = ROOT / "scenarios/h200/gpt_184m_b16.yaml"
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
# 1 layer, h 8, f 32, V 16, s 4 (learned positions: 4 rows), biases, tied: block 872, root wte 128 + wpe 32 + ln_f 16
TINY = dict(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=4, vocab_size=16, ffn_hidden_size=32,
            micro_batch_size=1, data_parallel_size=8)


def _v2(shard=8, replicate=1, param_bytes=2, grad_bytes=4, **kw):
    sh = ShardingSpec("hybrid_shard" if replicate > 1 else "full_shard", shard, replicate, fwd_prefetch_depth=2,
                      param_bytes=param_bytes, sharded_param_bytes=4, grad_bytes=grad_bytes, version=2, **kw)
    return build_gpt_step(TransformerSpec(**TINY, precision="amp_fp32_params", sharding=sh))


def _op(g, name):
    return next(o for o in g.ops if o.name == name)


def test_fsdp2_copy_in_copy_out_and_reduce_scatter_bytes_by_hand():
    g = _v2()
    # per-parameter padding over 8 ranks: every block parameter's dim 0 (8, 32, 24 rows) divides by 8 -> 872;
    # the root's wpe has 4 rows, padded to 8 x 8 = 64 (FSDP1's flat unit: 176) -> 128 + 64 + 16 = 208
    assert _op(g, "root.fwd.param_all_gather").meta["bytes"] == 2 * 208
    assert _op(g, "L0.fwd.param_all_gather").meta["bytes"] == 2 * 872
    cast, cin = _op(g, "L0.fwd.fsdp.all_gather_cast"), _op(g, "L0.fwd.fsdp.all_gather_copy_in")
    assert (cast.bytes_read, cast.bytes_written) == (4 * 109, 2 * 109)  # the 872 / 8 fp32 shard -> bf16
    assert (cin.bytes_read, cin.bytes_written) == (2 * 109, 2 * 109)
    assert [a.nbytes for a in cin.allocs] == [2 * 872]  # the all-gather output, allocated by the copy-in
    out = _op(g, "L0.fwd.fsdp.all_gather_copy_out")
    assert (out.bytes_read, out.bytes_written, out.stream) == (2 * 872, 2 * 872, "compute")
    # forward: the previous unit's all-gather output is held until this copy-out (all_gather_state)
    assert out.uses == (cin.allocs[0].name, _op(g, "root.fwd.fsdp.all_gather_copy_in").allocs[0].name)
    assert _op(g, "L0.bwd.fsdp.all_gather_copy_out").uses == (_op(g, "L0.bwd.fsdp.all_gather_copy_in").allocs[0].name,)
    rsin = _op(g, "L0.bwd.fsdp.reduce_scatter_copy_in.0")  # bf16 gradients -> padded fp32 buffer
    assert (rsin.bytes_read, rsin.bytes_written) == (2 * 872, 4 * 872)
    rs = _op(g, "fsdp.grad_reduce_scatter.0")
    assert rs.meta["bytes"] == 4 * 872 and [a.nbytes for a in rs.allocs] == [4 * 109]
    assert _op(g, "fsdp.grad_reduce_scatter.1").meta["bytes"] == 4 * 208


def test_fsdp2_bf16_reduction_is_cast_to_the_fp32_grad():
    g = _v2(grad_bytes=2)
    c = _op(g, "fsdp.grad_cast_fp32.0")
    assert (c.bytes_read, c.bytes_written) == (2 * 109, 4 * 109)


def test_hsdp_2x4_bytes_by_hand():
    g = _v2(shard=4, replicate=2)  # 4 ranks: no padding (dims divide by 4), shard 872 / 4 = 218
    cs = [o for o in g.ops if o.kind is OpKind.COLLECTIVE]
    assert {(c.meta["group"], c.meta["collective"]) for c in cs} == {
        ("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter"), ("dp_replicate", "all_reduce")}
    ar = [c.meta["bytes"] for c in cs if c.meta["group"] == "dp_replicate"]
    assert ar == [4 * 218, 4 * 44]  # the block's and the root's (176 / 4) fp32 gradient shards


@pytest.mark.parametrize("preset,nodes,sets,shard,replicate", [
    # HSDP 2 x 4 on 8 ranks over 2 nodes of 4: shard group = a node, replicas across
    ("dgx-h100, overrides: {gpus_per_node: 4}", 2, ["parallelism.data_parallel_shard_degree=4",
                                "parallelism.data_parallel_replicate_degree=2"], (0, 1, 2, 3), (0, 4)),
    # replicate 2 inside one 8-GPU node (HYBRID_SHARD's default would be one shard group of 8)
    ("dgx-h100", 1, ["parallelism.data_parallel_replicate_degree=2"], (0, 1, 2, 3), (0, 4)),
    # a shard group spanning two 4-GPU nodes, replicated across the other two
    ("dgx-h100, overrides: {gpus_per_node: 4}", 4, ["parallelism.data_parallel_shard_degree=8",
                                                     "parallelism.data_parallel_replicate_degree=2"], tuple(range(8)),
     (0, 8)),
])
def test_hsdp_group_membership(preset, nodes, sets, shard, replicate):
    cfg = load_scenario(B16, [f"hardware.cluster={{preset: {preset}, nodes: {nodes}}}", "hardware.gpu=h100-sxm-80gb",
                              "fsdp={version: 2}", *sets])
    hw = resolve_hardware(cfg)
    assert hw.dp_shard_group == shard and hw.dp_replicate_group == replicate


def test_hsdp_shard_group_across_nodes_is_priced_on_its_links():
    """The same 8-rank all-gather costs more when its group spans two nodes than inside one."""
    base = ["hardware.gpu=h100-sxm-80gb", "fsdp={version: 2}"]
    span = resolve_hardware(load_scenario(B16, base + ["hardware.cluster={preset: dgx-h100, nodes: 4, overrides: {gpus_per_node: 4}}",
                                                       "parallelism.data_parallel_shard_degree=8",
                                                       "parallelism.data_parallel_replicate_degree=2"]))
    node = resolve_hardware(load_scenario(B16, base + ["hardware.cluster={preset: dgx-h100, nodes: 4, overrides: {gpus_per_node: 4}}",
                                                       "parallelism.data_parallel_shard_degree=4",
                                                       "parallelism.data_parallel_replicate_degree=4"]))
    t = lambda hw: hw.collectives.price("all_gather", hw.dp_shard_group, 1 << 26, hw.nccl).time_s  # noqa: E731
    assert len(node.dp_shard_group) == 4 and t(span) > t(node)


@pytest.mark.parametrize("sets,needle", [
    (["parallelism.data_parallel_shard_degree=3"], "data_parallel_shard_degree: 3 does not divide"),
    (["parallelism.data_parallel_shard_degree=2", "parallelism.data_parallel_replicate_degree=2"],
     "2 x data_parallel_replicate_degree 2 = 4 is not data_parallel_size 8"),
    (["parallelism.data_parallel_replicate_degree=3"], "data_parallel_replicate_degree: 3 does not divide"),
    (["fsdp={version: 2, limit_all_gathers: true}"], "fsdp.limit_all_gathers is FSDP1's"),
    (["fsdp={version: 2, sharding_strategy: HYBRID_SHARD}"], "fsdp.sharding_strategy is FSDP1's"),
    (["fsdp={sharding_strategy: FULL_SHARD, reshard_after_forward: 2}"], "is FSDP2's"),
    (["fsdp={version: 2, reshard_after_forward: 3}"], "reshard_after_forward: 3 is not a factor of"),
    (["fsdp={sharding_strategy: FULL_SHARD}", "parallelism.data_parallel_replicate_degree=2"],
     "FSDP1 replicates shards only under HYBRID_SHARD"),
    (["fsdp={version: 3}"], "allowed: 1 (FullyShardedDataParallel), 2 (fully_shard)"),
    (["parallelism.data_parallel_shard_degree=1", "parallelism.data_parallel_replicate_degree=8"],
     "is DDP, not FSDP (allowed: a shard degree > 1, or no fsdp section (plain DDP))"),
    (["fsdp={sharding_strategy: HYBRID_SHARD}", "parallelism.data_parallel_shard_degree=1",
      "parallelism.data_parallel_replicate_degree=8"], "or fsdp.sharding_strategy NO_SHARD"),
    (["fsdp={sharding_strategy: HYBRID_SHARD}", "parallelism.data_parallel_replicate_degree=1"],
     "replicates nothing: it is FULL_SHARD"),
])
def test_bad_input_one_line_exit_2(sets, needle):
    base = ["hardware.gpu=h100-sxm-80gb", "hardware.cluster={preset: dgx-h100}"]
    if not any(s.startswith("fsdp=") for s in sets):
        base.append("fsdp={version: 2}")
    args = [a for s in base + sets for a in ("--set", s)]
    r = subprocess.run([sys.executable, "-m", "simulator", "run", str(B16), *args], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    lines = [x for x in r.stderr.strip().splitlines() if not x.startswith("warning")]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr


def test_reshard_after_forward_int_keeps_a_quarter_and_gathers_it_over_four_ranks():
    g = _v2(post_forward_size=4)  # reshard_after_forward=4 over a shard group of 8
    keep = _op(g, "L0.fwd.fsdp.reshard_post_forward")
    assert [a.nbytes for a in keep.allocs] == [2 * 872 // 4]  # bf16, 1/4 of the gathered block
    cin = _op(g, "L0.bwd.fsdp.all_gather_copy_in")  # from the kept copy: no fp32 -> bf16 cast
    assert cin.uses == (keep.allocs[0].name,) and (cin.bytes_read, cin.bytes_written) == (436, 436)
    assert not [o for o in g.ops if o.name == "L0.bwd.fsdp.all_gather_cast"]
    ag = _op(g, "L0.bwd.param_all_gather")
    assert (ag.meta["group"], ag.meta["bytes"]) == ("dp_post_forward", 2 * 872)


def test_reshard_after_forward_int_group_is_consecutive_shard_ranks():
    hw = resolve_hardware(load_scenario(B16, ["hardware.gpu=h100-sxm-80gb", "hardware.cluster={preset: dgx-h100}",
                                              "fsdp={version: 2, reshard_after_forward: 4}"]))
    assert hw.dp_post_forward_group == (0, 1, 2, 3) and hw.dp_shard_group == tuple(range(8))


@pytest.mark.parametrize("post", [1, 3, 8, 16])
def test_post_forward_size_must_be_a_proper_factor_of_the_shard_group(post):
    """``post_forward_size`` r (FSDP2's int ``reshard_after_forward``) is documented as 1 < r < shard_size and
    dividing it: r = shard_size (8) is the whole shard group (``reshard_after_forward: true``), refused as the
    other values."""
    from simulator.graph.builders.sharding import ShardingSpec

    with pytest.raises(ValueError, match="post_forward_size"):
        ShardingSpec("full_shard", 8, version=2, post_forward_size=post)
    assert ShardingSpec("full_shard", 8, version=2, post_forward_size=4).post_forward_size == 4
