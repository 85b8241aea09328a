"""Step graph of a dense decoder: GPT-2 style (pre-LayerNorm, GELU MLP, causal multi-head attention,
learned positions) or Llama style (grouped-query attention, SwiGLU MLP, RMSNorm, rotary embeddings).

The graph follows what eager PyTorch runs, kernel by kernel, so that the roofline prices the
same memory traffic the GPU moves:

* **Precision** ``amp_fp32_params`` (``torch.autocast(dtype=torch.bfloat16)`` over fp32
  parameters, as in the measured runs): every Linear casts its fp32 weight (and its fp32 input,
  when it comes from a LayerNorm) to bf16 before the bf16 GEMM; LayerNorm, residual adds and the
  loss run in fp32; gradients are cast back to fp32 for fp32 ``.grad``; the optimizer is AdamW on
  fp32 parameters. ``bf16`` (Megatron-LM ``--bf16``): bf16 parameters and activations, fp32 main
  gradients and fp32 master weights in the optimizer. ``fp16`` (Megatron-LM ``--fp16``): the same
  with fp16 tensors (GEMMs at the GPU's fp16 peak) and dynamic loss scaling (Micikevicius et al.,
  *Mixed Precision Training*, ICLR 2018, section 3.2; Megatron-LM ``--loss-scale`` /
  ``--initial-loss-scale``: dynamic when no fixed scale is given): the loss is multiplied by the
  scale before backward, and before the optimizer the fp32 main gradients are unscaled in place and
  checked for inf/nan (``torch._amp_foreach_non_finite_check_and_unscale_``, one read and one write
  of 4 B per parameter, as in Megatron's ``MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan``);
  the found-inf flag is all-reduced (MAX) over the tensor-parallel group and read by the host
  (``found_inf.item()``, a device synchronisation) before the optimizer step is launched.
* **Attention** is one fused flash kernel (``scaled_dot_product_attention``) whose FLOPs are
  ``4 * b * a * s^2 * d / 2`` forward with causal masking and 2.5x that backward (the backward
  recomputes the scores: Dao, *FlashAttention-2*, 2023, section 4.1 FLOP accounting).
* **GEMM FLOPs** are ``2 m n k``. A Linear ``[T, i] x [i, o]`` has forward ``(T, o, i)``,
  input-gradient ``(T, i, o)`` and weight-gradient ``(o, i, T)`` GEMMs.
* **Memory**: each kernel allocates its outputs; a tensor lives until the last kernel that uses it
  has run (autograd's saved tensors are used by the backward kernels). Parameters and optimizer
  state are persistent; gradients are allocated by the backward pass and freed after the
  optimizer step (``zero_grad(set_to_none=True)``).
* **Activation recompute** ``full`` keeps only each block's input and re-runs the block's forward
  before its backward (Megatron-LM ``--recompute-granularity full --recompute-method uniform``);
  ``selective`` re-runs only the attention core (Korthikanti et al., *Reducing Activation
  Recomputation in Large Transformer Models*, MLSys 2023).

* **Tensor parallelism** (Megatron-LM, Shoeybi et al., *Megatron-LM: Training Multi-Billion Parameter
  Language Models Using Model Parallelism*, 2019, section 3; ``megatron/mpu/layers.py`` of 2020):
  one tensor-parallel rank of ``t`` is built. QKV and fc1 are column-parallel (output ``/ t``),
  proj and fc2 row-parallel (input ``/ t``), attention runs ``a / t`` heads; the token embedding
  and the LM head are vocabulary-parallel (``V_p / t`` rows, ``V_p`` the vocabulary padded to a
  multiple of ``128 t``: Megatron ``_vocab_size_with_padding`` with ``--make-vocab-size-divisible-by
  128``), and the loss is the vocab-parallel cross-entropy, whose forward all-reduces three fp32
  ``[b, s]`` tensors (the logit max, the target logit and the sum of exponentials:
  ``_VocabParallelCrossEntropy.forward``). The TP collectives are ``COLLECTIVE`` ops on stream
  ``comm.tp`` (group ``"tp"``) that the compute stream waits for (Megatron 2020 does not overlap
  them): per layer forward, an all-reduce of the ``b s h`` 16-bit activations after proj and after
  fc2 (row-parallel ``reduce_from_tensor_model_parallel_region``); backward, one after the qkv and
  one after the fc1 input gradients (column-parallel ``copy_to_tensor_model_parallel_region``);
  the embedding output is all-reduced in forward and the LM-head input gradient in backward; full
  recompute repeats the forward ones. LayerNorms, position embedding and the biases of the
  row-parallel layers are replicated.
* **Sequence parallelism** (``sequence_parallel``; Korthikanti et al., MLSys 2023, section 4.2.2):
  every TP all-reduce becomes a reduce-scatter / all-gather pair of the same ``b s h`` array (forward:
  all-gather before qkv, fc1 and the LM head, reduce-scatter after proj, fc2 and the embedding;
  backward the reverse), LayerNorm and residual kernels (and their activations) run on ``s / t``
  tokens, and the gradients of the sequence-parallel parameters (LayerNorms, row-parallel biases)
  are all-reduced over the TP group once per step (Megatron ``_allreduce_layernorm_grads``). Megatron's
  re-gather of the LayerNorm output for the weight gradient in backward (overlapped with the input
  gradient GEMM) is not modelled.

* **Llama features** (Touvron et al., *Llama 2*, 2023, section 2.2; Megatron-LM names):
  grouped-query attention (Ainslie et al., *GQA*, EMNLP 2023) with ``g`` K/V groups makes the
  QKV projection ``h x (h + 2 g d)`` and the flash kernel read ``g`` K/V heads (FLOPs per query
  head unchanged); SwiGLU (Shazeer, *GLU Variants Improve Transformer*, 2020) fuses gate and up
  projections into fc1 ``h x 2f``, then an elementwise ``silu(a) * b`` kernel (backward: reads
  dy, a, b; writes da, db) feeds fc2 ``f x h``; RMSNorm (Zhang and Sennrich, 2019) has one weight
  and one fp32 statistic per token (LayerNorm: two), same activation traffic; rotary embeddings
  (Su et al., *RoFormer*, 2021) are an elementwise kernel on q and k after the QKV GEMM and its
  mirror in backward, with no position table.

* **Head dimension** ``kv_channels`` (Megatron ``--kv-channels``) makes the attention width ``a d``
  instead of ``h``; **sliding-window attention** ``window_size`` (Jiang et al., *Mistral 7B*, 2023,
  section 2) scores ``w (2 s - w) / 2`` (query, key) pairs per head instead of ``s^2 / 2``
  (``TransformerSpec.attention_pairs``), in the flash kernels forward and backward and in the model
  FLOPs. The flash kernels' HBM traffic stays q, k, v read once: in training every key lies in some
  query's window, so the window removes work, not compulsory K/V bytes (a decode-time KV cache
  would shrink; not modelled here).
* **Mixture of experts** ``num_experts``: the MLP of every block is ``simulator.graph.builders.moe``.

Shapes below use ``T = micro_batch_size * seq_length`` tokens, ``h`` hidden, ``f`` FFN hidden,
``V`` vocabulary, ``a`` heads, ``d = h / a`` (or ``kv_channels``).
"""

from __future__ import annotations

from dataclasses import dataclass

from simulator.graph.builders import moe
from simulator.graph.builders.emitter import KernelEmitter
from simulator.graph.op_graph import GraphBuilder, OpGraph, ParamGroup
from simulator.graph.ops import CostClass as C
from simulator.graph.ops import OpKind, Phase, TensorAlloc

