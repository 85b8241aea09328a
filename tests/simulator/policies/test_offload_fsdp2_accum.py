"""FSDP2 CPU offload with gradient accumulation and the first touch of its pageable CPU gradients
(``simulator/policies/offload_fsdp.py``: pytorch/pytorch@8fc2039d _fsdp_collectives.py ``foreach_reduce``), worked out
by hand on the tiny model of ``test_fsdp2_hsdp.py`` over 8 shard ranks.

Tiny model: the block's shard is 109 fp32 elements (436 B) in 14 PyTorch parameters (12 builder groups, the fused
qkv standing for wq, wk, wv), the root's 26 (104 B) in 4. Two micro-batches: buckets 0 (block) and 1 (root) reduce
the first, 2 and 3 the second, whose shards are added on the CPU.

The test host: 16 cores, one NUMA node, 8 GB/s sustained, 1 GB/s per core, no clock (vector work unpriced), 2 us
per page fault, 10 us per dispatched op. The 8 ranks of the DGX share it: ``cores // 8`` = 2 threads each, capped
at 2 GB/s, and the node's 8 GB/s split max-min fairly over 8 flows: 1 GB/s per rank."""

from __future__ import annotations

import dataclasses

import pytest

from hardware_models.host import HostCpuSpec
from simulator.config.loader import load_scenario, resolve_hardware
from simulator.graph.builders.sharding import ShardingSpec
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.ops import OpKind
from simulator.policies.offload_fsdp import fsdp_cpu_offload
from tests.simulator.engine.test_fsdp2_hsdp import TINY
from tests.simulator.engine.test_sharding import B16, DGX

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
FAULT_S, LAUNCH_S, RANK_BW = 2e-6, 1e-5, 1e9


@pytest.fixture(scope="module")
def hw():
    hw = resolve_hardware(load_scenario(B16, DGX))
    cpu = HostCpuSpec("test-host", 16, 8e9, stream_bandwidth_bytes_per_s=8e9, per_core_bandwidth_bytes_per_s=1e9,
                      page_fault_s=FAULT_S)
    return dataclasses.replace(hw, host_cpu=cpu, launch_overhead_s=LAUNCH_S)


def _graph(mbs=2, **kw):
    sh = ShardingSpec("full_shard", 8, 1, fwd_prefetch_depth=2, param_bytes=2, sharded_param_bytes=4, grad_bytes=4,
                      version=2)
    return build_gpt_step(TransformerSpec(**{**TINY, "num_micro_batches": mbs, **kw}, precision="amp_fp32_params",
                                          sharding=sh))


def _named(g, prefix):
    return sorted((o for o in g.ops if o.name.startswith(prefix) and not o.name.endswith(".wait")),
                  key=lambda o: o.id)


@pytest.mark.parametrize("pin", [True, False])
def test_later_micro_batches_copy_synchronously_and_add_on_the_cpu_by_hand(hw, pin):
    g = fsdp_cpu_offload(_graph(), hw, impl="torch_fused", ranks=8, pin_memory=pin)
    assert not [o for o in g.ops if o.name.endswith("grad.shard_accum")]  # no GPU accumulation left
    copies = _named(g, "fsdp_offload.d2h.grad.shard.")
    assert [o.bytes_read for o in copies] == [436, 104, 436, 104]
    # first micro-batch: .to("cpu", non_blocking=pin_memory); later: non_blocking False, a pageable destination
    assert [o.pinned for o in copies] == [pin, pin, False, False]
    waits = {o.deps[0]: o for o in g.ops if o.kind is OpKind.SYNC and o.name.endswith(".wait")
             and o.name.startswith("fsdp_offload.d2h")}
    assert {c.id for c in copies[2:]} <= set(waits) and (copies[0].id in waits) is (not pin)
    adds = _named(g, "fsdp_offload.cpu_grad_accum.")
    assert [a.name for a in adds] == ["fsdp_offload.cpu_grad_accum.2", "fsdp_offload.cpu_grad_accum.3"]
    for a, c in zip(adds, copies[2:]):  # after the training thread's wait on its copy, on the host stream
        assert a.kind is OpKind.HOST and a.stream == "host" and a.deps == (waits[c.id].id,)
        assert c.allocs[0].device == "host_pageable" and a.uses == (c.allocs[0].name,)
        assert c.allocs[0].nbytes == c.bytes_read
    # 12 B per element at 1 GB/s plus one dispatch per PyTorch parameter (14 in the block, 4 in the root)
    assert adds[0].host_s == pytest.approx(12 * 109 / RANK_BW + 14 * LAUNCH_S, rel=1e-12)
    assert adds[1].host_s == pytest.approx(12 * 26 / RANK_BW + 4 * LAUNCH_S, rel=1e-12)
    assert all(c.host_s == 0.0 for c in copies)  # 540 B of gradients: recycled from the heap, no faults
    assert g.meta["fsdp_cpu_offload"]["d2h_bytes_per_step"] == 2 * 540


