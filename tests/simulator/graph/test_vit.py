"""Vision transformer (model.architecture: vit): parameter counts, hand-worked FLOPs of the patch embedding and
the head, bidirectional attention, the input copy, tensor parallelism."""

from __future__ import annotations

import dataclasses

import pytest

from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.builders.vit import VitShape


def vit_spec(h=8, a=2, L=1, f=32, image=8, patch=4, C=3, K=5, b=2, **kw) -> TransformerSpec:
    shape = VitShape(image, patch, C, K)
    return TransformerSpec(num_layers=L, hidden_size=h, num_attention_heads=a, seq_length=shape.seq_length,
                           vocab_size=K, ffn_hidden_size=f, micro_batch_size=b, tied_embeddings=False,
                           causal=False, vit=shape, **{"precision": "bf16", **kw})


def hand_params(h, L, f, image, patch, C, K) -> int:
    """Patch conv C p^2 h + h, CLS h, positions (n_p + 1) h, per layer 12 h^2 + 13 h (f = 4h: QKV 3h^2 + 3h,
    proj h^2 + h, fc1 h f + f, fc2 f h + h, two LayerNorms 4h), final LayerNorm 2h, head h K + K."""
    n_p = (image // patch) ** 2
    layer = 4 * h * h + 2 * h * f + 9 * h + (f - 4 * h) + 4 * h  # biases: 3h + h + f + h; LayerNorms 4h
    return C * patch * patch * h + h + h + (n_p + 1) * h + L * layer + 2 * h + h * K + K


@pytest.mark.parametrize("name,h,a,L,published", [("ViT-B/16", 768, 12, 12, 86_567_656),
                                                 ("ViT-L/16", 1024, 16, 24, 304_326_632)])
def test_published_parameter_counts(name, h, a, L, published):
    """google/vit-base-patch16-224 and google/vit-large-patch16-224 (ViTForImageClassification, 1000 classes,
    no pooler): the hand formula, the builder's count and its parameter groups all equal the published count."""
    assert hand_params(h, L, 4 * h, 224, 16, 3, 1000) == published
    assert 12 * h * h + 13 * h == hand_params(h, 1, 4 * h, 224, 16, 3, 1000) - hand_params(h, 0, 4 * h, 224, 16, 3, 1000)
    s = vit_spec(h=h, a=a, L=L, f=4 * h, image=224, patch=16, K=1000, b=1)
    assert s.num_parameters == published
    g = build_gpt_step(s)
    assert sum(p.numel for p in g.param_groups) == published


def _ops(graph, name):
    return [op for op in graph.ops if op.name == name]


def test_tiny_vit_patch_embedding_and_head_flops():
    """b 2 images 8x8x3, patch 4 (n_p 4, P 48), h 8, K 5: patch GEMM [8, 48] x [48, 8] = 2*8*48*8 = 6144 FLOPs
    forward and as its weight gradient (no image gradient); head [2, 8] x [8, 5] = 160 FLOPs, three times."""
    g = build_gpt_step(vit_spec())
    (fwd,) = _ops(g, "fwd.patch_embed.gemm")
    assert (fwd.flops, fwd.shape) == (6144.0, (8, 8, 48))
    (wg,) = _ops(g, "bwd.patch_embed.wgrad")
    assert (wg.flops, wg.shape) == (6144.0, (8, 48, 8))
    assert not _ops(g, "bwd.patch_embed.dgrad")
    for name, shape in (("fwd.head.gemm", (2, 5, 8)), ("bwd.head.dgrad", (2, 8, 5)), ("bwd.head.wgrad", (5, 8, 2))):
        (op,) = _ops(g, name)
        assert (op.flops, op.shape) == (160.0, shape), name
    # model FLOPs per image: 3 x blocks (s 5 tokens) + patch 2 x 3072 + head 3 x 80
    s = vit_spec()
    h, f, seq = 8, 32, 5
    block = seq * 2 * (3 * h * h + h * h + 2 * h * f) + 4 * h * seq * seq  # GEMMs + full-square attention
    assert s.model_flops_per_sample() == 3 * block + 2 * 3072 + 3 * 80


def test_bidirectional_attention_is_twice_causal():
    """Same shape, causal vs not: the flash kernels' FLOPs double; the tiny ViT's forward is 4 b a s^2 d =
    4*2*2*25*4 = 1600 (backward 2.5x)."""
    s = vit_spec()
    assert s.attention_pairs == 25.0
    causal = dataclasses.replace(s, vit=None, causal=True)
    assert causal.attention_pairs == 12.5
    gv, gc = build_gpt_step(s), build_gpt_step(causal)
    for name, value in (("L0.fwd.attn", 1600.0), ("L0.bwd.attn.dgrad", 4000.0)):
        (v,), (c,) = _ops(gv, name), _ops(gc, name)
        assert v.flops == value and v.flops == 2 * c.flops


def test_input_copy_is_fp32_images_and_labels():
    """One H2D copy of b (4 C H W + 8) bytes: 2 x (4 x 192 + 8) = 1552."""
    g = build_gpt_step(vit_spec())
    (h2d,) = _ops(g, "fwd.input.h2d")
    assert h2d.bytes_read == 1552.0 and sorted(a.nbytes for a in h2d.allocs) == [16, 1536]


@pytest.mark.parametrize("precision", ["amp_fp32_params", "bf16", "fp16"])
def test_every_precision_builds_with_all_gradients(precision):
    s = vit_spec(L=2, precision=precision, num_micro_batches=2)
    g = build_gpt_step(s)
    assert sum(p.numel for p in g.param_groups) == s.num_parameters


def test_tensor_parallel_splits_blocks_only():
    """t = 2: the blocks' weights are split (biases of the row-parallel layers and LayerNorms replicated),
    patch embedding, CLS, positions, final LayerNorm and head replicated; one all-reduce after proj and fc2
    per layer forward and after qkv and fc1 backward, none at the embedding or the head; in the optimizer step,
    Megatron's gradient-norm all-reduce over the TP group (clip_grad 1.0 by default)."""
    h, f, t = 8, 32, 2
    s = vit_spec(tensor_parallel_size=t)
    block = (4 * h * h + 2 * h * f) // t + (3 * h + f) // t + 2 * h + 4 * h
    ends = 48 * h + h + h + 5 * h + 2 * h + 5 * h + 5
    assert s.num_parameters == ends + block
    g = build_gpt_step(s)
    tp = [op.name for op in g.ops if op.meta and op.meta.get("group") == "tp"]
    assert len(tp) == 5 and all(n.startswith("L0.") for n in tp[:4])
    assert tp[4] == "opt.tp.clip_grad.total_norm.all_reduce"


@pytest.mark.parametrize("kw,fragment", [
    ({"seq_length": 6}, "seq_length (6) must be"),
    ({"causal": True}, "causal attention"),
    ({"pipeline_parallel_size": 2, "num_layers": 2, "num_micro_batches": 2}, "pipeline parallelism"),
])
def test_spec_refusals(kw, fragment):
    base = dataclasses.asdict(vit_spec())
    base["vit"] = VitShape(8, 4, 3, 5)
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        TransformerSpec(**{**base, **kw})


def test_patch_must_divide_image():
    with pytest.raises(ValueError, match="patch_size"):
        VitShape(225, 16)
