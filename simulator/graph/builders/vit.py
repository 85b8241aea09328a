"""Vision transformer (ViT) ends of the step graph: the patch embedding in front of the encoder blocks and
the classification head behind them (Dosovitskiy et al., *An Image is Worth 16x16 Words: Transformers for
Image Recognition at Scale*, ICLR 2021, section 3.1 and eq. 1-4; Hugging Face ``ViTForImageClassification``,
``transformers/models/vit/modeling_vit.py``).

The blocks are the decoder's (``transformer._GptBuilder._layer_fwd`` / ``_layer_bwd``: pre-LayerNorm,
QKV with bias, GELU MLP) with **bidirectional attention** (``TransformerSpec.causal`` false: every query
scores all ``s`` keys, ``s^2`` (query, key) pairs per head instead of the causal ``s^2 / 2``). The
transformer builder calls ``embed_fwd`` / ``head_fwd`` / ``head_bwd`` / ``embed_bwd`` in place of its
token embedding and LM head when ``TransformerSpec.vit`` is set, as it calls ``moe`` for its MLP.

Shapes: ``b`` images per micro-batch, ``C`` channels, image ``H = W`` pixels, patch ``p``, ``n_p = (H /
p)^2`` patches, ``s = n_p + 1`` tokens (the CLS token first), ``P = C p^2`` values per patch, ``h`` hidden,
``K`` classes, ``T = b s``.

Forward:

* **input**: one host-to-device copy of the ``[b, C, H, W]`` fp32 images (``torchvision``
  ``ToTensor`` + ``Normalize``, the Hugging Face ``ViTImageProcessor`` ``pixel_values``: 4 bytes per value)
  and the ``[b]`` int64 labels; ``bf16`` / ``fp16`` cast the images to 16 bits on the GPU
  (``amp_fp32_params``: autocast's cast in front of the convolution, ``_linear_fwd``).
* **patch embedding**: ``Conv2d(C, h, kernel_size=p, stride=p)`` is one GEMM ``[b n_p, P] x [P, h]`` with
  its bias in the epilogue (an implicit-GEMM convolution reads the image in place: no unfold kernel);
  FLOPs ``2 b n_p P h``.
* **CLS and positions**: ``torch.cat`` of the expanded ``[1, 1, h]`` CLS token and the patch embeddings
  (one copy kernel writing ``[b, s, h]``), then the add of the ``[1, s, h]`` learned position table
  (dropout 0, as ``google/vit-*``, no kernel).
* **head**: the final LayerNorm over all ``T`` tokens (``ViTModel.layernorm``), the classifier Linear on
  the CLS token only (``sequence_output[:, 0, :]``, a strided view read in place): ``[b, h] x [h, K]``
  plus bias, FLOPs ``2 b h K``; the logits are cast to fp32 and the cross-entropy is ``log_softmax`` and
  ``nll_loss`` over ``[b, K]``.

Backward mirrors it: the loss and ``log_softmax`` gradients over ``[b, K]``, the head's input- and
weight-gradient GEMMs, the CLS row scattered into a zero ``[T, h]`` gradient (``select_backward``), the
final LayerNorm; at the input the position-table gradient (a reduction over the batch), the CLS-token
gradient, the patch rows made contiguous (cast to 16 bits under ``amp_fp32_params``), the patch
embedding's weight-gradient GEMM ``(h, P, b n_p)`` and bias gradient. No input gradient is computed for
the images.

Tensor parallelism: the blocks are Megatron's (heads and FFN split over ``t`` ranks); the patch
embedding, CLS token, position table, final LayerNorm and head are replicated on every TP rank (Megatron-LM
``megatron/legacy/model/vision/vit_backbone.py`` and ``classification.py`` use plain ``torch.nn``
layers there), so they need no TP collective. Not modelled (``check_vit_spec``): pipeline, context and
sequence parallelism, experts, ZeRO-3 / FSDP / the distributed optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from simulator.graph.ops import CostClass as C
from simulator.graph.ops import OpKind

#: bytes of one image value as the DataLoader hands it over (fp32 ``pixel_values``)
IMAGE_VALUE_BYTES = 4
#: bytes of one label (int64 class index)
LABEL_BYTES = 8


@dataclass(frozen=True)
class VitShape:
    """The vision-specific sizes of a ViT (Hugging Face ``ViTConfig`` names).

    Attributes:
        image_size: Image height = width ``H``, pixels.
        patch_size: Patch height = width ``p``, pixels (must divide ``image_size``).
        num_channels: Channels ``C`` (3: RGB).
        num_classes: Classes ``K`` of the classification head (``ViTConfig.num_labels``).

    Raises:
        ValueError: a non-positive size, or ``patch_size`` not dividing ``image_size``.
    """

    image_size: int
    patch_size: int
    num_channels: int = 3
    num_classes: int = 1000

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "num_channels", "num_classes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.image_size % self.patch_size:
            raise ValueError(f"patch_size ({self.patch_size}) must divide image_size ({self.image_size})")

    @property
    def num_patches(self) -> int:
        """Patches per image ``n_p = (H / p)^2``."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def seq_length(self) -> int:
        """Tokens per image ``s = n_p + 1`` (the CLS token)."""
        return self.num_patches + 1

    @property
    def patch_dim(self) -> int:
        """Values per patch ``P = C p^2`` (the patch-embedding GEMM's inner dimension)."""
        return self.num_channels * self.patch_size ** 2

    @property
    def image_values(self) -> int:
        """Values per image ``C H W`` (``= n_p P``)."""
        return self.num_channels * self.image_size ** 2


