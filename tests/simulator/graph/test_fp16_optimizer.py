"""DeepSpeed's FP16_Optimizer (``simulator.graph.builders.fp16_optimizer``): ZeRO stage 0 with fp16, or bf16 without a
pipeline. Bytes of every state, kernel and collective worked by hand on a tiny model (deepspeedai/DeepSpeed@051b9c8b
``deepspeed/runtime/fp16/fused_optimizer.py``, @007cca6a ``deepspeed/runtime/engine.py``; the module docstring lists
the sources)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from simulator.graph.builders import fp16_optimizer as fp16opt
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.ops import CostClass, OpKind, OpRole, Phase

# L=2, h=64, a=4, f=256, s=16, V=1000, biases, learned positions (16 rows), tied; dp 4, 2 micro-batches, one stage.
# wpe 1024 + wte 64000 + 2 blocks x 49,984 (ln 64 + 64, qkv 12288 + 192, proj 4096 + 64, ln 64 + 64,
# fc1 16384 + 256, fc2 16384 + 64) + ln_f 128 = P = 165,120 in 28 tensors.
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1000, ffn_hidden_size=256,
            micro_batch_size=2, num_micro_batches=2, precision="fp16", data_parallel_size=4,
            deepspeed_fp16_optimizer=True)
P, TENSORS = 165_120, 28
# Megatron-DeepSpeed's two param groups (get_param_groups), flattened one by one: weight decay (the 2-D weights: wte,
# wpe, 2 x (qkv 12288 + proj 4096 + fc1 16384 + fc2 16384)) P0 = 65,024 + 98,304 = 163,328 in 10 tensors; no weight
# decay (biases and norms: 2 x (ln1 128 + qkv 192 + proj 64 + ln2 128 + fc1 256 + fc2 64) + ln_f 128) P1 = 1,792 in 18
P0, P1, T0, T1 = 163_328, 1_792, 10, 18


def _graph(**kw):
    return build_gpt_step(TransformerSpec(**{**TINY, **kw}))


def _ops(g, part):
    return [o for o in g.ops if part in o.name]


def test_states_by_hand():
    """16-bit parameters 2 P, the flat fp32 master copy 4 P and the two Adam moments 4 P each, none partitioned (no
    ZeRO); no persistent gradient buffer (Megatron's DDP kept a 2 P fp16 one): the .grad are made by backward."""
    assert {t.name: t.nbytes for t in _graph().persistent} == {
        "params.fp16": 2 * P, "params.master_fp32": 4 * P, "optimizer.exp_avg": 4 * P, "optimizer.exp_avg_sq": 4 * P}


def test_gradient_all_reduce_by_hand():
    """After the last backward, one bucket (P < 500M elements): torch.cat of the 2-byte .grad (2 P read and
    written), one fp16 all-reduce of 2 P = 330,240 bytes over dp, its mul_(1 / 4) (2 P + 2 P), one copy_ back per
    tensor (28, 2 P read and written in all); nothing else over dp, no model-parallel group."""
    g = _graph()
    coll = [o for o in g.ops if o.kind is OpKind.COLLECTIVE]
    assert [(o.name, o.meta["collective"], o.meta["group"], o.meta["bytes"], o.dtype) for o in coll] == [
        ("fp16opt.grad_all_reduce.0", "all_reduce", "dp", 2 * P, "fp16")]
    by = {o.name: o for o in g.ops}
    cat, div = by["bwd.fp16opt.allreduce_bucket.0.flatten"], by["bwd.fp16opt.allreduce_bucket.0.div"]
    assert (cat.bytes_read, cat.bytes_written, cat.allocs[0].nbytes) == (2 * P, 2 * P, 2 * P)
    assert (div.bytes_read, div.bytes_written) == (2 * P, 2 * P) and coll[0].id in div.deps
    copies = _ops(g, "allreduce_bucket.0.copy_.")
    assert len(copies) == TENSORS and sum(o.bytes_read for o in copies) == sum(o.bytes_written for o in copies) == 2 * P
    assert all(o.phase is Phase.BWD for o in (cat, div, *copies))
    assert not any(o.name.startswith(("ddp.", "opt.megatron.", "opt.clip_grad")) for o in g.ops)


def test_two_param_groups_by_hand():
    """FP16_Optimizer's fp16_groups: the weight-decay group then the no-weight-decay one, each in named_parameters()
    order (deepspeedai/Megatron-DeepSpeed@dd16deb1 megatron/optimizer/__init__.py get_param_groups)."""
    from simulator.graph.builders.transformer import _GptBuilder

    groups = fp16opt.param_groups([("wte.weight", 64000), ("wpe.weight", 1024), ("L0.ln1.weight", 64),
                                   ("L0.ln1.bias", 64), ("L0.qkv.weight", 12288), ("L0.qkv.bias", 192),
                                   ("ln_f.bias", 64)])
    assert groups == [[64000, 1024, 12288], [64, 64, 192, 64]]
    assert fp16opt.param_groups([("wte.weight", 5)]) == [[5]]  # an empty group is left out
    bld = _GptBuilder(TransformerSpec(**TINY), False, False, True, False, False)
    bld.build()
    assert [(sum(g), len(g)) for g in fp16opt.rank_param_groups(bld)] == [(P0, T0), (P1, T1)]


def test_step_kernels_by_hand():
    """The step: per tensor float() (2 -> 4 B) and sum (4 B) and a host read, the overflow flag's host read; per
    group, per tensor .to(fp32) (2 -> 4 B) and one torch.cat (4 P_i read and written); per group the norm (4 P_i)
    and its host read, the total's host read; per group the unscale mul_ (4 P_i + 4 P_i) and the fused Adam
    (16 P_i, 12 P_i); the 16-bit copy back per tensor (4 P read, 2 P written). Before, one group of P: one cat, one
    norm, one mul_, one Adam."""
    g = _graph()
    opt = [o for o in g.ops if o.phase is Phase.OPT]
    floats = [o for o in opt if "has_inf_or_nan." in o.name and o.name.endswith(".float")]
    sums = [o for o in opt if "has_inf_or_nan." in o.name and o.name.endswith(".sum")]
    assert len(floats) == len(sums) == TENSORS
    assert (sum(o.bytes_read for o in floats), sum(o.bytes_written for o in floats)) == (2 * P, 4 * P)
    assert sum(o.bytes_read for o in sums) == 4 * P
    syncs = [o.name for o in g.ops if o.kind is OpKind.SYNC and o.name.startswith("fp16opt.")]
    assert len(syncs) == TENSORS + 4 and syncs[-4:] == ["fp16opt.overflow.item", "fp16opt.grad_norm.item.0",
                                                        "fp16opt.grad_norm.item.1", "fp16opt.grad_norm.total.item"]
    casts = _ops(g, "opt.fp16opt.grad_to_fp32.")
    assert (len(casts), sum(o.bytes_read for o in casts), sum(o.bytes_written for o in casts)) == (TENSORS, 2 * P, 4 * P)
    assert [o.bytes_read for o in casts[:T0]] == [2 * n for n in (1024, 64000, 12288, 4096, 16384, 16384) +
                                                  (12288, 4096, 16384, 16384)]
    by = {o.name: o for o in opt}
    for i, n in enumerate((P0, P1)):
        cat, norm, mul, adam = (by[f"opt.{k}.{i}"] for k in ("fp16opt.grad_flat.cat", "fp16opt.grad_norm.norm",
                                                              "fp16opt.unscale_and_clip_grads.mul", "adamw"))
        assert (cat.bytes_read, cat.bytes_written, cat.allocs[0].nbytes) == (4 * n, 4 * n, 4 * n)
        assert (norm.bytes_read, norm.bytes_written) == (4 * n, 4) and cat.allocs[0].name in norm.uses
        assert (mul.bytes_read, mul.bytes_written) == (4 * n, 4 * n)
        assert (adam.bytes_read, adam.bytes_written, adam.meta["params"]) == (16 * n, 12 * n, n)
    assert not [o for o in opt if o.name.endswith((".cat.2", ".norm.2", ".mul.2", "adamw.2", "opt.adamw"))]
    item0 = next(o.id for o in g.ops if o.name == "fp16opt.grad_norm.item.0")
    assert item0 in by["opt.fp16opt.grad_norm.norm.1"].deps  # launched after the first norm's host read
    back = _ops(g, "opt.fp16opt.update_fp16.")
    assert (len(back), sum(o.bytes_read for o in back), sum(o.bytes_written for o in back)) == (TENSORS, 4 * P, 2 * P)
    assert all(by["opt.adamw.1"].id in o.deps for o in back) and {o.dtype for o in back} == {"fp16"}
    assert not _ops(g, "grad_norm.mask")  # one stage: no pipe-replicated embedding to mask


def test_step_memory_by_hand():
    """The step's transient tensors: the overflow check's fp32 copy of each tensor (4 P in all, one at a time), per
    group the flatten's per-tensor fp32 copies (4 P_i) and the flat fp32 gradient (4 P_i), which its fused Adam
    reads; the 2-byte .grad (2 P; the builder tracks the weights', all in the first group) are last read by the
    first group's torch.cat (p.grad = None after it). Peak beyond the .grad: max(8 P0, 2 P0 + 8 P1) = 8 x 163,328
    (was 8 P, one group)."""
    g = _graph()
    by = {o.name: o for o in g.ops}
    cats = [by[f"opt.fp16opt.grad_flat.cat.{i}"] for i in (0, 1)]
    copies = _ops(g, "opt.fp16opt.grad_to_fp32.")
    assert sum(a.nbytes for o in copies for a in o.allocs) == 4 * P
    assert [c.allocs[0].nbytes for c in cats] == [4 * P0, 4 * P1]
    checks = _ops(g, "has_inf_or_nan.")
    assert sum(a.nbytes for o in checks for a in o.allocs) == 4 * P
    grads = {a.name: a.nbytes for o in g.ops if o.role is OpRole.GRAD_ACCUM for a in o.allocs}
    assert grads and all(u in cats[0].uses for u in grads) and not set(grads) & set(cats[1].uses)
    last_user = {u: max(o.id for o in g.ops if u in o.uses) for u in grads}
    assert all(i <= cats[0].id for i in last_user.values())
    for i, cat in enumerate(cats):
        assert max(o.id for o in g.ops if cat.allocs[0].name in o.uses) == by[f"opt.adamw.{i}"].id
    assert fp16opt.step_transient_bytes([P0, P1]) == 8 * P0 == 1_306_624
    assert fp16opt.step_transient_bytes([10, 100]) == 2 * 10 + 8 * 100  # the second group's flatten


def test_bf16_without_a_pipeline_is_the_same_optimizer_in_bf16():
    """DDP_BFLOAT16: the same FP16_Optimizer with low_precision_dtype bf16 (the overflow check runs too; no loss
    scale, whose unscale mul_ by 1.0 still runs): the all-reduce and the copy back are bf16."""
    g = _graph(precision="bf16")
    assert [(o.meta["bytes"], o.dtype) for o in g.ops if o.kind is OpKind.COLLECTIVE] == [(2 * P, "bf16")]
    assert len(_ops(g, "has_inf_or_nan.")) == 3 * TENSORS  # float, sum, host read per tensor
    assert {f"opt.fp16opt.unscale_and_clip_grads.mul.{i}" for i in (0, 1)} <= {o.name for o in g.ops}


def test_buckets_close_once_they_exceed_the_cap(monkeypatch):
    """allreduce_no_retain: a bucket closes after the tensor that makes it exceed the cap. With a 70,000-element cap:
    wpe 1024 + wte 64000 + ln1 64 + 64 = 65,152, then qkv.weight 12288 -> 77,440 > 70,000 closes bucket 0 (5
    tensors); block 0's other 9 tensors (37,568) and block 1's ln1, qkv, proj, ln2 and fc1.weight (33,280) make
    70,848 > 70,000, bucket 1 (18 tensors); fc1.bias, fc2 and ln_f (16,832) are bucket 2. Each its own flatten, fp16
    all-reduce, div and copies, one after the other (the compute stream waits for each all-reduce)."""
    assert fp16opt.allreduce_buckets([3, 3, 3], 5) == [[3, 3], [3]]
    assert fp16opt.allreduce_buckets([3, 3, 3], 6) == [[3, 3, 3]]
    assert fp16opt.allreduce_buckets([7, 1], 5) == [[7], [1]]
    monkeypatch.setattr(fp16opt, "ALLREDUCE_BUCKET_ELEMENTS", 70_000)
    g = _graph()
    coll = [o for o in g.ops if o.kind is OpKind.COLLECTIVE]
    assert [o.meta["bytes"] for o in coll] == [2 * 77_440, 2 * 70_848, 2 * 16_832]
    assert [len(_ops(g, f"allreduce_bucket.{k}.copy_.")) for k in range(3)] == [5, 18, 5]
    assert coll[0].id < _ops(g, "allreduce_bucket.1.flatten")[0].id < coll[1].id


def test_one_rank_still_flattens_and_copies_back():
    """dp 1: DeepSpeed's engine still runs buffered_allreduce_fallback (flatten, copy back; the all-reduce over a
    one-rank group exchanges nothing and the division is skipped: predivide factor 1 == world size 1)."""
    g = _graph(data_parallel_size=1)
    assert not [o for o in g.ops if o.kind is OpKind.COLLECTIVE] and not _ops(g, "allreduce_bucket.0.div")
    assert len(_ops(g, "allreduce_bucket.0.flatten")) == 1 and len(_ops(g, "allreduce_bucket.0.copy_.")) == TENSORS


def test_last_stage_masks_its_tied_embedding_replica_and_reduces_flags_over_the_stages():
    """Two stages, the last holding the pipe-replicated tied table: the norm of its group (weight decay: wte 64000 +
    one block's weights 49,152 = 113,152 elements; the other group, 832 + ln_f 128 = 960, holds none) masks that
    range (zeros of 113,152 + 1 fp32, cumsum, bool, masked_fill over that group's flat gradient, the norm of the
    masked copy); the overflow flag (1 B) and the norm (4 B) are all-reduced over the pipeline stages (DeepSpeed's
    mpu: the grid's model-parallel group), the tied embedding's .grad all-reduced in fp16 (2 B). Before, one group:
    the mask over all 114,112 elements."""
    W, N = 113_152, 960
    g = build_gpt_step(TransformerSpec(**{**TINY, "pipeline_parallel_size": 2}, pipeline_rank=1))
    by = {o.name: o for o in g.ops}
    zeros, cs, mb, fill = (by[f"opt.fp16opt.grad_norm.{n}.0"] for n in ("mask.zeros", "mask.cumsum", "mask.bool",
                                                                         "masked_fill"))
    assert zeros.cost_class is CostClass.MEMSET and zeros.bytes_written == 4 * (W + 1)
    assert (cs.bytes_read, cs.bytes_written, mb.bytes_read, mb.bytes_written) == (4 * (W + 1), 4 * (W + 1),
                                                                                  4 * (W + 1), W + 1)
    assert (fill.bytes_read, fill.bytes_written) == (5 * W, 4 * W)
    assert fill.allocs[0].name in by["opt.fp16opt.grad_norm.norm.0"].uses
    assert by["opt.fp16opt.grad_norm.norm.1"].bytes_read == 4 * N and len(_ops(g, "masked_fill")) == 1
    pp = {o.name: (o.meta["bytes"], o.dtype) for o in g.ops if o.kind is OpKind.COLLECTIVE and o.meta["group"] == "pp"
          and o.phase is Phase.OPT}  # (the point-to-point sends and receives aside)
    assert pp == {"pp.fp16opt.overflow.all_reduce": (1, "uint8"), "pp.fp16opt.grad_norm.all_reduce": (4, "fp32"),
                  "pp.embedding_grads.all_reduce": (2 * 64_000, "fp16")}
    assert fp16opt.step_transient_bytes([W, N], masked=[0]) == 2 * (W + N) + 9 * (W + 1) == 1_246_601


def test_tensor_parallel_rank_masks_its_replicated_parameters_norm():
    """TP 2: on a TP rank other than 0 DeepSpeed's norm masks the parameters that are not tensor-parallel
    (_require_avoid_recompute_norm), so the simulated rank (the slowest, which rank 0 waits for at the norm's
    model-parallel all-reduce) masks both groups: weight decay (the learned positions wpe; wte 512 x 64 = 32,768 of
    the padded 1024-row table, wpe 1024, 2 x (qkv 6144 + proj 2048 + fc1 8192 + fc2 8192): 82,944 elements) and
    no weight decay (norms and biases: 2 x 608 + ln_f 128 = 1,344). Peak beyond the .grad: the first mask beside
    every flat gradient less the freed .grad, 2 x 84,288 + 9 x 82,945 = 915,081 bytes. Before, no mask with TP."""
    W, N = 82_944, 1_344
    g = _graph(tensor_parallel_size=2, data_parallel_size=2)
    by = {o.name: o for o in g.ops}
    for i, n in enumerate((W, N)):
        assert by[f"opt.fp16opt.grad_norm.mask.zeros.{i}"].bytes_written == 4 * (n + 1)
        fill = by[f"opt.fp16opt.grad_norm.masked_fill.{i}"]
        assert (fill.bytes_read, fill.bytes_written) == (5 * n, 4 * n)
        assert fill.allocs[0].name in by[f"opt.fp16opt.grad_norm.norm.{i}"].uses
    assert fp16opt.step_transient_bytes([W, N], masked=[0, 1]) == 915_081
    rope = SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1)  # no learned positions: weights all TP
    named = [("wte.weight", 8), ("L0.qkv.weight", 8), ("L0.qkv.bias", 2), ("L0.proj.bias", 2), ("L0.ln1.weight", 2)]
    assert fp16opt.masked_groups(rope, named) == [1] and fp16opt.masked_groups(rope, named[:2]) == []
    assert fp16opt.masked_groups(SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1), named) == []


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_clip_grad_changes_no_kernel(clip):
    """unscale_and_clip_grads folds the clip coefficient into the one mul_ on the host: the same ops whatever
    gradient_clipping (DeepSpeed's default 0)."""
    assert [o.name for o in _graph(clip_grad=clip).ops] == [o.name for o in _graph().ops]
