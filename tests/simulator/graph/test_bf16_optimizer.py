"""DeepSpeed's BF16_Optimizer (``simulator.graph.builders.bf16_optimizer``): ZeRO stage 0 + bf16 + a pipeline.
Bytes of every kernel and collective worked by hand on a tiny two-stage model (deepspeedai/DeepSpeed@0acdb021
``deepspeed/runtime/bf16_optimizer.py``; the module docstring lists the sources)."""
from __future__ import annotations

from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.ops import CostClass, OpKind, Phase

# L=2, h=64, a=4, f=256, s=16, V=1000, biases, learned positions, tied; 2 stages, dp 4, 2 micro-batches.
# Stage 0: wpe 1024 + wte 64000 + one block (ln 128, qkv 12288 + 192, proj 4096 + 64, ln 128, fc1 16384 + 256,
# fc2 16384 + 64 = 49984): P0 = 115,008 in 14 tensors; Ps = P0 / 4 = 28,752.
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1000, ffn_hidden_size=256,
            micro_batch_size=2, num_micro_batches=2, precision="bf16", data_parallel_size=4,
            pipeline_parallel_size=2, deepspeed_bf16_optimizer=True)
P0, PS, TENSORS0 = 115_008, 28_752, 14


def _graph(rank=0, **kw):
    return build_gpt_step(TransformerSpec(**{**TINY, **kw}, pipeline_rank=rank))


def test_states_by_hand():
    """bf16 parameters 2 P, the bf16 accumulation buffer of every parameter 2 P (not partitioned), fp32 master and
    the two moments 4 Ps each (partitioned over dp like ZeRO-1); no fp32 DDP buffer."""
    g = _graph()
    assert {t.name: t.nbytes for t in g.persistent} == {
        "params.bf16": 2 * P0, "grad.bf16_optimizer.hp_flat": 2 * P0, "params.master_fp32": 4 * PS,
        "optimizer.exp_avg": 4 * PS, "optimizer.exp_avg_sq": 4 * PS}


def test_gradient_path_by_hand():
    """Per micro-batch: (from the second on) one memset of the 2 P bytes of .grad, then per tensor
    ``hp.add_(lp.grad)`` (read 4, write 2 B per element); after the last backward one bf16 all-reduce of the whole
    buffer (2 P bytes, no bucketing) and its ``mul_(1 / dp)``; no DDP bucket all-reduce, no Megatron grad-buffer
    memset."""
    ops = _graph().ops
    adds = [o for o in ops if ".bf16opt.update_hp_grads." in o.name]
    assert len(adds) == 2 * TENSORS0 and all(o.phase is Phase.BWD for o in adds)
    assert sum(o.bytes_read for o in adds) == 2 * 4 * P0 and sum(o.bytes_written for o in adds) == 2 * 2 * P0
    clear = [o for o in ops if o.name.endswith("bf16opt.clear_lp_grads")]
    assert [(o.cost_class, o.bytes_written) for o in clear] == [(CostClass.MEMSET, 2 * P0)]  # the 2nd micro-batch
    dp = [o for o in ops if o.kind is OpKind.COLLECTIVE and o.meta["group"] == "dp"]
    assert [(o.name, o.meta["collective"], o.meta["bytes"], o.dtype) for o in dp] == [
        ("bf16opt.grad_all_reduce", "all_reduce", 2 * P0, "bf16"),
        ("bf16opt.param_all_gather", "all_gather", 2 * P0, "bf16")]
    by = {o.name: o for o in ops}
    div = by["bwd.bf16opt.grad_all_reduce.div"]
    assert (div.bytes_read, div.bytes_written) == (2 * P0, 2 * P0) and dp[0].id in div.deps
    assert adds[-1].id < dp[0].id  # the last micro-batch's adds come before the all-reduce
    assert not any(n.startswith(("ddp.", "opt.megatron.", "opt.clip_grad")) for n in by)


def test_step_kernels_by_hand():
    """The step: per tensor ``t.float().norm()`` (2 + 4, then 4 B per element), the 4-byte norm all-reduce over
    the pipeline stages, the host read of the norm (and of the clip coefficient with clip_grad > 0), the partition's
    fp32 copy (2 + 4 Ps), the fused Adam (16 + 12 Ps), the bf16 copy of the updated partition (4 + 2 Ps), one
    all-gather of the whole bf16 flat buffer, and two memsets of the buffer (step's clear_hp_grads, zero_grad's)."""
    ops = [o for o in _graph(clip_grad=1.0).ops if o.phase is Phase.OPT or o.kind in (OpKind.SYNC, OpKind.COLLECTIVE)]
    by = {o.name: o for o in ops}
    casts = [o for o in ops if o.name.endswith(".float")]
    norms = [o for o in ops if o.name.endswith(".norm")]
    assert len(casts) == len(norms) == TENSORS0
    assert sum(o.bytes_read for o in casts) == 2 * P0 and sum(o.bytes_written for o in casts) == 4 * P0
    assert sum(o.bytes_read for o in norms) == 4 * P0 and all(o.bytes_written == 4 for o in norms)
    ar = by["pp.bf16opt.grad_norm.all_reduce"]
    assert ar.meta["bytes"] == 4 and ar.meta["rendezvous"] == ("pp", "bf16opt.grad_norm")
    assert by["bf16opt.grad_norm.item"].kind is OpKind.SYNC and "bf16opt.clip_coef.item" in by  # clip_grad 1.0
    part, adam, copy = (by[f"opt.{n}"] for n in ("bf16opt.grad_partition.to_fp32", "adamw",
                                                "bf16opt.update_lp_params.copy"))
    assert (part.bytes_read, part.bytes_written) == (2 * PS, 4 * PS)
    assert (adam.bytes_read, adam.bytes_written) == (16 * PS, 12 * PS) and part.id in adam.deps
    assert (copy.bytes_read, copy.bytes_written) == (4 * PS, 2 * PS)
    assert copy.id in by["bf16opt.param_all_gather"].deps
    memsets = [o for o in ops if ".bf16opt.clear_hp_grads." in o.name]
    assert [(o.cost_class, o.bytes_written) for o in memsets] == [(CostClass.MEMSET, 2 * P0)] * 2
    assert "bf16opt.clip_coef.item" not in {o.name for o in _graph(clip_grad=0.0).ops}
    assert "bf16opt.clip_coef.item" not in {o.name for o in _graph().ops}  # DeepSpeed's gradient_clipping default 0


def test_last_stage_skips_its_tied_embedding_replica_in_the_norm():
    """On the last stage the tied token table is a pipe-replicated copy (``ds_pipe_replicated``): its gradient is
    all-reduced with stage 0's (2-byte, the buffer's dtype) but left out of the norm. Stage 1: wte 64000 + one
    block 49984 + ln_f 128 in 15 tensors, 14 in the norm (64000 elements fewer)."""
    g = _graph(rank=1)
    norms = [o for o in g.ops if o.name.endswith(".norm") and ".bf16opt.grad_norm." in o.name]
    assert len(norms) == 14 and sum(o.bytes_read for o in norms) == 4 * (49_984 + 128)
    emb = next(o for o in g.ops if o.name == "pp.embedding_grads.all_reduce")
    assert emb.meta["bytes"] == 2 * 64_000 and emb.dtype == "bf16"