def image_sample_bytes(shape: VitShape) -> int:
    """Bytes of one collated sample: the fp32 image ``4 C H W`` and its int64 label (8)."""
    return IMAGE_VALUE_BYTES * shape.image_values + LABEL_BYTES


def check_vit_spec(s) -> None:
    """Check a ``TransformerSpec`` with ``vit`` set.

    Raises:
        ValueError: ``seq_length`` not ``n_p + 1``; causal attention, tied embeddings, rotary embeddings, a
            sliding window, experts, no biases; pipeline, context or sequence parallelism, or a ZeRO-3 /
            FSDP / distributed-optimizer sharding (not modelled with a ViT).
    """
    v = s.vit
    if s.seq_length != v.seq_length:
        raise ValueError(f"seq_length ({s.seq_length}) must be (image_size / patch_size)^2 + 1 = {v.seq_length} "
                         "with a ViT")
    bad = [("causal attention", s.causal), ("tied_embeddings", s.tied_embeddings),
           (f"position_embedding {s.position_embedding}", s.position_embedding != "learned_absolute"),
           ("window_size", s.window_size is not None),
           ("num_experts", s.num_experts is not None), ("no biases", not s.bias),
           ("pipeline parallelism", s.pipeline_parallel_size > 1), ("context parallelism",
                                                                    s.context_parallel_size > 1),
           ("sequence parallelism", s.sequence_parallel and s.tensor_parallel_size > 1),
           ("sharded data parallelism", s.sharding is not None and s.data_parallel_size > 1)]
    for what, on in bad:
        if on:
            raise ValueError(f"{what} is not modelled with a ViT (vit.check_vit_spec)")


def vit_params(s, blocks: int) -> int:
    """Parameters of the whole ViT (every part but the blocks is replicated on TP ranks): patch embedding
    ``P h + h``, CLS token ``h``, position table ``s h``, ``blocks`` (the encoder blocks' parameters on this
    rank), final LayerNorm ``2 h``, head ``h K + K``. ViT-B/16 with 1000 classes: 86,567,656 (no pooler:
    ``ViTForImageClassification`` builds ``ViTModel(add_pooling_layer=False)``)."""
    v, h = s.vit, s.hidden_size
    return (v.patch_dim * h + h) + h + v.seq_length * h + blocks + s.norm_params + (h * v.num_classes + v.num_classes)


def embed_head_flops(s) -> float:
    """Model FLOPs per image of the patch embedding and the head (fwd + bwd): the patch GEMM ``2 n_p P h``
    twice (forward and weight gradient; the images need no input gradient), the head ``2 h K`` three times
    (forward, input and weight gradients)."""
    v, h = s.vit, s.hidden_size
    return 2 * (2 * v.num_patches * v.patch_dim * h) + 3 * (2 * h * v.num_classes)


def embed_fwd(bld, st: dict) -> str:
    """Input copy, patch embedding, CLS concat and position add of one micro-batch; returns ``[T, h]`` in the
    residual dtype. ``st`` gets ``labels`` and ``sv_patch`` (the patch GEMM's saved operands)."""
    s, e = bld.s, bld.e
    v, b, h = s.vit, s.micro_batch_size, s.hidden_size
    T, npt, act = bld.T, b * v.num_patches, bld.act
    n_img = b * v.image_values
    img, labels = e.fresh("input.images"), e.fresh("input.labels")
    st["labels"] = labels
    e.kernel("input.h2d", C.COPY, kind=OpKind.MEMCPY_H2D, stream="h2d", reads=b * image_sample_bytes(v),
             out=[(img, IMAGE_VALUE_BYTES * n_img), (labels, LABEL_BYTES * b)], dtype="fp32")
    if not bld.amp:  # Megatron --bf16 / --fp16: the images in the model dtype (autocast casts them itself)
        img16 = e.fresh("input.images16")
        e.kernel("input.cast", C.CAST, reads=4 * n_img, writes=2 * n_img, out=[(img16, 2 * n_img)], uses=[img],
                 dtype="fp32")
        img = img16
    pe, st["sv_patch"] = bld._linear_fwd("patch_embed", img, v.patch_dim, h, x_fp32=True, save=True, tokens=npt)
    x0 = e.fresh("embed.cat.out")
    e.kernel("embed.cat", C.COPY, reads=2 * npt * h + act * h, writes=act * T * h, out=[(x0, act * T * h)], uses=[pe],
             dtype="fp32" if bld.amp else None)
    x = e.fresh("embed.out")
    e.kernel("embed.pos_add", C.ELEMENTWISE, reads=act * (T * h + s.seq_length * h), writes=act * T * h,
             out=[(x, act * T * h)], uses=[x0], dtype="fp32" if bld.amp else None)
    return x


