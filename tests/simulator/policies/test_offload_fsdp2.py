"""FSDP2's CPU offload, ``fully_shard(offload_policy=CPUOffloadPolicy(pin_memory))`` (``fsdp.version: 2`` with
``fsdp.offload_policy``; ``simulator/policies/offload_fsdp.py``), on the tiny model of ``test_fsdp2_hsdp.py`` worked
out by hand (exact), and on a bundled scenario.

Tiny model over 8 shard ranks: the block gathers 872 padded elements (shard 109), the root 208 (wpe's 4 rows padded
to 8: shard 26); this rank's shards: 135 elements, 540 fp32 bytes. FULL_SHARD gathers the root once (forward) and
the block in forward and again in backward, so each step copies H2D 4 x (26 + 109 + 109) = 976 bytes, and D2H the
two reduced fp32 gradient shards, 4 x (109 + 26) = 540 bytes: the shard sizes."""

from __future__ import annotations

import pytest

from simulator.api import run_scenario
from simulator.config.loader import load_scenario, resolve_hardware
from simulator.graph.builders.fsdp2 import COPY_IN_STREAM
from simulator.graph.ops import OpKind
from simulator.policies.offload_fsdp import fsdp_cpu_offload
from simulator.policies.offload_optimizer import cpu_step_times
from simulator.policies.registry import PolicyError
from tests.conftest import ROOT
from tests.simulator.engine.test_fsdp2_hsdp import _v2
from tests.simulator.engine.test_sharding import B16, DGX

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
DP8 = ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml"


@pytest.fixture(scope="module")
def hw():
    return resolve_hardware(load_scenario(B16, DGX))


def _by(g, kind, suffix=""):
    return [o for o in g.ops if o.kind is kind and o.name.endswith(suffix)]


def _op(g, name):
    return next(o for o in g.ops if o.name == name)


@pytest.mark.parametrize("pin", [True, False])
def test_bytes_moved_per_step_are_the_shard_sizes_by_hand(hw, pin):
    g = fsdp_cpu_offload(_v2(), hw, pin_memory=pin)
    fetch = _by(g, OpKind.MEMCPY_H2D, "fsdp_offload.fetch")
    assert [o.bytes_read for o in fetch] == [4 * 26, 4 * 109, 4 * 109]
    assert all(o.stream == COPY_IN_STREAM and o.pinned is pin for o in fetch)  # all_gather_inputs' .to(device)
    for f in fetch:  # the unit's bf16 cast reads the copied fp32 shard, then is freed
        cast = next(o for o in g.ops if f.id in o.deps and o.name.endswith(".fsdp.all_gather_cast"))
        assert f.allocs[0].name in cast.uses and cast.bytes_read == f.bytes_read and f.allocs[0].device == "gpu"
    down = _by(g, OpKind.MEMCPY_D2H)
    assert [o.bytes_read for o in down] == [4 * 109, 4 * 26] and all(o.pinned is pin for o in down)
    rs = [o for o in g.ops if o.name.startswith("fsdp.grad_reduce_scatter.")]
    assert [d.deps for d in down] == [(rs[0].id,), (rs[1].id,)]
    assert down[0].id in rs[1].deps  # the reduce-scatter stream's next op runs after the copy
    assert down[0].uses == (rs[0].allocs[0].name,)
    meta = g.meta["fsdp_cpu_offload"]
    assert (meta["h2d_bytes_per_step"], meta["d2h_bytes_per_step"]) == (976, 540)
    # the GPU keeps no sharded state; the host holds the fp32 parameter and gradient shards (pinned as asked) and
    # the two Adam moments, 540 bytes each
    host = "host_pinned" if pin else "host_pageable"
    assert sorted((t.name, t.device, t.nbytes) for t in g.persistent) == sorted([
        ("params.fp32.shard.host", host, 540), ("grad.fp32.shard.host", host, 540),
        ("optimizer.exp_avg.host", "host_pageable", 540), ("optimizer.exp_avg_sq.host", "host_pageable", 540)])
    assert not [o for o in g.ops if o.name == "opt.adamw"]
    done = _op(g, "offload.bwd_done")  # finalize_backward: grad_offload_event.synchronize()
    assert {d.id for d in down} <= set(done.deps)


