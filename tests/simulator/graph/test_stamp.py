"""Stamping (``simulator.graph.builders.stamp``): a graph whose block passes are stamped equals, op for op, the one
built kernel by kernel (``build_gpt_step(spec, stamp=False)``): ids, names, layers, costs, shapes, dependencies,
tensors and metadata, on small multi-layer pipeline cases and the variants that change what a pass emits; and
the builder stamps nothing where a pass reads state its key does not hold (ZeRO-3 / FSDP gathers, MoE, fp8, Hugging
Face eager GELU); backward passes that make or finish gradients, and LoRA's passes, are stamped too."""

from __future__ import annotations

import pytest

from simulator.graph.builders import sharding as shd
from simulator.graph.builders.lora import LoraSpec
from simulator.graph.builders.transformer import TransformerSpec, _GptBuilder, build_gpt_step
from simulator.policies.fidelity import coarsen

TINY = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1000, ffn_hidden_size=256,
            micro_batch_size=1, num_micro_batches=4, precision="bf16")


def _built(spec: TransformerSpec, stamp: bool):
    b = _GptBuilder(spec, stamp)
    return b.build(), b.stamper


def _assert_same(a, b) -> None:
    assert len(a.ops) == len(b.ops)
    for x, y in zip(a.ops, b.ops):
        assert x == y, (x, y)  # every field but meta (compare=False)
        assert x.meta == y.meta, (x.name, x.meta, y.meta)
    assert a.persistent == b.persistent
    assert a.param_groups == b.param_groups
    assert a.meta == b.meta and a.model == b.model


PIPELINE = dict(pipeline_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True, recompute="selective",
                data_parallel_size=2)