def head_fwd(bld, st: dict, x: str) -> None:
    """Final LayerNorm, classifier on the CLS tokens and cross-entropy over ``K`` classes (``st``: ``x``,
    ``sv_head``, ``lsm``)."""
    s = bld.s
    b, h, K = s.micro_batch_size, s.hidden_size, s.vit.num_classes
    st["x"] = x
    xf, st["ln_f_stats"] = bld._norm_fwd("ln_f", x)
    logits, st["sv_head"] = bld._linear_fwd("head", xf, h, K, x_fp32=True, save=True, tokens=b)
    st["lsm"] = bld._loss_fwd(b, K, logits, st["labels"], vocab_parallel=False)  # the head is replicated over TP


def head_bwd(bld, st: dict) -> str:
    """Backward of ``head_fwd``; returns the gradient of the last block's output ``[T, h]`` (residual dtype)."""
    s, e = bld.s, bld.e
    b, h, K, T, act = s.micro_batch_size, s.hidden_size, s.vit.num_classes, bld.T, bld.act
    g_logits = bld._loss_bwd(b, K, st["lsm"])  # over the b CLS rows
    g_cls = bld._linear_bwd("head", g_logits, st["sv_head"], h, K, g_fp32=False, tokens=b)
    if bld.amp:  # autocast's cast of the CLS rows: its backward brings the gradient back to fp32
        g32 = e.fresh("head.cast_in.dx")
        e.kernel("head.cast_in.dgrad", C.CAST, reads=2 * b * h, writes=4 * b * h, out=[(g32, 4 * b * h)],
                 uses=[g_cls], dtype="fp32")
        g_cls = g32
    g_seq = e.fresh("head.select.dx")  # select_backward: zeros [b, s, h] with the CLS rows filled in
    e.kernel("head.select.dgrad", C.COPY, reads=act * b * h, writes=act * T * h, out=[(g_seq, act * T * h)],
             uses=[g_cls], dtype="fp32" if bld.amp else None)
    return bld._norm_bwd("ln_f", g_seq, st["x"], g_is_bf16=False, stats=st["ln_f_stats"])


def embed_bwd(bld, st: dict, g: str) -> None:
    """Backward of ``embed_fwd`` from the gradient ``g`` of its ``[T, h]`` output: position-table, CLS-token
    and patch-embedding (weight and bias) gradients; none for the images."""
    s, e = bld.s, bld.e
    v, b, h, T, act = s.vit, s.micro_batch_size, s.hidden_size, bld.T, bld.act
    npt, P = b * v.num_patches, v.patch_dim
    i = e.kernel("pos_embed.dgrad", C.REDUCTION, reads=act * T * h, writes=4 * s.seq_length * h, uses=[g],
                 dtype="fp32")
    bld._grad_ready("pos_embed", s.seq_length * h, i)
    i = e.kernel("cls_token.dgrad", C.REDUCTION, reads=act * b * h, writes=4 * h, uses=[g], dtype="fp32")
    bld._grad_ready("cls_token", h, i)
    gp = e.fresh("embed.cat.dx")  # the patch rows of the gradient, contiguous, 16-bit for the GEMM
    e.kernel("embed.cat.dgrad", C.CAST if bld.amp else C.COPY, reads=act * npt * h, writes=2 * npt * h,
             out=[(gp, 2 * npt * h)], uses=[g], dtype="fp32" if bld.amp else None)
    xin = st["sv_patch"][0]  # (input, weight[, LoRA adapter])
    W = P * h
    dw = e.fresh("patch_embed.dw16")
    e.kernel("patch_embed.wgrad", C.GEMM, flops=2 * npt * P * h, shape=(h, P, npt), reads=2 * (npt * h + npt * P),
             writes=2 * W, out=[(dw, 2 * W)], uses=[gp, xin])
    bid = e.kernel("patch_embed.bias_grad", C.REDUCTION, reads=2 * npt * h, writes=4 * h, uses=[gp])
    bld._grad_ready("patch_embed.bias", h, bid)
    wid, gname = bld._accumulate_grad("patch_embed", dw, W)
    bld._grad_ready("patch_embed.weight", W, wid, gname)