def test_fsdp1_still_refuses_accumulation(hw):
    from simulator.policies.registry import PolicyError

    sh = ShardingSpec("full_shard", 8, 1, param_bytes=2, sharded_param_bytes=4, grad_bytes=4)
    g = build_gpt_step(TransformerSpec(**{**TINY, "num_micro_batches": 2}, precision="amp_fp32_params", sharding=sh))
    with pytest.raises(PolicyError, match="FSDP1 does not accumulate"):
        fsdp_cpu_offload(g, hw)


#: the root's wte over 8 ranks: 2^23 x 8 / 8 = 2^23 fp32 elements = 32 MiB, glibc's mmap threshold
BIG_VOCAB = 2 ** 23


@pytest.mark.parametrize("pin", [True, False])
def test_first_touch_of_fresh_pageable_gradients_by_hand(hw, pin):
    """pin_memory false: every first-micro-batch copy faults its whole shard in (the step's .grad tensors, freed
    together by zero_grad, are 32 MiB and more); the accumulation temporaries, freed one by one, fault only where a
    parameter is 32 MiB or more (wte), pinned policy or not."""
    g = fsdp_cpu_offload(_graph(vocab_size=BIG_VOCAB), hw, impl="torch_fused", ranks=8, pin_memory=pin)
    root = 26 - 16 + BIG_VOCAB  # ln_f 2, wpe 8, wte 2^23
    copies = _named(g, "fsdp_offload.d2h.grad.shard.")
    assert [o.bytes_read for o in copies] == [436, 4 * root, 436, 4 * root]
    page = FAULT_S / 4096
    first = [0.0, 0.0] if pin else [436 * page, 4 * root * page]
    assert [c.host_s for c in copies] == pytest.approx(first + [0.0, 4 * BIG_VOCAB * page], rel=1e-12)


def test_just_under_the_mmap_threshold_the_temporaries_do_not_fault(hw):
    g = fsdp_cpu_offload(_graph(vocab_size=BIG_VOCAB - 8), hw, impl="torch_fused", ranks=8, pin_memory=False)
    copies = _named(g, "fsdp_offload.d2h.grad.shard.")
    root = 26 - 16 + BIG_VOCAB - 8  # wte: 2^20 - 1 rows of 8, 32 B under 32 MiB; the step's total is above
    page = FAULT_S / 4096
    assert [c.host_s for c in copies] == pytest.approx([436 * page, 4 * root * page, 0.0, 0.0], rel=1e-12)


def test_pinned_without_accumulation_has_no_faults(hw):
    g = fsdp_cpu_offload(_graph(mbs=1, vocab_size=BIG_VOCAB), hw, impl="torch_fused", ranks=8, pin_memory=True)
    assert all(c.host_s == 0.0 and c.pinned for c in _named(g, "fsdp_offload.d2h.grad.shard."))
    assert not _named(g, "fsdp_offload.cpu_grad_accum.")


def test_scenario_accumulates_every_later_micro_batch_on_the_cpu():
    """The bundled GPT 1.3B dp8 scenario (4 layers, micro-batch 8) at global batch 128: two micro-batches per step.
    The measured step copies each unit's reduced shard D2H once per micro-batch (4 B per shard element each time),
    adds the second micro-batch's on the CPU once per unit (4 blocks and the root, on the training thread), and
    takes longer than twice the GPU part of a one-micro-batch step."""
    from simulator.api import run_scenario
    from tests.simulator.policies.test_offload_fsdp2 import DP8
    from tests.simulator.engine.test_sharding import SMALL

    one = run_scenario(load_scenario(DP8, SMALL + ["training.enable_cpu_offload=true", "fsdp={version: 2}"]))
    r = run_scenario(load_scenario(DP8, SMALL + ["training.enable_cpu_offload=true", "fsdp={version: 2}",
                                                 "training.global_batch_size=128"]))
    shard = one.summary["peak_host_pinned_bytes"] // 8
    sp = r.spans[r.spans.step == 1]
    assert sp[sp.kind == "memcpy_d2h"].bytes.sum() == 2 * 4 * shard
    adds = sp[sp.name.str.startswith("fsdp_offload.cpu_grad_accum.")]
    assert len(adds) == 5 and (adds.stream == "host").all() and (adds.duration_s > 0).all()
    assert r.summary["step_time_s"] > 2 * (one.summary["step_time_s"] - one.summary["offload_cpu_optimizer_s"])
    assert any("no page_fault_s, so the first-touch faults of the fresh pageable CPU gradient" in w
               for w in r.summary["warnings"])