PRECISIONS = ("amp_fp32_params", "bf16", "fp16")
#: Megatron-LM --make-vocab-size-divisible-by default (arguments.py); the padded vocabulary is a multiple of 128 t
VOCAB_DIVISIBLE_BY = 128
RECOMPUTE = ("none", "full", "selective")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")


@dataclass(frozen=True)
class TransformerSpec:
    """What the builder needs to know about the model and one GPU's share of the step.

    Attributes:
        num_layers: Transformer blocks.
        hidden_size: Model width ``h``.
        num_attention_heads: Heads ``a`` (must divide ``h``).
        seq_length: Tokens per sample ``s``.
        vocab_size: Vocabulary ``V``.
        ffn_hidden_size: MLP width ``f`` (Megatron default ``4h``).
        micro_batch_size: Samples per forward/backward pass ``b``.
        num_micro_batches: Gradient-accumulation steps per optimizer step.
        tied_embeddings: LM head shares the token-embedding weight.
        bias: Linear and LayerNorm layers have biases.
        precision: One of ``PRECISIONS``.
        optimizer_impl: ``fused`` (one multi-tensor kernel) or ``foreach``.
        recompute: One of ``RECOMPUTE``.
        data_parallel_size: Data-parallel replicas (ranks are identical: one is built). With > 1 the
            gradients are reduced over the ``dp`` group (see ``build_gpt_step``).
        zero_stage: DeepSpeed ZeRO stage with data parallelism: 0 (DDP all-reduce), 1 (optimizer
            state and master weights sharded), 2 (+ gradients sharded after a reduce-scatter).
        ddp_first_bucket_bytes: First DDP gradient bucket cap, bytes (PyTorch 1 MiB).
        ddp_bucket_cap_bytes: Other DDP bucket caps, bytes (PyTorch ``bucket_cap_mb`` 25 MiB).
        overlap_grad_reduce: Reduce buckets during backward (else all after backward).
        gradient_as_bucket_view: DDP gradients are views of the bucket buffer (no extra copy).
        reduce_bucket_elements: ZeRO-1/2 gradient bucket, elements (DeepSpeed ``reduce_bucket_size``).
        allgather_bucket_elements: ZeRO-1/2 parameter all-gather chunk, elements.
        tensor_parallel_size: Megatron tensor-parallel ranks ``t`` (one rank is built; its TP
            collectives run over the ``tp`` group).
        sequence_parallel: Megatron ``--sequence-parallel`` (with ``t > 1``).
        num_query_groups: K/V head groups ``g`` (Megatron ``--num-query-groups`` with
            ``--group-query-attention``; ``None``: ``a``, plain multi-head attention; 1: multi-query).
        swiglu: Gated MLP (Megatron ``--swiglu``): fc1 is ``h -> 2f`` and ``silu(a) * b`` feeds fc2.
        normalization: One of ``NORMALIZATIONS`` (RMSNorm: one weight, no bias, whatever ``bias`` says).
        position_embedding: One of ``POSITION_EMBEDDINGS`` (``rope``: no position table; rotary kernels
            on q and k).
        max_position_embeddings: Rows of the learned position table (``None``: ``seq_length``).
        qkv_bias: The QKV projection has a bias even without ``bias`` (Megatron ``--add-qkv-bias``; Qwen2).
        num_experts: Routed experts ``E`` of every block's MLP (Megatron ``--num-experts``; ``None``: dense
            MLP). The MoE layer is built by ``simulator.graph.builders.moe``.
        moe_router_topk: Experts per token ``k`` (Megatron ``--moe-router-topk``, default 2).
        moe_ffn_hidden_size: Width of one expert ``f_e`` (``None``: ``ffn_hidden_size``).
        moe_shared_expert_intermediate_size: Width of the shared expert run on every token (``None``: none).
        moe_expert_capacity_factor: Expert capacity factor ``c`` (token dropping; ``None``: dropless).
        moe_router_load_balancing_type: ``aux_loss`` (Switch-style auxiliary loss) or ``none``.
        expert_parallel_size: Expert-parallel ranks ``ep`` (Megatron ``--expert-model-parallel-size``): each
            rank holds ``E / ep`` experts; EP ranks lie inside the data-parallel dimension.
        kv_channels: Head dimension ``d`` (Megatron ``--kv-channels``; ``None``: ``h / a``). With ``a d != h``
            (Qwen3, Gemma, Mistral-Nemo) the QKV projection is ``h x (a d + 2 g d)`` and the output projection
            ``a d x h``.
        window_size: Sliding-window attention (Mistral; Beltagy et al., *Longformer*, 2020): each query
            attends to its ``window_size`` most recent keys, itself included (the Hugging Face
            ``sliding_window``); ``None``: full causal attention.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    ffn_hidden_size: int
    micro_batch_size: int
    num_micro_batches: int = 1
    tied_embeddings: bool = True
    bias: bool = True
    precision: str = "amp_fp32_params"
    optimizer_impl: str = "fused"
    recompute: str = "none"
    data_parallel_size: int = 1
    zero_stage: int = 0
    ddp_first_bucket_bytes: int = 1 << 20
    ddp_bucket_cap_bytes: int = 25 << 20
    overlap_grad_reduce: bool = True
    gradient_as_bucket_view: bool = False
    reduce_bucket_elements: int = 500_000_000
    allgather_bucket_elements: int = 500_000_000
    tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    num_query_groups: int | None = None
    swiglu: bool = False
    normalization: str = "LayerNorm"
    position_embedding: str = "learned_absolute"
    max_position_embeddings: int | None = None
    qkv_bias: bool = False
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_expert_capacity_factor: float | None = None
    moe_router_load_balancing_type: str = "aux_loss"
    expert_parallel_size: int = 1
    kv_channels: int | None = None
    window_size: int | None = None

    def __post_init__(self) -> None:
        """Raises: ValueError: non-positive sizes, heads not dividing hidden, unknown modes, a tensor-parallel
        size not dividing the heads or the FFN, sequence parallelism with ``t`` not dividing ``s``, tensor
        parallelism with ``amp_fp32_params``."""
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                     "ffn_hidden_size", "micro_batch_size", "num_micro_batches", "data_parallel_size",
                     "tensor_parallel_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must divide hidden_size ({self.hidden_size})"
            )
        for name in ("kv_channels", "window_size"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        g = self.query_groups
        if g <= 0 or self.num_attention_heads % g:
            raise ValueError(f"num_query_groups ({g}) must divide num_attention_heads ({self.num_attention_heads})")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}")
        if self.position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(f"position_embedding must be one of {POSITION_EMBEDDINGS}, got {self.position_embedding!r}")
        if (self.position_embedding == "learned_absolute" and self.max_position_embeddings is not None
                and self.max_position_embeddings < self.seq_length):
            raise ValueError(f"max_position_embeddings ({self.max_position_embeddings}) must be >= seq_length "
                             f"({self.seq_length})")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.zero_stage not in (0, 1, 2):
            raise ValueError(f"zero_stage must be 0, 1 or 2 (stage 3 is not modelled), got {self.zero_stage}")
        if self.zero_stage == 2 and self.data_parallel_size > 1 and self.num_micro_batches > 1:
            raise ValueError("ZeRO stage 2 with gradient accumulation (DeepSpeed reduces every micro-batch) is not "
                             "modelled yet")
        t = self.tensor_parallel_size
        if t > 1:
            for name, v in (("num_attention_heads", self.num_attention_heads),
                            ("ffn_hidden_size", self.ffn_hidden_size), ("num_query_groups", g)):
                if v % t:
                    raise ValueError(f"tensor_parallel_size ({t}) must divide {name} ({v})")
            if self.precision == "amp_fp32_params":
                raise ValueError("tensor parallelism is modelled for Megatron precisions bf16 and fp16, not "
                                 "amp_fp32_params (torch.autocast)")
        if self.sequence_parallel and t > 1 and self.seq_length % t:
            raise ValueError(f"sequence_parallel: tensor_parallel_size ({t}) must divide seq_length ({self.seq_length})")
        moe.check_moe_spec(self)

    # -- counts ----------------------------------------------------------------------------
    @property
    def query_groups(self) -> int:
        """K/V head groups ``g`` (``a`` without grouped-query attention)."""
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """``d``: ``kv_channels``, else ``h / a``."""
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    @property
    def attention_width(self) -> int:
        """Width of the attention output (query heads), whole model: ``a d`` (``h`` unless ``kv_channels``)."""
        return self.num_attention_heads * self.head_dim

    @property
    def qkv_out_size(self) -> int:
        """Output width of the fused QKV projection, whole model: ``a d + 2 g d`` (``3h`` for MHA)."""
        return self.attention_width + 2 * self.query_groups * self.head_dim

    @property
    def attention_pairs(self) -> float:
        """(query, key) pairs one head scores per sequence: ``s^2 / 2`` causal (the half square, as the FLOP
        count of FlashAttention and PaLM's MFU), ``w (2 s - w) / 2`` with a window ``w < s`` (the half square
        minus the ``(s - w)^2 / 2`` pairs beyond the window)."""
        s, w = self.seq_length, self.window_size
        if w is None or w >= s:
            return s * s / 2
        return w * (2 * s - w) / 2

    @property
    def fc1_out_size(self) -> int:
        """Output width of fc1, whole model: ``2f`` with SwiGLU (gate and up projections fused), else ``f``."""
        return 2 * self.ffn_hidden_size if self.swiglu else self.ffn_hidden_size

    @property
    def norm_params(self) -> int:
        """Parameters of one norm: LayerNorm ``2h`` (weight + bias; ``h`` without biases), RMSNorm ``h``."""
        return 2 * self.hidden_size if self.bias and self.normalization == "LayerNorm" else self.hidden_size

    @property
    def norm_has_bias(self) -> bool:
        """The norms carry a bias (LayerNorm with ``bias``)."""
        return self.norm_params == 2 * self.hidden_size

    @property
    def position_table_rows(self) -> int:
        """Rows of the learned position table (0 with rotary embeddings)."""
        if self.position_embedding == "rope":
            return 0
        return self.max_position_embeddings or self.seq_length

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary rows of the embedding and LM head: ``V`` with ``t = 1``; with ``t > 1`` Megatron's
        padding to a multiple of ``128 t`` (``_vocab_size_with_padding``)."""
        t = self.tensor_parallel_size
        if t == 1:
            return self.vocab_size
        m = VOCAB_DIVISIBLE_BY * t
        return -(-self.vocab_size // m) * m

    @property
    def vocab_per_rank(self) -> int:
        """Vocabulary rows held by one tensor-parallel rank, ``V_p / t``."""
        return self.padded_vocab_size // self.tensor_parallel_size

    @property
    def layer_params(self) -> int:
        """Parameters of one block held by one TP rank: QKV (``h x (h + 2 g d)``) and fc1 (``h x f``, ``h x 2f``
        with SwiGLU; column-parallel: weight and bias ``/ t``), projection and fc2 (row-parallel: weight
        ``/ t``, bias replicated), two norms (replicated). Whole layer with GQA + SwiGLU + RMSNorm and no
        biases: ``2 h^2 + 2 h g d + 3 h f + 2 h`` (Llama: Touvron et al., *Llama 2*, 2023, section 2.2 and
        the Hugging Face ``LlamaDecoderLayer``). With experts the MLP is the MoE layer's share on this rank
        (``moe.moe_mlp_params``: router, ``E / ep`` experts, shared expert)."""
        return self._layer_params(self.local_experts)

    def _layer_params(self, experts: int) -> int:
        """One block's parameters on a TP rank with ``experts`` routed experts (dense MLP without MoE)."""
        h, f, t = self.hidden_size, self.ffn_hidden_size, self.tensor_parallel_size
        qkv, fc1 = self.qkv_out_size, self.fc1_out_size
        if self.num_experts:
            mlp = moe.moe_mlp_params(self, experts)
        else:
            mlp = (h * fc1 + f * h) // t
        w = (h * qkv + self.attention_width * h) // t + mlp
        b = (qkv // t + h + fc1 // t + h) if self.bias else (qkv // t if self.qkv_bias else 0)
        return w + b + 2 * self.norm_params

    @property
    def local_experts(self) -> int:
        """Routed experts held by one rank, ``E / ep`` (0 without MoE)."""
        return (self.num_experts or 0) // self.expert_parallel_size

    def _params(self, experts: int) -> int:
        h = self.hidden_size
        emb = self.vocab_per_rank * h + self.position_table_rows * h
        head = 0 if self.tied_embeddings else self.vocab_per_rank * h
        return emb + self.num_layers * self._layer_params(experts) + self.norm_params + head

    @property
    def num_parameters(self) -> int:
        """Parameters held by one TP rank (the whole model with ``t = 1``): embeddings (token ``V_p / t``
        rows + learned position, replicated; none with rope), blocks, final norm, LM head. With experts:
        the ``E / ep`` experts of this expert-parallel rank (all of them with ``ep = 1``)."""
        return self._params(self.local_experts)

    @property
    def num_active_parameters(self) -> int:
        """Parameters one token passes through (``num_parameters`` without MoE): every dense weight, the
        router and ``k`` routed experts per block (Mixtral-8x7B: 12,879,925,248 of 46,702,792,704; Jiang et
        al., *Mixtral of Experts*, 2024, section 2: "13B active parameters")."""
        return self._params(self.moe_router_topk) if self.num_experts else self.num_parameters

    @property
    def sequence_parallel_params(self) -> int:
        """Parameters replicated across TP ranks whose gradients differ per rank under sequence
        parallelism (LayerNorms, row-parallel biases), all-reduced once per step."""
        h = self.hidden_size
        ln = self.norm_params
        return self.num_layers * (2 * ln + (2 * h if self.bias else 0)) + ln

    def model_flops_per_sample(self) -> float:
        """Training FLOPs per sample and GPU without recompute: 3x the forward's GEMM + attention FLOPs,
        divided by the tensor-parallel size.

        Forward per token: ``2 * (12 h^2 (for f = 4h: 2(4h^2) + 2 f h) ) + 2 * h * V`` for the
        matrices plus causal attention ``2 * s * h``; backward is twice the forward (Narayanan et
        al., *Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM*,
        SC21, eq. 3, with causal attention counted at half the ``s^2`` work, as PaLM's MFU
        definition in Chowdhery et al. 2022, appendix B, and FlashAttention do). With GQA the
        QKV matrix is ``h (h + 2 g d)`` (attention FLOPs per query head unchanged) and with SwiGLU the
        MLP is ``3 h f``: Megatron-LM ``training.py num_floating_point_operations``, terms
        ``(1 + num_query_groups / num_attention_heads)`` and ``gated_linear_multiplier = 3/2``.
        With ``kv_channels`` the attention matrices are ``h (a d + 2 g d) + a d h`` and attention
        ``4 a d`` FLOPs per (query, key) pair; a sliding window counts only the pairs inside it
        (``attention_pairs``). Mixture of experts: the active weights (router, ``k`` experts, shared
        expert; Megatron's formula has ``num_experts_routed_to = moe_router_topk`` and omits the
        router's ``2 h E``, < 0.01% of Mixtral's); dropped tokens (capacity factor) still count.
        """
        h, f, s, V = self.hidden_size, self.ffn_hidden_size, self.seq_length, self.vocab_size
        if self.num_experts:  # active weights only: router + k experts (+ shared expert), see moe_mlp_params
            mlp = moe.moe_mlp_params(self, self.moe_router_topk)
        else:
            mlp = (3 if self.swiglu else 2) * h * f
        # causal attention per token: 2 (QK^T) + 2 (PV) FLOPs x d per (query, key) pair and head
        att = 4 * self.attention_width * self.attention_pairs / s
        per_token_layer = 2 * (h * self.qkv_out_size + self.attention_width * h + mlp) + att
        fwd = s * (self.num_layers * per_token_layer + 2 * h * V)
        return 3.0 * fwd / self.tensor_parallel_size  # per GPU: a TP rank does 1/t of the sample


def build_gpt_step(spec: TransformerSpec) -> OpGraph:
    """Build one training step (all micro-batches and the optimizer) for one GPU.

    Args:
        spec: Model and per-GPU batch description.

    Data parallelism (``data_parallel_size > 1``): in the last micro-batch (DDP's ``no_sync()`` for
    the earlier ones) gradients are bucketed in the order backward finishes them and one
    ``COLLECTIVE`` op per bucket runs on stream ``comm.dp`` right after the op that completes the
    bucket (``meta``: ``collective``, ``bytes``, ``group="dp"``); without overlap all buckets follow
    backward. The optimizer waits for them.

    * ZeRO 0 (PyTorch DDP, ``torch/csrc/distributed/c10d/reducer.cpp``
      ``compute_bucket_assignment_by_size``): a bucket closes once its bytes reach its cap (first
      bucket 1 MiB, then ``bucket_cap_mb``); all-reduce of the fp32 bucket. The bucket buffers
      (4 bytes/param) are allocated when DDP is constructed and persist. Without
      ``gradient_as_bucket_view`` the ``.grad`` tensors are one more fp32 copy allocated in
      backward; with it they are views of the buckets and take no memory of their own (PyTorch
      DDP docs: the view "saves memory equal to the total gradients size").
    * ZeRO 1/2 (Rajbhandari et al., *ZeRO*, SC20, section 7: 2Psi communication per step for
      P_os and P_os+g, as DP's all-reduce): DeepSpeed's buckets (``reduce_bucket_size``
      elements, flushed before a gradient that would overflow them) are reduce-scattered; Adam
      state (8 bytes/param) and fp32 master weights (bf16 mode) are divided by dp (ceil), as are
      the optimizer kernel's traffic and FLOPs; stage 2 keeps only the reduced 1/dp shard of each
      bucket (the full gradients live until their bucket's reduce-scatter ends); after the step
      the updated parameters (model dtype) are all-gathered in ``allgather_bucket_size`` chunks.

    Returns:
        The step graph; ``samples_per_step`` counts all data-parallel replicas;
        ``param_groups`` lists every parameter tensor (their ``numel`` sum to ``num_parameters``).
    """
    return _GptBuilder(spec).build()


class _GptBuilder:
    def __init__(self, spec: TransformerSpec):
        self.s = spec
        self.b = GraphBuilder()
        self.e = KernelEmitter(self.b)
        amp = spec.precision == "amp_fp32_params"
        self.amp = amp
        self.act = 4 if amp else 2  # bytes per element of the residual stream / LayerNorm
        self.T = spec.micro_batch_size * spec.seq_length
        self.grad_made: set[str] = set()
        self.last_mb = False
        self.groups: list[ParamGroup] = []
        self.dp = spec.data_parallel_size > 1
        self.zero = spec.zero_stage if self.dp else 0
        # DDP with gradient_as_bucket_view: .grad tensors are views of the persistent buckets
        self._grads_in_buckets = self.dp and self.zero == 0 and spec.gradient_as_bucket_view
        self.overlap = spec.overlap_grad_reduce
        self._bucket: list[ParamGroup] = []
        self._buckets: list[tuple[ParamGroup, ...]] = []  # closed, not yet emitted (overlap off)
        self._limits = ((spec.ddp_first_bucket_bytes,) if self.zero == 0 else ())
        self.comm_ops: list[int] = []
        self.grad_shards: list[str] = []
        self.fp16 = spec.precision == "fp16"
        self.e.half = "fp16" if self.fp16 else "bf16"
        self.tp = spec.tensor_parallel_size
        self.sp = spec.sequence_parallel and self.tp > 1
        #: tokens of the LayerNorm / residual region on this rank (``T / t`` with sequence parallelism)
        self.Tn = self.T // self.tp if self.sp else self.T
        self.tp_ops: list[int] = []  # TP collectives the optimizer waits for (SP LayerNorm grads, found-inf)
        self.moe_grad_ops: list[int] = []  # expert-gradient all-reduces over the edp group (moe.reduce_expert_grad)

    # -- helpers ---------------------------------------------------------------------------
    def _linear_fwd(self, name: str, x: str, in_dim: int, out_dim: int, x_fp32: bool, save: bool,
                    tokens: int | None = None, groups: int = 1):
        """Autocast Linear: (cast input) + cast weight + GEMM (+bias in the epilogue).

        ``tokens`` rows (default ``T``); ``groups > 1``: a grouped GEMM of ``groups`` weights ``[in, out]``
        over ``tokens`` rows in all (the MoE experts), priced as one GEMM of the stacked rows."""
        e = self.e
        T = self.T if tokens is None else tokens
        W = groups * in_dim * out_dim
        w16 = e.fresh(f"{name}.w16")
        if self.amp:
            e.kernel(f"{name}.cast_w", C.CAST, reads=4 * W, writes=2 * W, out=[(w16, 2 * W)], dtype="fp32")
        else:
            w16 = f"param.{name}"
        xin = x
        if self.amp and x_fp32:
            xin = e.fresh(f"{name}.in16")
            e.kernel(f"{name}.cast_in", C.CAST, reads=4 * T * in_dim, writes=2 * T * in_dim,
                     out=[(xin, 2 * T * in_dim)], uses=[x], dtype="fp32")
        y = e.fresh(f"{name}.out")
        e.kernel(f"{name}.gemm", C.GEMM, flops=2 * T * in_dim * out_dim, shape=(T, out_dim, in_dim),
                 reads=2 * (T * in_dim + W), writes=2 * T * out_dim,
                 out=[(y, 2 * T * out_dim)], uses=[xin, w16])
        return y, (xin, w16) if save else ()

    def _linear_bwd(self, name: str, g: str, saved: tuple, in_dim: int, out_dim: int, g_fp32: bool,
                    tokens: int | None = None, groups: int = 1):
        """Input-gradient and weight-gradient GEMMs, bias gradient, fp32 grad accumulation (``tokens``,
        ``groups``: as ``_linear_fwd``; the grouped weight gradient is ``groups`` GEMMs ``(out, in,
        tokens / groups)``, priced as one of ``groups * out`` rows)."""
        e = self.e
        T = self.T if tokens is None else tokens
        W = groups * in_dim * out_dim
        xin, w16 = saved
        gin = g
        if g_fp32 and self.amp:
            gin = e.fresh(f"{name}.g16")
            e.kernel(f"{name}.cast_grad", C.CAST, reads=4 * T * out_dim, writes=2 * T * out_dim,
                     out=[(gin, 2 * T * out_dim)], uses=[g], dtype="fp32")
        dx = e.fresh(f"{name}.dx")
        e.kernel(f"{name}.dgrad", C.GEMM, flops=2 * T * in_dim * out_dim, shape=(T, in_dim, out_dim),
                 reads=2 * (T * out_dim + W), writes=2 * T * in_dim,
                 out=[(dx, 2 * T * in_dim)], uses=[gin, w16])
        dw = e.fresh(f"{name}.dw16")
        e.kernel(f"{name}.wgrad", C.GEMM, flops=2 * T * in_dim * out_dim, shape=(groups * out_dim, in_dim, -(-T // groups)),
                 reads=2 * (T * out_dim + T * in_dim), writes=2 * W,
                 out=[(dw, 2 * W)], uses=[gin, xin])
        head = self.e.layer < 0 and name in ("wte", "lm_head")  # no LM-head bias parameter (num_parameters)
        if self.s.bias or (name == "qkv" and self.s.qkv_bias):
            bid = e.kernel(f"{name}.bias_grad", C.REDUCTION, reads=2 * T * out_dim, writes=4 * out_dim, uses=[gin])
            if not head:
                self._grad_ready(f"{name}.bias", out_dim, bid)
        wid, gname = self._accumulate_grad(name, dw, W)
        if name != "wte":  # the tied wte gradient is finished by embed.grad_accum
            self._grad_ready(f"{name}.weight", W, wid, gname)
        return dx

    def _accumulate_grad(self, pname: str, dw16: str, numel: int) -> None:
        """Cast a bf16 weight gradient into the fp32 ``.grad`` (allocate on first write)."""
        gname = f"grad.L{self.e.layer}.{pname}" if self.e.layer >= 0 else f"grad.{pname}"
        first = gname not in self.grad_made
        out = [(gname, 4 * numel)] if first and not self._grads_in_buckets else []
        if first:
            self.grad_made.add(gname)
        reads = 2 * numel + (0 if first else 4 * numel)
        i = self.e.kernel(f"{pname}.grad_accum", C.CAST if first else C.ELEMENTWISE, reads=reads,
                          writes=4 * numel, out=out, uses=[dw16], dtype="fp32")
        return i, gname

    def _norm_fwd(self, name: str, x: str):
        e, T, h = self.e, self.Tn, self.s.hidden_size
        y = e.fresh(f"{name}.out")
        stats = 8 * T if self.s.normalization == "LayerNorm" else 4 * T  # fp32 mean + rstd, or rstd only (RMSNorm)
        e.kernel(f"{name}", C.NORM, reads=self.act * T * h, writes=self.act * T * h,
                 out=[(y, self.act * T * h), (e.fresh(f"{name}.stats"), stats)], uses=[x], dtype="fp32")
        return y

    def _norm_bwd(self, name: str, g: str, x: str, g_is_bf16: bool):
        e, T, h = self.e, self.Tn, self.s.hidden_size
        gin = g
        if self.amp and g_is_bf16:
            gin = e.fresh(f"{name}.g32")
            e.kernel(f"{name}.cast_grad", C.CAST, reads=2 * T * h, writes=4 * T * h,
                     out=[(gin, 4 * T * h)], uses=[g], dtype="fp32")
        dx = e.fresh(f"{name}.dx")
        e.kernel(f"{name}.dgrad", C.NORM, reads=2 * self.act * T * h, writes=self.act * T * h,
                 out=[(dx, self.act * T * h)], uses=[gin, x], dtype="fp32")
        nb = self.s.norm_has_bias
        i = e.kernel(f"{name}.dgamma_dbeta" if nb else f"{name}.dgamma", C.REDUCTION, reads=2 * self.act * T * h,
                     writes=(8 if nb else 4) * h, uses=[gin, x], dtype="fp32")
        self._grad_ready(f"{name}.weight", h, i)
        if nb:
            self._grad_ready(f"{name}.bias", h, i)
        return dx

    def _add(self, name: str, a: str, b_: str, a_bytes: int, b_bytes: int, out_bytes: int):
        e, T, h = self.e, self.Tn, self.s.hidden_size
        y = e.fresh(f"{name}.out")
        e.kernel(name, C.ELEMENTWISE, reads=(a_bytes + b_bytes) * T * h, writes=out_bytes * T * h,
                 out=[(y, out_bytes * T * h)], uses=[a, b_], dtype="fp32")
        return y

    # -- tensor parallel ---------------------------------------------------------------------
    def _tp_op(self, name: str, op: str, nbytes: int, uses=(), out=(), deps=(), dtype: str | None = None,
               group: str = "tp") -> int:
        """A blocking collective over the ``tp`` group (or ``group``: ``ep`` for the MoE all-to-alls) on stream
        ``comm.<group>`` (``nbytes``: the per-rank buffer of an all-reduce or all-to-all, the whole
        gathered/scattered array of an all-gather/reduce-scatter).

        As a synchronous ``torch.distributed`` call (ProcessGroupNCCL): it starts after every kernel issued
        before it on the compute stream, and the next compute kernel waits for it (Megatron 2020: no
        overlap of TP communication with compute)."""
        e = self.e
        i = e.kernel(f"{group}.{name}", C.OTHER, kind=OpKind.COLLECTIVE, stream=f"comm.{group}", reads=float(nbytes),
                     uses=uses, out=out, deps=[*deps, e.last_compute], dtype=dtype,
                     meta={"collective": op, "bytes": int(nbytes), "group": group})
        e.wait_for.append(i)
        return i

    def _tp_reduce(self, name: str, x: str) -> str:
        """Sum the partial ``[T, h]`` output of a row-parallel GEMM (or a column-parallel input gradient)
        over the TP ranks: an in-place all-reduce, or a reduce-scatter to ``T / t`` tokens with sequence
        parallelism. The compute stream waits for it. Returns the reduced tensor (identity at ``t = 1``)."""
        if self.tp == 1:
            return x
        nbytes = 2 * self.T * self.s.hidden_size
        if not self.sp:
            self.e.producer[x] = self._tp_op(f"{name}.all_reduce", "all_reduce", nbytes, uses=[x])
            return x
        y = self.e.fresh(f"{name}.rs")
        self._tp_op(f"{name}.reduce_scatter", "reduce_scatter", nbytes, uses=[x], out=[(y, nbytes // self.tp)])
        return y

    def _tp_gather(self, name: str, x: str) -> str:
        """Sequence parallelism: all-gather the ``[T / t, h]`` 16-bit shard ``x`` into ``[T, h]`` before a
        column-parallel GEMM (forward) or a row-parallel backward. Identity without it."""
        if not self.sp:
            return x
        nbytes = 2 * self.T * self.s.hidden_size
        y = self.e.fresh(f"{name}.ag")
        self._tp_op(f"{name}.all_gather", "all_gather", nbytes, uses=[x], out=[(y, nbytes)])
        return y

    # -- rotary embeddings -----------------------------------------------------------------
    def _rope_fwd(self, qkv: str, width: int) -> str | None:
        """Rotary embedding of q and k (Su et al., *RoFormer*, 2021, eq. 34; Megatron
        ``apply_rotary_pos_emb``): elementwise ``x cos + rotate_half(x) sin`` over the ``[T, width]``
        16-bit q and k (``width = h / t + g d / t``), memory-bound: reads q, k and the fp32 ``[s, d]``
        cos/sin tables, writes the rotated q, k (saved for the attention backward). ``None`` without rope."""
        if self.s.position_embedding != "rope":
            return None
        return self._rope_kernel("rope", "rope.qk", qkv, width)

    def _rope_bwd(self, g_qkv: str, width: int) -> str:
        """Backward of ``_rope_fwd`` (the inverse rotation of dq, dk: same traffic); returns the QKV gradient."""
        if self.s.position_embedding != "rope":
            return g_qkv
        return self._rope_kernel("rope.dgrad", "rope.dx", g_qkv, width)

    def _rope_kernel(self, name: str, out: str, src: str, width: int) -> str:
        """One rotation pass over ``[T, width]`` 16-bit elements (forward or backward: the same traffic)."""
        e, s = self.e, self.s
        n = self.T * width
        y = e.fresh(out)
        e.kernel(name, C.ELEMENTWISE, reads=2 * n + 2 * 4 * s.seq_length * s.head_dim, writes=2 * n,
                 flops=3 * n, out=[(y, 2 * n)], uses=[src])
        return y

    # -- MLP activation ----------------------------------------------------------------------
    def _act_fwd(self, prefix: str, fc1: str, T: int, f: int) -> str:
        """The MLP activation over ``[T, f]`` 16-bit outputs (``prefix``: kernel-name prefix, e.g. ``experts.``):
        SwiGLU ``silu(a) * b`` over the two halves of fc1 (Megatron fused bias_swiglu, ~6 FLOPs/element), or
        GELU (~8 FLOPs/element)."""
        e = self.e
        name = "swiglu" if self.s.swiglu else "gelu"
        g = e.fresh(f"{prefix}{name}.out")
        n_in = 2 * T * f if self.s.swiglu else T * f
        e.kernel(f"{prefix}{name}", C.ELEMENTWISE, reads=2 * n_in, writes=2 * T * f,
                 flops=(6 if self.s.swiglu else 8) * T * f, out=[(g, 2 * T * f)], uses=[fc1])
        return g

    def _act_bwd(self, prefix: str, g: str, fc1: str, T: int, f: int) -> str:
        """Backward of ``_act_fwd``: SwiGLU reads dy and both halves, writes both gradients (~12 FLOPs/element);
        GELU reads dy and its input, writes dx (~16 FLOPs/element)."""
        e = self.e
        if self.s.swiglu:
            dx = e.fresh(f"{prefix}swiglu.dx")
            e.kernel(f"{prefix}swiglu.dgrad", C.ELEMENTWISE, reads=2 * 3 * T * f, writes=2 * 2 * T * f,
                     flops=12 * T * f, out=[(dx, 2 * 2 * T * f)], uses=[g, fc1])
        else:
            dx = e.fresh(f"{prefix}gelu.dx")
            e.kernel(f"{prefix}gelu.dgrad", C.ELEMENTWISE, reads=2 * 2 * T * f, writes=2 * T * f, flops=16 * T * f,
                     out=[(dx, 2 * T * f)], uses=[g, fc1])
        return dx

    # -- blocks ----------------------------------------------------------------------------
    def _layer_fwd(self, x: str, save: bool, selective: bool) -> tuple[str, dict]:
        """One block forward. Returns the output tensor and the tensors saved for backward."""
        s, e, T, t = self.s, self.e, self.T, self.tp
        f, a, d, hf = s.ffn_hidden_size // t, s.num_attention_heads // t, s.head_dim, s.hidden_size
        h = s.attention_width // t  # per TP rank: attention width a d (h unless kv_channels), FFN width, heads
        qo, kv = s.qkv_out_size // t, s.query_groups * d // t  # QKV width a d + 2 g d, K (or V) width g d per rank
        ln1 = self._tp_gather("ln1", self._norm_fwd("ln1", x))
        qkv, sv_qkv = self._linear_fwd("qkv", ln1, hf, qo, x_fp32=True, save=save)
        qk = self._rope_fwd(qkv, h + kv)
        att = e.fresh("attn.out")
        bsz = s.micro_batch_size
        att_flops = 4 * bsz * a * s.attention_pairs * d
        # flash attention with grouped K/V: a query heads read g K/V heads (FLOPs per query head unchanged)
        e.kernel("attn", C.ATTENTION_FWD, flops=att_flops, shape=(bsz * a, s.seq_length, s.seq_length, d),
                 reads=2 * T * qo, writes=2 * T * h + 4 * bsz * a * s.seq_length,
                 out=[(att, 2 * T * h), (e.fresh("attn.lse"), 4 * bsz * a * s.seq_length)],
                 uses=[qkv] + ([qk] if qk else []), meta={"kv_heads": s.query_groups // t, "window": s.window_size})
        attc = e.fresh("attn.out_contig")
        e.kernel("attn.transpose", C.COPY, reads=2 * T * h, writes=2 * T * h, out=[(attc, 2 * T * h)], uses=[att])
        proj, sv_proj = self._linear_fwd("proj", attc, h, hf, x_fp32=False, save=save)
        proj = self._tp_reduce("proj", proj)
        x2 = self._add("residual1", x, proj, self.act, 2, self.act)
        ln2 = self._tp_gather("ln2", self._norm_fwd("ln2", x2))
        fc1 = sv_fc1 = sv_fc2 = sv_moe = None
        if s.num_experts:  # mixture of experts (simulator/graph/builders/moe.py)
            fc2, sv_moe = moe.moe_fwd(self, ln2, save)
        else:
            fc1, sv_fc1 = self._linear_fwd("fc1", ln2, hf, s.fc1_out_size // t, x_fp32=True, save=save)
            g = self._act_fwd("", fc1, T, f)
            fc2, sv_fc2 = self._linear_fwd("fc2", g, f, hf, x_fp32=False, save=save)
            fc2 = self._tp_reduce("fc2", fc2)
        x3 = self._add("residual2", x2, fc2, self.act, 2, self.act)
        saved = {}
        if save:
            saved = dict(x=x, qkv=qkv, qk=qk, att=None if selective else att, sv_qkv=sv_qkv, sv_proj=sv_proj,
                         x2=x2, fc1=fc1, sv_fc1=sv_fc1, sv_fc2=sv_fc2, moe=sv_moe)
        return x3, saved

    def _layer_bwd(self, gx: str, sv: dict) -> str:
        """One block backward; ``gx`` is the gradient of the block output (residual dtype)."""
        s, e, T, t = self.s, self.e, self.T, self.tp
        f, a, d, hf = s.ffn_hidden_size // t, s.num_attention_heads // t, s.head_dim, s.hidden_size
        h = s.attention_width // t  # per TP rank (see _layer_fwd)
        qo, kv = s.qkv_out_size // t, s.query_groups * d // t
        bsz = s.micro_batch_size
        att_flops = 4 * bsz * a * s.attention_pairs * d
        # MLP
        if s.num_experts:  # mixture of experts (simulator/graph/builders/moe.py)
            g_ln2 = moe.moe_bwd(self, gx, sv["moe"])
        else:
            g_fc2_in = self._linear_bwd("fc2", self._tp_gather("fc2.grad", gx), sv["sv_fc2"], f, hf, g_fp32=True)
            g_gelu = self._act_bwd("", g_fc2_in, sv["fc1"], T, f)
            g_ln2 = self._tp_reduce("fc1.grad", self._linear_bwd("fc1", g_gelu, sv["sv_fc1"], hf, s.fc1_out_size // t,
                                                                 g_fp32=False))
        g_x2 = self._norm_bwd("ln2", g_ln2, sv["x2"], g_is_bf16=True)
        g_mid = self._add("residual2.grad", gx, g_x2, self.act, self.act, self.act)
        # attention
        g_proj_in = self._linear_bwd("proj", self._tp_gather("proj.grad", g_mid), sv["sv_proj"], h, hf, g_fp32=True)
        g_att = e.fresh("attn.transpose.dx")
        e.kernel("attn.transpose.dgrad", C.COPY, reads=2 * T * h, writes=2 * T * h,
                 out=[(g_att, 2 * T * h)], uses=[g_proj_in])
        att = sv["att"]
        if att is None:  # selective recompute: re-run the attention forward
            att = e.fresh("attn.out.recomputed")
            e.kernel("attn.recompute", C.ATTENTION_FWD, flops=att_flops,
                     shape=(bsz * a, s.seq_length, s.seq_length, d), reads=2 * T * qo, writes=2 * T * h,
                     out=[(att, 2 * T * h)], uses=[sv["qkv"]] + ([sv["qk"]] if sv["qk"] else []))
        g_qkv = e.fresh("attn.dqkv")
        e.kernel("attn.dgrad", C.ATTENTION_BWD, flops=2.5 * att_flops,
                 shape=(bsz * a, s.seq_length, s.seq_length, d),
                 reads=2 * (T * qo + 2 * T * h), writes=2 * T * qo + 4 * T * h,
                 out=[(g_qkv, 2 * T * qo)], uses=[g_att, sv["qkv"], att] + ([sv["qk"]] if sv["qk"] else []),
                 meta={"kv_heads": s.query_groups // t, "window": s.window_size})
        g_qkv = self._rope_bwd(g_qkv, h + kv)
        g_ln1 = self._tp_reduce("qkv.grad", self._linear_bwd("qkv", g_qkv, sv["sv_qkv"], hf, qo, g_fp32=False))
        g_x = self._norm_bwd("ln1", g_ln1, sv["x"], g_is_bf16=True)
        return self._add("residual1.grad", g_mid, g_x, self.act, self.act, self.act)

    # -- whole step ------------------------------------------------------------------------
    def _persistent(self) -> None:
        s, b = self.s, self.b
        P = s.num_parameters
        Ps = self._shard(P) if self.zero else P  # ZeRO-1/2: optimizer state and master weights per rank
        if self.amp:
            b.persistent("params.fp32", 4 * P)
        else:
            b.persistent(f"params.{self.e.half}", 2 * P)
            b.persistent("params.master_fp32", 4 * Ps)
        b.persistent("optimizer.exp_avg", 4 * Ps)
        b.persistent("optimizer.exp_avg_sq", 4 * Ps)
        if self.dp and self.zero == 0:
            b.persistent("grad.ddp_buckets", 4 * P)  # DDP's flat bucket buffers (fp32, all parameters)

    def _micro_batch(self, mb: int) -> None:
        s, e, T = self.s, self.e, self.T
        h, V = s.hidden_size, s.vocab_per_rank  # vocabulary-parallel embedding and LM head: V_p / t rows
        full = s.recompute == "full"
        selective = s.recompute == "selective"
        e.phase, e.layer = Phase.FWD, -1
        tokens = e.fresh("input.tokens")
        e.kernel("input.h2d", C.COPY, kind=OpKind.MEMCPY_H2D, stream="h2d", reads=8 * 2 * T, out=[(tokens, 16 * T)],
                 dtype="int64")
        x = e.fresh("embed.out")
        rows = 2 if s.position_table_rows else 1  # token row (+ learned position row) per token
        e.kernel("embed", C.EMBEDDING, reads=8 * T + rows * self.act * T * h, writes=self.act * T * h,
                 out=[(x, self.act * T * h)], uses=[tokens], dtype="fp32")
        x = self._tp_reduce("embed", x)  # VocabParallelEmbedding: rows outside the rank's range are zero
        saved_layers = []
        for layer in range(s.num_layers):
            e.layer = layer
            x_in = x
            x, sv = self._layer_fwd(x, save=not full, selective=selective)
            saved_layers.append(sv if not full else {"x": x_in})
        e.layer = -1
        xf = self._tp_gather("ln_f", self._norm_fwd("ln_f", x))
        logits, sv_head = self._linear_fwd("lm_head", xf, h, V, x_fp32=True, save=True)
        l32 = e.fresh("logits.fp32")
        lf = e.kernel("logits.float", C.CAST, reads=2 * T * V, writes=4 * T * V, out=[(l32, 4 * T * V)],
                      uses=[logits])
        ce = []  # vocab-parallel cross-entropy: all-reduce (MAX) of the logit max, then (SUM) of the target
        if self.tp > 1:  # logit and of the sum of exponentials, fp32 [b, s] each (_VocabParallelCrossEntropy)
            ce.append(self._tp_op("ce.logits_max.all_reduce", "all_reduce", 4 * T, deps=[lf], dtype="fp32"))
        lsm = e.fresh("log_softmax.out")
        ls = e.kernel("log_softmax", C.SOFTMAX, reads=4 * T * V, writes=4 * T * V, out=[(lsm, 4 * T * V)],
                      uses=[l32], deps=ce, dtype="fp32")
        if self.tp > 1:
            ce = [self._tp_op(f"ce.{w}.all_reduce", "all_reduce", 4 * T, deps=[ls], dtype="fp32")
                  for w in ("predicted_logits", "sum_exp_logits")]
        e.kernel("nll_loss", C.REDUCTION, reads=4 * T + 8 * T, writes=4, uses=[lsm, tokens], deps=ce, dtype="fp32")
        # backward
        e.phase = Phase.BWD
        if self.fp16:  # dynamic loss scaling: backward starts from loss * scale (Micikevicius et al. 2018)
            e.kernel("loss_scale.scale", C.ELEMENTWISE, reads=8, writes=4, flops=1, dtype="fp32")
        g_lsm = e.fresh("nll_loss.dx")
        e.kernel("nll_loss.dgrad", C.MEMSET, reads=0, writes=4 * T * V, out=[(g_lsm, 4 * T * V)], dtype="fp32")
        g_l32 = e.fresh("log_softmax.dx")
        e.kernel("log_softmax.dgrad", C.SOFTMAX, reads=8 * T * V, writes=4 * T * V, out=[(g_l32, 4 * T * V)],
                 uses=[g_lsm, lsm], dtype="fp32")
        g_logits = e.fresh("logits.float.dx")
        e.kernel("logits.float.dgrad", C.CAST, reads=4 * T * V, writes=2 * T * V, out=[(g_logits, 2 * T * V)],
                 uses=[g_l32], dtype="fp32")
        g = self._linear_bwd("wte" if s.tied_embeddings else "lm_head", g_logits, sv_head, h, V, g_fp32=False)
        g = self._norm_bwd("ln_f", self._tp_reduce("lm_head.grad", g), x, g_is_bf16=True)
        for layer in reversed(range(s.num_layers)):
            e.layer = layer
            sv = saved_layers[layer]
            if full:
                _, sv = self._layer_fwd(sv["x"], save=True, selective=False)
            g = self._layer_bwd(g, sv)
        e.layer = -1
        g = self._tp_gather("embed.grad", g)  # sequence parallelism: the reduce-scatter's backward
        # embedding backward: dense fp32 gradient of the token table (+ tied LM-head gradient)
        d_emb = e.fresh("embed.dw")
        e.kernel("embed.dgrad", C.EMBEDDING, reads=self.act * T * h + 8 * T, writes=4 * V * h,
                 out=[(d_emb, 4 * V * h)], uses=[g, tokens], dtype="fp32")
        gname = "grad.wte"
        first = gname not in self.grad_made
        self.grad_made.add(gname)
        i = e.kernel("embed.grad_accum", C.COPY if first else C.ELEMENTWISE, reads=4 * V * h * (1 if first else 2),
                     writes=4 * V * h, out=[(gname, 4 * V * h)] if first and not self._grads_in_buckets else [],
                     uses=[d_emb], dtype="fp32")
        self._grad_ready("wte.weight", V * h, i, gname)
        if s.position_table_rows:
            P = s.position_table_rows
            i = e.kernel("pos_embed.dgrad", C.REDUCTION, reads=self.act * T * h, writes=4 * P * h, uses=[g],
                         dtype="fp32")
            self._grad_ready("wpe.weight", P * h, i)
        self._end_of_backward()

    def _sequence_parallel_grads(self) -> None:
        """Sequence parallelism: one coalesced all-reduce over the TP group of the fp32 gradients of the
        LayerNorms and row-parallel biases (Megatron ``finalize_model_grads`` -> ``_allreduce_layernorm_grads``)."""
        if self.sp:
            self.e.phase, self.e.layer = Phase.BWD, -1
            self.tp_ops.append(self._tp_op("layernorm_grads.all_reduce", "all_reduce",
                                           4 * self.s.sequence_parallel_params, deps=[len(self.b) - 1],
                                           dtype="fp32"))

    def _optimizer(self) -> None:
        s, e = self.s, self.e
        P = s.num_parameters
        e.phase, e.layer = Phase.OPT, -1
        grads = sorted(self.grad_made) if self.zero < 2 else list(self.grad_shards)
        # fp32 params/grads + two moments read, params + moments written; bf16 mode also writes bf16 params
        reads, writes = 16 * P, 12 * P + (0 if self.amp else 2 * P)
        share = self._shard(P) / P if self.zero else 1.0  # ZeRO-1/2: this rank updates its 1/dp partition
        deps = list(self.comm_ops) + self.tp_ops + self.moe_grad_ops
        if self.fp16:  # unscale the fp32 main grads in place and check them for inf/nan, then found_inf.item()
            chk = e.kernel("loss_scale.unscale_check", C.ELEMENTWISE, reads=4 * P * share, writes=4 * P * share,
                           flops=P * share, uses=grads, deps=deps, dtype="fp32")
            if self.tp > 1:
                chk = self._tp_op("loss_scale.found_inf.all_reduce", "all_reduce", 4, deps=[chk], dtype="fp32")
            deps = [self.b.add("loss_scale.found_inf.item", OpKind.SYNC, "host", deps=[chk], phase=Phase.OPT,
                               launch=False)]
        e.kernel("adamw", C.OPTIMIZER, reads=reads * share, writes=writes * share, flops=12 * P * share, uses=grads,
                 dtype="fp32", deps=deps, meta={"params": P})
        if self.zero:
            opt = len(self.b) - 1
            pbytes = 4 if self.amp else 2
            left, k = P, 0
            while left > 0:
                n = min(left, s.allgather_bucket_elements)
                self.comm_ops.append(self._collective(f"zero.param_all_gather.{k}", "all_gather", n * pbytes, [opt],
                                                      Phase.OPT))
                left, k = left - n, k + 1

    # -- data parallel -----------------------------------------------------------------------
    def _shard(self, n: int) -> int:
        """Elements of one rank's ZeRO partition of ``n`` (DeepSpeed pads the flat buffer to dp)."""
        dp = self.s.data_parallel_size
        return -(-n // dp)

    def _grad_ready(self, name: str, numel: int, op: int, tensor: str | None = None) -> None:
        """Record that op ``op`` finished the gradient of parameter ``name`` (last micro-batch)."""
        if not self.last_mb:
            return
        layer = self.e.layer
        pg = ParamGroup(f"L{layer}.{name}" if layer >= 0 else name, numel, layer, 4, op, tensor)
        self.groups.append(pg)
        if not self.dp:
            return
        if self.s.expert_parallel_size > 1 and name.startswith("experts."):  # over the expert-data-parallel group
            moe.reduce_expert_grad(self, pg)
            return
        s = self.s
        if self.zero == 0:  # DDP: close once the bucket reaches its cap (reducer.cpp)
            self._bucket.append(pg)
            cap = self._limits[0] if len(self._buckets) + len(self.comm_ops) == 0 else s.ddp_bucket_cap_bytes
            if sum(g.grad_bytes for g in self._bucket) >= cap:
                self._close_bucket()
        else:  # DeepSpeed: flush before a gradient that would overflow reduce_bucket_size elements
            if self._bucket and sum(g.numel for g in self._bucket) + numel > s.reduce_bucket_elements:
                self._close_bucket()
            self._bucket.append(pg)

    def _close_bucket(self) -> None:
        bucket, self._bucket = tuple(self._bucket), []
        if self.overlap:
            self._emit_bucket(bucket, ())
        else:
            self._buckets.append(bucket)

    def _end_of_backward(self) -> None:
        if not (self.dp and self.last_mb):
            return
        if self._bucket:
            self._close_bucket()
        last = len(self.b) - 1
        for bucket in self._buckets:
            self._emit_bucket(bucket, (last,))
        self._buckets = []

    def _emit_bucket(self, bucket: tuple[ParamGroup, ...], extra: tuple[int, ...]) -> None:
        k = len(self.comm_ops)
        nbytes = sum(g.grad_bytes for g in bucket)
        tensors = [g.grad_tensor for g in bucket if g.grad_tensor]
        deps = [g.grad_op for g in bucket] + list(extra)
        if self.zero == 0:
            self.comm_ops.append(self._collective(f"ddp.grad_all_reduce.{k}", "all_reduce", nbytes, deps, Phase.BWD,
                                                  uses=tensors))
            return
        out = []
        if self.zero == 2:  # the reduced shard stays; the full gradients are freed after the reduce-scatter
            shard = self.e.fresh(f"grad.shard.b{k}")
            self.grad_shards.append(shard)
            out = [TensorAlloc(shard, -(-nbytes // self.s.data_parallel_size))]
        self.comm_ops.append(self._collective(f"zero.grad_reduce_scatter.{k}", "reduce_scatter", nbytes, deps,
                                              Phase.BWD, uses=tensors if self.zero == 2 else (), allocs=tuple(out)))

    def _collective(self, name: str, op: str, nbytes: int, deps, phase: Phase, uses=(), allocs=(),
                    group: str = "dp") -> int:
        """A collective over the ``dp`` group (or ``group``) on stream ``comm.<group>`` (priced by the engine's
        NCCL model)."""
        return self.b.add(name, OpKind.COLLECTIVE, f"comm.{group}", deps=deps, phase=phase, bytes_read=float(nbytes),
                          uses=tuple(uses), allocs=tuple(allocs), dtype="fp32",
                          meta={"collective": op, "bytes": int(nbytes), "group": group})

    def build(self) -> OpGraph:
        s = self.s
        self._persistent()
        for mb in range(s.num_micro_batches):
            self.last_mb = mb == s.num_micro_batches - 1
            self._micro_batch(mb)
        self._sequence_parallel_grads()
        self._optimizer()
        # the measured training loops synchronise the device after every step
        self.b.add("step.synchronize", OpKind.SYNC, "host", deps=[len(self.b) - 1], phase=Phase.OTHER,
                   launch=False)
        samples = s.micro_batch_size * s.num_micro_batches * s.data_parallel_size
        return self.b.build(
            samples_per_step=float(samples),
            tokens_per_step=float(samples * s.seq_length),
            model_flops_per_step=s.model_flops_per_sample() * s.micro_batch_size * s.num_micro_batches,
            source="builder:gpt",
            param_groups=tuple(self.groups),
            meta={"num_parameters": s.num_parameters, "spec": s, "tensor_parallel_size": s.tensor_parallel_size},
        )
