"""FSDP1 (``FullyShardedDataParallel``) with ``MixedPrecision(param_dtype=bf16)`` over fp32 flat parameters: before
each all-gather, ``FlatParamHandle.pre_unshard`` -> ``_use_low_precision_shard`` casts the unit's fp32 shard into a
bf16 ``_mp_shard`` on the pre-unshard stream; the all-gather reads it; ``post_unshard`` frees it
(``_free_low_precision_sharded_param``). Hand-worked on the tiny model of ``test_fsdp_modes``: root 176 elements,
block 872."""

from __future__ import annotations

import pytest

from simulator.api import run_scenario
from simulator.config.loader import load_scenario
from simulator.graph.builders.sharding import LOW_PRECISION_SHARD, PRE_UNSHARD_STREAM, ShardingSpec
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from tests.simulator.engine.test_fsdp_modes import TINY
from tests.simulator.engine.test_sharding import B16, DGX, SMALL, _colls

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _graph(strategy: str, param_bytes: int = 2, sharded_param_bytes: int = 4, dp: int = 2):
    sh = ShardingSpec(strategy, dp, param_bytes=param_bytes, sharded_param_bytes=sharded_param_bytes, grad_bytes=4,
                      reshard_after_forward=strategy != "shard_grad_op")
    z = {"zero_stage": 3, "precision": "bf16"} if strategy == "zero3" else {}
    return build_gpt_step(TransformerSpec(**{**TINY, "num_layers": 1, "data_parallel_size": dp, **z}, sharding=sh))


def _casts(g):
    return [o for o in g.ops if o.name.endswith(LOW_PRECISION_SHARD)]


@pytest.mark.parametrize("dp,root,block", [(2, 88, 436), (4, 44, 218)])
def test_full_shard_casts_each_shard_before_each_all_gather_by_hand(dp, root, block):
    """FULL_SHARD over dp ranks: the root is gathered once (kept gathered after forward), the block in forward and
    again in backward. Each gather of a unit of n elements is preceded by the cast of this rank's fp32 shard,
    s = ceil(n / dp) elements: reads 4 s, writes 2 s bytes, allocates the 2 s-byte bf16 shard, on the pre-unshard
    stream. dp 2: root s = 88 (reads 352, writes 176), block s = 436 (reads 1744, writes 872); dp 4: 44 and 218.
    The gather (2 n bytes) waits for its cast and reads the shard (its last use: freed when the gather ends)."""
    g = _graph("full_shard", dp=dp)
    casts = _casts(g)
    assert [(o.name, o.stream, o.bytes_read, o.bytes_written, o.allocs[0].nbytes) for o in casts] == [
        (f"root.fwd.{LOW_PRECISION_SHARD}", PRE_UNSHARD_STREAM, 4 * root, 2 * root, 2 * root),
        (f"L0.fwd.{LOW_PRECISION_SHARD}", PRE_UNSHARD_STREAM, 4 * block, 2 * block, 2 * block),
        (f"L0.bwd.{LOW_PRECISION_SHARD}", PRE_UNSHARD_STREAM, 4 * block, 2 * block, 2 * block)]
    gathers = [o for o in _colls(g) if o.meta["collective"] == "all_gather"]
    assert [o.meta["bytes"] for o in gathers] == [2 * 176, 2 * 872, 2 * 872]
    for c, ga in zip(casts, gathers):
        assert c.id in ga.deps and ga.uses == (c.allocs[0].name,)
        assert not [o for o in g.ops if o.id != ga.id and c.allocs[0].name in o.uses]  # freed after the gather


def test_shard_grad_op_casts_only_where_it_gathers():
    """SHARD_GRAD_OP keeps the block gathered from forward to backward: ``pre_unshard`` is a no-op without an
    unshard (``needs_unshard`` false), so only the two forward gathers are cast (root 88, block 436 at dp 2)."""
    assert [(o.name, o.bytes_read) for o in _casts(_graph("shard_grad_op"))] == [
        (f"root.fwd.{LOW_PRECISION_SHARD}", 4 * 88), (f"L0.fwd.{LOW_PRECISION_SHARD}", 4 * 436)]


@pytest.mark.parametrize("strategy,param_bytes,sharded", [("full_shard", 4, 4), ("zero3", 2, 2)])
def test_no_cast_without_a_narrower_param_dtype(strategy, param_bytes, sharded):
    """fp32 ``param_dtype`` (no ``fsdp.mixed_precision``): the fp32 shard is gathered as it is; ZeRO-3 gathers its
    16-bit partition: no cast."""
    assert not _casts(_graph(strategy, param_bytes, sharded))


def test_engine_runs_the_cast_on_its_stream_and_holds_the_shard_until_the_gather():
    """The simulated step: every cast runs on the pre-unshard stream and ends before its gather starts; the result
    says that it does not slow the compute kernels beside it (fp32 ``param_dtype``: no cast, no such line)."""
    r = run_scenario(load_scenario(B16, SMALL + DGX + ["fsdp={sharding_strategy: FULL_SHARD}"]))
    assert sum("pre-unshard stream" in w for w in r.summary["warnings"]) == 1
    fp32 = ["fsdp={sharding_strategy: FULL_SHARD, mixed_precision: FULL}"]
    full = run_scenario(load_scenario(B16, SMALL + DGX + fp32))
    assert not any("pre-unshard stream" in w for w in full.summary["warnings"])
    assert not full.spans.name.str.endswith(LOW_PRECISION_SHARD).any()
    sp = r.spans
    casts = sp[sp.name.str.endswith(LOW_PRECISION_SHARD)]
    assert len(casts) and set(casts.stream) == {PRE_UNSHARD_STREAM} and (casts.end_s > casts.start_s).all()
    for _, c in casts.iterrows():
        ga = sp[(sp.name == c["name"].replace(LOW_PRECISION_SHARD, "param_all_gather")) & (sp.step == c["step"])]
        assert len(ga) == 1 and ga.start_s.iloc[0] >= c.end_s