def test_pageable_copies_block_the_training_thread(hw):
    """pin_memory false: one host wait after every copy, which the next op launched after it follows."""
    g = fsdp_cpu_offload(_v2(), hw, pin_memory=False)
    copies = _by(g, OpKind.MEMCPY_H2D, "fsdp_offload.fetch") + _by(g, OpKind.MEMCPY_D2H)
    waits = [o for o in g.ops if o.kind is OpKind.SYNC and o.name.endswith(".wait")]
    assert sorted(w.deps for w in waits) == sorted((c.id,) for c in copies)
    assert all(w.stream == "host" and w.id == c.id + 1 for w, c in zip(sorted(waits, key=lambda o: o.id),
                                                                         sorted(copies, key=lambda o: o.id)))
    pinned = fsdp_cpu_offload(_v2(), hw, pin_memory=True)
    assert not [o for o in pinned.ops if o.kind is OpKind.SYNC and o.name.endswith(".wait")]


def test_hsdp_copies_after_the_replica_all_reduce(hw):
    """HSDP 2 x 4 (no padding: shards 218 and 44): the copy follows the all-reduce, the all-reduce stream's next
    all-reduce waits for it."""
    g = fsdp_cpu_offload(_v2(shard=4, replicate=2), hw)
    down = _by(g, OpKind.MEMCPY_D2H)
    ar = [o for o in g.ops if o.name.startswith("fsdp.grad_all_reduce_replicas.")]
    assert [o.bytes_read for o in down] == [4 * 218, 4 * 44]
    assert [d.deps for d in down] == [(ar[0].id,), (ar[1].id,)] and down[0].id in ar[1].deps


def test_bf16_reduction_copies_the_fp32_cast(hw):
    g = fsdp_cpu_offload(_v2(grad_bytes=2), hw)
    cast = _op(g, "fsdp.grad_cast_fp32.0")
    d = _op(g, "fsdp_offload.d2h.grad.shard.0")
    assert d.deps == (cast.id,) and d.uses == (cast.allocs[0].name,) and d.bytes_read == 4 * 109


def test_fp32_param_dtype_fetches_before_the_copy_in(hw):
    g = fsdp_cpu_offload(_v2(param_bytes=4), hw)
    fetch = _by(g, OpKind.MEMCPY_H2D, "fsdp_offload.fetch")
    assert [o.bytes_read for o in fetch] == [4 * 26, 4 * 109, 4 * 109]
    assert all(o.name.endswith(".fsdp.all_gather_copy_in.fsdp_offload.fetch") for o in fetch)


def test_reshard_to_a_smaller_group_gathers_backward_from_the_gpu_copy(hw):
    """reshard_after_forward 4: backward all-gathers the post-forward GPU copy (the SHARDED_POST_FORWARD branch of
    all_gather_inputs): no H2D copy then."""
    g = fsdp_cpu_offload(_v2(post_forward_size=4), hw)
    assert [(o.name, o.bytes_read) for o in _by(g, OpKind.MEMCPY_H2D, "fsdp_offload.fetch")] == [
        ("root.fwd.fsdp.all_gather_cast.fsdp_offload.fetch", 4 * 26),
        ("L0.fwd.fsdp.all_gather_cast.fsdp_offload.fetch", 4 * 109)]


def test_cpu_step_is_the_host_model_over_the_per_parameter_shards(hw):
    """One CPU tensor per parameter (its padded dim-0 shard): 16 tensors summing to 135 elements."""
    g = fsdp_cpu_offload(_v2(), hw, impl="torch_foreach")
    sizes = [1, 1, 1, 32, 4, 32, 1, 1, 1, 8, 3, 24, 1, 1, 16, 8]
    want = cpu_step_times(135, 16, "torch_foreach", hw, tensor_elements=sizes, pin_memory=True)["cpu.adam"]
    assert _op(g, "cpu.adam").host_s == pytest.approx(want, rel=1e-12)