CASES = {
    "pp2_tp2_sp_selective_dp2": PIPELINE,
    "pp2_full_recompute": dict(pipeline_parallel_size=2, recompute="full", tensor_parallel_size=2),
    "interleaved_v2": dict(pipeline_parallel_size=2, virtual_pipeline_size=2, pipeline_schedule="interleaved_1f1b",
                           num_micro_batches=4, data_parallel_size=2, overlap_grad_reduce=True),
    "unfused_dropout_amp": dict(attention_backend="unfused", attention_dropout=0.1, hidden_dropout=0.1,
                                precision="amp_fp32_params", num_micro_batches=3),
    "zero2_dp4": dict(data_parallel_size=4, zero_stage=2),
    "zero1_fp16_tp2": dict(data_parallel_size=2, zero_stage=1, precision="fp16", tensor_parallel_size=2),
    "tp_comm_overlap": dict(tensor_parallel_size=2, sequence_parallel=True, tp_comm_overlap="overlap"),
    "context_parallel_p2p": dict(context_parallel_size=2, cp_comm_type="p2p", data_parallel_size=1),
    "llama_gqa_rope": dict(num_query_groups=2, swiglu=True, normalization="RMSNorm", position_embedding="rope",
                           bias=False, ffn_hidden_size=128),
    "torchtitan_repeat_kv_cp2": dict(num_query_groups=2, swiglu=True, normalization="RMSNorm", position_embedding="rope",
                                     bias=False, ffn_hidden_size=128, qkv_separate=True, repeat_kv=True,
                                     context_parallel_size=2, recompute="selective"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_stamped_graph_equals_built_graph(case):
    kw = {**TINY, **CASES[case]}
    p = kw.get("pipeline_parallel_size", 1)
    for rank in range(p):
        spec = TransformerSpec(**kw, pipeline_rank=rank)
        stamped, st = _built(spec, True)
        ref, ref_st = _built(spec, False)
        _assert_same(stamped, ref)
        assert ref_st.stamped == 0
        assert st.stamped > 0  # passes were stamped, not only built
        # the layer-fidelity graph follows (same input graph, same coarsening)
        _assert_same(coarsen(stamped, fold_tp=True), coarsen(ref, fold_tp=True))


def test_stamp_counts_on_a_pipeline_stage_worked_out():
    # rank 0 of PP2, 4 layers -> 2 per stage, 4 micro-batches, selective recompute, DP2 (gradients reduced in the
    # last micro-batch): per micro-batch 2 forward and 2 backward passes, 16 in all. Forward: the first pass of
    # each layer position (the stage's first layer reads the embedding output, the second a block output: two
    # contexts) is built, 8 - 2 = 6 stamped. Backward: micro-batch 0 makes the gradients (built), micro-batch 3
    # is the last (its passes bucket gradients: built), micro-batch 1 is built once per context (the top layer
    # starts from the received gradient, the other from a block's output), micro-batch 2 is stamped: 2.
    spec = TransformerSpec(**{**TINY, **PIPELINE}, pipeline_rank=0)
    _, st = _built(spec, True)
    assert (st.built, st.stamped) == (8, 8)


@pytest.mark.parametrize("mbs, counts", [(1, (3, 5)), (4, (7, 25))])
def test_backward_with_gradients_stamped_on_one_gpu_worked_out(mbs, counts):
    # one GPU, 4 layers: every forward has one context (1 built). A backward makes or finishes gradients (marks them
    # made, finishes their parameter groups in the last micro-batch), which the builder replays on a stamp: per
    # backward key (first micro-batch: gradients made; middle; last: groups finished) the top layer (from the loss)
    # and the one below (from a block) are built, the other two stamped. 1 micro-batch: 1 + 2 built of 8 passes;
    # 4: 1 + 2 x 3 built (micro-batches 1 and 2 share a key) of 32
    spec = TransformerSpec(**{**TINY, "num_micro_batches": mbs})
    stamped, st = _built(spec, True)
    assert (st.built, st.stamped) == counts
    ref, _ = _built(spec, False)
    _assert_same(stamped, ref)
    # backward order: the final norm, then per layer from the top 12 groups (fc2, fc1, ln2, proj, qkv, ln1: weight and
    # bias each), the stamped layers' groups finished by their own ops
    names = [g.name for g in stamped.param_groups]
    assert names[:4] == ["ln_f.weight", "ln_f.bias", "L3.fc2.bias", "L3.fc2.weight"]
    assert names[-5:] == ["L0.qkv.weight", "L0.ln1.weight", "L0.ln1.bias", "wte.weight", "wpe.weight"]
    assert len(names) == 2 + 4 * 12 + 2
    for g in stamped.param_groups[2:-2]:
        assert stamped.ops[g.grad_op].layer == g.layer and g.name.startswith(f"L{g.layer}.")


LORA_ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("kw", [dict(lora=LoraSpec(4, 8, ("q_proj",))),
                                dict(lora=LoraSpec(4, 8, LORA_ALL, 0.1), precision="amp_fp32_params",
                                     qkv_separate=True),
                                dict(lora=LoraSpec(4, 8, ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")),
                                     tensor_parallel_size=2)])
def test_lora_stamped_graph_equals_built_graph(kw):
    # LoRA's passes read their layer's adapter weights (``param.L<layer>.lora...``, renamed per copy) and save module
    # names (kept as they are). 4 layers x 4 micro-batches: the forward is built once; a backward once per key
    # (first, middle, last micro-batch): frozen norms have no dgamma, so the loss gradient's producer is the last
    # kernel as a block's is, one context (TP2: the top layer's input gradient is reduced, one more); 32 passes
    spec = TransformerSpec(**{**TINY, **kw})
    stamped, st = _built(spec, True)
    _assert_same(stamped, build_gpt_step(spec, stamp=False))
    assert (st.built, st.stamped) == ((5, 27) if spec.tensor_parallel_size > 1 else (4, 28))
    # not as layer blocks: built kernel by kernel there, as before
    blocks = build_gpt_step(spec, blocks=True)
    assert blocks.meta["layer_blocks"]["stamped"] == 0 and blocks.meta["layer_blocks"]["kernel_build"] is None


def test_layer_name_parts():
    from simulator.graph.builders.stamp import layer_name_parts
    assert layer_name_parts("grad.L3.fc1.weight", 3) == ("grad.", "fc1.weight")
    assert layer_name_parts("L3.fc1.weight", 3) == ("", "fc1.weight")
    assert layer_name_parts("grad.L13.fc1.weight", 3) is None  # L13, not L3
    assert layer_name_parts("grad.XL3.fc1", 3) is None  # not at a name part's start
    assert layer_name_parts("grad.L3.x.L3.y", 3) is None  # twice: ambiguous


def test_stamp_disabled_where_passes_read_per_layer_state():
    cases = [dict(sharding=shd.ShardingSpec("full_shard", 2), data_parallel_size=2, precision="amp_fp32_params"),
             dict(num_experts=2, moe_router_topk=1, bias=False),
             # Hugging Face eager gelu_new keeps its saved tensors in the builder (hf_eager.gelu_fwd), not the pass
             dict(kernels="hf_eager", attention_backend="unfused", precision="fp32")]
    for kw in cases:
        stamped, st = _built(TransformerSpec(**{**TINY, **kw}), True)
        assert st.stamped == 0 and st.built == 2 * 4 * 4
        _assert_same(stamped, build_gpt_step(TransformerSpec(**{**TINY, **kw}), stamp=False))