def test_fsdp1_graph_refuses_pageable(hw):
    from simulator.graph.builders.sharding import ShardingSpec
    from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
    from tests.simulator.engine.test_fsdp2_hsdp import TINY
    sh = ShardingSpec("full_shard", 8, param_bytes=2, sharded_param_bytes=4, grad_bytes=4)
    with pytest.raises(PolicyError, match="FSDP1's CPUOffload always pins"):
        fsdp_cpu_offload(build_gpt_step(TransformerSpec(**TINY, sharding=sh)), hw, pin_memory=False)


SMALL = ["model.num_layers=4", "run.steps=2", "run.warmup_steps=1"]


def _gpu_bytes_at(r, op: str) -> int:
    c = r.counters[(r.counters.metric == "memory_bytes") & (r.counters.scope == "gpu0.hbm")].sort_values("t_s")
    t = float(r.spans[(r.spans.name == op) & (r.spans.step == 1)].start_s.iloc[0])
    return int(c[c.t_s <= t].value.iloc[-1])


def test_scenario_offload_moves_every_sharded_state_to_the_host():
    """The bundled GPT 1.3B dp8 scenario (4 layers) with fully_shard: at the optimizer step the GPU holds the fp32
    sharded parameters, gradients and both moments, 16 B per shard element, and with CPUOffloadPolicy nothing; the
    peak falls by the 12 B of the resident states; the host pools hold the shards (pinned: parameters and gradients)
    and the moments (pageable); the measured step moves 4 B per shard element D2H and more than that H2D (the blocks
    are gathered twice); the step is slower than with the states on the GPU."""
    plain = run_scenario(load_scenario(DP8, SMALL + ["fsdp={version: 2}"]))
    r = run_scenario(load_scenario(DP8, SMALL + ["training.enable_cpu_offload=true", "fsdp={version: 2}"]))
    s, shard = r.summary, r.summary["peak_host_pinned_bytes"] // 8  # 2 pinned fp32 tensors of the shard's size
    assert _gpu_bytes_at(plain, "opt.adamw") == 16 * shard and _gpu_bytes_at(r, "cpu.adam") == 0
    assert plain.summary["peak_memory_bytes"] - s["peak_memory_bytes"] == 12 * shard
    assert s["peak_host_pageable_bytes"] == 8 * shard and not s["oom"]
    sp = r.spans[r.spans.step == 1]
    assert sp[sp.kind == "memcpy_d2h"].bytes.sum() == 4 * shard
    assert sp[sp.name.str.endswith("fsdp_offload.fetch")].bytes.sum() > 4 * shard
    assert s["fsdp_cpu_offload"] == {"impl": "torch_fused", "ranks_per_host": 8, "pin_memory": True}
    assert s["offload_cpu_optimizer_s"] > 0 and s["step_time_s"] > plain.summary["step_time_s"]
    assert any(w.startswith("fsdp.offload_policy (FSDP2)") for w in s["warnings"])
    pageable = run_scenario(load_scenario(DP8, SMALL + ["fsdp={version: 2, offload_policy: 'CPUOffloadPolicy("
                                                        "pin_memory=False)'}"])).summary
    assert pageable["peak_host_pinned_bytes"] == 0 and pageable["peak_host_pageable_bytes"] == 16 * shard
    assert pageable["step_time_s"] > s["step_time_s"]  # the training thread waits on every copy
    assert any("fsdp.offload_policy.pin_memory false copies through pageable host memory" in w
               for w in pageable["warnings"])


def test_scenario_host_memory_is_a_capacity():
    r = run_scenario(load_scenario(DP8, SMALL + ["fsdp={version: 2, offload_policy: CPUOffloadPolicy}",
                                                 "hardware.host.overrides.memory.capacity_bytes=1 GB"]))
    oom = r.summary["oom"]
    assert oom and oom.startswith("out of memory on host: FSDP2 offload_policy states for the node's 8 ranks"), oom
