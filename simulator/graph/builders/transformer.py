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
  ``fp32`` / ``tf32``: plain fp32 training (no autocast): fp32 parameters (no master copy), activations,
  gradients and Adam state; every GEMM on fp32 operands at the GPU's fp32 rate, or with ``tf32``
  (``torch.backends.cuda.matmul.allow_tf32 = True``; PyTorch's default from 1.7 to 1.11) at its TF32
  tensor-core rate. Needs the unfused attention (flash attention has no fp32 kernel). The first
  micro-batch's weight gradient is still copied into ``.grad`` (PyTorch's AccumulateGrad takes the buffer
  instead): 8 bytes per parameter per step too many. With FSDP2 gathering fp32 parameters (``fsdp2_full_precision``:
  torchtitan's ``mixed_precision_param = "float32"``, which runs without autocast) the GEMMs read the gathered fp32
  weights. With FSDP2 gathering bf16 parameters under ``amp_fp32_params`` (``fsdp2_bf16_params``, torchtitan's
  default) there is no autocast either: fp32 sharded parameters and optimizer, but the residual stream, norms and
  saved activations in bf16 and no casts before the GEMMs; FSDP1 (llm-foundry / Composer) stays under autocast.
* **Attention** is one fused flash kernel (``scaled_dot_product_attention``) whose FLOPs are
  ``4 * b * a * s^2 * d / 2`` forward with causal masking and 2.5x that backward (the backward
  recomputes the scores: Dao, *FlashAttention-2*, 2023, section 4.1 FLOP accounting); with
  ``attention_backend: unfused`` it is Megatron-LM 2020-2022's batched GEMMs, fused causal softmax and
  dropout (``simulator.graph.builders.attention``, which also holds the hidden-dropout kernels).
* **GEMM FLOPs** are ``2 m n k``. A Linear ``[T, i] x [i, o]`` has forward ``(T, o, i)``,
  input-gradient ``(T, i, o)`` and weight-gradient ``(o, i, T)`` GEMMs.
* **Memory**: each kernel allocates its outputs; a tensor lives until the last kernel that uses it
  has run (autograd's saved tensors are used by the backward kernels). Parameters and optimizer
  state are persistent; gradients are allocated by the backward pass and freed after the
  optimizer step (``zero_grad(set_to_none=True)``).
* **Activation recompute** ``full`` keeps only each block's input and re-runs the block's forward
  before its backward (Megatron-LM ``--recompute-granularity full --recompute-method uniform``);
  ``selective`` re-runs only the attention core (Korthikanti et al., *Reducing Activation
  Recomputation in Large Transformer Models*, MLSys 2023); ``full`` with ``recompute_every`` n checkpoints every
  n-th block only (torchtitan's ``selective_ac_option`` n); ``op`` is torchtitan's per-op policy, which keeps the
  outputs of wq, wv, w1, w2, SDPA and the TP reduce-scatters and re-runs the rest before each block's backward
  (``simulator/graph/builders/op_sac.py``).

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
  are all-reduced over the TP group once per step (Megatron ``_allreduce_layernorm_grads``; not under DeepSpeed's
  engine, which Megatron-DeepSpeed leaves without it: ``TransformerSpec.deepspeed_engine``). With
  ``tp_async_grad_reduce`` the column-parallel layers save their input's ``s / t`` shard and gather it again
  for the weight gradient beside the input-gradient GEMM (Megatron's re-gather), and reduce-scatter the input
  gradient beside the weight-gradient GEMM; without it the gathered input is saved and nothing is re-gathered.
* **Asynchronous column-parallel backward** (``tp_async_grad_reduce``, Megatron-LM 2021 on): the qkv, fc1
  and LM-head input-gradient all-reduce starts after the input-gradient GEMM and runs beside the weight
  gradient; the compute stream waits for it after the bias gradient (see ``TransformerSpec``).

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
* **LoRA** ``lora``: frozen base weights and low-rank adapters, ``simulator.graph.builders.lora``.
* **Vision transformer** ``vit``: patch embedding and classification head from
  ``simulator.graph.builders.vit`` around the same blocks, with bidirectional attention (``causal`` false:
  ``s^2`` pairs per head).

Shapes below use ``T = micro_batch_size * seq_length`` tokens, ``h`` hidden, ``f`` FFN hidden,
``V`` vocabulary, ``a`` heads, ``d = h / a`` (or ``kv_channels``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hardware_models.host_kernels import adamw_passes

from simulator.graph.builders import attention as core
from simulator.graph.builders import fsdp2
from simulator.graph.builders import bf16_optimizer as bf16opt
from simulator.graph.builders import fp16_optimizer as fp16opt
from simulator.graph.builders import grad_norm as gn
from simulator.graph.builders import sharding as shd
from simulator.graph.builders import hf_eager as hf
from simulator.graph.builders import lora, moe, op_sac, qkv_layout, varlen
from simulator.graph.builders import vit as vitb
from simulator.graph.builders.emitter import KernelEmitter
from simulator.graph.builders.pipeline import (SPLIT_BACKWARD, Action, Comm, check_schedule, chunk_layers, chunk_rank,
                                               rank_chunks, stage_actions, transfer_stream, uniform_split)
from simulator.graph.builders import stamp_blocks
from simulator.graph.builders.stamp import Stamper, layer_name_parts
from simulator.graph.op_graph import GraphBuilder, ModelFacts, OpGraph, ParamGroup
from simulator.graph.ops import CostClass as C
from simulator.graph.ops import OpKind, OpRole, Phase, TensorAlloc

PRECISIONS = ("amp_fp32_params", "bf16", "fp16", "fp32", "tf32")
#: precisions whose parameters, activations and GEMMs are all fp32 (tf32: GEMMs on TF32 tensor cores)
FULL_PRECISIONS = ("fp32", "tf32")
#: Megatron-LM --make-vocab-size-divisible-by default (arguments.py); the padded vocabulary is a multiple of 128 t
VOCAB_DIVISIBLE_BY = 128
#: ``op``: torchtitan's per-op selective checkpointing (``simulator/graph/builders/op_sac.py``)
RECOMPUTE = ("none", "full", "selective", "op")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
#: Megatron-LM --position-embedding-type values modelled; ``none``: no position parameters or kernels (ALiBi's
#: bias is added inside the flash kernel; Press et al., ICLR 2022)
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")
#: The LM head's loss (``TransformerSpec.cross_entropy``): PyTorch's ``F.cross_entropy`` or Megatron-LM's
#: vocab-parallel cross-entropy (megatron/core/tensor_parallel/cross_entropy.py, fusions/fused_cross_entropy.py)
CROSS_ENTROPY_IMPLS = ("pytorch", "megatron", "megatron_fused")
TP_COMM_OVERLAP = ("none", "overlap", "fused")
CP_COMM_TYPES = ("p2p", "all_gather", "a2a")


def _parts(t: str | tuple[str, ...]) -> list[str]:
    """A tensor, or the tensors of a GEMM written in parts (``_linear_fwd(parts=...)``), as a list."""
    return [t] if isinstance(t, str) else list(t)


@dataclass(frozen=True)
class TransformerSpec:
    """What the builder needs to know about the model and one GPU's share of the step.

    Attributes:
        num_layers: Transformer blocks.
        hidden_size: Model width ``h``.
        num_attention_heads: Heads ``a`` (must divide ``h``).
        seq_length: Tokens per sample ``s``.
        vocab_size: Vocabulary ``V`` (unused with ``vit``).
        ffn_hidden_size: MLP width ``f`` (Megatron default ``4h``).
        micro_batch_size: Samples per forward/backward pass ``b``.
        num_micro_batches: Gradient-accumulation steps per optimizer step.
        tied_embeddings: LM head shares the token-embedding weight.
        bias: Linear and LayerNorm layers have biases.
        precision: One of ``PRECISIONS``.
        optimizer_impl: ``fused`` (one kernel, 28 bytes per fp32 parameter), ``foreach``
            (``torch.optim.AdamW(foreach=True)``, ``_multi_tensor_adamw``: its eight multi-tensor passes of
            ``hardware_models.host_kernels.adamw_passes("torch_foreach")``, 80 bytes per fp32 parameter) or
            ``single`` (the per-tensor loop of ``torch.optim.AdamW(foreach=False)`` / Composer's
            ``DecoupledAdamW``: the same passes, sqrt and div into new tensors, ``"torch_single"``, 80 bytes per
            fp32 parameter). One kernel per pass over the rank's partition: the per-tensor (single) or per
            multi-tensor-apply chunk (foreach) launches are not counted.
        clip_grad: Gradient-clipping max norm (0: no clipping; None: the framework's default, 0 with an FSDP
            ``sharding``, DeepSpeed ZeRO (``zero_stage`` > 0) or ``deepspeed_bf16_optimizer`` (DeepSpeed's
            ``gradient_clipping`` default 0, ``config.schema.clip_grad_of``), else Megatron's 1.0), the framework's
            kernels. Megatron's optimizer (bf16
            / fp16 outside ZeRO / FSDP): ``--clip-grad``, the norm kernel and its all-reduce over the model-parallel
            group or the world (``_GptBuilder._clip_grad_norm``, ``_grad_stats_all_reduce``). FSDP:
            ``clip_grad_norm_`` (``_fsdp_clip_grad_norm``: over its process group, no cross-stage sync). DeepSpeed
            ZeRO-1/2: its step's norm and unscale run whatever the value (``grad_norm.deepspeed_zero_step``). A
            PyTorch loop: ``torch.nn.utils.clip_grad_norm_`` with ``clip_grad_norm_call`` (``_torch_clips``), else no
            kernel; with ``p > 1`` every pipeline rank then joins a gradient-norm all-reduce before its optimizer
            (``_pipeline_syncs``); with 0 only fp16's found-inf all-reduce joins them.
        clip_grad_norm_call: The PyTorch loop calls ``torch.nn.utils.clip_grad_norm_(max_norm=clip_grad)``
            (``grad_norm.torch_clip_grad_norm``; set where the scenario gives ``training.clip_grad > 0``); used only
            without Megatron's optimizer, DeepSpeed ZeRO or FSDP, which compute their own norms.
        accumulate_allreduce_grads_in_fp32: Megatron-LM ``--accumulate-allreduce-grads-in-fp32`` (default off;
            forced on with bf16): with fp16 and Megatron's optimizer, off keeps the contiguous grad buffer, its
            accumulation and its data-parallel reduction in fp16 (2 B per parameter) and casts the grads into fp32
            main grads before the step (``_GptBuilder._copy_model_grads_to_main_grads``); on: fp32 (4 B).
        deepspeed_bf16_optimizer: DeepSpeed's ``BF16_Optimizer`` runs the step (a DeepSpeed pipeline with ZeRO
            stage 0 and bf16: ``graph.builders.bf16_optimizer``): 2-byte ``.grad`` tensors beside a bf16
            accumulation buffer of every parameter, fp32 master weights and moments partitioned over ``dp``, one
            bf16 all-reduce of the buffer after the last backward, its own norm and a parameter all-gather; in
            place of Megatron's optimizer (bf16 precision only).
        deepspeed_fp16_optimizer: DeepSpeed's ``FP16_Optimizer`` runs the step (ZeRO stage 0 with fp16, or bf16
            without a pipeline: ``graph.builders.fp16_optimizer``): 2-byte ``.grad`` tensors, a flat fp32 master copy
            and moments of every parameter, the engine's bucketed 16-bit all-reduce after the last backward, its
            per-tensor overflow check, flat fp32 gradient, norm, unscale, Adam and 16-bit copy back; in place of
            Megatron's DDP and optimizer (bf16 / fp16 precision only).
        grad_reduce_in_bf16: Megatron-LM ``--grad-reduce-in-bf16``: with bf16 and Megatron's optimizer the
            contiguous grad buffer, its accumulation and its data-parallel reduction are bf16 (2 B per parameter),
            cast into fp32 main grads before the step, as fp16's buffer (``megatron_half_grads``); no effect with
            another precision (Megatron-LM reads it only under ``--bf16``).
        recompute: One of ``RECOMPUTE``.
        recompute_every: With ``recompute`` full, block ``i`` (0-based) is checkpointed whole when ``(i + 1) %
            recompute_every == 0`` and keeps all its activations otherwise (torchtitan's ``selective_ac_option``
            int n: ``simulator/config/sections/torchtitan_ac.py``); 1: every block.
        recompute_early_stop: With ``recompute`` op, torch's early stop of the non-reentrant recompute (it ends at
            w2, the last op whose autograd node saves a tensor); False (torchtitan's ``early_stop`` default) re-runs
            the block's forward to its end, the second residual add too (``op_sac.recompute``).
        data_parallel_size: Data-parallel replicas (ranks are identical: one is built). With > 1 the
            gradients are reduced over the ``dp`` group (see ``build_gpt_step``).
        zero_stage: DeepSpeed ZeRO stage with data parallelism: 0 (DDP all-reduce), 1 (optimizer
            state and master weights sharded), 2 (+ gradients sharded after a reduce-scatter), 3 (+
            parameters sharded; needs ``sharding`` with strategy ``zero3``).
        sharding: ZeRO-3, FSDP or Megatron distributed-optimizer sharding (``sharding.ShardingSpec``;
            ``None``: DDP or ZeRO-1/2 as ``zero_stage`` says).
        ddp_first_bucket_bytes: First DDP gradient bucket cap, bytes (PyTorch 1 MiB).
        ddp_bucket_cap_bytes: Other DDP bucket caps, bytes (PyTorch ``bucket_cap_mb`` 25 MiB).
        overlap_grad_reduce: Reduce buckets during backward (else all after backward; ZeRO-2/3: each still from
            the backward hook, the compute stream waiting for it, as DeepSpeed without ``overlap_comm``).
        gradient_as_bucket_view: DDP gradients are views of the bucket buffer (no extra copy).
        reduce_bucket_elements: ZeRO-1/2 gradient bucket, elements (DeepSpeed ``reduce_bucket_size``).
        zero_ipg_buffers: DeepSpeed ZeRO-1/2 IPG gradient buffers of ``reduce_bucket_elements`` each
            (``contiguous_gradients``; ``_GptBuilder._ipg_alloc``): 2 with ``overlap_comm``, else 1; 0: none
            (``contiguous_gradients: false``, or optimizer offload, whose buffers are not modelled).
        tensor_parallel_size: Megatron tensor-parallel ranks ``t`` (one rank is built; its TP
            collectives run over the ``tp`` group).
        sequence_parallel: Megatron ``--sequence-parallel`` (with ``t > 1``).
        num_query_groups: K/V head groups ``g`` (Megatron ``--num-query-groups`` with
            ``--group-query-attention``; ``None``: ``a``, plain multi-head attention; 1: multi-query).
        swiglu: Gated MLP (Megatron ``--swiglu``): fc1 is ``h -> 2f`` and ``silu(a) * b`` feeds fc2.
        normalization: One of ``NORMALIZATIONS`` (RMSNorm: one weight, no bias, whatever ``bias`` says).
        position_embedding: One of ``POSITION_EMBEDDINGS`` (``rope``: no position table; rotary kernels
            on q and k; ``none``: no table and no position kernel, ALiBi / NoPE).
        max_position_embeddings: Rows of the learned position table (``None``: ``seq_length``).
        qkv_bias: The QKV projection has a bias even without ``bias`` (Megatron ``--add-qkv-bias``; Qwen2).
        pipeline_parallel_size: Pipeline ranks ``p`` (Megatron ``--pipeline-model-parallel-size``); one
            rank's graph is built (``pipeline_rank``), its send/recv ops meet the other ranks' in the engine.
        pipeline_rank: The pipeline rank built, ``0..p-1``.
        virtual_pipeline_size: Model chunks per pipeline rank ``v`` (interleaved schedule).
        pipeline_schedule: One of ``pipeline.SCHEDULES``.
        pipeline_layers: Layers per model chunk, ``p v`` numbers summing to ``num_layers`` (``None``: even).
        tp_comm_overlap: ``none``; ``overlap`` (Megatron-LM ``--tp-comm-overlap``, Transformer Engine
            userbuffers: the sequence-parallel all-gather before a column-parallel GEMM and the reduce-scatter
            after a row-parallel GEMM run beside that GEMM, chunk by chunk, and interfere with it as any
            collective does); ``fused`` (one fused GEMM + collective kernel, Triton-distributed / async-TP:
            the same overlap without taking SMs or HBM bandwidth from the GEMM). Needs sequence parallelism.
        tp_async_grad_reduce: Megatron-LM's asynchronous backward of the column-parallel layers (qkv, fc1, the
            LM head; ``--no-async-tensor-model-parallel-allreduce`` turns it off, Megatron-LM 2021 on; the 2020
            code has it not): without sequence parallelism the input gradient's all-reduce runs beside the
            weight-gradient GEMM and the bias gradient (``ColumnParallelLinearWithAsyncAllreduce``); with it
            (and ``tp_comm_overlap`` none) the layer input is saved as its ``1 / t`` sequence shard, all-gathered
            again beside the input-gradient GEMM for the weight gradient, and the input gradient
            reduce-scattered beside the weight-gradient GEMM (``ColumnParallelLinearWithSequenceParallelism``;
            NVIDIA/Megatron-LM @02bb1f5 ``megatron/mpu/layers.py``). The compute stream waits for the
            collective after the bias gradient (``handle.wait()``), before the fp32 gradient accumulation.
            False: the 2020 behaviour (the reduction blocks the compute stream after the layer's backward; the
            gathered input is saved). Not applied to MoE shared experts, LoRA, sequence parallelism under
            ``amp_fp32_params`` or fp8 (the blocking backward is built), nor to a deferred (zero-bubble) weight
            gradient (the reduction blocks: nothing to run beside).
        fp8: Megatron-LM ``--fp8-format`` (``hybrid``, ``e4m3``; ``None``: no fp8): the blocks' Linear GEMMs in
            fp8 under Transformer Engine with per-tensor delayed scaling; ``fp8_amax_history_len`` its amax history.
        fp8_weight_copies: Bytes per element of Transformer Engine's cached fp8 weight workspace of each block
            Linear, one per cached copy: 2 where fp8 GEMMs are TN-only (the fp8 weight for the forward GEMM and its
            transpose for the input-gradient GEMM: Hopper, Ada, ROCm; ``GpuSpec.fp8_gemm_tn_only``), 1 where the
            GEMM reads the one copy either way (Blackwell, delayed scaling). Resident for the whole run (Megatron's
            TELinear passes ``is_first_microbatch``: ``_fp8_operands``).
        fp8_param_gather: Megatron-LM ``--fp8-param-gather`` (Transformer Engine ``fp8_model_init``; needs ``fp8``
            and Megatron's optimizer, a dense model): the block Linear weights are fp8 parameters (``Float8Tensor``:
            1 B per element in Megatron's uint8 param buffer, plus the transpose where ``fp8_weight_copies`` is 2)
            in place of the bf16 weights and their cached fp8 workspace; the step casts the fp32 master shard to
            fp8 and the parameter all-gather moves 1 B per fp8 element (``_GptBuilder._copy_main_params_to_fp8``).
        num_experts: Routed experts ``E`` of every block's MLP (Megatron ``--num-experts``; ``None``: dense
            MLP). The MoE layer is built by ``simulator.graph.builders.moe``.
        moe_router_topk: Experts per token ``k`` (Megatron ``--moe-router-topk``, default 2).
        moe_ffn_hidden_size: Width of one expert ``f_e`` (``None``: ``ffn_hidden_size``).
        moe_shared_expert_intermediate_size: Width of the shared expert run on every token (``None``: none).
        moe_expert_capacity_factor: Expert capacity factor ``c`` (token dropping; ``None``: dropless).
        moe_router_load_balancing_type: ``aux_loss`` (Switch-style auxiliary loss) or ``none``.
        expert_parallel_size: Expert-parallel ranks ``ep`` (Megatron ``--expert-model-parallel-size``): each
            rank holds ``E / ep`` experts; EP ranks lie inside the data-parallel dimension.
        moe_tokens_per_expert: Routed tokens per expert, ``E`` non-negative counts or fractions (``None``:
            balanced routing); the rank built is the busiest EP rank (``moe.expert_tokens``).
        expert_tensor_parallel_size: Ranks ``etp`` each expert's width is split over (Megatron
            ``--expert-tensor-parallel-size``; the grid etp-ep-edp spans the tp x dp ranks of a stage).
        moe_shared_expert_gate: A sigmoid gate ``[h, 1]`` scales the shared expert's output (Qwen2-MoE).
        moe_layer_pattern: 1 (MoE) or 0 (dense MLP of ``ffn_hidden_size``) per block (Megatron
            ``--moe-layer-freq`` as a list; ``None``: every block is MoE).
        moe_grouped_gemm: The local experts run as grouped GEMMs (Megatron ``--moe-grouped-gemm``, ``GroupedMLP``
            / ``TEGroupedMLP``); false: one MLP per local expert, one after another on its token slice
            (``SequentialMLP``: ``simulator.graph.builders.moe_experts``).
        moe_token_dispatcher_type: ``alltoall`` (``MoEAlltoAllTokenDispatcher``) or ``allgather``
            (``MoEAllGatherTokenDispatcher``: ``simulator.graph.builders.moe_allgather``).
        moe_router_dtype: Megatron ``--moe-router-dtype`` (``None``: the model dtype; ``fp32``): the dtype of the
            routing probabilities (``moe_probs_bytes``).
        kv_channels: Head dimension ``d`` (Megatron ``--kv-channels``; ``None``: ``h / a``). With ``a d != h``
            (Qwen3, Gemma, Mistral-Nemo) the QKV projection is ``h x (a d + 2 g d)`` and the output projection
            ``a d x h``.
        window_size: Sliding-window attention (Mistral; Beltagy et al., *Longformer*, 2020): each query
            attends to its ``window_size`` most recent keys, itself included (the Hugging Face
            ``sliding_window``); ``None``: full causal attention.
        lora: LoRA fine-tune (``lora.LoraSpec``): base weights frozen, adapters trained; ``None``: every
            parameter is trained.
        causal: Causal (decoder) attention; false: bidirectional, every query scores all ``s`` keys (ViT).
        vit: A vision transformer (``vit.VitShape``): patch embedding and classification head in place of the
            token embedding and LM head (``vocab_size`` unused); ``None``: a decoder.
        attention_backend: ``flash`` (one flash-attention kernel), ``flash_varlen`` (the same kernel between
            flash-attn's unpad / pad helpers, llm-foundry's MPT: ``simulator/graph/builders/varlen.py``) or
            ``unfused`` (Megatron-LM 2020-2022: batched
            GEMMs, fused causal softmax, dropout; ``simulator.graph.builders.attention``).
        attention_dropout: Attention-probability dropout rate (Megatron ``--attention-dropout``; kernels and
            masks with ``unfused``; inside the flash kernel, not priced, with ``flash``: the run's warnings say so,
            ``attention.flash_dropout_note``).
        hidden_dropout: Dropout rate after the projection and fc2 (Megatron ``--hidden-dropout``, fused with the
            residual add: 1-byte masks saved for backward); 0: none.
        cross_entropy: The LM head's loss (``CROSS_ENTROPY_IMPLS``): ``pytorch`` (``F.cross_entropy`` on the
            fp32 logits: log-softmax and NLL, three fp32 logits-sized tensors live in backward), ``megatron`` or
            ``megatron_fused`` (Megatron-LM's ``_VocabParallelCrossEntropy``, without or with
            ``--cross-entropy-loss-fusion``: the same memory, fewer passes fused; one fp32 copy of the logits made
            softmax in place, saved, and turned into the gradient in place; ``_GptBuilder._loss_fwd``).
        qkv_separate: q, k and v come from separate projections (torchtitan's ``wq`` / ``wk`` / ``wv``, Hugging
            Face's ``q_proj`` / ``k_proj`` / ``v_proj``): with flash attention and rope no contiguous copy of V
            (``simulator/graph/builders/qkv_layout.py``); false: Megatron / Transformer Engine's fused QKV.
        repeat_kv: torchtitan's ``repeat_kv``: with grouped K/V heads, k and v are copied out to the query heads
            before the flash kernel and their gradients summed back (``qkv_layout.py``; needs flash and rope).
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
    clip_grad: float | None = None
    clip_grad_norm_call: bool = False
    accumulate_allreduce_grads_in_fp32: bool = False
    grad_reduce_in_bf16: bool = False
    deepspeed_bf16_optimizer: bool = False
    deepspeed_fp16_optimizer: bool = False
    recompute: str = "none"
    recompute_every: int = 1
    recompute_early_stop: bool = False
    data_parallel_size: int = 1
    zero_stage: int = 0
    ddp_first_bucket_bytes: int = 1 << 20
    ddp_bucket_cap_bytes: int = 25 << 20
    overlap_grad_reduce: bool = True
    gradient_as_bucket_view: bool = False
    reduce_bucket_elements: int = 500_000_000
    zero_ipg_buffers: int = 0
    tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    num_query_groups: int | None = None
    swiglu: bool = False
    normalization: str = "LayerNorm"
    position_embedding: str = "learned_absolute"
    max_position_embeddings: int | None = None
    qkv_bias: bool = False
    sharding: shd.ShardingSpec | None = None
    pipeline_parallel_size: int = 1
    pipeline_rank: int = 0
    virtual_pipeline_size: int = 1
    pipeline_schedule: str = "1f1b"
    pipeline_layers: tuple[int, ...] | None = None
    tp_comm_overlap: str = "none"
    tp_async_grad_reduce: bool = False
    context_parallel_size: int = 1
    cp_comm_type: str = "p2p"
    fp8: str | None = None
    fp8_amax_history_len: int = 1
    fp8_param_gather: bool = False
    fp8_weight_copies: int = 2
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_expert_capacity_factor: float | None = None
    moe_router_load_balancing_type: str = "aux_loss"
    expert_parallel_size: int = 1
    moe_tokens_per_expert: tuple[float, ...] | None = None
    expert_tensor_parallel_size: int = 1
    moe_shared_expert_gate: bool = False
    moe_layer_pattern: tuple[int, ...] | None = None
    moe_grouped_gemm: bool = True
    moe_token_dispatcher_type: str = "alltoall"
    moe_router_dtype: str | None = None
    kv_channels: int | None = None
    window_size: int | None = None
    lora: lora.LoraSpec | None = None
    causal: bool = True
    vit: vitb.VitShape | None = None
    attention_backend: str = "flash"
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    kernels: str = "fused"
    cross_entropy: str = "pytorch"
    qkv_separate: bool = False
    repeat_kv: bool = False

    def __post_init__(self) -> None:
        """Raises: ValueError: non-positive sizes, heads not dividing hidden, unknown modes, a tensor-parallel
        size not dividing the heads or the FFN, sequence parallelism with ``t`` not dividing ``s``, tensor
        parallelism with ``amp_fp32_params``."""
        if self.clip_grad is None:  # the framework's default (config.schema.clip_grad_of): 0 with FSDP or DeepSpeed
            fsdp = self.sharding is not None and self.sharding.unit_buckets
            object.__setattr__(self, "clip_grad", 0.0 if fsdp or self.zero_stage > 0 or self.deepspeed_bf16_optimizer
                               or self.deepspeed_fp16_optimizer else 1.0)
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
        if self.moe_router_dtype not in (None, "fp32"):  # moe_probs_bytes knows these only
            raise ValueError(f"moe_router_dtype must be None or 'fp32', got {self.moe_router_dtype!r}")
        if self.cross_entropy not in CROSS_ENTROPY_IMPLS:
            raise ValueError(f"cross_entropy must be one of {CROSS_ENTROPY_IMPLS}, got {self.cross_entropy!r}")
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
        if self.recompute_every < 1 or (self.recompute_every > 1 and self.recompute != "full"):
            raise ValueError(f"recompute_every must be >= 1 and 1 unless recompute is full, got {self.recompute_every}")
        if self.recompute_early_stop and self.recompute != "op":
            raise ValueError(f"recompute_early_stop is modelled with recompute op only, got {self.recompute!r}")
        if self.recompute == "op":
            op_sac.check_spec(self)
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0-3, got {self.zero_stage}")
        sh = self.sharding
        n_sh = self.grad_reduce_size
        if self.zero_stage == 3 and n_sh > 1 and (sh is None or sh.strategy != "zero3"):
            raise ValueError("zero_stage 3 with data parallelism needs sharding=ShardingSpec('zero3', ...)")
        if sh is not None and n_sh > 1:
            if sh.strategy == "zero3" and self.zero_stage != 3:
                raise ValueError("sharding strategy zero3 needs zero_stage 3")
            if sh.strategy != "zero3" and self.zero_stage:
                raise ValueError(f"sharding strategy {sh.strategy} excludes ZeRO stage {self.zero_stage}")
            if sh.shard_size * sh.replicate_size != n_sh:
                raise ValueError(f"shard_size x replicate_size ({sh.shard_size} x {sh.replicate_size}) must equal "
                                 f"data_parallel_size x context_parallel_size ({n_sh})")
            if sh.strategy == "no_shard" and self.tensor_parallel_size > 1:
                raise ValueError("no_shard with tensor parallelism is not modelled yet")
            if sh.strategy == "no_shard" and sh.grad_bytes == 2 and self.num_micro_batches > 1 and \
                    self.pipeline_parallel_size == 1:
                raise ValueError("NO_SHARD with a 16-bit reduce_dtype and gradient accumulation is not modelled yet")
            if sh.casts_units and self.pipeline_parallel_size > 1:
                raise ValueError("NO_SHARD with a 16-bit param_dtype and a pipeline is not modelled yet")
            if sh.strategy == "zero3" and self.precision == "amp_fp32_params":
                raise ValueError("ZeRO-3 is modelled with precision bf16 or fp16 (16-bit parameter partitions)")
            if sh.strategy == "distributed_optimizer" and self.precision == "amp_fp32_params":
                raise ValueError("the distributed optimizer is modelled with precision bf16 or fp16 (Megatron-LM)")
            if sh.unit_buckets and self.pipeline_parallel_size > 1 and (
                    self.virtual_pipeline_size > 1 or self.pipeline_schedule in SPLIT_BACKWARD
                    or self.tied_embeddings):
                raise ValueError("FSDP with a pipeline is modelled with one model chunk per rank, gpipe or 1f1b, "
                                 "untied embeddings (torch.distributed.pipelining ties no weights across stages)")
            if sh.unit_buckets and self.precision != "amp_fp32_params" and not self.fsdp2_full_precision:
                raise ValueError("FSDP is modelled with precision amp_fp32_params (fp32 sharded parameters under "
                                 "torch.autocast), or fp32 / tf32 with FSDP2 gathering fp32 parameters (param_bytes 4)")
        t = self.tensor_parallel_size
        if t > 1:
            for name, v in (("num_attention_heads", self.num_attention_heads),
                            ("ffn_hidden_size", self.ffn_hidden_size), ("num_query_groups", g)):
                if v % t:
                    raise ValueError(f"tensor_parallel_size ({t}) must divide {name} ({v})")
            if self.precision == "amp_fp32_params" and not self._fsdp:
                raise ValueError("tensor parallelism is modelled for Megatron precisions bf16 and fp16, not "
                                 "amp_fp32_params (torch.autocast; allowed with FSDP: PyTorch's 2-D FSDP + TP)")
        if self.sequence_parallel and t > 1 and self.seq_length % t:
            raise ValueError(f"sequence_parallel: tensor_parallel_size ({t}) must divide seq_length ({self.seq_length})")
        c = self.context_parallel_size
        if c < 1 or self.seq_length % (2 * c) and c > 1:
            raise ValueError(f"context_parallel_size {c}: 2 x {c} must divide seq_length {self.seq_length}")
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"cp_comm_type must be one of {CP_COMM_TYPES}, got {self.cp_comm_type!r}")
        if self.tp_comm_overlap not in TP_COMM_OVERLAP:
            raise ValueError(f"tp_comm_overlap must be one of {TP_COMM_OVERLAP}, got {self.tp_comm_overlap!r}")
        if self.tp_comm_overlap != "none" and not (self.sequence_parallel and t > 1):
            raise ValueError("tp_comm_overlap needs sequence_parallel with tensor_parallel_size > 1 (Megatron-LM)")
        if self.num_micro_batches > 1 and self.zero_stage == 2 and self.data_parallel_size > 1 and \
                moe.own_expert_grads(self):
            raise ValueError("ZeRO stage 2 with gradient accumulation and experts reduced over their own group "
                             "(expert_model_parallel_size > 1) is not modelled yet (allowed: stage 0 or 1, or no "
                             "accumulation)")
        if self.pipeline_schedule in SPLIT_BACKWARD and (self.tp_comm_overlap != "none" or self.lora is not None):
            raise ValueError(f"the {self.pipeline_schedule} schedule with tp_comm_overlap or LoRA is not modelled yet "
                             "(its W passes move the weight-gradient GEMMs those pair with)")
        if self.pipeline_schedule == "zero_bubble_v" and self.tied_embeddings:
            raise ValueError("the zero_bubble_v schedule needs untied embeddings (as its reference implementation)")
        p, v = self.pipeline_parallel_size, self.virtual_pipeline_size
        check_schedule(self.pipeline_schedule, p, self.num_micro_batches, v)
        if not 0 <= self.pipeline_rank < p:
            raise ValueError(f"pipeline_rank {self.pipeline_rank} outside 0..{p - 1}")
        split = self.layer_split
        if len(split) != p * v or sum(split) != self.num_layers or min(split) < 1:
            raise ValueError(f"pipeline_layers {list(split)} must be {p * v} numbers >= 1 (pipeline size x virtual "
                             f"stages) summing to num_layers {self.num_layers}")
        moe.check_moe_spec(self)
        lora.check_lora_spec(self)
        if not self.causal and self.window_size is not None:
            raise ValueError("window_size needs causal attention (a bidirectional window is not modelled)")
        if self.vit is not None:
            vitb.check_vit_spec(self)
        core.check_attention_spec(self)
        qkv_layout.check_qkv_layout(self)
        varlen.check_varlen_spec(self)
        hf.check_spec(self)
        if self.fp8_param_gather and (self.fp8 is None or not self.megatron_optimizer or self.num_experts):
            raise ValueError("fp8_param_gather needs fp8, Megatron's optimizer (bf16, no ZeRO / FSDP / LoRA) and a "
                             "dense model")
        if self.fp8_weight_copies not in (1, 2):
            raise ValueError(f"fp8_weight_copies must be 1 or 2 (the fp8 weight, and its transpose where fp8 GEMMs "
                             f"are TN-only), got {self.fp8_weight_copies}")
        if self.precision in FULL_PRECISIONS:
            if self.attention_backend != "unfused":
                raise ValueError(f"precision {self.precision} needs attention_backend unfused (flash attention has "
                                 "fp16 / bf16 kernels only)")
            if self.fp8 or self.num_experts or (self.sharding is not None and n_sh > 1
                                                 and not self.fsdp2_full_precision):
                raise ValueError(f"precision {self.precision} with fp8, experts, ZeRO-3, FSDP1, FSDP2 gathering "
                                 "16-bit parameters or the distributed optimizer is not modelled")

    # -- counts ----------------------------------------------------------------------------
    @property
    def fsdp2_full_precision(self) -> bool:
        """FSDP2 (``fully_shard``) gathering fp32 parameters (``MixedPrecisionPolicy(param_dtype=float32)``, the
        ``param_bytes`` 4 of its ``ShardingSpec``) under ``precision`` fp32 / tf32: no autocast, so every GEMM runs on
        the gathered fp32 weights and fp32 activations, at the fp32 rate or, with ``allow_tf32``, the TF32 one. What
        torchtitan runs with ``training.mixed_precision_param = "float32"``: its ``maybe_enable_amp`` enters no
        autocast when FSDP is on ("Mixed precision training is handled by fully_shard"; pytorch/torchtitan@000204a4
        torchtitan/train.py, torchtitan/distributed/utils.py), and ``apply_fsdp`` passes that dtype to
        ``MixedPrecisionPolicy(param_dtype=...)`` (pytorch/torchtitan@81c12433
        torchtitan/models/llama3/infra/parallelize.py)."""
        sh = self.sharding
        return (self.precision in FULL_PRECISIONS and sh is not None and sh.version == 2 and sh.param_bytes == 4
                and self.grad_reduce_size > 1)

    @property
    def fsdp2_bf16_params(self) -> bool:
        """FSDP2 (``fully_shard``) over fp32 sharded parameters gathering bf16 ones (``precision`` amp_fp32_params,
        ``MixedPrecisionPolicy(param_dtype=bfloat16)``: the ``param_bytes`` 2 of its ``ShardingSpec``), torchtitan's
        default ``mixed_precision_param = "bfloat16"``. No autocast runs: torchtitan's ``maybe_enable_amp`` returns a
        ``nullcontext`` when FSDP is on (pytorch/torchtitan@30b9ea0b torchtitan/distributed/utils.py), and fully_shard's
        mixed precision is per module, "low-precision activations are saved for backward and high-to-low-precision
        casts are incurred only at module boundaries" (pytorch/pytorch@01d5c2cc
        torch/distributed/fsdp/_fully_shard/_fsdp_api.py ``MixedPrecisionPolicy``; ``cast_forward_inputs=True`` casts
        each fully_shard module's floating inputs to bf16). So the residual stream, the norms and every activation
        are bf16, no Linear casts its input or weight, and the norms read and write bf16 (torchtitan's Llama uses
        ``nn.RMSNorm``, pytorch/torchtitan@018740b7 torchtitan/models/llama3/model/model.py, whose ``rms_norm``
        computes in fp32 and returns ``type_as(input)``, keeping an fp32 ``rstd``: pytorch/pytorch aten/src/ATen/
        native/layer_norm.cpp ``rms_norm_composite``). The loss upcasts the bf16 logits (``pred.float()`` in
        ``cross_entropy_loss``: pytorch/torchtitan@00a388d9 torchtitan/components/loss.py), as autocast did."""
        sh = self.sharding
        return (self.precision == "amp_fp32_params" and sh is not None and sh.version == 2 and sh.param_bytes == 2
                and self.grad_reduce_size > 1)

    @property
    def autocast(self) -> bool:
        """``torch.autocast`` runs the step (``amp_fp32_params`` except FSDP2 gathering bf16 parameters,
        ``fsdp2_bf16_params``): the residual stream and norms are fp32 and each Linear casts its fp32 input."""
        return self.precision == "amp_fp32_params" and not self.fsdp2_bf16_params

    @property
    def residual_bytes(self) -> int:
        """Bytes per element of the residual stream and the norms' inputs and outputs: 4 under autocast and with
        fp32 / tf32, else 2 (16-bit)."""
        return 4 if self.autocast or self.precision in FULL_PRECISIONS else 2

    @property
    def _fsdp(self) -> bool:
        """FSDP sharding (a strategy of ``sharding.STRATEGIES`` with per-unit buckets) over data parallelism."""
        return self.sharding is not None and self.sharding.unit_buckets and self.grad_reduce_size > 1

    @property
    def tp_async_backward(self) -> bool:
        """Megatron's asynchronous column-parallel backward is built (``tp_async_grad_reduce`` with TP, no LoRA;
        with sequence parallelism only for 16-bit inputs without ``tp_comm_overlap``: else the blocking one)."""
        sp = self.sequence_parallel and self.tensor_parallel_size > 1
        return self.tp_async_grad_reduce and self.tensor_parallel_size > 1 and self.lora is None and (
            not sp or (self.tp_comm_overlap == "none" and self.precision != "amp_fp32_params" and self.fp8 is None))

    @property
    def pipeline_step_end_sync(self) -> bool:
        """Every pipeline stage joins an all-reduce before its optimizer (``_GptBuilder._pipeline_syncs``): the
        gradient norm with ``clip_grad > 0`` (DeepSpeed ZeRO-1/2/3: whatever its value, ``grad_norm.deepspeed_zero_step``),
        else fp16's found-inf check; False with one stage, or bf16 without clipping (a stage that ends a step early
        starts the next one)."""
        fsdp = self.sharding is not None and self.sharding.unit_buckets  # FSDP's norm: over its own group only
        zero = self.grad_reduce_size > 1 and ((self.zero_stage in (1, 2) and self.sharding is None) or (
            self.zero_stage == 3 and self.sharding is not None and self.sharding.strategy == "zero3"))
        return self.pipeline_parallel_size > 1 and (
            (self.clip_grad > 0 and not fsdp) or self.precision == "fp16" or zero or self.deepspeed_bf16_optimizer
            or self.deepspeed_fp16_optimizer)

    @property
    def megatron_optimizer(self) -> bool:
        """Megatron-LM's mixed-precision optimizer runs the step: ``bf16`` / ``fp16`` outside DeepSpeed ZeRO and
        FSDP (DDP's contiguous grad buffer, or the distributed optimizer), no LoRA (PEFT: torch DDP). Megatron-LM
        ``Float16OptimizerWithFloat16Params`` / ``DistributedOptimizer`` (megatron/core/optimizer/optimizer.py,
        distrib_optimizer.py): the fused AdamW updates the fp32 main params, then ``_copy_main_params_to_model_params``
        casts them into the 16-bit model params; ``clip_grad_norm`` before it (``_GptBuilder._clip_grad_norm``) and
        the grad buffer's ``zero_grad_buffer`` before the step's first forward (``_GptBuilder._zero_grad_buffer``)."""
        sh = self.sharding if self.grad_reduce_size > 1 else None
        return (self.precision in MEGATRON_DDP_PRECISIONS and self.zero_stage == 0 and self.lora is None
                and not self.deepspeed_bf16_optimizer and not self.deepspeed_fp16_optimizer
                and (sh is None or sh.strategy == "distributed_optimizer"))

    @property
    def megatron_half_grads(self) -> bool:
        """Megatron's optimizer with a 16-bit contiguous grad buffer (``main_grad``), so the gradients are
        accumulated over the micro-batches and all-reduced (or reduce-scattered) in the parameters' dtype, 2 bytes
        per element: fp16 without ``--accumulate-allreduce-grads-in-fp32``, or bf16 with ``--grad-reduce-in-bf16``.
        Sources: NVIDIA/Megatron-LM megatron/arguments.py (2021-2022: ``--accumulate-allreduce-grads-in-fp32``
        store_true, forced on only with ``--bf16``), megatron/model/distributed.py ``_get_buffer_type``
        (``torch.float if accumulate_allreduce_grads_in_fp32 else param.dtype``); the 2020 code (apex-style
        FP16_Optimizer) kept the fp16 ``.grad`` and all-reduced it in fp16 too (``--fp32-allreduce`` off by
        default). NVIDIA/Megatron-LM@307dcf37 megatron/training/arguments.py ``validate_args``: under ``--bf16``,
        ``--grad-reduce-in-bf16`` sets ``accumulate_allreduce_grads_in_fp32 = False`` (overriding it), which
        becomes ``DistributedDataParallelConfig.grad_reduce_in_fp32`` (megatron/training/training.py), and the
        buffer's dtype is ``torch.float if grad_reduce_in_fp32 else param.dtype``
        (megatron/core/distributed/distributed_data_parallel.py); outside ``--bf16`` the flag is not read."""
        if not self.megatron_optimizer:
            return False
        return ((self.precision == "fp16" and not self.accumulate_allreduce_grads_in_fp32)
                or (self.precision == "bf16" and self.grad_reduce_in_bf16))

    @property
    def moe_probs_bytes(self) -> int:
        """Bytes per element of the MoE routing probabilities ``[T, E]`` and of what the dispatchers move or weigh with
        them: the logits' dtype, which is ``moe_router_dtype`` or else the model's (NVIDIA/Megatron-LM@005742ff
        ``megatron/core/transformer/moe/router.py`` ``Router.gating``: ``router_dtype = input.dtype`` unless
        ``moe_router_dtype`` is fp32 / fp64; @00611e6e ``moe_utils.py`` ``topk_routing_with_score_function``: "The final
        probs are casted to the same dtype as the logits"): 2 in bf16 / fp16, 4 with fp32."""
        if self.moe_router_dtype == "fp32":
            return 4
        return 4 if self.precision in FULL_PRECISIONS else 2

    @property
    def deepspeed_engine(self) -> bool:
        """DeepSpeed's engine runs backward and the step (ZeRO stage > 0, ``BF16_Optimizer`` or ``FP16_Optimizer``):
        Megatron-DeepSpeed then never all-reduces the sequence-parallel replicated gradients over the TP group
        (``_GptBuilder._sequence_parallel_grads``). Its ``train_step`` calls Megatron's ``reduce_model_grads``, the
        only holder of that all-reduce, under ``if not args.deepspeed``, and its pipeline path is DeepSpeed's
        ``train_batch`` (microsoft/Megatron-DeepSpeed@00caa0e9 ``megatron/training.py``; @3adb671f
        ``megatron/core/pipeline_parallel/schedules.py`` ``forward_backward_no_pipelining``: ``model.backward``,
        no gradient finalisation); DeepSpeed's engine reduces over the data-parallel group only
        (deepspeedai/DeepSpeed@007cca6a ``deepspeed/runtime/engine.py`` ``allreduce_gradients``). Seen by users:
        deepspeedai/Megatron-DeepSpeed issues #170 ("Not.") and #223 (LayerNorm weights differ across TP ranks
        after training with ``--sequence-parallel``)."""
        return self.zero_stage > 0 or self.deepspeed_bf16_optimizer or self.deepspeed_fp16_optimizer

    @property
    def zero_half_grads(self) -> bool:
        """DeepSpeed ZeRO-1/2 over data parallelism (no sharding spec) keeps the gradients in the model dtype,
        2 bytes in bf16 / fp16 (``ZERO_HALF_GRAD_PRECISIONS``); False: fp32 ``.grad`` (or the sharding spec's)."""
        return (self.sharding is None and self.zero_stage in (1, 2) and self.grad_reduce_size > 1
                and self.precision in ZERO_HALF_GRAD_PRECISIONS)

    @property
    def zero_ipg(self) -> tuple[int, bool]:
        """DeepSpeed ZeRO-1/2's IPG gradient buffers one rank holds (``_GptBuilder._init_ipg``; source
        microsoft/DeepSpeed@cde57d2 ``deepspeed/runtime/zero/stage_1_and_2.py``): ``(buffers, at_reduction)``,
        each buffer ``reduce_bucket_elements`` gradient elements. ``zero_ipg_buffers`` (``contiguous_gradients``: 1,
        2 with ``overlap_comm``) from the first backward on; ``at_reduction``: a pipeline stage without the LM head
        (whose backward DeepSpeed's PipelineEngine runs itself) holds one, only while the step's gradients are
        reduced. ``(0, False)`` without data-parallel ZeRO-1/2 (a sharding spec, one replica), with
        ``contiguous_gradients: false`` or optimizer offload (``zero_ipg_buffers`` 0)."""
        if self.sharding is not None or self.zero_stage not in (1, 2) or self.grad_reduce_size <= 1 \
                or not self.zero_ipg_buffers:
            return 0, False
        lazy = self.pipeline_parallel_size > 1 and not self.has_head
        return (1 if lazy else self.zero_ipg_buffers), lazy

    @property
    def sp_regathers_inputs(self) -> bool:
        """Sequence parallelism saves the column-parallel layers' ``1 / t`` input shards and gathers them again in
        backward (Megatron's re-gather, with ``tp_async_backward``); False: the gathered inputs are kept."""
        return self.tp_async_backward and self.sequence_parallel  # tp_async_backward needs tp > 1

    @property
    def grad_reduce_size(self) -> int:
        """Ranks the gradients are reduced over and ZeRO / FSDP / the distributed optimizer shard the model states
        over: ``dp x cp`` (Megatron's data-parallel group with context parallelism: the CP ranks hold other tokens
        of the same samples and the same parameters)."""
        return self.data_parallel_size * self.context_parallel_size

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
        if not self.causal:  # bidirectional (ViT): the full square
            return float(s * s)
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
        """Rows of the learned position table (0 with rotary embeddings or ``none``)."""
        if self.position_embedding != "learned_absolute":
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

    def _layer_params(self, experts: int, moe_layer: bool = True) -> int:
        """One block's parameters on a TP rank with ``experts`` routed experts (dense MLP without MoE or with
        ``moe_layer`` false: a dense block of a mixed model, ``moe_layer_pattern``)."""
        h, f, t = self.hidden_size, self.ffn_hidden_size, self.tensor_parallel_size
        qkv, fc1 = self.qkv_out_size, self.fc1_out_size
        if self.num_experts and moe_layer:
            mlp = moe.moe_rank_params(self, experts)
        else:
            mlp = (h * fc1 + f * h) // t
        w = (h * qkv + self.attention_width * h) // t + mlp
        b = (qkv // t + h + fc1 // t + h) if self.bias else (qkv // t if self.qkv_bias else 0)
        return w + b + 2 * self.norm_params

    @property
    def layer_split(self) -> tuple[int, ...]:
        """Layers per model chunk (``pipeline_layers``, else an even split: ``pipeline.uniform_split``)."""
        if self.pipeline_layers is not None:
            return tuple(self.pipeline_layers)
        return uniform_split(self.num_layers, self.pipeline_parallel_size * self.virtual_pipeline_size)

    @property
    def model_chunks(self) -> tuple[int, ...]:
        """Model chunks held by ``pipeline_rank``: ``c p + r`` for local chunk ``c``, or ZB-V's V
        (``pipeline.rank_chunks``)."""
        return rank_chunks(self.pipeline_schedule, self.pipeline_parallel_size, self.pipeline_rank,
                           self.virtual_pipeline_size)

    @property
    def rank_layers(self) -> int:
        """Transformer blocks held by this pipeline rank."""
        split = self.layer_split
        return sum(split[k] for k in self.model_chunks)

    @property
    def has_embedding(self) -> bool:
        """This pipeline rank holds the input embedding (model chunk 0)."""
        return self.pipeline_rank == 0

    @property
    def has_head(self) -> bool:
        """This pipeline rank holds the final norm, the LM head and the loss (the last model chunk: on the last
        rank, on rank 0 with ZB-V)."""
        return self.pipeline_parallel_size * self.virtual_pipeline_size - 1 in self.model_chunks

    @property
    def embedding_copy(self) -> bool:
        """The last pipeline rank keeps its own copy of the tied word embeddings for the LM head, whose
        gradient is all-reduced with the first rank's (Megatron-LM ``_allreduce_word_embedding_grads``)."""
        return self.tied_embeddings and self.pipeline_parallel_size > 1

    @property
    def rank_num_parameters(self) -> int:
        """Parameters held by this (tensor- and pipeline-parallel) rank: ``num_parameters`` with one
        pipeline rank; otherwise its blocks, plus the embeddings on the first rank, plus the final norm and
        the LM head (or the tied-embedding copy) on the last."""
        if self.pipeline_parallel_size == 1:
            return self.num_parameters
        h = self.hidden_size
        n = sum(self._layer_params(self.local_experts, moe.is_moe_layer(self, i)) for i in moe.rank_layer_ids(self))
        if self.has_embedding:
            n += self.vocab_per_rank * h + self.position_table_rows * h
        if self.has_head:
            n += self.norm_params + self.vocab_per_rank * h  # LM head, or the tied embedding's copy
        return n

    @property
    def local_experts(self) -> int:
        """Routed experts held by one rank, ``E / ep`` (0 without MoE)."""
        return (self.num_experts or 0) // self.expert_parallel_size

    def _params(self, experts: int) -> int:
        h = self.hidden_size
        if self.vit is not None:  # patch embedding, CLS, positions, head (vit.vit_params)
            return vitb.vit_params(self, self.num_layers * self._layer_params(experts))
        emb = self.vocab_per_rank * h + self.position_table_rows * h
        head = 0 if self.tied_embeddings else self.vocab_per_rank * h
        n_moe = moe.moe_layer_count(self, range(self.num_layers))
        blocks = n_moe * self._layer_params(experts) + (self.num_layers - n_moe) * self._layer_params(experts, False)
        return emb + blocks + self.norm_params + head

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
        moe_rep = (self.num_experts + (1 if self.moe_shared_expert_gate else 0)) * h if self.num_experts else 0
        n_moe = moe.moe_layer_count(self, moe.rank_layer_ids(self)) if self.num_experts else 0
        return (self.rank_layers * (2 * ln + (2 * h if self.bias else 0)) + n_moe * moe_rep
                + (ln if self.has_head else 0))

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
        dense = (3 if self.swiglu else 2) * h * f
        # active weights only: router + k experts (+ shared expert), see moe_mlp_params; dense blocks of a mixed model
        mlp = moe.moe_mlp_params(self, self.moe_router_topk) if self.num_experts else dense
        n_moe = moe.moe_layer_count(self, range(self.num_layers)) if self.num_experts else 0
        # causal attention per token: 2 (QK^T) + 2 (PV) FLOPs x d per (query, key) pair and head
        att = 4 * self.attention_width * self.attention_pairs / s
        per_token_layer = 2 * (h * self.qkv_out_size + self.attention_width * h + mlp) + att
        if self.vit is not None:  # patch embedding and head per image, fwd + bwd (vit.embed_head_flops)
            return (3.0 * s * self.num_layers * per_token_layer + vitb.embed_head_flops(self)) / self.tensor_parallel_size
        per_token_dense = 2 * (h * self.qkv_out_size + self.attention_width * h + dense) + att
        fwd = s * (n_moe * per_token_layer + (self.num_layers - n_moe) * per_token_dense + 2 * h * V)
        return 3.0 * fwd / self.tensor_parallel_size  # per GPU: a TP rank does 1/t of the sample


def model_facts(s: TransformerSpec) -> ModelFacts:
    """The ``ModelFacts`` of a spec: what the policies and the pipeline summary read of the built model.

    ``upload_groups``: embeddings (token table ``V_p / t`` rows + the learned position table, none with rope),
    each block ``layer_params``, head (final norm ``norm_params`` + an untied LM head ``V_p / t`` rows): the
    ZeRO-Offload upload copies (was ``offload_optimizer.layer_param_groups``, which priced a position table for
    rope models too)."""
    h = s.hidden_size
    groups = [("embed", -1, s.vocab_per_rank * h + s.position_table_rows * h)]
    groups += [(f"L{i}", i, s.layer_params) for i in range(s.num_layers)]
    groups.append(("head", -1, s.norm_params + (0 if s.tied_embeddings else s.vocab_per_rank * h)))
    return ModelFacts(precision=s.precision, recompute=s.recompute, num_parameters=s.num_parameters,
                      num_layers=s.num_layers, layer_params=s.layer_params, upload_groups=tuple(groups),
                      tied_embeddings=s.tied_embeddings, data_parallel_size=s.data_parallel_size,
                      rank_layers=s.rank_layers,
                      num_micro_batches=s.num_micro_batches)


def build_gpt_step(spec: TransformerSpec, stamp: bool = True, blocks: bool = False, fold_tp: bool = False,
                   prefold: bool | None = None, waits_fold: bool | None = None) -> OpGraph:
    """Build one training step (all micro-batches and the optimizer) for one GPU.

    Args:
        spec: Model and per-GPU batch description.
        stamp: Emit each distinct block pass (forward, recompute, backward) once and stamp copies of it for
            the other layers and micro-batches (``simulator.graph.builders.stamp``; the same graph, built
            faster). False: every pass kernel by kernel (the reference the stamping tests compare with).
        blocks: For ``run.fidelity: layer``: stamp those copies as their layer blocks (``stamp_blocks``, folding
            blocking TP collectives where ``fold_tp``), so that ``simulator.graph.blocks.coarsen`` of the graph is
            the one it makes of the kernel-level graph; where ``stamp_blocks.check`` finds a pass for which it
            would not be, the kernel-level graph is built instead. ``meta["layer_blocks"]`` records
            ``{"stamped": passes stamped as blocks, "kernel_build": None or why the kernel-level graph was built}``.
        prefold: With ``fold_tp`` (default: ``fold_tp``): stamp the passes that qualify with their TP collectives
            beside compute folded too (``simulator.graph.side_blocks``), so that ``fold_overlapped_tp(coarsen(...))``
            of the graph is the one made of the kernel-level graph; where ``stamp_blocks.check`` fails the graph is
            built again without (``meta["layer_blocks"]["prefold"]``: None or why).
        waits_fold: With ``prefold`` (default: ``prefold``): a forward saving sequence parallelism's shard for
            the backward's asynchronous re-gather is stamped with its TP collectives folded across the shard's
            producer where the backward of the same layer and micro-batch class (last, first) was last stamped
            with its TP collectives folded (so the re-gather is folded there too), or, before any backward of its
            class, where that class is neither the first micro-batch's nor the chunk's last (``_block_fwd``;
            ``Stamper.run(waits_fold)``, ``stamp_blocks`` check 5 verifies it); where the check fails the graph is
            built again without (``meta["layer_blocks"]["waits_fold"]``: None or why).

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
      DDP docs: the view "saves memory equal to the total gradients size"). In bf16 / fp16 (Megatron's
      DDP, ``MEGATRON_DDP_PRECISIONS``) the gradients are views of the buckets too.
    * ZeRO 1/2 (Rajbhandari et al., *ZeRO*, SC20, section 7: 2Psi communication per step for
      P_os and P_os+g, as DP's all-reduce): DeepSpeed's buckets (``reduce_bucket_size``
      elements, flushed before a gradient that would overflow them) are reduce-scattered; Adam
      state (8 bytes/param) and fp32 master weights (bf16 mode) are divided by dp (ceil), as are
      the optimizer kernel's traffic and FLOPs; stage 2 keeps only the reduced 1/dp shard of each
      bucket (the full gradients live until their bucket's reduce-scatter ends, in DeepSpeed's IPG
      buffers with ``contiguous_gradients``: ``_GptBuilder._init_ipg``); before the optimizer kernel DeepSpeed's
      step computes the gradient norm, copies the partition to fp32 and unscales it (fp16: after its overflow
      check; ``simulator.graph.builders.grad_norm.deepspeed_zero_step``); after the step
      the updated parameters (model dtype) are all-gathered in one call per param group (``ZERO_PARAM_ALL_GATHER``,
      ``zero_param_groups``: weight decay, no weight decay). The rest of the step (the partition's gradient views,
      its flatten, fp32 copy and copy back) is priced as one flat group: per group DeepSpeed pads and partitions
      each group's flat buffer on its own and runs those kernels per group (a few more launches, not counted).
    * ZeRO-3, FSDP and the Megatron-LM distributed optimizer (``spec.sharding``): per-unit parameter
      all-gathers with prefetch, per-unit / per-bucket gradient reduce-scatters and sharded states,
      through the hooks ``_gather_layer_params`` / ``_release_layer_params``
      (``simulator/graph/builders/sharding.py`` documents the schedule and its sources); ZeRO-3's step runs its
      fp16 overflow check, per-partition fp64 norm, fp32 copy and unscale before the optimizer kernel
      (``grad_norm.deepspeed_zero_step`` with ``stage3``).
    * DeepSpeed's BF16_Optimizer (``spec.deepspeed_bf16_optimizer``: a DeepSpeed pipeline with ZeRO stage 0 and
      bf16): ``simulator/graph/builders/bf16_optimizer.py`` (states, per-micro-batch accumulation, one bf16
      all-reduce, its step), in place of Megatron's DDP and optimizer.
    * DeepSpeed's FP16_Optimizer (``spec.deepspeed_fp16_optimizer``: ZeRO stage 0 with fp16, or bf16 without a
      pipeline): ``simulator/graph/builders/fp16_optimizer.py`` (states, the engine's bucketed 16-bit all-reduce
      after the last backward, its step), in place of Megatron's DDP and optimizer.

    Returns:
        The step graph; ``samples_per_step`` counts all data-parallel replicas;
        ``param_groups`` lists every parameter tensor (their ``numel`` sum to ``num_parameters``).
    """
    prefold = fold_tp if prefold is None else prefold and fold_tp
    waits_fold = prefold if waits_fold is None else waits_fold and prefold
    b = _GptBuilder(spec, stamp, blocks and stamp, fold_tp, prefold, waits_fold)
    graph = b.build()
    b.stamper.state = None  # the stamper's bound method closes a cycle through the builder and every op it made
    if not blocks:
        return graph
    inst = b.stamper.instances
    why = stamp_blocks.check(graph.ops, inst) if stamp else "stamping off"
    if why is not None and waits_fold and any(i.bt.waits_folded for i in inst):
        graph = build_gpt_step(spec, stamp, blocks, fold_tp, prefold=prefold, waits_fold=False)
        return graph.with_changes(meta={**graph.meta, "layer_blocks": {**graph.meta["layer_blocks"],
                                                                       "waits_fold": why}})
    if why is not None and prefold and any(i.bt.prefold for i in inst):
        graph = build_gpt_step(spec, stamp, blocks, fold_tp, prefold=False)
        return graph.with_changes(meta={**graph.meta, "layer_blocks": {**graph.meta["layer_blocks"], "prefold": why}})
    if why is not None:
        graph = build_gpt_step(spec, stamp)
    return graph.with_changes(meta={**graph.meta, "layer_blocks": {"stamped": 0 if why else len(inst),
                                                                   "kernel_build": why, "prefold": None,
                                                                   "waits_fold": None}})


#: DeepSpeed ZeRO-1/2's parameter all-gathers after the step, one op per param group (``zero.param_all_gather.<k>``):
#: ``step`` calls ``all_gather_dp_groups``, which issues one ``all_gather_into_tensor`` of each whole flat 16-bit
#: param group (``bit16_groups_flat``, one per ``optimizer.param_groups`` entry: ``zero_param_groups``) when the
#: backend has it (``dist.has_all_gather_into_tensor()``: torch.distributed with ``all_gather_into_tensor``, torch
#: >= 1.13); only without it does DeepSpeed fall back to ``dist.all_gather`` calls in ``allgather_bucket_size``
#: chunks, not modelled (deepspeedai/DeepSpeed@e466bd53 ``deepspeed/runtime/utils.py`` ``all_gather_dp_groups`` /
#: ``all_gather_into_tensor_dp_groups``: ``for group_id, ...: dist.all_gather_into_tensor(group_flat, ...)``). The
#: current behaviour is modelled: ``allgather_bucket_size`` has no effect.
ZERO_PARAM_ALL_GATHER = "zero.param_all_gather"


def no_weight_decay(name: str) -> bool:
    """Parameter ``name`` (a ``ParamGroup`` name, ``L<layer>.<module>.<weight|bias>`` or ``<module>.<...>``) is in
    the no-weight-decay group: a bias or a norm's weight, the builder's 1-D tensors (the norms are ``ln1``, ``ln2``,
    ``ln_f``: ``_norm_bwd``). Megatron-DeepSpeed's rule (microsoft/Megatron-DeepSpeed@8fd352da
    ``megatron/optimizer/__init__.py`` ``_get_params_for_weight_decay_optimization``: LayerNorm parameters and
    biases without weight decay, the rest with it; later ``get_param_groups``: ``name.endswith(".bias") or
    len(param.shape) == 1``) and Hugging Face's Trainer's (``get_decay_parameter_names``: biases and norm weights
    excluded)."""
    parts = name.split(".")
    return parts[-1] == "bias" or (len(parts) >= 2 and parts[-2] in ("ln1", "ln2", "ln_f"))


def zero_param_groups(numels: Sequence[tuple[str, int]]) -> list[int]:
    """Elements of each non-empty param group DeepSpeed's ZeRO-1/2 flattens, in ``optimizer.param_groups`` order:
    the weight-decay group, then the no-weight-decay one (``no_weight_decay``), from ``(name, elements)`` of the
    rank's parameters. Both Megatron-DeepSpeed and Hugging Face's Trainer hand DeepSpeed these two groups
    (Megatron-DeepSpeed@8fd352da ``get_megatron_optimizer``: ``if args.deepspeed: return optimizer`` over
    ``param_groups``); an empty one gets no flat buffer here (the groups: ``fp16_optimizer.param_groups``)."""
    return [sum(g) for g in fp16opt.param_groups(numels) if sum(g) > 0]
#: Precisions whose DeepSpeed ZeRO-1/2 gradients (``.grad``, the IPG buckets, their reduce-scatter and the reduced
#: partition) are 16-bit: DeepSpeed's ``engine.get_data_types`` makes the gradient accumulation dtype the model
#: dtype under ZeRO unless ``data_types.grad_accum_dtype`` is set, ``communication_data_type`` defaults to
#: bf16 / fp16 with ``bf16`` / ``fp16`` enabled, and ``stage_1_and_2.DeepSpeedZeroOptimizer`` (``self.dtype``, the
#: parameters' dtype) holds the IPG buffer and the gradient partition in it; BF16_Optimizer is chosen for ZeRO-1 only
#: with ``grad_accum_dtype: fp32``, not modelled (ZeRO-0 + bf16 + a pipeline's is: ``bf16_optimizer.py``) (deepspeedai/DeepSpeed master, 2025:
#: ``deepspeed/runtime/engine.py``, ``deepspeed/runtime/zero/stage_1_and_2.py``). The optimizer still reads fp32.
ZERO_HALF_GRAD_PRECISIONS = ("bf16", "fp16")

#: Precisions whose data parallelism without ZeRO is Megatron-LM's ``DistributedDataParallel`` (16-bit parameters, fp32
#: master weights): its gradients are ``main_grad`` views of one contiguous fp32 grad buffer (the DDP buckets), with
#: gradient accumulation fusion writing the weight gradients into it (NVIDIA/Megatron-LM
#: ``megatron/core/distributed/distributed_data_parallel.py``, ``param_and_grad_buffer.py``). ``amp_fp32_params`` is
#: PyTorch DDP: fp32 ``.grad`` tensors beside the buckets unless ``gradient_as_bucket_view``.
MEGATRON_DDP_PRECISIONS = ("bf16", "fp16")


class _GptBuilder:
    def __init__(self, spec: TransformerSpec, stamp: bool = True, blocks: bool = False, fold_tp: bool = False,
                 prefold: bool = False, waits_fold: bool = False):
        self.s = spec
        self.b = GraphBuilder()
        self.e = KernelEmitter(self.b)
        #: fp32 parameters without a master copy (``amp_fp32_params``, with or without autocast)
        self.amp = spec.precision == "amp_fp32_params"
        #: torch.autocast casts each Linear's fp32 input (not under FSDP2 gathering bf16 parameters)
        self.autocast = spec.autocast
        self.act = spec.residual_bytes  # bytes per element of the residual stream / LayerNorm
        #: fp32 / tf32: everything fp32 (PyTorch without autocast; tf32: torch.backends.cuda.matmul.allow_tf32)
        self.full = spec.precision in FULL_PRECISIONS
        self.w = 4 if self.full else 2  # bytes per element of the GEMM operands and activations between them
        self.cp = spec.context_parallel_size
        #: tokens of one micro-batch on this rank (``s / c`` of each sequence with context parallelism)
        self.T = spec.micro_batch_size * spec.seq_length // self.cp
        self.grad_made: set[str] = set()
        self.last_mb = False
        self.groups: list[ParamGroup] = []
        # gradients are reduced over the data x context parallel ranks (CP ranks hold other tokens of a sequence)
        self.dp = spec.grad_reduce_size > 1
        self.zero = spec.zero_stage if self.dp else 0
        # DDP with gradient_as_bucket_view, or Megatron's DDP (bf16 / fp16): the gradients are views of the persistent
        # buckets (Megatron-LM DistributedDataParallel: param.main_grad views its contiguous fp32 grad buffer, the
        # weight-gradient GEMMs accumulate into it; no separate .grad). A separate fp32 .grad beside the buffer
        # counted 4 bytes per parameter twice (GPT 6.7B PP2 x DP8: 86.05 GB, out of memory, against 72.22 GB)
        self._grads_in_buckets = self.dp and self.zero == 0 and not spec.deepspeed_bf16_optimizer and (
            not spec.deepspeed_fp16_optimizer) and (
            spec.gradient_as_bucket_view or (spec.precision in MEGATRON_DDP_PRECISIONS and spec.lora is None))  # PEFT: torch DDP
        #: BF16_Optimizer: the weight gradients each backward made, for its update_hp_grads (bf16_optimizer.py)
        self._bf16_ready: list[tuple[str, int, int, str | None]] | None = (
            [] if spec.deepspeed_bf16_optimizer else None)
        self.overlap = spec.overlap_grad_reduce
        self._bucket: list[ParamGroup] = []
        self._buckets: list[tuple[ParamGroup, ...]] = []  # closed, not yet emitted (overlap off)
        self._limits = ((spec.ddp_first_bucket_bytes,) if self.zero == 0 else ())
        self.comm_ops: list[int] = []
        self.grad_shards: list[str] = []
        self.fp16 = spec.precision == "fp16"
        #: the fp32 softmax tensors saved by ``_megatron_loss_fwd`` (their backward is ``_megatron_loss_bwd``)
        self._megatron_ce: set[str] = set()
        self.fp8 = spec.fp8 is not None
        self._fp8_w: dict[tuple[int, str], str] = {}  # (layer, Linear) -> its cached fp8 weight workspace
        self._fp8_ws: dict[str, int] = {}  # workspace -> bytes (persistent: _fp8_operands)
        self.e.half = "fp16" if self.fp16 else (spec.precision if self.full else "bf16")
        self.tp = spec.tensor_parallel_size
        self.sp = spec.sequence_parallel and self.tp > 1
        #: Megatron's asynchronous column-parallel backward (``tp_async_grad_reduce``); with sequence parallelism
        #: the layer input is saved as its shard and gathered again (16-bit inputs only: TP needs bf16 / fp16)
        self._async_grad = spec.tp_async_backward
        self._regather = spec.sp_regathers_inputs
        #: tokens of the LayerNorm / residual region on this rank (``T / t`` with sequence parallelism)
        self.Tn = self.T // self.tp if self.sp else self.T
        self.tp_ops: list[int] = []  # TP collectives the optimizer waits for (SP LayerNorm grads, found-inf)
        self._init_sharding()
        self._init_ipg()
        st = self.sh.strategy if self.sh is not None else None
        # ZeRO-2/3 and FSDP reduce every micro-batch's gradients (DeepSpeed: the ipg buckets of each backward;
        # FSDP outside no_sync()); the others once per step, after the last micro-batch. FSDP under a pipeline
        # (torch.distributed.pipelining: set_requires_gradient_sync(False) until the step's last backward) too
        pp_fsdp = spec.pipeline_parallel_size > 1 and self.sh is not None and self.sh.unit_buckets
        self._every_mb = spec.num_micro_batches > 1 and not pp_fsdp and (
            self.zero == 2 or st not in (None, "distributed_optimizer"))
        #: the full gradients are freed by their reduce-scatter, so each micro-batch allocates them again
        self._fresh_grads = self._every_mb and st != "no_shard"
        self._partials: list[tuple[str, int]] = []  # reduced shards of this micro-batch to add into the step's
        self._bwd_comm_start = 0
        self.n_chunks = spec.pipeline_parallel_size * spec.virtual_pipeline_size  # model chunks
        self.received: dict[tuple, str] = {}  # pipeline transfers received, not yet read by their pass
        self.outgoing: dict[tuple, str] = {}  # pipeline transfers produced, not yet sent
        self._last_call: list[int] = []  # ops of the previous point-to-point call
        self._detached: list[int] = []  # sends only the step's end waits for (ZB-V)
        self._overlapped: list[int] = []  # TP all-gathers running beside the next GEMM (tp_comm_overlap)
        self.moe_grad_ops: list[int] = []  # expert-gradient all-reduces over the edp group (moe.reduce_expert_grad)
        self.lora_adapters = lora.rank_adapters(spec) if spec.lora is not None else []
        #: zero_bubble_h1/_h2/_v: the weight-gradient work of the current B pass, and of each B pass until its W
        self._deferred: list | None = None
        self._w_queue: dict[tuple[int, int], list] = {}
        # stamping (stamp.py): not where a pass reads per-layer state its key does not hold (ZeRO-3/FSDP and
        # Megatron parameter gathers, fp8 weight copies, MoE routing per layer); LoRA's passes (adapter weights named
        # after the layer, module names in what they save) not as layer blocks (``stamp_blocks.check`` refuses them)
        self.stamper = Stamper(self.e, self._stamp_state, enabled=stamp and self.sh is None
                               and (spec.lora is None or not blocks) and not self.fp8 and spec.num_experts is None,
                               blocks=blocks, fold_tp=fold_tp,
                               prefold=prefold, effects=(self._effects_mark, self._effects_of, self._effects_replay))
        self._grad_layers: set[int] = set()  # layers whose gradients exist (a backward ran)
        #: ``build_gpt_step(waits_fold)``: (layer, last, first micro-batch) -> whether that backward was last stamped
        #: with its TP collectives folded (``Stamper.last_prefold``); (chunk, micro-batch) -> its backward's ``last``
        self._waits_fold = waits_fold and blocks
        self._bwd_folded: dict[tuple, bool] = {}
        self._bwd_last: dict[tuple[int, int], bool] = {}

    def _stamp_state(self) -> tuple:
        """The bookkeeping a stamped pass must leave as it is (``Stamper``): sizes of every collection a pass
        may add to."""
        return (len(self.grad_made), len(self.groups), len(self.comm_ops), len(self.tp_ops), len(self._bucket),
                len(self._buckets), len(self._fp8_w), len(self.moe_grad_ops), len(self._partials),
                len(self.grad_shards), len(self.b._persistent), len(self.received), len(self.outgoing),
                len(self._overlapped), len(self.lora_adapters), self._deferred is None,
                len(getattr(self, "hf_gelu_saved", ())))  # hf_eager's gelu_new saves (hf_eager.gelu_fwd)

    def _effects_mark(self) -> frozenset[str]:
        """What ``_effects_of`` compares a recorded pass's gradients with: the gradient tensors made so far."""
        return frozenset(self.grad_made)

    def _effects_of(self, made_before: frozenset[str], before: tuple, after: tuple, start: int, end: int,
                    layer: int) -> tuple | None:
        """The effects of a block pass on the bookkeeping (``Stamper``) that a stamp of it replays
        (``_effects_replay``), or None where it has others: only gradients marked made (``grad_made``) and parameter
        groups finished (``groups``) by ops of the pass (``start..end - 1``), all of ``layer`` and named after it
        (``stamp.layer_name_parts``); none while a BF16_Optimizer lists every backward's gradients or gradients are
        made per micro-batch (their names hold it)."""
        if before[2:] != after[2:] or self._bf16_ready is not None or self._fresh_grads:
            return None
        made = [layer_name_parts(n, layer) for n in self.grad_made - made_before]
        if None in made:
            return None
        prefix, groups = f"L{layer}.", []
        for g in self.groups[before[1]:]:
            tensor = None if g.grad_tensor is None else layer_name_parts(g.grad_tensor, layer)
            if g.layer != layer or not g.name.startswith(prefix) or not start <= g.grad_op < end or (
                    tensor is None and g.grad_tensor is not None):
                return None
            groups.append((g.name[len(prefix):], g.numel, g.grad_bytes_per_element, g.grad_op - start, tensor))
        return tuple(made), tuple(groups)

    def _effects_replay(self, effects: tuple, layer: int, start: int) -> None:
        """``_effects_of``'s effects for a stamp of the pass for ``layer`` whose first op is ``start``."""
        made, groups = effects
        prefix = f"L{layer}."
        self.grad_made.update([f"{h}{prefix}{t}" for h, t in made])
        self.groups.extend([ParamGroup(prefix + n, numel, layer, gb, start + r,
                                       None if tensor is None else f"{tensor[0]}{prefix}{tensor[1]}")
                            for n, numel, gb, r, tensor in groups])

    def _pass_key(self, kind: tuple) -> tuple:
        """What shapes a block pass besides its inputs: its kind and phase; for a backward, the micro-batch's
        flags that the gradient bookkeeping reads (last micro-batch, first, per-micro-batch reduction, the layer's
        gradients made)."""
        e = self.e
        if kind[0] != "bwd":
            return kind, e.phase
        return kind, e.phase, self.last_mb, self._every_mb, self._mb == 0, e.layer in self._grad_layers

    def _block_fwd(self, x: str, save: bool, selective: bool) -> tuple[str, dict]:
        """``_layer_fwd`` through the stamper; folded across the saved shard (``waits_fold``) where the backward of
        its class was last stamped with the re-gather folded, or, for a class not built yet (the pipeline's warm-up
        forwards), where it is neither the first micro-batch's nor its chunk's last backward (whose re-gathers the
        gradient bookkeeping keeps as ops): a guess ``stamp_blocks`` check 5 verifies (``build_gpt_step(waits_fold)``
        builds again without where it was wrong)."""
        if self._overlapped or self._deferred is not None:
            return self._layer_fwd(x, save, selective)
        cls = self._bwd_class()
        fold = self._waits_fold and save and self._regather and self._bwd_folded.get(cls, not cls[1] and not cls[2])
        return self.stamper.run(self._pass_key(("fwd", save, selective)), self.e.layer,
                                lambda x_: self._layer_fwd(x_, save, selective), (x,), waits_fold=fold)

    def _bwd_class(self) -> tuple:
        """The current layer and micro-batch's backward as ``_bwd_folded`` keys it: layer, whether it is the last
        backward of its chunk, whether the micro-batch is the first."""
        return self.e.layer, self._bwd_last.get((self._chunk, self._mb), True), self._mb == 0

    def _block_bwd(self, gx: str, sv: dict) -> str:
        """``_layer_bwd`` through the stamper."""
        if self._overlapped or self._deferred is not None:
            out = self._layer_bwd(gx, sv)
        else:
            out = self.stamper.run(self._pass_key(("bwd",)), self.e.layer, self._layer_bwd, (gx, sv))
            self._bwd_folded[self._bwd_class()] = self.stamper.last_prefold
        self._grad_layers.add(self.e.layer)
        return out

    # -- helpers ---------------------------------------------------------------------------
    def _linear_fwd(self, name: str, x: str, in_dim: int, out_dim: int, x_fp32: bool, save: bool,
                    tokens: int | None = None, groups: int = 1, parts: tuple[int, ...] = ()):
        """Autocast Linear: (cast input) + cast weight + GEMM (+bias in the epilogue).

        ``tokens`` rows (default ``T``); ``groups > 1``: a grouped GEMM of ``groups`` weights ``[in, out]``
        over ``tokens`` rows in all (the MoE experts), priced as one GEMM of the stacked rows. ``parts``: output
        widths summing to ``out_dim`` (separate projections priced as one GEMM, ``qkv_layout``): the GEMM writes one
        tensor per part and the first return value is their tuple."""
        e = self.e
        T = self.T if tokens is None else tokens
        W = groups * in_dim * out_dim
        w16 = self._weight16(name, W)
        xin = x
        if self.autocast and x_fp32:
            xin = e.fresh(f"{name}.in16")
            e.kernel(f"{name}.cast_in", C.CAST, reads=4 * T * in_dim, writes=2 * T * in_dim,
                     out=[(xin, 2 * T * in_dim)], uses=[x], dtype="fp32")
        outs = [(e.fresh(f"{name}.out"), self.w * T * p) for p in (parts or (out_dim,))]
        y = outs[0][0]
        if self.fp8 and e.layer >= 0:  # Transformer Engine fp8 Linear
            xin, w16 = self._fp8_operands(name, xin, w16, T * in_dim, W)
            e.kernel(f"{name}.gemm", C.GEMM, flops=2 * T * in_dim * out_dim, shape=(T, out_dim, in_dim),
                     reads=T * in_dim + W, writes=2 * T * out_dim, out=[(y, 2 * T * out_dim)], uses=[xin, w16],
                     dtype="fp8")
        else:
            beta = hf.addmm_bias_copy(self, name, T, out_dim)  # Conv1D's addmm on PyTorch 1.10 (hf_eager only)
            e.kernel(f"{name}.gemm", C.GEMM, flops=2 * T * in_dim * out_dim, shape=(T, out_dim, in_dim),
                     reads=self.w * (T * in_dim + W + (T * out_dim if beta else 0)), writes=self.w * T * out_dim,
                     out=outs, uses=[xin, w16, *([beta] if beta else [])])
        self._after_overlapped_gemm()
        ad = lora.adapter_fwd(self, name, x, x_fp32, y, save) if self.s.lora is not None else None
        for t, _ in outs[1:]:  # the parts are ready when the first is (after its adapters' add)
            e.producer[t] = e.producer[y]
        return (tuple(t for t, _ in outs) if parts else y), (xin, w16, ad) if save else ()

    def _weight16(self, name: str, W: int) -> str:
        """The 16-bit weight a Linear ``name`` of ``W`` elements multiplies by: under autocast its fp32 weight cast
        (one kernel, 4 B read and 2 B written per element), else the parameter or the gathered ZeRO-3/FSDP unit."""
        e = self.e
        wg = self.pg.weight(e.layer, e.phase) if self.pg is not None else None  # ZeRO-3/FSDP gathered unit
        w16 = e.fresh(f"{name}.w16")  # drawn either way (the tensor numbering stays that of every other kernel)
        if self.amp and not (wg is not None and self.sh.param_bytes == 2):
            e.kernel(f"{name}.cast_w", C.CAST, reads=4 * W, writes=2 * W, out=[(w16, 2 * W)], uses=[wg] if wg else [],
                     dtype="fp32")
            return w16
        return wg or f"param.{name}"

    def _fp8_meta_bytes(self, tensors: int) -> int:
        """Bytes of the delayed-scaling state of ``tensors`` fp8 tensors: an fp32 amax history of
        ``fp8_amax_history_len`` entries, a scale and its inverse each (Transformer Engine ``FP8TensorMeta``)."""
        return 4 * tensors * (self.s.fp8_amax_history_len + 2)

    def _fp8_scale_update(self, forward: bool) -> None:
        """End of a micro-batch's forward (inputs and weights) or backward (output gradients) of the fp8 blocks:
        Transformer Engine's fused amax-history roll and scale update over every fp8 tensor of the pass
        (``DelayedScaling``: scales from the amax history; Megatron-LM ``--fp8-amax-history-len``, default 1). One
        fp8 Linear per weight copy of this step (``_fp8_w``); the cross-rank amax all-reduce is not modelled
        (flagged in ``warnings``)."""
        if not self.fp8 or not self._fp8_w:
            return
        n = (2 if forward else 1) * len(self._fp8_w)
        nbytes = self._fp8_meta_bytes(n)
        self.e.kernel("fp8.amax_scale_update", C.ELEMENTWISE, reads=nbytes, writes=nbytes, flops=2 * n, dtype="fp32")

    def _fp8_operands(self, name: str, x: str, w: str, x_numel: int, w_numel: int) -> tuple[str, str]:
        """fp8 copies of a GEMM's input (quantized here: 2 bytes read, 1 written per element) and weight.

        The weight goes into Transformer Engine's cached workspace of the module, ``fp8_weight_copies`` bytes per
        element, resident for the whole run (declared persistent by ``build``, category ``workspace``; made by
        the first step's first forward in a real run, which no peak precedes): Megatron-Core's TELinear passes
        ``is_first_microbatch`` (True on the step's first micro-batch: ``set_is_first_microbatch`` in
        ``forward_step``, NVIDIA/Megatron-LM@00611e6e megatron/core/pipeline_parallel/schedules.py; None only
        with ``disable_parameter_transpose_cache``, NVIDIA/Megatron-LM@d086a2e3
        megatron/core/extensions/transformer_engine.py), so Transformer Engine keeps the workspace in the
        module's cache (``_fp8_workspaces["weight"]``, module/base.py ``get_weight_workspace``; TE 1.x: the
        persistent ``weight1_fp8`` / ``weight1_t_fp8`` buffers, NVIDIA/TransformerEngine@3ec87875
        transformer_engine/pytorch/module/linear.py ``get_fp8_weights_scratchpad``) and refreshes it in place
        on the first micro-batch only. The transpose, where kept, is written eagerly in the forward by the same
        cast (linear.py ``fp8_cast_transpose_fused(..., cast_out=weight_fp8, transpose_out=weight_t_fp8)`` when
        grad is enabled; TE 2.x: the weight quantizer's columnwise usage), not lazily in backward, so the
        quantize kernel writes every copy; Blackwell reads the one copy in both layouts (NVIDIA/TransformerEngine
        @073d3fd7 transformer_engine/pytorch/tensor/storage/float8_tensor_storage.py ``update_usage`` drops the
        transpose when non-TN GEMMs are supported)."""
        e = self.e
        xq = e.fresh(f"{name}.x_fp8")
        e.kernel(f"{name}.fp8_quantize_x", C.CAST, reads=2 * x_numel, writes=x_numel, out=[(xq, x_numel)], uses=[x])
        key = (e.layer, name)
        wq = self._fp8_w.get(key)
        if wq is None and self.s.fp8_param_gather:  # the fp8 parameter itself (params.fp8): no cast, no workspace
            wq = self._fp8_w[key] = "params.fp8"
        if wq is None:
            wq = self._fp8_w[key] = f"workspace.fp8_weight.L{e.layer}.{name}"
            self._fp8_ws[wq] = self.s.fp8_weight_copies * w_numel
            # the GEMMs reading the workspace wait for the cast (no allocation: it is persistent)
            e.producer[wq] = e.kernel(f"{name}.fp8_quantize_w", C.CAST, reads=2 * w_numel, writes=self._fp8_ws[wq],
                                      uses=[w])
        return xq, wq

    def _linear_bwd(self, name: str, g: str, saved: tuple, in_dim: int, out_dim: int, g_fp32: bool,
                    tokens: int | None = None, groups: int = 1, tp_reduce: str | None = None):
        """Input-gradient and weight-gradient GEMMs, bias gradient, fp32 grad accumulation (``tokens``,
        ``groups``: as ``_linear_fwd``; the grouped weight gradient is ``groups`` GEMMs ``(out, in,
        tokens / groups)``, priced as one of ``groups * out`` rows).

        ``tp_reduce``: a column-parallel layer, whose input gradient is reduced over the TP group under that
        name (``_tp_reduce``; returned reduced): asynchronously beside the weight gradient with
        ``tp_async_grad_reduce`` (and, with sequence parallelism, the saved input shard gathered again beside the
        input-gradient GEMM), else blocking after the layer's backward."""
        e = self.e
        T = self.T if tokens is None else tokens
        W = groups * in_dim * out_dim
        xin, w16 = saved[:2]
        async_ = tp_reduce is not None and self._async_grad
        if async_ and self._regather:  # the 1/t shard saved in forward (_save_shard): gathered beside the dgrad GEMM
            xin = self._tp_gather_beside(f"{name}.input", xin, self.w * T * in_dim)
        keep = []
        if self.pg is not None:  # ZeRO-3/FULL_SHARD: read the parameters gathered again for backward
            w16 = self.pg.backward_weight(w16)
            # fp32 gathered parameters under autocast: the GEMM reads the bf16 copy saved in forward, but FSDP
            # keeps the unit's unsharded flat parameter (kept from forward by SHARD_GRAD_OP, else gathered
            # again) until its post-backward reshard (torch/distributed/fsdp/_runtime_utils.py _post_backward_hook)
            live = self.pg.weight(e.layer, e.phase)
            keep = [live] if live is not None and live != w16 else []
        gin = g
        if g_fp32 and self.autocast:
            gin = e.fresh(f"{name}.g16")
            e.kernel(f"{name}.cast_grad", C.CAST, reads=4 * T * out_dim, writes=2 * T * out_dim,
                     out=[(gin, 2 * T * out_dim)], uses=[g], dtype="fp32")
        dx = e.fresh(f"{name}.dx")
        q = self.w  # operand bytes
        gdt = None
        if self.fp8 and e.layer >= 0:  # the output gradient quantized (e5m2 with hybrid), then fp8 GEMMs
            gq = e.fresh(f"{name}.g_fp8")
            e.kernel(f"{name}.fp8_quantize_grad", C.CAST, reads=2 * T * out_dim, writes=T * out_dim,
                     out=[(gq, T * out_dim)], uses=[gin])
            gin, q, gdt = gq, 1, "fp8"
        dg = e.kernel(f"{name}.dgrad", C.GEMM, flops=2 * T * in_dim * out_dim, shape=(T, in_dim, out_dim),
                      reads=q * (T * out_dim + W), writes=self.w * T * in_dim,
                      out=[(dx, self.w * T * in_dim)], uses=[gin, w16, *keep], dtype=gdt)
        self._after_overlapped_gemm()
        if self.s.lora is not None:  # frozen base weight: no weight or bias gradient (lora.py)
            dx = lora.adapter_bwd(self, gin, saved[2] if len(saved) > 2 else None, dx)
            return self._tp_reduce(tp_reduce, dx) if tp_reduce is not None else dx
        pending: list[int] = []  # the asynchronous reduction the compute stream waits for after the bias gradient
        if async_:
            dx, rid = self._tp_reduce_beside(tp_reduce, dx, dg)
            pending.append(rid)
            if self._deferred is not None:  # zero-bubble: the weight gradient runs later, nothing to hide behind
                e.wait_for.extend(pending)
                pending.clear()

        def weight_grads() -> None:
            dw = e.fresh(f"{name}.dw16")
            e.kernel(f"{name}.wgrad", C.GEMM, role=OpRole.WEIGHT_GRAD, flops=2 * T * in_dim * out_dim,
                     shape=(groups * out_dim, in_dim, -(-T // groups)), reads=q * (T * out_dim + T * in_dim),
                     writes=self.w * W, out=[(dw, self.w * W)], uses=[gin, xin], dtype=gdt)
            head = self.e.layer < 0 and name in ("wte", "lm_head")  # no LM-head bias parameter (num_parameters)
            if self.s.bias or (name == "qkv" and self.s.qkv_bias):
                bid = e.kernel(f"{name}.bias_grad", C.REDUCTION, role=OpRole.BIAS_GRAD, reads=self.w * T * out_dim,
                               writes=4 * out_dim, uses=[gin])
                if not head:
                    self._grad_ready(f"{name}.bias", out_dim, bid)
            e.wait_for.extend(pending)  # Megatron handle.wait(): before the main_grad accumulation hook
            wid, gname = self._accumulate_grad(name, dw, W)
            if name != "wte" or not self.s.has_embedding:  # the tied wte gradient is finished by embed.grad_accum
                self._grad_ready(f"{name}.weight", W, wid, gname)

        self._weight_grads(weight_grads)
        if tp_reduce is not None and not async_:
            dx = self._tp_reduce(tp_reduce, dx)
        return dx

    def _weight_grads(self, fn) -> None:
        """Emit the weight-gradient work ``fn()`` now, or, in a ``B`` pass of a ``SPLIT_BACKWARD`` schedule, keep it
        (with its layer) for the pass's ``W`` action (``_weight``)."""
        if self._deferred is None:
            fn()
        else:
            self._deferred.append((self.e.layer, fn))

    def _weight(self, chunk: int, mb: int, last_pass: bool) -> None:
        """The ``W`` action of a ``SPLIT_BACKWARD`` schedule: the weight gradients the ``B`` pass of (``chunk``,
        ``mb``) kept, in the order backward produced them; ``last_pass``: the chunk's gradients are then complete."""
        e = self.e
        self.last_mb, self._chunk, self._mb = last_pass, self.s.model_chunks[chunk], mb
        e.phase = Phase.BWD
        for layer, fn in self._w_queue.pop((chunk, mb)):
            e.layer = layer
            fn()
        e.layer = -1
        self._end_of_backward()

    def _accumulate_grad(self, pname: str, dw16: str, numel: int) -> None:
        """Cast a bf16 weight gradient into the fp32 ``.grad`` (allocate on first write)."""
        gname = f"grad.L{self.e.layer}.{pname}" if self.e.layer >= 0 else f"grad.{pname}"
        if self._fresh_grads:  # freed by the micro-batch's reduce-scatter: a new tensor per micro-batch
            gname += f".mb{self._mb}"
        first = gname not in self.grad_made
        gb = self._grad_elem_bytes  # 4: fp32 .grad / main_grad; ZeRO-3 16-bit, FSDP reduce_dtype
        in_ipg = self._in_ipg(numel) and not (pname.startswith("experts.") and moe.own_expert_grads(self.s))
        out = [(gname, gb * numel)] if first and not (self._grads_in_buckets or in_ipg) else []
        if first:
            self.grad_made.add(gname)
        reads = self.w * numel + (0 if first else gb * numel)
        i = self.e.kernel(f"{pname}.grad_accum", C.CAST if first else C.ELEMENTWISE, role=OpRole.GRAD_ACCUM,
                          reads=reads,
                          writes=gb * numel, out=out, uses=[dw16, self._ipg] if in_ipg else [dw16], dtype="fp32")
        return i, gname

    def _norm_fwd(self, name: str, x: str, role: OpRole = OpRole.NONE) -> tuple[str, str]:
        """LayerNorm / RMSNorm over ``[T_n, h]``. Returns ``(output, statistics)``: the fp32 per-token mean and
        ``rstd`` (LayerNorm, 8 B a token) or ``rstd`` alone (RMSNorm, 4 B), which the backward reads, so they live
        until ``_norm_bwd`` (pytorch/pytorch aten/src/ATen/native/layer_norm.cpp ``native_layer_norm`` returns
        ``(out, mean, rstd)`` and its backward takes ``mean, rstd``; NVIDIA/TransformerEngine ``rmsnorm_fwd`` keeps
        ``rsigma`` for ``rmsnorm_bwd``)."""
        e, T, h = self.e, self.Tn, self.s.hidden_size
        y, st = e.fresh(f"{name}.out"), e.fresh(f"{name}.stats")
        stats = 8 * T if self.s.normalization == "LayerNorm" else 4 * T  # fp32 mean + rstd, or rstd only (RMSNorm)
        e.kernel(f"{name}", C.NORM, role=role, reads=self.act * T * h, writes=self.act * T * h,
                 out=[(y, self.act * T * h), (st, stats)], uses=[x], dtype="fp32")
        return y, st

    def _norm_bwd(self, name: str, g: str, x: str, g_is_bf16: bool, stats: str | None = None):
        """Backward of ``_norm_fwd`` from ``g``; ``x`` its input, ``stats`` its statistics (read by the input- and
        weight-gradient kernels; None: none kept). Returns the input gradient."""
        e, T, h = self.e, self.Tn, self.s.hidden_size
        gin = g
        if self.autocast and g_is_bf16:
            gin = e.fresh(f"{name}.g32")
            e.kernel(f"{name}.cast_grad", C.CAST, reads=2 * T * h, writes=4 * T * h,
                     out=[(gin, 4 * T * h)], uses=[g], dtype="fp32")
        dx = e.fresh(f"{name}.dx")
        st = [stats] if stats else []
        e.kernel(f"{name}.dgrad", C.NORM, reads=2 * self.act * T * h, writes=self.act * T * h,
                 out=[(dx, self.act * T * h)], uses=[gin, x, *st], dtype="fp32")
        if self.s.lora is not None:  # frozen norm weights: no dgamma / dbeta
            return dx
        nb = self.s.norm_has_bias

        def weight_grads() -> None:
            i = e.kernel(f"{name}.dgamma_dbeta" if nb else f"{name}.dgamma", C.REDUCTION, role=OpRole.NORM_GRAD,
                         reads=2 * self.act * T * h, writes=(8 if nb else 4) * h, uses=[gin, x, *st], dtype="fp32")
            self._grad_ready(f"{name}.weight", h, i)
            if nb:
                self._grad_ready(f"{name}.bias", h, i)

        self._weight_grads(weight_grads)
        return dx

    def _add(self, name: str, a: str, b_: str, a_bytes: int, b_bytes: int, out_bytes: int, held=()):
        """Elementwise ``a + b_`` over ``[T_n, h]`` (bytes per element of each); ``held``: tensors kept alive until
        it runs (read by nothing: torchtitan's per-op checkpoint storage, ``op_sac.py``). Returns the sum."""
        e, T, h = self.e, self.Tn, self.s.hidden_size
        y = e.fresh(f"{name}.out")
        e.kernel(name, C.ELEMENTWISE, reads=(a_bytes + b_bytes) * T * h, writes=out_bytes * T * h,
                 out=[(y, out_bytes * T * h)], uses=[a, b_, *held], dtype="fp32")
        return y

    # -- tensor parallel ---------------------------------------------------------------------
    def _tp_op(self, name: str, op: str, nbytes: int, uses=(), out=(), deps=(), dtype: str | None = None,
               after=None, fused: bool = False, group: str = "tp") -> int:
        """A blocking collective over the ``tp`` group (or ``group``: ``ep`` for the MoE all-to-alls) on stream
        ``comm.<group>`` (``nbytes``: the per-rank buffer of an all-reduce or all-to-all, the whole
        gathered/scattered array of an all-gather/reduce-scatter).

        As a synchronous ``torch.distributed`` call (ProcessGroupNCCL): it starts after every kernel issued
        before it on the compute stream (``after``: these ops instead, to run beside the last kernel), and the
        next compute kernel waits for it (Megatron 2020: no overlap of TP communication with compute).
        ``fused``: part of a fused GEMM + collective kernel (no interference with the GEMM)."""
        e = self.e
        meta = {"collective": op, "bytes": int(nbytes), "group": group}
        if fused:
            meta["fused_gemm"] = True
        i = e.kernel(f"{group}.{name}", C.OTHER, kind=OpKind.COLLECTIVE, stream=f"comm.{group}", reads=float(nbytes),
                     uses=uses, out=out, deps=[*deps, *(after if after is not None else [e.last_compute])],
                     dtype=dtype, meta=meta)
        e.wait_for.append(i)
        return i

    def _after_overlapped_gemm(self) -> None:
        """After a GEMM that ran beside a TP all-gather (``tp_comm_overlap``): the next kernel waits for it."""
        if self._overlapped:
            self.e.wait_for.extend(self._overlapped)
            self._overlapped = []

    def _tp_reduce(self, name: str, x: str, beside_gemm: bool = True) -> str:
        """Sum the partial ``[T, h]`` output of a row-parallel GEMM (or a column-parallel input gradient)
        over the TP ranks: an in-place all-reduce, or a reduce-scatter to ``T / t`` tokens with sequence
        parallelism. The compute stream waits for it. Returns the reduced tensor (identity at ``t = 1``)."""
        if self.tp == 1:
            return x
        return self._tp_reduce_op(name, x, beside_gemm=beside_gemm)[0]

    def _tp_reduce_beside(self, name: str, x: str, gemm: int) -> tuple[str, int]:
        """``_tp_reduce`` of the input gradient ``x`` of a column-parallel layer, issued right after its
        input-gradient GEMM ``gemm`` and not waited for by the next compute kernel (Megatron's asynchronous
        all-reduce / reduce-scatter beside the weight-gradient GEMM, ``tp_async_grad_reduce``). Returns the
        reduced tensor and the collective's id (the caller makes the compute stream wait for it)."""
        y, i = self._tp_reduce_op(name, x, after=[gemm])
        self.e.wait_for.remove(i)
        return y, i

    def _tp_reduce_op(self, name: str, x: str, beside_gemm: bool = False, after: list[int] | None = None
                      ) -> tuple[str, int]:
        """The collective of ``_tp_reduce`` / ``_tp_reduce_beside`` (``nbytes = w T h``): an in-place all-reduce of
        ``x`` (which it then produces), or with sequence parallelism a reduce-scatter into a new ``[T / t, h]``
        tensor. ``beside_gemm`` with ``tp_comm_overlap``: the reduce-scatter runs beside the GEMM producing ``x``,
        chunk by chunk (after that GEMM's inputs, not reading ``x`` as one tensor); else it starts after ``after``
        (default: the last compute kernel). Returns the reduced tensor and the collective's id; the compute
        stream waits for it (``_tp_op``)."""
        e = self.e
        nbytes = self.w * self.T * self.s.hidden_size
        if not self.sp:
            i = e.producer[x] = self._tp_op(f"{name}.all_reduce", "all_reduce", nbytes, uses=[x], after=after)
            return x, i
        y = e.fresh(f"{name}.rs")
        out = [(y, nbytes // self.tp)]
        if self.s.tp_comm_overlap != "none" and beside_gemm:
            i = self._tp_op(f"{name}.reduce_scatter", "reduce_scatter", nbytes, out=out,
                            after=list(self.b.ops[e.producer[x]].deps), fused=self.s.tp_comm_overlap == "fused")
        else:
            i = self._tp_op(f"{name}.reduce_scatter", "reduce_scatter", nbytes, uses=[x], out=out, after=after)
        return y, i

    def _tp_gather_beside(self, name: str, x: str, nbytes: int) -> str:
        """Sequence parallelism with ``tp_async_grad_reduce``: all-gather the saved ``1 / t`` shard ``x`` of a
        column-parallel layer's input (``nbytes`` the gathered array) beside the input-gradient GEMM issued
        next; only the weight-gradient GEMM reading the result waits for it (Megatron ``_all_gather_base(...,
        async_op=True)`` in the column-parallel backward). Returns the gathered tensor."""
        y, i = self._tp_gather_op(name, x, nbytes)
        self.e.wait_for.remove(i)
        return y

    def _save_shard(self, saved: tuple, shard: str) -> tuple:
        """What a column-parallel layer saves for backward under sequence parallelism with
        ``tp_async_grad_reduce``: its input's ``1 / t`` shard ``shard`` in place of the gathered input (Megatron
        saves the shard and gathers it again in backward; Korthikanti et al. 2023, section 4.2.2, the ``2 s b h /
        t`` LayerNorm outputs of eq. 2). Else ``saved`` unchanged."""
        if not (saved and self._regather):
            return saved
        self.stamper.waited_later(shard)  # the backward's all-gather on comm.tp waits for it (stamp_blocks)
        return (shard, *saved[1:])

    def _tp_gather(self, name: str, x: str, before_gemm: bool = True) -> str:
        """Sequence parallelism: all-gather the ``[T / t, h]`` 16-bit shard ``x`` into ``[T, h]`` before a
        column-parallel GEMM (forward) or a row-parallel backward. Identity without it."""
        if not self.sp:
            return x
        y, i = self._tp_gather_op(name, x, self.w * self.T * self.s.hidden_size,
                                  fused=self.s.tp_comm_overlap == "fused" and before_gemm)
        if self.s.tp_comm_overlap != "none" and before_gemm:  # the GEMM reading y runs beside it, chunk by chunk
            self.e.wait_for.remove(i)
            self.e.producer[y] = self.e.producer.get(x, -1)
            self._overlapped.append(i)
        return y

    def _tp_gather_op(self, name: str, x: str, nbytes: int, fused: bool = False) -> tuple[str, int]:
        """The all-gather of ``_tp_gather`` / ``_tp_gather_beside``: shard ``x`` into a new tensor of ``nbytes``
        (the gathered array), after the last compute kernel (``fused``: inside a fused GEMM + collective kernel).
        Returns the gathered tensor and the collective's id; the compute stream waits for it (``_tp_op``)."""
        y = self.e.fresh(f"{name}.ag")
        return y, self._tp_op(f"{name}.all_gather", "all_gather", nbytes, uses=[x], out=[(y, nbytes)], fused=fused)

    # -- rotary embeddings -----------------------------------------------------------------
    def _rope_fwd(self, qkv: str, width: int) -> str | None:
        """Rotary embedding of q and k (Su et al., *RoFormer*, 2021, eq. 34; Megatron
        ``apply_rotary_pos_emb``): elementwise ``x cos + rotate_half(x) sin`` over the ``[T, width]``
        16-bit q and k (``width = h / t + g d / t``), memory-bound: reads q, k and the fp32 ``[s, d]``
        cos/sin tables, writes the rotated q, k (saved for the attention backward). ``None`` without rope."""
        if self.s.position_embedding != "rope":
            return None
        return self._rope_kernel("rope", "rope.qk", qkv, width)

    def _rope_bwd(self, g_qkv: str | list[str], width: int) -> str:
        """Backward of ``_rope_fwd`` (the inverse rotation of dq, dk: same traffic); returns the QKV gradient."""
        if self.s.position_embedding != "rope":
            return g_qkv
        return self._rope_kernel("rope.dgrad", "rope.dx", g_qkv, width)

    def _rope_kernel(self, name: str, out: str, src: str | list[str], width: int, parts: tuple[int, ...] = ()):
        """One rotation pass over ``[T, width]`` 16-bit elements (forward or backward: the same traffic) reading
        ``src`` (a tensor, or several). Returns its output, or with ``parts`` (widths summing to ``width``) one
        output tensor per part (q and k apart), as a tuple."""
        e, s = self.e, self.s
        n = self.T * width
        w = self.w
        ys = [(e.fresh(out), w * self.T * p) for p in parts] if parts else [(e.fresh(out), w * n)]
        e.kernel(name, C.ELEMENTWISE, reads=w * n + 2 * 4 * s.seq_length * s.head_dim, writes=w * n,
                 flops=3 * n, out=ys, uses=[src] if isinstance(src, str) else src)
        return tuple(y for y, _ in ys) if parts else ys[0][0]

    def _contiguous_v(self, qkv: str, kv: int) -> str:
        """V's contiguous copy, ``[T, kv]`` 16-bit (``kv = g d / t``), saved for the attention backward in place of
        the QKV output: with rope the rotated q, k are new tensors and v a strided view of the QKV output, a
        layout Transformer Engine's ``get_qkv_layout`` does not take (k's and v's strides differ), so it makes
        q, k, v contiguous (NVIDIA/TransformerEngine@a0b36d0 transformer_engine/pytorch/attention/dot_product_attention/
        utils.py ``get_qkv_layout``: ``not_supported`` -> ``x.contiguous()``) and FusedAttnFunc saves those:
        q, k, v saved are 2 T (a d + 2 g d) / t bytes, the QKV output's size, not it and the rotated q, k. Megatron /
        Transformer Engine's fused QKV only: separate q, k, v projections take no such copy (``qkv_layout``)."""
        e = self.e
        v = e.fresh("attn.v")
        n = self.w * self.T * kv
        e.kernel("attn.v_contiguous", C.COPY, reads=n, writes=n, out=[(v, n)], uses=[qkv])
        return v

    # -- MLP activation ----------------------------------------------------------------------
    def _act_fwd(self, prefix: str, fc1: str | tuple[str, str], T: int, f: int) -> str:
        """The MLP activation over ``[T, f]`` 16-bit outputs (``prefix``: kernel-name prefix, e.g. ``experts.``;
        ``fc1``: the fc1 output, or its gate and up halves as two tensors, ``op_sac.py``):
        SwiGLU ``silu(a) * b`` over the two halves of fc1 (Megatron fused bias_swiglu, ~6 FLOPs/element), or
        GELU (~8 FLOPs/element)."""
        if hf.is_hf_eager(self.s):  # Hugging Face gelu_new, 8 eager kernels (simulator/graph/builders/hf_eager.py)
            return hf.gelu_fwd(self, prefix, fc1, T, f)
        e = self.e
        name = "swiglu" if self.s.swiglu else "gelu"
        g = e.fresh(f"{prefix}{name}.out")
        n_in = 2 * T * f if self.s.swiglu else T * f
        w = self.w
        e.kernel(f"{prefix}{name}", C.ELEMENTWISE, reads=w * n_in, writes=w * T * f,
                 flops=(6 if self.s.swiglu else 8) * T * f, out=[(g, w * T * f)], uses=_parts(fc1))
        return g

    def _act_bwd(self, prefix: str, g: str, fc1: str, T: int, f: int) -> str:
        """Backward of ``_act_fwd``: SwiGLU reads dy and both halves, writes both gradients (~12 FLOPs/element);
        GELU reads dy and its input, writes dx (~16 FLOPs/element)."""
        if hf.is_hf_eager(self.s):
            return hf.gelu_bwd(self, prefix, g, fc1, T, f)
        e, w = self.e, self.w
        if self.s.swiglu:
            dx = e.fresh(f"{prefix}swiglu.dx")
            e.kernel(f"{prefix}swiglu.dgrad", C.ELEMENTWISE, reads=w * 3 * T * f, writes=w * 2 * T * f,
                     flops=12 * T * f, out=[(dx, w * 2 * T * f)], uses=[g, *_parts(fc1)])
        else:
            dx = e.fresh(f"{prefix}gelu.dx")
            e.kernel(f"{prefix}gelu.dgrad", C.ELEMENTWISE, reads=w * 2 * T * f, writes=w * T * f, flops=16 * T * f,
                     out=[(dx, w * T * f)], uses=[g, fc1])
        return dx

    # -- blocks ----------------------------------------------------------------------------
    def _attention(self, name: str, cc: C, *, flops: float, reads: float, writes: float, out, uses, meta: dict,
                   kv: int, q_bytes: float, o_bytes: float, backward: bool = False) -> None:
        """One flash-attention kernel (forward, recompute or backward) over this rank's queries, with context
        parallelism's communication around it (``cp_comm_type``; nothing without context parallelism).

        ``flops``: the kernel's FLOPs over the whole sequence for this rank's heads; ``kv``: K (or V) width per TP
        rank (``g d / t``); ``q_bytes`` / ``o_bytes``: the 16-bit tensors the
        Ulysses all-to-alls move before / after the kernel. With ``c`` CP ranks the kernel does ``1 / c`` of the
        sequence's work (Megatron's causal load balancing: 2c chunks, rank ``i`` holds chunks ``i`` and
        ``2c - 1 - i``): ``p2p`` runs it as ``c`` partial kernels, each over one K/V chunk, and passes the local
        K/V chunk (with its gradient in backward) to the next CP rank beside each (Liu et al., *Ring
        Attention*, 2023; Megatron ``AttnFuncWithCPAndKVP2P``); ``all_gather`` all-gathers K and V before the
        kernel (and dK/dV are reduce-scattered after the backward); ``a2a`` all-to-alls q, k, v into a head split
        and the output back (Jacobs et al., *DeepSpeed-Ulysses*, 2023)."""
        s, e, c = self.s, self.e, self.cp
        bsz, a, d = s.micro_batch_size, s.num_attention_heads // self.tp, s.head_dim
        if c == 1:
            e.kernel(name, cc, flops=flops, shape=(bsz * a, s.seq_length, s.seq_length, d), reads=reads,
                     writes=writes, out=out, uses=uses, meta=meta)
            return
        s_loc = s.seq_length // c
        chunk = 2 * 2 * bsz * s_loc * kv  # this rank's K and V, 16-bit
        flops = flops / c  # ``flops`` is the whole sequence's for this rank's heads: 1 / c of it is this rank's
        mode = s.cp_comm_type
        if mode == "a2a":
            self._cp_op(f"{name}.a2a_in", "all_to_all", q_bytes)
            e.kernel(name, cc, flops=flops, shape=(bsz * a // c, s.seq_length, s.seq_length, d), reads=reads,
                     writes=writes, out=out, uses=uses, meta=meta)
            self._cp_op(f"{name}.a2a_out", "all_to_all", o_bytes)
            return
        if mode == "all_gather":
            full = e.fresh(f"{name}.kv_gathered")
            self._cp_op(f"{name}.kv.all_gather", "all_gather", chunk * c, out=[(full, chunk * c)])
            e.kernel(name, cc, flops=flops, shape=(bsz * a, s_loc, s.seq_length, d), reads=reads + chunk * (c - 1),
                     writes=writes, out=out, uses=[*uses, full], meta=meta)
            if backward:
                self._cp_op(f"{name}.dkv.reduce_scatter", "reduce_scatter", chunk * c)
            return
        # p2p: c partial kernels; the chunk for kernel i + 1 travels beside kernel i
        nbytes = chunk * (2 if backward else 1)  # backward passes K/V and their gradients
        held = [t for t, _ in out]
        prev = e.last_compute
        for i in range(c):
            deps = []
            if i > 0:
                deps.append(ring)
            k = e.kernel(f"{name}.part{i}", cc, flops=flops / c, shape=(bsz * a, s_loc, s_loc, d),
                         reads=reads / c + (chunk if i else 0), writes=writes / c, out=out if i == 0 else [],
                         uses=[*uses, *(held if i else [])], deps=deps, meta=meta)
            if i < c - 1:
                ring = e.kernel(f"cp.{name}.ring{i}", C.OTHER, kind=OpKind.COLLECTIVE, stream="comm.cp",
                                reads=float(nbytes), deps=[prev], meta={"collective": "send_recv", "bytes": int(nbytes),
                                                                        "group": "cp"})
            prev = k

    def _cp_op(self, name: str, op: str, nbytes: float, out=()) -> int:
        """A blocking collective over the context-parallel group (as ``_tp_op``, stream ``comm.cp``)."""
        return self._tp_op(name, op, int(nbytes), out=out, group="cp")

    def _layer_fwd(self, x: str, save: bool, selective: bool) -> tuple[str, dict]:
        """One block forward. Returns the output tensor and the tensors saved for backward."""
        s, e, T, t = self.s, self.e, self.T, self.tp
        f, a, d, hf = s.ffn_hidden_size // t, s.num_attention_heads // t, s.head_dim, s.hidden_size
        h = s.attention_width // t  # per TP rank: attention width a d (h unless kv_channels), FFN width, heads
        qo, kv = s.qkv_out_size // t, s.query_groups * d // t  # QKV width a d + 2 g d, K (or V) width g d per rank
        self._gather_layer_params(e.layer, e.phase)
        ln1s, ln1_st = self._norm_fwd("ln1", x, OpRole.BLOCK_INPUT_NORM)
        ln1 = self._tp_gather("ln1", ln1s)
        sep = qkv_layout.separate(s)  # q, k, v from separate projections (torchtitan, PEFT): qkv_layout.py
        op = s.recompute == "op"  # torchtitan's per-op checkpointing: q, k, v apart (op_sac.py saves q and v)
        qkv, sv_qkv = self._linear_fwd("qkv", ln1, hf, qo, x_fp32=True, save=save,
                                       parts=(h, kv, kv) if op else (h + kv, kv) if sep else ())
        sv_qkv = self._save_shard(sv_qkv, ln1s)
        projections = qkv
        if sep:  # rope, torchtitan's repeat_kv copies; V goes in as the projection wrote it
            attn_in = qkv_layout.separate_fwd(self, qkv[:-1] if op else qkv[0], qkv[-1], h, kv)
            qk, qkv = attn_in[0], attn_in[-1]
        else:
            qk = self._rope_fwd(qkv, h + kv)
            if qk is not None and s.attention_backend == "flash":
                qkv = self._contiguous_v(qkv, kv)  # the QKV output is then saved by nothing
        qw, kvw = qkv_layout.attn_widths(s, h, kv) if sep else (qo, kv)  # the flash kernel's q, k, v; K width
        att = e.fresh("attn.out")
        bsz = s.micro_batch_size
        att_flops = 4 * bsz * a * s.attention_pairs * d
        # flash attention with grouped K/V: a query heads read g K/V heads (FLOPs per query head unchanged)
        s_loc = s.seq_length // self.cp
        sv_core = lse = None
        varlen_mode = s.attention_backend == "flash_varlen"  # MPT's padding helpers (builders/varlen.py)
        if varlen_mode:
            qkv = varlen.unpad_fwd(self, qkv, T, (h, kv, kv))
        if not sep:
            attn_in = [qkv] + ([qk] if qk else [])
        if s.attention_backend == "unfused":  # Megatron 2020-2022 (simulator/graph/builders/attention.py)
            att, sv_core = core.unfused_fwd(self, qkv, qk)
        else:
            lse = e.fresh("attn.lse")  # fp32 [b, a / t, s / c] row log-sum-exp, read by the backward
            self._attention("attn", C.ATTENTION_FWD, flops=att_flops, reads=2 * T * qw,
                            writes=2 * T * h + 4 * bsz * a * s_loc,
                            out=[(att, 2 * T * h), (lse, 4 * bsz * a * s_loc)], uses=attn_in,
                            meta={"kv_heads": s.query_groups // t, "window": s.window_size},
                            kv=kvw, q_bytes=2 * T * qw, o_bytes=2 * T * h)
        if varlen_mode:
            attc = varlen.pad_fwd(self, att, T, h)
        else:
            attc = e.fresh("attn.out_contig")
            e.kernel("attn.transpose", C.COPY, reads=self.w * T * h, writes=self.w * T * h,
                     out=[(attc, self.w * T * h)], uses=[att])
        proj, sv_proj = self._linear_fwd("proj", attc, h, hf, x_fp32=False, save=save)
        proj_rs = proj = self._tp_reduce("proj", proj)
        x2, mask1 = core.residual_dropout_add(self, "residual1", x, proj, self.w)
        ln2, ln2_st = self._norm_fwd("ln2", x2)
        fc1 = sv_fc1 = sv_fc2 = sv_moe = None
        if moe.is_moe_layer(s, e.layer):  # mixture of experts (simulator/graph/builders/moe.py), T / t tokens
            fc2, sv_moe = moe.moe_fwd(self, ln2, save)
        else:
            ln2s, ln2 = ln2, self._tp_gather("ln2", ln2)
            fc1, sv_fc1 = self._linear_fwd("fc1", ln2, hf, s.fc1_out_size // t, x_fp32=True, save=save,
                                           parts=(f, f) if op else ())  # op: w1 and w3 apart (op_sac.py saves w1)
            sv_fc1 = self._save_shard(sv_fc1, ln2s)
            g = self._act_fwd("", fc1, T, f)
            fc2_out, sv_fc2 = self._linear_fwd("fc2", g, f, hf, x_fp32=False, save=save)
            fc2 = self._tp_reduce("fc2", fc2_out)
        x3, mask2 = core.residual_dropout_add(self, "residual2", x2, fc2, self.w)
        saved = {}
        if op:  # what torchtitan's policy keeps of the block (op_sac.py); the rest is recomputed in backward
            saved = op_sac.saved_outputs(self, x=x, q=projections[0], v=projections[2], att=att, lse=lse,
                                         proj_rs=proj_rs, w1=fc1[0], w2=fc2_out, w2_rs=fc2)
        elif save:
            saved = dict(x=x, qkv=qkv, qk=qk, att=None if selective else att, sv_qkv=sv_qkv, sv_proj=sv_proj,
                         x2=x2, fc1=fc1, sv_fc1=sv_fc1, sv_fc2=sv_fc2, moe=sv_moe,
                         core=None if selective else sv_core, mask1=mask1, mask2=mask2,
                         lse=None if selective else lse, ln1_stats=ln1_st, ln2_stats=ln2_st, attn_in=attn_in)
        return x3, saved

    def _layer_bwd(self, gx: str, sv: dict) -> str:
        """One block backward; ``gx`` is the gradient of the block output (residual dtype)."""
        s, e, T, t = self.s, self.e, self.T, self.tp
        f, a, d, hf = s.ffn_hidden_size // t, s.num_attention_heads // t, s.head_dim, s.hidden_size
        h = s.attention_width // t  # per TP rank (see _layer_fwd)
        qo, kv = s.qkv_out_size // t, s.query_groups * d // t
        self._gather_layer_params(e.layer, e.phase)
        bsz = s.micro_batch_size
        att_flops = 4 * bsz * a * s.attention_pairs * d
        # MLP
        if moe.is_moe_layer(s, e.layer):  # mixture of experts (simulator/graph/builders/moe.py)
            g_ln2 = moe.moe_bwd(self, gx, sv["moe"])
        else:
            g_fc2 = core.hidden_dropout_bwd(self, "residual2.dropout", gx, sv["mask2"])
            g_fc2_in = self._linear_bwd("fc2", self._tp_gather("fc2.grad", g_fc2), sv["sv_fc2"], f, hf, g_fp32=True)
            g_gelu = self._act_bwd("", g_fc2_in, sv["fc1"], T, f)
            g_ln2 = self._linear_bwd("fc1", g_gelu, sv["sv_fc1"], hf, s.fc1_out_size // t, g_fp32=False,
                                     tp_reduce="fc1.grad")
        g_x2 = self._norm_bwd("ln2", g_ln2, sv["x2"], g_is_bf16=True, stats=sv["ln2_stats"])
        g_mid = self._add("residual2.grad", gx, g_x2, self.act, self.act, self.act)
        # attention
        g_proj = core.hidden_dropout_bwd(self, "residual1.dropout", g_mid, sv["mask1"])
        g_proj_in = self._linear_bwd("proj", self._tp_gather("proj.grad", g_proj), sv["sv_proj"], h, hf, g_fp32=True)
        if s.attention_backend == "flash_varlen":  # MPT's padding helpers (simulator/graph/builders/varlen.py)
            g_att = varlen.pad_bwd(self, g_proj_in, T, h)
        else:
            g_att = e.fresh("attn.transpose.dx")
            e.kernel("attn.transpose.dgrad", C.COPY, reads=self.w * T * h, writes=self.w * T * h,
                     out=[(g_att, self.w * T * h)], uses=[g_proj_in])
        att = sv["att"]
        if s.attention_backend == "unfused":  # re-run the core first with selective recompute
            sv_core = sv["core"] or core.unfused_fwd(self, sv["qkv"], sv["qk"], prefix="attn.recompute")[1]
            g_qkv = self._rope_bwd(core.unfused_bwd(self, g_att, sv_core, T * qo), h + kv)
        lse, sep = sv.get("lse"), qkv_layout.separate(s)
        qw, kvw = qkv_layout.attn_widths(s, h, kv) if sep else (qo, kv)  # the flash kernel's q, k, v; K width
        if s.attention_backend != "unfused" and att is None:  # selective recompute: re-run the attention forward
            att, lse = e.fresh("attn.out.recomputed"), e.fresh("attn.lse.recomputed")
            nl = 4 * bsz * a * (s.seq_length // self.cp)
            self._attention("attn.recompute", C.ATTENTION_FWD, flops=att_flops, reads=2 * T * qw,
                            writes=2 * T * h + nl, out=[(att, 2 * T * h), (lse, nl)], uses=sv["attn_in"], meta={},
                            kv=kvw, q_bytes=2 * T * qw, o_bytes=2 * T * h)
        if s.attention_backend != "unfused":
            outs = qkv_layout.grad_outs(self, h, kv) if sep else [(e.fresh("attn.dqkv"), 2 * T * qo)]
            ain = sv["attn_in"]
            self._attention("attn.dgrad", C.ATTENTION_BWD, flops=2.5 * att_flops, reads=2 * (T * qw + 2 * T * h),
                            writes=2 * T * qw + 4 * T * h, out=outs,
                            uses=[g_att, ain[0], att, *ain[1:]] + ([lse] if lse else []),
                            meta={"kv_heads": s.query_groups // t, "window": s.window_size}, kv=kvw,
                            q_bytes=2 * T * h, o_bytes=2 * T * qw, backward=True)
            g_qkv = [g for g, _ in outs]
            g_qkv = qkv_layout.reduce_grads(self, g_qkv, h, kv) if sep else g_qkv
            g_qkv = g_qkv[0] if len(g_qkv) == 1 else g_qkv
            if s.attention_backend == "flash_varlen":
                g_qkv = varlen.unpad_bwd(self, g_qkv, T, (h, kv, kv))
            g_qkv = self._rope_bwd(g_qkv, h + kv)
        g_ln1 = self._linear_bwd("qkv", g_qkv, sv["sv_qkv"], hf, qo, g_fp32=False, tp_reduce="qkv.grad")
        g_x = self._norm_bwd("ln1", g_ln1, sv["x"], g_is_bf16=True, stats=sv["ln1_stats"])
        out = self._add("residual1.grad", g_mid, g_x, self.act, self.act, self.act, held=sv.get("held", ()))
        self._release_layer_params(e.layer, Phase.BWD)
        return out

    # -- whole step ------------------------------------------------------------------------
    def _persistent(self) -> None:
        if self.s.lora is not None:
            lora.persistent(self)
            return
        if self.sh is not None:
            self._persistent_sharded()
            return
        s, b = self.s, self.b
        P = s.rank_num_parameters
        if s.deepspeed_bf16_optimizer:
            bf16opt.persistent(self, P, self._shard(P))
            return
        if s.deepspeed_fp16_optimizer:
            fp16opt.persistent(self, P)
            return
        Ps = moe.sharded_state(s, P, self._shard) if self.zero else P  # ZeRO-1/2: states per rank (experts: edp)
        if self.amp or self.full:  # fp32 parameters, no separate master copy
            b.persistent("params.fp32", 4 * P)
        else:
            self._half_params(P)
            b.persistent("params.master_fp32", 4 * Ps)
        b.persistent("optimizer.exp_avg", 4 * Ps)
        b.persistent("optimizer.exp_avg_sq", 4 * Ps)
        if self.dp and self.zero == 0:
            # DDP's flat bucket buffers (all parameters; fp32, or Megatron's 16-bit buffer: _half_grad_buffer)
            b.persistent("grad.ddp_buckets", self._grad_elem_bytes * P)

    def _forward(self, chunk: int, mb: int) -> dict:
        """Forward of micro-batch ``mb`` through local chunk ``chunk``: the embedding on model chunk 0 (else
        the activation received from the previous chunk), the chunk's blocks, then the LM head and the
        loss on the last model chunk (else the activation sent to the next). Returns what backward needs."""
        s, e, T = self.s, self.e, self.T
        h, V = s.hidden_size, s.vocab_per_rank  # vocabulary-parallel embedding and LM head: V_p / t rows
        k = self._chunk = s.model_chunks[chunk]
        first, last = k == 0, k == self.n_chunks - 1
        selective = s.recompute == "selective"
        e.phase, e.layer = Phase.FWD, -1
        self._new_micro_batch(mb)
        self._gather_layer_params(-1, Phase.FWD)  # the root unit (embeddings, final norm, head)
        st: dict = {}
        if (first or last) and s.vit is None:  # tokens (first stage) and labels (last stage): Megatron get_batch
            tokens = st["tokens"] = e.fresh("input.tokens")
            e.kernel("input.h2d", C.COPY, kind=OpKind.MEMCPY_H2D, stream="h2d", reads=8 * 2 * T, role=OpRole.INPUT_COPY,
                     out=[(tokens, 16 * T)], dtype="int64")
        if s.vit is not None:  # vision transformer: images, patch embedding, CLS token, positions (vit.py)
            x = vitb.embed_fwd(self, st)
        elif first:
            x = e.fresh("embed.out")
            rows = 2 if s.position_table_rows else 1  # token row (+ learned position row) per token
            e.kernel("embed", C.EMBEDDING, reads=8 * T + rows * self.act * T * h, writes=self.act * T * h,
                     out=[(x, self.act * T * h)], uses=[tokens], dtype="fp32")
            x = self._tp_reduce("embed", x, beside_gemm=False)  # VocabParallelEmbedding: other ranks' rows are 0
        else:
            x = self._take(("act", k - 1, mb))
        saved_layers = st["layers"] = {}
        for layer in chunk_layers(s.layer_split, k):
            e.layer = layer
            x_in = x
            full = self._checkpointed(layer)
            x, sv = self._block_fwd(x, save=not full and s.recompute != "op", selective=selective)
            saved_layers[layer] = sv if not full else {"x": x_in}
        e.layer = -1
        self._fp8_scale_update(forward=True)
        if not last:
            self.outgoing["act", k, mb] = x
            return st
        if s.vit is not None:  # final LayerNorm, classifier on the CLS token, cross-entropy (vit.py)
            vitb.head_fwd(self, st, x)
            return st
        st["x"] = x
        self._gather_layer_params(s.num_layers, Phase.FWD)  # the head (final norm, LM head)
        xfs, st["ln_f_stats"] = self._norm_fwd("ln_f", x)
        xf = self._tp_gather("ln_f", xfs)
        logits, sv_head = self._linear_fwd("lm_head", xf, h, V, x_fp32=True, save=True)
        st["sv_head"] = self._save_shard(sv_head, xfs)
        st["lsm"] = self._loss_fwd(T, V, logits, tokens, vocab_parallel=True)
        return st

    def _loss_fwd(self, rows: int, classes: int, logits: str, labels: str, vocab_parallel: bool) -> str:
        """Softmax cross-entropy in fp32 over ``rows`` x ``classes`` logits (per rank): the logits' ``.float()``
        (none with fp32 / tf32), log-softmax, NLL against ``labels``; ``vocab_parallel`` with TP: Megatron-LM's
        ``_VocabParallelCrossEntropy`` all-reduces (MAX) of the logit max, then (SUM) of the target logit and of
        the sum of exponentials, fp32 per row. Returns the saved log-softmax tensor."""
        e, n = self.e, rows * classes
        if self.full:  # fp32 logits already: .float() is a no-op
            l32, lf = logits, e.last_compute
        else:
            l32 = e.fresh("logits.fp32")
            lf = e.kernel("logits.float", C.CAST, reads=2 * n, writes=4 * n, out=[(l32, 4 * n)], uses=[logits])
        tp = vocab_parallel and self.tp > 1
        megatron = vocab_parallel and self.s.cross_entropy != "pytorch"
        if megatron and self.s.cross_entropy == "megatron":  # the max is its own pass, then its all-reduce
            return self._megatron_loss_fwd(rows, n, logits, l32, labels, [])
        ce = [self._tp_op("ce.logits_max.all_reduce", "all_reduce", 4 * rows, deps=[lf], dtype="fp32")] if tp else []
        if megatron:
            return self._megatron_loss_fwd(rows, n, logits, l32, labels, ce)
        lsm = e.fresh("log_softmax.out")
        ls = e.kernel("log_softmax", C.SOFTMAX, reads=4 * n, writes=4 * n, out=[(lsm, 4 * n)], uses=[l32], deps=ce,
                      dtype="fp32")
        if tp:
            ce = [self._tp_op(f"ce.{w}.all_reduce", "all_reduce", 4 * rows, deps=[ls], dtype="fp32")
                  for w in ("predicted_logits", "sum_exp_logits")]
        e.kernel("nll_loss", C.REDUCTION, reads=4 * rows + 8 * rows, writes=4, uses=[lsm, labels], deps=ce,
                 dtype="fp32")
        return lsm

    def _megatron_loss_fwd(self, rows: int, n: int, logits: str, l32: str, labels: str, ce: list) -> str:
        """Megatron-LM's vocab-parallel cross-entropy forward over ``n`` fp32 logits ``l32`` (``rows`` tokens),
        after ``logits.float()`` (``ce``: the logit max's TP all-reduce). Every logits-sized step runs in place
        on ``l32`` (NVIDIA/Megatron-LM@00611e6 megatron/core/tensor_parallel/cross_entropy.py
        ``calculate_logits_max``, ``calculate_predicted_logits``: ``vocab_parallel_logits -= logits_max``,
        ``torch.exp(..., out=)``, ``exp_logits.sum``; ``calculate_cross_entropy_loss``: ``exp_logits.div_``), and
        ``ctx.save_for_backward(exp_logits, ...)`` keeps only that fp32 softmax (4 B per logit). Unfused (Megatron's
        default): the max, shift, exponent, row sum and division each one pass; ``megatron_fused``
        (``--cross-entropy-loss-fusion``: @0cb4a9c megatron/core/fusions/fused_cross_entropy.py): the max with the
        cast (``jit_fuser``), one compiled in-place pass for the shift and exponent (``_exp_logits_inplace``), the
        row sum ``exp_logits.sum`` run outside the compiled graphs (its own pass: the module's note on Inductor
        materialising a mutated input that is also reduced), one pass for the division. (At d086a2e the whole of
        ``calculate_predicted_logits`` was one ``jit_fuser`` region, which that note says costs a logits-sized
        transient and a copy back under torch.compile: not modelled.) The 16-bit ``logits`` stay alive until the loss returns (GPTModel's local). Returns ``l32``."""
        e, fused = self.e, self.s.cross_entropy == "megatron_fused"
        if fused:  # the shift and exp one compiled in-place pass, the row sum outside it (@0cb4a9c)
            steps = [("ce.exp", C.ELEMENTWISE, 4 * n), ("ce.sum_exp", C.REDUCTION, 0)]
        else:
            ce = [e.kernel("ce.logits_max", C.REDUCTION, reads=4 * n, writes=4 * rows, uses=[l32], dtype="fp32")]
            if self.tp > 1:
                ce = [self._tp_op("ce.logits_max.all_reduce", "all_reduce", 4 * rows, deps=ce, dtype="fp32")]
            steps = [("ce.sub_max", C.ELEMENTWISE, 4 * n), ("ce.exp", C.ELEMENTWISE, 4 * n),
                     ("ce.sum_exp", C.REDUCTION, 0)]
        for name, cc, writes in steps:
            ex = e.kernel(name, cc, reads=4 * n, writes=writes or 4 * rows, flops=n, uses=[l32, labels], deps=ce,
                          dtype="fp32")
            ce = []
        if self.tp > 1:  # predicted logits and sums of exponentials (one batched all-reduce when fused)
            pairs = [("predicted_logits_sum_exp_logits", 8 * rows)] if fused else [
                ("predicted_logits", 4 * rows), ("sum_exp_logits", 4 * rows)]
            ce = [self._tp_op(f"ce.{w}.all_reduce", "all_reduce", nb, deps=[ex], dtype="fp32") for w, nb in pairs]
        e.kernel("ce.normalize", C.ELEMENTWISE, reads=4 * n + 4 * rows, writes=4 * n + 4 * rows, flops=n,
                 uses=[l32, logits], deps=ce, dtype="fp32")
        self._megatron_ce.add(l32)
        return l32

    def _megatron_loss_bwd(self, n: int, sm: str) -> str:
        """Backward of ``_megatron_loss_fwd`` over its saved fp32 softmax ``sm`` (``n`` logits): the target's
        ``- 1`` scatter and ``grad_input.mul_(grad_output)`` in place on ``sm`` (one pass; @00611e6
        cross_entropy.py ``calculate_gradients``), then its cast to the 16-bit logits dtype (@0cb4a9c
        fused_cross_entropy.py ``grad_input.to(logits_dtype)``; the autograd engine's cast in the unfused one),
        beside which ``sm`` is freed; fp32 / tf32: ``sm`` is the gradient. Returns the logits' gradient."""
        e = self.e
        e.kernel("ce.dgrad", C.ELEMENTWISE, reads=4 * n, writes=4 * n, flops=n, uses=[sm], dtype="fp32")
        if self.full:
            return sm
        g_logits = e.fresh("logits.float.dx")
        e.kernel("logits.float.dgrad", C.CAST, reads=4 * n, writes=2 * n, out=[(g_logits, 2 * n)], uses=[sm],
                 dtype="fp32")
        return g_logits

    def _loss_bwd(self, rows: int, classes: int, lsm: str) -> str:
        """Backward of the fp32 softmax cross-entropy over ``rows`` x ``classes`` logits (``lsm``: the saved
        log-softmax): the loss-scale multiply with fp16 (dynamic loss scaling starts backward from loss x scale;
        Micikevicius et al. 2018), the NLL and log-softmax gradients in fp32, then their cast to the 16-bit
        logits dtype (none with fp32 / tf32). Returns the logits' gradient tensor."""
        e, n = self.e, rows * classes
        if self.fp16:
            e.kernel("loss_scale.scale", C.ELEMENTWISE, reads=8, writes=4, flops=1, dtype="fp32")
        if lsm in self._megatron_ce:  # saved by _megatron_loss_fwd
            return self._megatron_loss_bwd(n, lsm)
        g_lsm = e.fresh("nll_loss.dx")
        e.kernel("nll_loss.dgrad", C.MEMSET, reads=0, writes=4 * n, out=[(g_lsm, 4 * n)], dtype="fp32")
        g_l32 = e.fresh("log_softmax.dx")
        e.kernel("log_softmax.dgrad", C.SOFTMAX, reads=8 * n, writes=4 * n, out=[(g_l32, 4 * n)],
                 uses=[g_lsm, lsm], dtype="fp32")
        if self.full:  # fp32 / tf32: the logits' gradient is the fp32 one
            return g_l32
        g_logits = e.fresh("logits.float.dx")
        e.kernel("logits.float.dgrad", C.CAST, reads=4 * n, writes=2 * n, out=[(g_logits, 2 * n)], uses=[g_l32],
                 dtype="fp32")
        return g_logits

    def _backward(self, chunk: int, mb: int, st: dict, last_pass: bool) -> None:
        """Backward of micro-batch ``mb`` through local chunk ``chunk`` (``st``: its forward's state): from the
        loss on the last model chunk (else the gradient received from the next chunk), the blocks in reverse,
        then the embedding backward on model chunk 0 (else the input gradient sent to the previous chunk).
        ``last_pass``: the chunk's final backward of the step (gradients complete: DP buckets are reduced)."""
        s, e, T = self.s, self.e, self.T
        h, V = s.hidden_size, s.vocab_per_rank
        k = self._chunk = s.model_chunks[chunk]
        first, last = k == 0, k == self.n_chunks - 1
        self.last_mb = last_pass
        self._mb, self._bwd_comm_start = mb, len(self.comm_ops)
        if self.pg is not None:
            self.pg.start_pass(Phase.BWD)
        e.phase, e.layer = Phase.BWD, -1
        if not self._ipg_lazy:
            self._ipg_alloc()
        if self._bf16_ready is not None:  # BF16_Optimizer.clear_lp_grads before the backward
            bf16opt.clear_lp_grads(self)
        if s.vit is not None:
            g = vitb.head_bwd(self, st)
        elif last:
            g_logits = self._loss_bwd(T, V, st["lsm"])
            self._gather_layer_params(s.num_layers, Phase.BWD)
            g = self._linear_bwd("wte" if s.tied_embeddings else "lm_head", g_logits, st["sv_head"], h, V,
                                 g_fp32=False, tp_reduce="lm_head.grad")
            g = self._norm_bwd("ln_f", g, st["x"], g_is_bf16=True, stats=st["ln_f_stats"])
        else:
            g = self._take(("grad", k, mb))
        saved_layers = st["layers"]
        for layer in reversed(chunk_layers(s.layer_split, k)):
            e.layer = layer
            sv = saved_layers[layer]
            if self._checkpointed(layer):
                _, sv = self._block_fwd(sv["x"], save=True, selective=False)
            elif s.recompute == "op":  # torchtitan's per-op checkpointing: re-run what its policy did not save
                sv = op_sac.recompute(self, sv)
            g = self._block_bwd(g, sv)
        e.layer = -1
        self._fp8_scale_update(forward=False)
        if not first:
            self.outgoing["grad", k - 1, mb] = g
            self._end_of_backward()
            return
        if s.vit is not None:  # position, CLS and patch-embedding gradients (vit.py)
            vitb.embed_bwd(self, st, g)
            self._end_of_backward()
            return
        tokens = st["tokens"]
        if s.lora is not None:  # frozen embeddings: no embedding backward
            self._end_of_backward()
            return
        self._weight_grads(lambda: self._embedding_grads(g, tokens))
        self._end_of_backward()

    def _checkpointed(self, layer: int) -> bool:
        """Block ``layer`` is checkpointed whole: only its input kept, its forward re-run before its backward
        (``recompute`` full; with ``recompute_every`` n only the blocks with ``(layer + 1) % n == 0``)."""
        s = self.s
        return s.recompute == "full" and (layer + 1) % s.recompute_every == 0

    def _embedding_grads(self, g: str, tokens: str) -> None:
        """Embedding backward of model chunk 0: the dense fp32 gradient of the token table (+ the tied LM-head
        gradient) and of the position table (weight gradients only: nothing flows further back)."""
        s, e, T = self.s, self.e, self.T
        h, V = s.hidden_size, s.vocab_per_rank
        g = self._tp_gather("embed.grad", g, before_gemm=False)  # sequence parallelism: the reduce-scatter's backward
        d_emb = e.fresh("embed.dw")
        e.kernel("embed.dgrad", C.EMBEDDING, reads=self.act * T * h + 8 * T, writes=4 * V * h,
                 out=[(d_emb, 4 * V * h)], uses=[g, tokens], dtype="fp32")
        gname = f"grad.wte.mb{self._mb}" if self._fresh_grads else "grad.wte"
        first_write = gname not in self.grad_made
        self.grad_made.add(gname)
        gb = self._grad_elem_bytes
        in_ipg = self._in_ipg(V * h)
        i = e.kernel("embed.grad_accum", C.COPY if first_write else C.ELEMENTWISE, role=OpRole.GRAD_ACCUM,
                     reads=4 * V * h + (0 if first_write else gb * V * h), writes=gb * V * h,
                     out=[(gname, gb * V * h)] if first_write and not (self._grads_in_buckets or in_ipg)
                     else [], uses=[d_emb, self._ipg] if in_ipg else [d_emb], dtype="fp32")
        self._grad_ready("wte.weight", V * h, i, gname)
        if s.position_table_rows:
            P = s.position_table_rows
            i = e.kernel("pos_embed.dgrad", C.REDUCTION, reads=self.act * T * h, writes=4 * P * h, uses=[g],
                         dtype="fp32")
            self._grad_ready("wpe.weight", P * h, i)

    # -- pipeline parallel -------------------------------------------------------------------
    def _take(self, key: tuple) -> str:
        """The tensor of transfer ``key`` for the pass that reads it: received, or (ZB-V's last rank, whose chunk
        0 feeds its own chunk 1) produced on this rank and handed over in place."""
        return self.received.pop(key) if key in self.received else self.outgoing.pop(key)

    def _comm(self, call: Comm) -> None:
        """One blocking point-to-point call of the schedule: an NCCL send/recv per transfer of the ``[b, s, h]``
        16-bit residual stream (``[b, s / t, h]`` with sequence parallelism) between two pipeline ranks, a
        rendezvous that starts when both sides have posted it (``engine.rendezvous``).

        As Megatron-LM's ``p2p_communication._communicate`` (``batch_isend_irecv``, ``wait_on_reqs``): the
        call's sends and receives are posted together after the kernel issued before it and after the
        previous call has returned; the next kernel waits for all of them. Each direction has its own stream
        (both ranks post one direction's transfers in the same order). Received tensors are kept for the
        pass that reads them (``self.received``). A ``detached`` send (ZB-V) is waited for by nobody but the
        step's end (``_pipeline_syncs``)."""
        s, e = self.s, self.e
        p, sched = s.pipeline_parallel_size, s.pipeline_schedule
        nbytes = self.act * self.Tn * s.hidden_size
        ops = []
        for sending, moves in ((True, call.sends), (False, call.recvs)):
            for key in moves:
                direction, boundary, mb = key
                src, dst = (boundary, boundary + 1) if direction == "act" else (boundary + 1, boundary)
                meta = {"collective": "send_recv", "bytes": int(nbytes), "group": "pp",
                        "pp_ranks": (chunk_rank(sched, p, src), chunk_rank(sched, p, dst)), "rendezvous": ("pp", *key),
                        "parties": 2}
                stream = transfer_stream(sched, p, key, sending)
                what = "activation" if direction == "act" else "grad"
                deps = [e.last_compute, *self._last_call]
                if sending:
                    ops.append(e.kernel(f"pp.send_{what}.k{boundary}.mb{mb}", C.OTHER, kind=OpKind.COLLECTIVE, stream=stream,
                                        reads=float(nbytes), uses=[self.outgoing.pop(key)], deps=deps, meta=meta))
                else:
                    y = self.received[key] = e.fresh(f"pp.{direction}.recv")
                    ops.append(e.kernel(f"pp.recv_{what}.k{boundary}.mb{mb}", C.OTHER, kind=OpKind.COLLECTIVE, stream=stream,
                                        reads=float(nbytes), out=[(y, nbytes)], deps=deps, meta=meta))
        if call.detached:
            self._detached.extend(ops)
            return
        self._last_call = ops
        if call.blocking:  # else an asynchronous send: only the next call waits for it
            e.wait_for.extend(ops)

    def _pipeline_syncs(self) -> None:
        """Before the optimizer, with ``p > 1``: the tied word-embedding gradients of the first and last
        pipeline ranks are all-reduced (the ``main_grad``: fp32, 16-bit with ``_half_grad_buffer``; Megatron-LM
        ``_allreduce_word_embedding_grads``), then, with ``clip_grad > 0`` (Megatron-LM's default 1.0) outside
        Megatron's optimizer and FSDP, every pipeline rank joins a gradient-norm all-reduce (one fp32 value; with
        fp16 and ``clip_grad`` 0 the found-inf all-reduce of ``_optimizer`` joins them instead). Megatron's
        optimizer reduces its norm and found-inf flag itself, after the local norm (``_grad_stats_all_reduce``).

        The rendezvous makes the *optimizer start* together on every stage, not the step end: each stage then
        runs its own optimizer (stage 0 and the last stage hold the embedding and the LM head, so theirs is
        longer) and the next step's first ops follow on their own. The stages' step ends spread by those
        differences (the run summary's ``pipeline.step_end_spread_s``); the step time is the period of the
        step ends (``analysis.pipeline.combined_steps``)."""
        s, e = self.s, self.e
        p = s.pipeline_parallel_size
        if p == 1:
            return
        e.phase, e.layer = Phase.OPT, -1
        calls = [*self._last_call, *self._detached]
        deps = [len(self.b) - 1, *self.comm_ops, *self.tp_ops, *calls]
        if s.embedding_copy and (s.has_embedding or s.has_head):
            # the main_grad's dtype; BF16_Optimizer's buffer view (weight._hp_grad, pipe/engine.py _exec_reduce_tied_grads)
            # FP16_Optimizer's 16-bit .grad (weight.grad, the same function)
            gb, dt = (2, self.e.half) if (self._half_grad_buffer or s.deepspeed_bf16_optimizer
                                          or s.deepspeed_fp16_optimizer) else (4, "fp32")
            nbytes = gb * s.vocab_per_rank * s.hidden_size
            calls.append(self.b.add("pp.embedding_grads.all_reduce", OpKind.COLLECTIVE, "comm.pp", deps=deps,
                                    phase=Phase.OPT, bytes_read=float(nbytes), dtype=dt,
                                    meta={"collective": "all_reduce", "bytes": nbytes, "group": "pp",
                                          "pp_ranks": (0, p - 1), "rendezvous": ("pp", "embedding_grads"),
                                          "parties": 2}))
            deps.append(calls[-1])
        own_norm = (self._megatron_optimizer or self._deepspeed_zero_step or self._deepspeed_zero3_step
                    or self._torch_clips or s.deepspeed_bf16_optimizer or s.deepspeed_fp16_optimizer)
        if s.clip_grad > 0 and not own_norm and not (self.sh is not None and self.sh.unit_buckets):
            self.tp_ops.append(self._pp_all_reduce("grad_norm", deps))  # FSDP: its own group only (_fsdp_clips)
        else:  # the optimizer waits for the last point-to-point calls and the embedding all-reduce itself (Megatron's
            self.tp_ops.extend(calls)  # optimizer, DeepSpeed ZeRO, clip_grad_norm_: _grad_stats_all_reduce)

    def _pp_all_reduce(self, what: str, deps: list[int]) -> int:
        """One fp32 value all-reduced over every pipeline rank (``pp.<what>.all_reduce``, a rendezvous of all
        ``p`` stages), after ``deps``; returns its op id."""
        p = self.s.pipeline_parallel_size
        return self.b.add(f"pp.{what}.all_reduce", OpKind.COLLECTIVE, "comm.pp", deps=deps, phase=Phase.OPT,
                          bytes_read=4.0, dtype="fp32",
                          meta={"collective": "all_reduce", "bytes": 4, "group": "pp", "pp_ranks": tuple(range(p)),
                                "rendezvous": ("pp", what), "parties": p})

    def _unit_sp_grads(self) -> None:
        """FSDP with sequence parallelism: the TP all-reduce of the unit's TP-replicated gradients before its
        reduce-scatter (``sharding.sp_unit_grads``; in place of ``_sequence_parallel_grads``); none under DeepSpeed's
        engine (ZeRO-3: ``TransformerSpec.deepspeed_engine``)."""
        if self.sp and self.sh is not None and self.sh.unit_buckets and self._bucket and not self.s.deepspeed_engine:
            shd.sp_unit_grads(self, self._bucket)

    def _sequence_parallel_grads(self) -> None:
        """Sequence parallelism: one coalesced all-reduce over the TP group of the gradients (fp32, 16-bit with
        ``_half_grad_buffer``) of the LayerNorms and row-parallel biases (Megatron ``finalize_model_grads`` -> ``_allreduce_layernorm_grads``;
        FSDP: per unit, ``_unit_sp_grads``); none under DeepSpeed's engine (ZeRO, BF16_Optimizer, FP16_Optimizer:
        ``TransformerSpec.deepspeed_engine``, flagged by ``api.deepspeed_sp_grads_note``)."""
        if self.sp and not (self.sh is not None and self.sh.unit_buckets) and not self.s.deepspeed_engine:
            self.e.phase, self.e.layer = Phase.BWD, -1
            gb, dt = (2, self.e.half) if self._half_grad_buffer else (4, "fp32")  # the main_grad's dtype
            self.tp_ops.append(self._tp_op("layernorm_grads.all_reduce", "all_reduce",
                                           gb * self.s.sequence_parallel_params, deps=[len(self.b) - 1],
                                           dtype=dt))

    def _optimizer(self) -> None:
        s, e = self.s, self.e
        P = lora.trainable_parameters(s) if s.lora is not None else s.rank_num_parameters
        e.phase, e.layer = Phase.OPT, -1
        grads = self._optimizer_grads()
        # fp32 params/grads + two moments read, params + moments written; bf16 mode also writes bf16 params (DeepSpeed
        # ZeRO's copy folded in; Megatron's is its own kernel, _copy_main_params_to_model)
        reads, writes = 16 * P, 12 * P + (0 if self.amp or self.full else 2 * P)
        share = self._optimizer_share()  # ZeRO/FSDP/distributed optimizer: this rank updates its 1/dp partition
        if s.deepspeed_bf16_optimizer:  # DeepSpeed's BF16_Optimizer.step (bf16_optimizer.py)
            bf16opt.step(self, self._shard(P), grads, list(self.comm_ops) + self.tp_ops + self.moe_grad_ops)
            return
        if s.deepspeed_fp16_optimizer:  # DeepSpeed's FP16_Optimizer.step (fp16_optimizer.py)
            fp16opt.step(self, grads, list(self.comm_ops) + self.tp_ops + self.moe_grad_ops)
            return
        deps = list(self.comm_ops) + self.tp_ops + self.moe_grad_ops
        if self._half_grad_buffer:
            grads, deps = self._copy_model_grads_to_main_grads(P * share, grads, deps)
        if self._deepspeed_zero_step:  # DeepSpeed's overflow check, norm, fp32 copy and unscale (grad_norm.py)
            pieces = gn.zero_partition_pieces([g.numel for g in reversed(self.groups)], s.grad_reduce_size)
            grads, deps = gn.deepspeed_zero_step(self, pieces, P * share, grads, deps, check_overflow=self.fp16)
        elif self._deepspeed_zero3_step:  # ZeRO-3's: over each parameter's own partition (grad_norm.py)
            pieces = gn.zero3_partition_pieces([g.numel for g in reversed(self.groups)], self.sh.shard_size)
            grads, deps = gn.deepspeed_zero_step(self, pieces, P * share, grads, deps, check_overflow=self.fp16,
                                                 stage3=True)
        elif self.fp16:  # unscale the fp32 main grads in place and check them for inf/nan, then found_inf.item()
            chk = e.kernel("loss_scale.unscale_check", C.ELEMENTWISE, reads=4 * P * share, writes=4 * P * share,
                           flops=P * share, uses=grads, deps=deps, dtype="fp32")
            if self._megatron_optimizer:  # over Megatron's grad-stats group (model parallel, or the world)
                chk = self._grad_stats_all_reduce("loss_scale.found_inf", [chk])[-1]
            else:
                if self.tp > 1:
                    chk = self._tp_op("loss_scale.found_inf.all_reduce", "all_reduce", 4, deps=[chk], dtype="fp32")
                if s.pipeline_step_end_sync and s.clip_grad == 0:  # over the pipeline stages
                    chk = self._pp_all_reduce("found_inf", [chk])
            deps = [self.b.add("loss_scale.found_inf.item", OpKind.SYNC, "host", deps=[chk], phase=Phase.OPT,
                               launch=False)]
        if self._fsdp_clips:
            deps = self._fsdp_clip_grad_norm(P * share, grads, deps)
        elif self._torch_clips:
            deps = gn.torch_clip_grad_norm(self, P * share, grads, deps)
        if s.optimizer_impl in ("single", "foreach"):  # one kernel per pass (fp32 parameters: the schema's rule)
            for k, ps in enumerate(adamw_passes(f"torch_{s.optimizer_impl}")):
                deps = [e.kernel(f"adamw.{k}.{ps.name.split('(')[0]}", C.OPTIMIZER, reads=ps.read_bytes * P * share,
                                 writes=(ps.write_bytes + ps.fresh_bytes) * P * share, flops=P * share, uses=grads,
                                 dtype="fp32", deps=deps, **({"meta": {"params": P}} if k == 0 else {}))]
        else:
            meg = self._megatron_optimizer
            if meg and s.clip_grad > 0:
                deps = self._clip_grad_norm(P * share, grads, deps)
            if meg:  # the fused kernel writes the fp32 params and moments only (the bf16 / fp16 copy: below)
                writes = 12 * P
            adam = e.kernel("adamw", C.OPTIMIZER, reads=reads * share, writes=writes * share, flops=12 * P * share,
                            uses=grads, dtype="fp32", deps=deps, meta={"params": P})
            if meg:
                f8 = shd.fp8_weight_numel(s) if s.fp8_param_gather else 0
                if P > f8:
                    self._copy_main_params_to_model((P - f8) * share, adam)
                if f8:
                    self._copy_main_params_to_fp8(f8 * share, adam, grads)
        self._after_step_gathers(len(self.b) - 1)
        if self.zero in (1, 2):
            opt = len(self.b) - 1
            pbytes = 4 if self.amp or self.full else 2
            moe.expert_param_gathers(self, opt)
            own = moe.own_expert_grads(s)  # the experts' own group is gathered by expert_param_gathers
            numels = [(g.name, g.numel) for g in self.groups if not (own and ".experts." in f".{g.name}")]
            for k, n in enumerate(zero_param_groups(numels)):  # one all_gather_into_tensor per flat group
                self.comm_ops.append(self._collective(f"{ZERO_PARAM_ALL_GATHER}.{k}", "all_gather", n * pbytes,
                                                      [opt], Phase.OPT))

    # -- data parallel -----------------------------------------------------------------------
    def _init_ipg(self) -> None:
        """DeepSpeed ZeRO-1/2's IPG (independent partition gradient) buffers, ``spec.zero_ipg`` (count, when) of
        ``reduce_bucket_size`` elements in the model dtype (``_grad_elem_bytes``: 2 in bf16 / fp16, 4 with fp32
        parameters), whatever the model's size. Source: microsoft/DeepSpeed@cde57d2
        ``deepspeed/runtime/zero/stage_1_and_2.py``: ``DeepSpeedZeroOptimizer.backward`` allocates
        ``torch.empty(reduce_bucket_size, dtype=self.dtype)`` before each micro-batch's ``loss.backward()`` when
        ``contiguous_gradients`` (default true, ``deepspeed/runtime/zero/config.py``) and a second one with
        ``overlap_comm`` (the double buffer its hooks alternate); ``independent_gradient_partition_epilogue``
        releases them (``_release_ipg_buffers``) after the reductions. Modelled (``_ipg_alloc``):

        * ZeRO-2 (its epilogue runs after every micro-batch's backward): allocated at the start of each backward
          and alive until that backward's last reduce-scatter. Each gradient is copied into it by its hook
          (``reduce_independent_p_g_buckets_and_remove_grads``: ``copy_`` into the buffer, ``param.grad`` made a
          view of it), so a bucket's gradients take no memory beside it: the gradient copy ``grad_accum``
          writes into the buffer (``_in_ipg``; not a gradient larger than the buffer, reduced from its own tensor).
        * ZeRO-1 (the epilogue only at the gradient-accumulation boundary; each backward's buffers replace the
          previous ones, freed first): from the first micro-batch's backward to the step's last reduce-scatter,
          beside the ``.grad`` tensors, which accumulate until then.
        * ZeRO-1 with a pipeline: the last stage as ZeRO-1 (DeepSpeed's PipelineEngine runs its backward through
          ``DeepSpeedEngine.backward``); the other stages run ``torch.autograd.backward`` themselves and get one
          buffer from ``reduce_gradients(pipeline_parallel=True)``: from the step's first reduce-scatter to its
          last.
        """
        s = self.s
        buffers, lazy = s.zero_ipg  # the one rule, also the memory estimate's
        self._ipg_bytes = buffers * s.reduce_bucket_elements * self._grad_elem_bytes
        self._ipg_lazy = lazy  # allocated by the first reduce-scatter, not by the backward
        self._ipg: str | None = None  # the live buffer
        self._grads_in_ipg = buffers > 0 and self.zero == 2

    def _in_ipg(self, numel: int) -> bool:
        """ZeRO-2 with IPG buffers: a gradient of ``numel`` elements is copied into the buffer (one larger than
        ``reduce_bucket_size`` is not: DeepSpeed reduces it alone from its own tensor,
        ``extra_large_param_to_reduce``)."""
        return self._grads_in_ipg and numel <= self.s.reduce_bucket_elements

    def _ipg_alloc(self) -> None:
        """Allocate the IPG buffer (``_init_ipg``) where DeepSpeed does, unless it is live: a zero-time op on the
        compute stream (DeepSpeed's ``torch.empty``; no kernel)."""
        if not self._ipg_bytes or self._ipg is not None:
            return
        self._ipg = self.e.fresh("grad.ipg_buffer")  # counted as gradients (memory.category)
        op = self.b.add("zero.ipg_buffer.alloc", OpKind.COMPUTE, "compute", phase=Phase.BWD, fixed_duration_s=0.0,
                        launch=False, allocs=(TensorAlloc(self._ipg, self._ipg_bytes),))
        self.e.producer[self._ipg] = op

    def _shard(self, n: int) -> int:
        """Elements of one rank's ZeRO partition of ``n`` (DeepSpeed pads the flat buffer to dp; x cp)."""
        dp = self.s.grad_reduce_size
        return -(-n // dp)

    def _grad_ready(self, name: str, numel: int, op: int, tensor: str | None = None) -> None:
        """Record that op ``op`` finished the gradient of parameter ``name`` (the last micro-batch's, or every
        micro-batch's when ZeRO-2/3 or FSDP reduce each one)."""
        if self._bf16_ready is not None:  # BF16_Optimizer adds every backward's gradients into its buffer
            self._bf16_ready.append((f"L{self.e.layer}.{name}" if self.e.layer >= 0 else name, numel, op, tensor))
        if not (self.last_mb or self._every_mb):
            return
        layer = self.e.layer
        pg = ParamGroup(f"L{layer}.{name}" if layer >= 0 else name, numel, layer, self._grad_elem_bytes, op, tensor)
        if self.last_mb:
            self.groups.append(pg)
        if name.startswith("experts.") and moe.own_expert_grads(self.s):  # over the expert-data-parallel group
            if self.last_mb:
                moe.reduce_expert_grad(self, pg)
            return
        s = self.s
        if not self.dp or self._bf16_ready is not None or s.deepspeed_fp16_optimizer:  # BF16_ / FP16_Optimizer: the
            return  # engine reduces after the last backward (bf16_optimizer / fp16_optimizer .reduce_grads)
        if self.sh is not None and self._sharded_grad_ready(pg):
            return
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
        # ZeRO-2/3 reduce each full bucket from the backward hook whatever overlap_comm (DeepSpeed
        # stage_1_and_2.py: the hooks are installed when partition_gradients or overlap_comm; reduce_ipg_grads
        # runs on the current stream without overlap_comm and then clears the grads outside the partition)
        if self.overlap or self.zero in (2, 3) or (self.sh is not None and self.sh.unit_buckets):
            self._emit_bucket(bucket, ())
            if self.zero in (2, 3) and not self.overlap:  # overlap_comm false: the reduction blocks the compute stream
                self.e.wait_for.append(self.comm_ops[-1])
        else:
            self._buckets.append(bucket)

    def _end_of_backward(self) -> None:
        if self._bf16_ready is not None:  # BF16_Optimizer.update_hp_grads after every backward
            bf16opt.update_hp_grads(self, self._bf16_ready)
        if not (self.dp and (self.last_mb or self._every_mb)):
            return
        self._bucket = self._root_bucket + self._bucket  # FSDP: the root unit's reduce-scatter comes last
        self._root_bucket = []
        self._unit_sp_grads()
        if self._bucket:
            self._close_bucket()
        last = len(self.b) - 1
        for bucket in self._buckets:
            self._emit_bucket(bucket, (last,))
        self._buckets = []
        if self._every_mb:
            self._accumulate_shards()
        if self.zero == 2:  # DeepSpeed's epilogue released the IPG buffer: the next backward allocates its own
            self._ipg = None

    def _accumulate_shards(self) -> None:
        """End of a micro-batch's backward with per-micro-batch reductions: the compute stream waits for this
        backward's reductions (DeepSpeed's ``independent_gradient_partition_epilogue`` waits for its reduction
        stream; FSDP's ``_post_backward_final_callback`` for its post-backward stream) and, after the first
        micro-batch, adds the reduced shards into the step's gradient shards (one elementwise pass each)."""
        mine = self.comm_ops[self._bwd_comm_start:]
        if self._partials:
            nbytes = sum(n for _, n in self._partials)
            self.e.kernel("grad.shard_accum", C.ELEMENTWISE, reads=2 * nbytes, writes=nbytes, flops=nbytes / 4,
                          uses=[t for t, _ in self._partials], deps=mine, dtype="fp32")
            self._partials = []
        elif not self.last_mb:  # the wait itself, on the compute stream, in backward (where the epilogue's
            # wait_stream puts it: the backward-end event completes after the reductions)
            self.b.add("bwd.grad_reduce.wait", OpKind.COMPUTE, "compute", deps=mine, phase=Phase.BWD,
                       fixed_duration_s=0.0, launch=False)

    def _reduced_shard(self, k: int, nbytes: int) -> tuple[TensorAlloc, ...]:
        """Where bucket ``k``'s reduce-scatter writes its ``nbytes`` shard: the step's gradient shard on the first
        micro-batch, a partial added into it at the end of a later one (``_accumulate_shards``)."""
        shard = self.e.fresh(f"grad.shard.b{k}")
        if self._every_mb and self._mb > 0:
            self._partials.append((shard, nbytes))
        else:
            self.grad_shards.append(shard)
        return (TensorAlloc(shard, nbytes),)

    def _emit_bucket(self, bucket: tuple[ParamGroup, ...], extra: tuple[int, ...]) -> None:
        k = len(self.comm_ops)
        nbytes = sum(g.grad_bytes for g in bucket)
        tensors = [g.grad_tensor for g in bucket if g.grad_tensor]
        deps = [g.grad_op for g in bucket] + list(extra)
        if self.sh is not None and self.sh.version == 2:
            fsdp2.fsdp2_reduce(self, k, bucket, tensors, deps)
            return
        if self.sh is not None:
            self._emit_sharded_bucket(k, nbytes, tensors, deps)
            return
        if self.zero == 0:
            self.comm_ops.append(self._collective(f"ddp.grad_all_reduce.{k}", "all_reduce", nbytes, deps, Phase.BWD,
                                                  uses=tensors, elem_bytes=self._grad_elem_bytes))
            return
        out: tuple[TensorAlloc, ...] = ()
        if self.zero == 2:  # the reduced shard stays; the full gradients are freed after the reduce-scatter
            out = self._reduced_shard(k, -(-nbytes // self.s.grad_reduce_size))
        if self._ipg_lazy:
            self._ipg_alloc()
        uses = list(tensors) if self.zero == 2 else []  # (a gradient held in the IPG buffer has no tensor of its own)
        if self._ipg is not None:  # the bucket is reduced from the IPG buffer, alive until its last reduction
            uses.append(self._ipg)
        self.comm_ops.append(self._collective(f"zero.grad_reduce_scatter.{k}", "reduce_scatter", nbytes, deps,
                                              Phase.BWD, uses=uses, allocs=out, elem_bytes=self._grad_elem_bytes))

    def _collective(self, name: str, op: str, nbytes: int, deps, phase: Phase, uses=(), allocs=(),
                    group: str = "dp", elem_bytes: int = 4) -> int:
        """A collective over ``group`` (``dp``; HYBRID_SHARD: ``dp_shard`` / ``dp_replicate``) on stream
        ``comm.<group>`` (priced by the engine's NCCL model) of ``elem_bytes``-byte elements (its dtype label:
        8 fp64, 4 fp32, 2 the model's 16-bit type)."""
        dtype = {8: "fp64", 4: "fp32"}.get(elem_bytes) or ("fp16" if self.s.precision == "fp16" else "bf16")
        return self.b.add(name, OpKind.COLLECTIVE, f"comm.{group}", deps=deps, phase=phase, bytes_read=float(nbytes),
                          uses=tuple(uses), allocs=tuple(allocs), dtype=dtype,
                          meta={"collective": op, "bytes": int(nbytes), "group": group})

    # -- sharded data parallel (ZeRO-3, FSDP, Megatron distributed optimizer: sharding.py) ----------
    def _init_sharding(self) -> None:
        s = self.s
        sh = s.sharding if self.dp else None
        self.sh = sh
        self._mb = self._chunk = 0
        self._root_bucket: list[ParamGroup] = []
        #: bytes per element of a parameter's gradient tensor (and of its reduction)
        self._grad_elem_bytes = 4 if sh is None or sh.strategy == "distributed_optimizer" else sh.grad_bytes
        if s.zero_half_grads:
            self._grad_elem_bytes = 2  # DeepSpeed ZeRO-1/2 keeps the gradients in the model dtype (ZERO_HALF_GRAD_...)
        if self._half_grad_buffer or s.deepspeed_bf16_optimizer or s.deepspeed_fp16_optimizer:  # their 16-bit .grad
            self._grad_elem_bytes = 2
        if sh is not None and sh.version == 2:  # autograd's unsharded gradients are in param_dtype (fsdp2.py)
            self._grad_elem_bytes = sh.param_bytes
        self._shard_group = "dp_shard" if sh is not None and sh.replicate_size > 1 else "dp"
        self.pg = None
        if sh is not None and sh.version == 2:
            self.pg = fsdp2.Fsdp2ParamGather(s, self.e, self.b, lambda name, op, nbytes, deps, phase, uses=(),
                                             group=None: self._collective(name, op, nbytes, deps, phase, uses=uses,
                                                                          group=group or self._shard_group))
        elif sh is not None and sh.gathers:
            self.pg = shd.ParamGather(s, self.e, lambda name, op, nbytes, deps, phase, allocs=(), uses=(): (
                self._collective(name, op, nbytes, deps, phase, uses=uses, allocs=allocs, group=self._shard_group)))
        elif sh is not None and sh.casts_units:  # NO_SHARD, param_dtype bf16: a cast per unit in place of a gather
            self.pg = shd.ParamGather(s, self.e, lambda *a, **k: shd.unit_param_cast(self.b, *a, **k), "param_cast")
        if sh is not None and sh.strategy == "distributed_optimizer":
            self._grads_in_buckets = True  # Megatron: .main_grad are views of the contiguous fp32 grad buffer
            self._mg: dict[int, shd.MegatronBuffer] = {}  # model chunk -> its gradient buffer
            for k in s.model_chunks:
                self._mg[k] = shd.megatron_buffer(s, k, sum(len(b.bucket_len) for b in self._mg.values()),
                                                  experts=not moe.own_expert_grads(s))

    def _new_micro_batch(self, mb: int) -> None:
        self._mb = mb
        if self.pg is not None:
            self.pg.new_micro_batch()

    def _gather_layer_params(self, layer: int, phase: Phase) -> None:
        """Hook at the start of a unit's compute (``layer`` -1: embeddings, ``num_layers``: the head):
        ZeRO-3/FSDP all-gather with prefetch; Megatron ``overlap_param_gather``: wait for the unit's buckets."""
        if self.pg is not None:
            self.pg.enter(layer, phase)
        elif (self.sh is not None and self.sh.strategy == "distributed_optimizer" and self.sh.overlap_param_gather
              and phase == Phase.FWD and self._mb == 0):
            buf = self._mg[self._chunk]
            if not buf.gather_ops:  # the chunk's buckets, in forward order, on the dp stream at its first forward
                for bi in reversed(range(len(buf.bucket_len))):
                    buf.gather_ops[bi] = self._collective(f"megatron.param_all_gather.{buf.first_bucket + bi}",
                                                          "all_gather", self._param_gather_bytes(buf, bi), [],
                                                          Phase.FWD)
            hooks = buf.hook_buckets.get(layer, ())
            self.e.wait_for.extend(buf.gather_ops[bi] for bi in hooks)
            self._fp8_transposes(buf, hooks, [buf.gather_ops[bi] for bi in hooks])

    def _release_layer_params(self, layer: int, phase: Phase) -> None:
        """Hook at the end of a block's backward: BACKWARD_POST prefetch, then the FSDP unit's reduce-scatter."""
        if self.pg is not None:
            self.pg.leave(layer, phase)
        if self.sh is not None and self.sh.unit_buckets and (self.last_mb or self._every_mb) and self._bucket:
            self._unit_sp_grads()
            self._close_bucket()

    def _persistent_sharded(self) -> None:
        s, b, sh = self.s, self.b, self.sh
        P = s.rank_num_parameters  # this pipeline stage's (the whole model without a pipeline)
        Ps = moe.sharded_state(s, P, sh.shard) if sh.strategy == "distributed_optimizer" else self._shard_numel(P)
        half = self.e.half
        st = sh.strategy
        if st == "distributed_optimizer":  # Megatron: bf16 params and fp32 grad buffer whole, 12 bytes/param / dp
            self._half_params(P)
            b.persistent("params.master_fp32", 4 * Ps)
            b.persistent("grad.ddp_buckets", self._grad_elem_bytes * P)  # fp32, or 16-bit (_half_grad_buffer)
        elif st == "zero3":  # 16-bit partition + gradient partition + fp32 master (ZeRO paper (2 + 2 + K) Psi / Nd)
            b.persistent(f"params.{half}.partition", 2 * Ps)
            if self.pg.persistent_numel:
                b.persistent(f"params.{half}.persistent", 2 * self.pg.persistent_numel)
            b.persistent("params.master_fp32", 4 * Ps)
            b.persistent(f"grad.{half}.partition", 2 * Ps)
        elif st == "no_shard":
            b.persistent("params.fp32", 4 * P)
        else:  # FSDP: the fp32 flat parameters, sharded
            b.persistent("params.fp32.shard", 4 * Ps)
        n = P if st == "no_shard" else Ps
        b.persistent("optimizer.exp_avg", 4 * n)
        b.persistent("optimizer.exp_avg_sq", 4 * n)

    def _half_params(self, P: int) -> None:
        """The model's 16-bit parameters, whole on every rank; with ``fp8_param_gather`` the block Linear weights
        (``sharding.fp8_weight_numel``) are fp8 parameters instead: 1 B each in Megatron's uint8 param buffer
        (``params.fp8``) and, where fp8 GEMMs are TN-only (``fp8_weight_copies`` 2), their transposes
        (``params.fp8_transpose``, made after each all-gather: ``_fp8_transposes``). Sources:
        NVIDIA/Megatron-LM main of 2025 (commit not pinned) megatron/core/distributed/distributed_data_parallel.py (a
        ``Float8Tensor``'s buffer dtype is ``torch.uint8``, each (param dtype, grad dtype) its own buffer) and
        param_and_grad_buffer.py ``finish_param_sync`` -> megatron/core/fp8_utils.py ``post_all_gather_processing``
        -> NVIDIA/TransformerEngine@002a3e57 transformer_engine/pytorch/tensor/utils.py
        (``model_weight._create_transpose()`` where ``is_non_tn_fp8_gemm_supported()`` is false)."""
        f8 = shd.fp8_weight_numel(self.s) if self.s.fp8_param_gather else 0
        self.b.persistent(f"params.{self.e.half}", 2 * (P - f8))
        if f8:
            self.b.persistent("params.fp8", f8)
            if self.s.fp8_weight_copies == 2:
                self.b.persistent("params.fp8_transpose", f8)

    def _fsdp2_meta(self) -> dict:
        """FSDP2 graphs: ``param_shard_numels``, this rank's padded shard of each parameter (``fsdp2.padded_numel`` /
        the shard size), in ``param_groups`` order: the CPU tensors of ``fsdp.offload_policy``'s CPU AdamW; and
        ``param_part_shard_numels``, the same split into the PyTorch parameters each stands for (``fsdp2.dim0_parts``:
        torchtitan's separate ``wq`` / ``wk`` / ``wv``, ``w1`` / ``w3``), one tuple per group. {} else."""
        if self.sh is None or self.sh.version != 2:
            return {}
        w = self.sh.shard_size
        parts = []
        for g in self.groups:
            dims, row = fsdp2.dim0_parts(self.s, g.name, g.numel)
            parts.append(tuple(-(-d // w) * row for d in dims))
        return {"param_shard_numels": tuple(fsdp2.padded_numel(self.s, g.name, g.numel, w) // w for g in self.groups),
                "param_part_shard_numels": tuple(parts)}

    def _shard_numel(self, P: int) -> int:
        """Elements of this rank's shard of its ``P`` parameters: FSDP2 pads each parameter
        (``fsdp2.sharded_numel``), FSDP1 / ZeRO-3 the flat buffer (``ShardingSpec.shard``)."""
        if self.sh.version == 2:
            return fsdp2.sharded_numel(self.s, self.sh.shard_size)
        return self.sh.shard(P)

    @property
    def _megatron_optimizer(self) -> bool:
        """``TransformerSpec.megatron_optimizer``: Megatron-LM's mixed-precision optimizer runs the step."""
        return self.s.megatron_optimizer

    @property
    def _half_grad_buffer(self) -> bool:
        """``TransformerSpec.megatron_half_grads``: Megatron's contiguous grad buffer is 16-bit (fp16, or bf16 with
        ``--grad-reduce-in-bf16``), 2 bytes per element."""
        return self.s.megatron_half_grads

    def _copy_model_grads_to_main_grads(self, n: float, grads: list[str], deps: list[int]):
        """Megatron ``_copy_model_grads_to_main_grads`` with a 16-bit grad buffer (``_half_grad_buffer``):
        ``main_param.grad = model_param.main_grad.float()`` for the ``n`` gradient elements this rank updates (its
        shard with the distributed optimizer), read 2 + write 4 bytes each, into fresh fp32 main grads that the
        unscale, the norm and the AdamW read. Source: NVIDIA/Megatron-LM megatron/optimizer/optimizer.py
        ``Float16OptimizerWithFloat16Params._copy_model_grads_to_main_grads`` (distrib_optimizer.py: the shard's
        ``shard_model_grad.float()``); with an fp32 buffer ``.float()`` returns the tensor itself (no kernel).
        Returns ``(grads, deps)`` for the optimizer."""
        e = self.e
        main = e.fresh("grad.main_fp32")
        i = e.kernel("megatron.copy_model_grads_to_main_grads", C.CAST, reads=2 * n, writes=4 * n, flops=n,
                     out=[(main, 4 * n)], uses=grads, deps=deps, dtype="fp32")
        return [main], [i]

    def _zero_grad_buffer(self) -> None:
        """Megatron: ``model_chunk.zero_grad_buffer()`` at the start of every step, a memset of the rank's whole
        contiguous grad buffer (``_grad_elem_bytes`` per parameter: the fp32 ``main_grad``; not sharded by the
        distributed optimizer, every rank holds the full buffer). Source: NVIDIA/Megatron-LM
        megatron/core/distributed/param_and_grad_buffer.py (``reset``: ``self.grad_data.zero_()``), called by
        megatron/training/training.py ``train_step``. PyTorch ``zero_grad(set_to_none=True)`` (its default since
        2.0) and DeepSpeed launch no kernel: nothing is emitted for them."""
        if not self._megatron_optimizer:
            return
        self.e.phase, self.e.layer = Phase.OPT, -1
        n = self._grad_elem_bytes * self.s.rank_num_parameters  # Megatron's optimizer: no LoRA (_megatron_optimizer)
        self.e.kernel("megatron.zero_grad_buffer", C.MEMSET, writes=n, dtype="fp32")

    def _clip_grad_norm(self, n: float, grads: list[str], deps: list[int]) -> list[int]:
        """Megatron ``clip_grad_norm`` over the ``n`` fp32 main grads this rank updates (``training.clip_grad >
        0``): one ``multi_tensor_l2norm`` reading 4 bytes per element (2 FLOPs: square, add), then
        ``total_norm.item()`` on the host. Source: NVIDIA/Megatron-LM megatron/core/optimizer/clip_grads.py
        ``get_grad_norm_fp32`` (apex ``amp_C.multi_tensor_l2norm``; the releases of the validated runs, up to
        core_r0.8.0, take ``.item()`` there). The clip itself (``clip_grad_by_total_norm_fp32``:
        ``multi_tensor_scale``, read + write 4 bytes per element) runs only when ``max_norm / total_norm < 1``: not
        priced, a converged run's norm stays under ``clip_grad`` (assumed; the logs of the validated runs do not
        give it). Newer releases with Transformer Engine's ``multi_tensor_scale_tensor`` scale every step without
        the ``.item()``: not modelled. The norm's all-reduce: ``_grad_stats_all_reduce`` (model-parallel group, or
        the world with the distributed optimizer). The shared (tied) and TP-duplicated params excluded from the norm
        are counted (a few norm weights). Returns the deps of the optimizer kernel."""
        e = self.e
        norm = e.kernel("clip_grad.l2norm", C.REDUCTION, reads=4 * n, writes=4, flops=2 * n, uses=grads, deps=deps,
                        dtype="fp32")
        return [self.b.add("clip_grad.total_norm.item", OpKind.SYNC, "host",
                           deps=self._grad_stats_all_reduce("clip_grad.total_norm", [norm]), phase=Phase.OPT,
                           launch=False)]

    @property
    def _fsdp_clips(self) -> bool:
        """FSDP's ``clip_grad_norm_`` runs before the optimizer: ``clip_grad > 0`` with an FSDP sharding strategy
        (``_fsdp_clip_grad_norm``)."""
        return self.s.clip_grad > 0 and self.sh is not None and self.sh.unit_buckets

    @property
    def _deepspeed_zero_step(self) -> bool:
        """DeepSpeed ZeRO-1/2 (over data parallelism, no sharding spec) runs its ``step``'s norm, fp32 gradient copy
        and unscale before the optimizer kernel (``grad_norm.deepspeed_zero_step``), every step."""
        return self.zero in (1, 2) and self.sh is None

    @property
    def _deepspeed_zero3_step(self) -> bool:
        """DeepSpeed ZeRO-3 over data parallelism runs its ``step``'s fp16 overflow check, norm, fp32 gradient copy
        and unscale before the optimizer kernel (``grad_norm.deepspeed_zero_step`` with ``stage3``), every step,
        whatever ``clip_grad``. With optimizer offload the offload policy replaces the step (not priced there)."""
        return self.zero == 3 and self.sh is not None and self.sh.strategy == "zero3"

    @property
    def _torch_clips(self) -> bool:
        """A PyTorch loop calls ``torch.nn.utils.clip_grad_norm_`` (``TransformerSpec.clip_grad_norm_call``, with
        ``clip_grad > 0``) and neither Megatron's optimizer, DeepSpeed ZeRO nor FSDP computes its own norm."""
        s = self.s
        return (s.clip_grad_norm_call and s.clip_grad > 0 and not self._megatron_optimizer and self.zero == 0
                and not s.deepspeed_fp16_optimizer
                and not (self.sh is not None and self.sh.unit_buckets))

    def _fsdp_clip_grad_norm(self, n: float, grads: list[str], deps: list[int]) -> list[int]:
        """PyTorch FSDP ``FullyShardedDataParallel.clip_grad_norm_(max_norm)`` over the ``n`` gradient elements of
        this rank's shard (fp32: the sharded gradient is in the parameters' dtype, fp32 with
        ``amp_fp32_params``), before the optimizer; returns the optimizer's deps. Source: pytorch/pytorch
        torch/distributed/fsdp/fully_sharded_data_parallel.py ``clip_grad_norm_`` (releases 2.0-2.4) and
        ``_get_grad_norm``: a ``torch.linalg.vector_norm`` of each local gradient in fp32 (read 4 B per element,
        2 FLOPs) then of their stack, the sum of squares all-reduced over the FSDP process group (every shard rank;
        unconditional, NO_SHARD's local norm added after it), ``clip_coef = max_norm / (total_norm + 1e-6)`` clamped
        at 1 on the device, then ``grad.mul_(clip_coef_clamped)`` on every gradient whatever the norm (read +
        write 4 B per element). No host read of the norm (no ``.item()``): the host does not wait. Priced as one
        norm kernel, the 4-byte all-reduce and one ``mul_`` kernel: the per-tensor launches (one norm and one
        ``mul_`` per flat parameter) and the scalar kernels (stack, pow, add, div, clamp) are not counted.
        Composer's ``gradient_clipping`` algorithm with ``clipping_type: norm`` calls it on FSDP models
        (mosaicml/composer composer/algorithms/gradient_clipping/gradient_clipping.py).

        FSDP2 (``fully_shard``, no method of its own): ``torch.nn.utils.clip_grad_norm_`` on the DTensor gradients
        (torchtitan ``dist_utils.clip_grad_norm_``): the norm is ``Partial`` on every mesh dimension the
        gradients are sharded over and ``total_norm.full_tensor()`` all-reduces it over each, the shard group
        and, with tensor parallelism, the TP group (one more 4-byte all-reduce, ``_grad_stats_all_reduce``); a
        pipeline's extra all-reduce over the stages (torchtitan's ``pp_mesh``) is not built. Sources:
        pytorch/torchtitan torchtitan/distributed/utils.py ``clip_grad_norm_``; pytorch/pytorch
        torch/distributed/tensor ``Partial`` -> ``Replicate`` redistribution (one all-reduce per mesh dim)."""

        def reduce(d: list[int]) -> list[int]:
            ar = [self._collective("fsdp.clip_grad.total_norm.all_reduce", "all_reduce", 4, d, Phase.OPT,
                                   group=self._shard_group)]
            if self.sh.version == 2 and self.tp > 1 and self.s.pipeline_parallel_size == 1:
                return self._grad_stats_all_reduce("fsdp.clip_grad.total_norm", ar)
            return ar

        return gn.norm_then_mul(self, "fsdp.clip_grad", n, grads, deps, reduce)

    def _grad_stats_all_reduce(self, what: str, deps: list[int], nbytes: int = 4) -> list[int]:
        """Megatron's optimizer: one fp32 value (the squared gradient norm, or fp16's found-inf flag) all-reduced,
        after ``deps``, over the group Megatron reduces its gradient statistics over; returns the deps of what
        follows (``deps`` itself when that group is this rank alone). ``nbytes``: the value's size, 4 (fp32), or
        8 for DeepSpeed ZeRO-3's fp64 squared norm (deepspeedai/DeepSpeed@007cca6a ``deepspeed/runtime/zero/
        stage3.py`` ``get_grad_norm_direct``: the sum of the ``.double().norm(2)`` squares, all-reduced over the
        data-parallel group, then by ``_model_parallel_all_reduce`` over the model-parallel group).

        The group (NVIDIA/Megatron-LM megatron/core/optimizer/clip_grads.py ``get_grad_norm_fp32``, all-reduce
        over ``grad_stats_parallel_group``, formerly ``model_parallel_group``; optimizer.py
        ``_unscale_main_grads_and_check_for_nan``, the found-inf all-reduce over the same group): the
        model-parallel group (tp x pp ranks; the gradients are whole on every data-parallel replica), or, with
        the distributed optimizer (each rank's main grads a 1/dp shard), every rank (``DistributedOptimizer
        .get_model_parallel_group`` returns None, the default world group; the ``get_grad_stats_parallel_group``
        of newer releases is the same world). Modelled as one 4-byte NCCL all-reduce (latency-bound):

        * ``world``: the distributed optimizer (group ``world``, stream ``comm.world``);
        * ``mp`` / ``pp``: pipeline stages, with TP (the tp x pp ranks) or without (the stage representatives);
        * ``tp``: one stage with TP (``_tp_op``); one rank: nothing.

        With pipeline stages it is a rendezvous of every stage (of every data-parallel rank class with the world
        group, ``api._meet_across_classes``): the ranks start it together, so a straggler delays every stage's
        optimizer. Expert-parallel MoE ranks (Megatron's separate expert grad-stats group) are not told apart."""
        s, p = self.s, self.s.pipeline_parallel_size
        dtype = {8: "fp64", 1: "uint8"}.get(nbytes, "fp32")  # 1: a byte flag (DeepSpeed's overflow ByteTensor)
        if self.sh is not None and self.sh.strategy == "distributed_optimizer":
            group = "world"
        elif p > 1:
            group = "mp" if self.tp > 1 else "pp"
        elif self.tp > 1:
            return [self._tp_op(f"{what}.all_reduce", "all_reduce", nbytes, deps=deps, dtype=dtype)]
        else:
            return deps
        meta = {"collective": "all_reduce", "bytes": nbytes, "group": group}
        if group == "pp":
            meta["pp_ranks"] = tuple(range(p))
        if p > 1:
            meta |= {"rendezvous": (group, what), "parties": p}
        return [self.b.add(f"{group}.{what}.all_reduce", OpKind.COLLECTIVE, f"comm.{group}", deps=deps,
                           phase=Phase.OPT, bytes_read=float(nbytes), dtype=dtype, meta=meta)]

    def _copy_main_params_to_fp8(self, n8: float, adam: int, grads: list[str]) -> None:
        """``fp8_param_gather``: Megatron ``quantize_param_shard`` for the ``n8`` fp32 master elements of fp8
        parameters this rank updates, Transformer Engine's delayed-scaling path: ``master_weight.to(bf16)`` for
        all of them first (read 4 + write 2 bytes each, a bf16 copy of the shard alive through the quantize), then
        ``update_quantized`` into the fp8 param buffer (read 2 + write 1, its amax), then one packed fp32 amax per
        fp8 weight all-reduced (MAX) over the data-parallel group. Sources: NVIDIA/Megatron-LM main of 2025 (commit
        not pinned) megatron/core/fp8_utils.py ``quantize_param_shard``, called by
        megatron/core/optimizer/distrib_optimizer.py ``_copy_main_params_to_model_params``;
        NVIDIA/TransformerEngine@002a3e57 transformer_engine/pytorch/tensor/utils.py ``cast_master_weights_to_fp8``
        and ``_cast_master_weights_to_fp8_delayed_scaling``. The scale-inverse updates (a few bytes per weight)
        are not priced. The fp32 main grads ``grads`` are still allocated (``.grad`` of the main params until the
        next step's ``zero_grad``): the cast holds them."""
        e = self.e
        tmp = e.fresh("fp8.master_bf16")
        cast = e.kernel("megatron.fp8.master_to_bf16", C.CAST, reads=4 * n8, writes=2 * n8, flops=n8,
                        out=[(tmp, 2 * n8)], uses=grads, deps=[adam], dtype="fp32")
        q = e.kernel("megatron.fp8.quantize_param_shard", C.CAST, reads=2 * n8, writes=n8, flops=2 * n8, uses=[tmp],
                     deps=[cast])
        if self.sh is None:  # one data-parallel rank: the all-gather is over itself, the transposes follow the cast
            if self.s.fp8_weight_copies == 2:
                e.kernel("megatron.fp8_transpose", C.COPY, reads=n8, writes=n8, uses=["params.fp8"], deps=[q],
                         dtype="fp8")
        else:
            count = 4 * self.s.rank_layers  # qkv, proj, fc1, fc2 of each block (is_fp8_weight)
            self.comm_ops.append(self.b.add(
                "dp.fp8_param_amax.all_reduce", OpKind.COLLECTIVE, "comm.dp", deps=[q], phase=Phase.OPT,
                bytes_read=4.0 * count, dtype="fp32", meta={"collective": "all_reduce", "bytes": 4 * count,
                                                              "group": "dp"}))

    def _fp8_transposes(self, buf, buckets, deps: list[int]) -> None:
        """``fp8_param_gather`` where fp8 GEMMs are TN-only: after the all-gather of ``buckets`` of ``buf``,
        ``post_all_gather_processing`` writes each fp8 weight's transpose (read 1 + write 1 byte per element, into
        ``params.fp8_transpose``), once per step (``_half_params``' sources)."""
        if not self.s.fp8_param_gather or self.s.fp8_weight_copies != 2:
            return
        for bi in buckets:
            if bi in buf.transposed or not buf.bucket_fp8_numel[bi]:
                continue
            buf.transposed.add(bi)
            n = buf.bucket_fp8_numel[bi]
            self.e.kernel(f"megatron.fp8_transpose.{buf.first_bucket + bi}", C.COPY, reads=n, writes=n,
                          uses=["params.fp8"], deps=deps, dtype="fp8")

    def _copy_main_params_to_model(self, n: float, adam: int) -> None:
        """Megatron ``_copy_main_params_to_model_params`` after the fused AdamW: the ``n`` updated fp32 main params
        of this rank (its shard with the distributed optimizer, into the param buffer the all-gather reads) cast into
        the 16-bit model params, read 4 + write 2 bytes each. Source: NVIDIA/Megatron-LM
        megatron/core/optimizer/optimizer.py ``Float16OptimizerWithFloat16Params._copy_main_params_to_model_params``
        (``_multi_tensor_copy_this_to_that``: ``multi_tensor_scale`` by 1.0, or ``copy_``) and distrib_optimizer.py
        (``shard_model_param.data.copy_(shard_main_param)``); apex's FusedAdam, the kernel of ``adamw``, writes only
        the fp32 params and moments."""
        self.e.kernel("megatron.copy_main_to_model_params", C.CAST, reads=4 * n, writes=2 * n, flops=n,
                      deps=[adam], dtype="fp32")

    def _optimizer_grads(self) -> list[str]:
        if self.sh is None:
            return sorted(self.grad_made) if self.zero < 2 else list(self.grad_shards)
        if self.sh.strategy == "zero3":
            return []  # the persistent gradient partition
        if self.sh.unit_buckets and (self.sh.shards_grads or self.sh.grad_bytes == 2):
            return list(self.grad_shards)
        return sorted(self.grad_made)

    def _optimizer_share(self) -> float:
        P = self.s.rank_num_parameters
        if self.sh is not None and self.sh.strategy == "distributed_optimizer":
            return moe.sharded_state(self.s, P, self.sh.shard) / P
        if self.sh is not None:
            return 1.0 if self.sh.strategy == "no_shard" else self._shard_numel(P) / P
        return moe.sharded_state(self.s, P, self._shard) / P if self.zero else 1.0

    def _after_step_gathers(self, opt: int) -> None:
        """ZeRO-3: the persistent parameters' all-gather; Megatron without overlap_param_gather: the bf16
        parameters' all-gather per bucket after the step."""
        sh = self.sh
        if sh is None:
            return
        if sh.strategy == "zero3" and self.pg.persistent_numel:
            self.comm_ops.append(self._collective("zero3.persistent_param_all_gather", "all_gather",
                                                  2 * self.pg.persistent_numel, [opt], Phase.OPT,
                                                  group=self._shard_group))
        if sh.strategy == "distributed_optimizer":
            moe.expert_param_gathers(self, opt)  # (after the step even with overlap_param_gather)
        if sh.strategy == "distributed_optimizer" and not sh.overlap_param_gather:
            for buf in self._mg.values():
                for bi in range(len(buf.bucket_numel)):
                    self.comm_ops.append(self._collective(f"megatron.param_all_gather.{buf.first_bucket + bi}",
                                                          "all_gather", self._param_gather_bytes(buf, bi), [opt],
                                                          Phase.OPT))
                    self._fp8_transposes(buf, [bi], [self.comm_ops[-1]])

    @staticmethod
    def _param_gather_bytes(buf, bi: int) -> int:
        """Bytes of bucket ``bi``'s parameter all-gather: 2 per 16-bit element, 1 per fp8 parameter element
        (``fp8_param_gather``; Megatron keeps them in their own uint8 buffer, bucketed on its own: here they share
        the 16-bit parameters' buckets, flagged by ``run_warnings``)."""
        return 2 * buf.bucket_numel[bi] - (buf.bucket_fp8_numel[bi] if buf.bucket_fp8_numel else 0)

    def _sharded_grad_ready(self, pg: ParamGroup) -> bool:
        """Bucket a finished gradient (FSDP: per unit; Megatron: its precomputed buckets). False: use the
        DeepSpeed rule (ZeRO-3)."""
        sh = self.sh
        if sh.unit_buckets:
            (self._bucket if pg.layer >= 0 else self._root_bucket).append(pg)
            return True
        if sh.strategy == "distributed_optimizer":
            buf = self._mg[self._chunk]
            self._bucket.append(pg)
            if len(self._bucket) == buf.bucket_len[buf.closed]:
                buf.closed += 1
                self._close_bucket()
            return True
        return False

    def _emit_sharded_bucket(self, k: int, nbytes: int, tensors: list[str], deps: list[int]) -> None:
        sh, st = self.sh, self.sh.strategy
        if st == "no_shard":  # FSDP NO_SHARD: all-reduce of the unit's gradients (DDP); bf16: then cast to fp32
            self.comm_ops.append(self._collective(f"fsdp.grad_all_reduce.{k}", "all_reduce", nbytes, deps, Phase.BWD,
                                                  elem_bytes=sh.grad_bytes))
            if sh.grad_bytes == 2:
                i, grad = shd.grad_cast_back(self.b, k, nbytes, self.comm_ops[-1], tensors)
                self.comm_ops.append(i)
                self.grad_shards.append(grad)
        elif st == "distributed_optimizer":  # in place in the grad buffer
            self.comm_ops.append(self._collective(f"megatron.grad_reduce_scatter.{k}", "reduce_scatter", nbytes, deps,
                                                  Phase.BWD, elem_bytes=self._grad_elem_bytes))
        elif st == "zero3":  # into the persistent partition (after the first micro-batch: a partial added into
            # it); the full gradients are freed
            out = self._reduced_shard(k, sh.grad_bytes * sh.shard(nbytes // sh.grad_bytes)) if self._mb else ()
            self.comm_ops.append(self._collective(f"zero3.grad_reduce_scatter.{k}", "reduce_scatter", nbytes, deps,
                                                  Phase.BWD, uses=tensors, allocs=out, group=self._shard_group,
                                                  elem_bytes=sh.grad_bytes))
        else:  # FSDP: the reduced shard becomes the fp32 sharded .grad; HYBRID: then all-reduced across nodes
            numel = nbytes // sh.grad_bytes
            rs = self._collective(f"fsdp.grad_reduce_scatter.{k}", "reduce_scatter", nbytes, deps, Phase.BWD,
                                  uses=tensors, allocs=self._reduced_shard(k, 4 * sh.shard(numel)),
                                  group=self._shard_group, elem_bytes=sh.grad_bytes)
            self.comm_ops.append(rs)
            if sh.replicate_size > 1:
                self.comm_ops.append(self._collective(f"fsdp.grad_all_reduce_replicas.{k}", "all_reduce",
                                                      sh.grad_bytes * sh.shard(numel), [rs], Phase.BWD,
                                                      group="dp_replicate", elem_bytes=sh.grad_bytes))

    def build(self) -> OpGraph:
        s = self.s
        self._persistent()
        self._zero_grad_buffer()
        state: dict[tuple[int, int], dict] = {}
        actions = stage_actions(s.pipeline_schedule, s.pipeline_parallel_size, s.num_micro_batches, s.pipeline_rank,
                                s.virtual_pipeline_size)
        split_w = any(isinstance(a, Action) and a.kind == "W" for a in actions)  # SPLIT_BACKWARD with a pipeline
        self._bwd_last = {(s.model_chunks[a.chunk], a.micro_batch): a.last for a in actions
                          if isinstance(a, Action) and a.kind == "B"}
        for a in actions:
            if isinstance(a, Comm):
                self._comm(a)
            elif a.kind == "F":
                state[a.chunk, a.micro_batch] = self._forward(a.chunk, a.micro_batch)
            elif a.kind == "B":
                if split_w:  # the weight gradients wait for the W action
                    self._deferred = self._w_queue[a.chunk, a.micro_batch] = []
                self._backward(a.chunk, a.micro_batch, state.pop((a.chunk, a.micro_batch)), a.last)
                self._deferred = None
            else:
                self._weight(a.chunk, a.micro_batch, a.last)
        if self.fp8:  # the scaling state of every fp8 Linear (input, weight, output gradient), resident
            self.b.persistent("fp8.scaling_meta", self._fp8_meta_bytes(3 * len(self._fp8_w)))
            for ws, nbytes in self._fp8_ws.items():
                self.b.persistent(ws, nbytes)
        self._sequence_parallel_grads()
        self._pipeline_syncs()
        if s.deepspeed_bf16_optimizer:  # pipe/engine.py: ReduceTiedGrads, then ReduceGrads, then the step
            bf16opt.reduce_grads(self)
        if s.deepspeed_fp16_optimizer:  # engine.py _backward_epilogue / pipe/engine.py _exec_reduce_grads
            fp16opt.reduce_grads(self, self._optimizer_grads())
        self._optimizer()
        # the measured training loops synchronise the device after every step
        self.b.add("step.synchronize", OpKind.SYNC, "host", deps=[len(self.b) - 1], phase=Phase.OTHER,
                   launch=False)
        samples = s.micro_batch_size * s.num_micro_batches * s.data_parallel_size
        return self.b.build(
            samples_per_step=float(samples),
            tokens_per_step=float(samples * s.seq_length),
            # per GPU: a pipeline rank's share is counted as the average, 1 / p of the model's FLOPs
            model_flops_per_step=((lora.model_flops_per_sample(s) if s.lora is not None else s.model_flops_per_sample())
                                  * s.micro_batch_size * s.num_micro_batches
                                  / s.pipeline_parallel_size / s.context_parallel_size),
            source="builder:gpt",
            param_groups=tuple(self.groups),
            model=model_facts(s),
            meta={"num_parameters": s.num_parameters,
                  "num_trainable_parameters": lora.trainable_parameters(s) if s.lora is not None else s.num_parameters, "tensor_parallel_size": s.tensor_parallel_size,
                  "sharding": self.sh.strategy if self.sh is not None else None,
                  "shard_size": self.sh.shard_size if self.sh is not None else 1,
                  "param_bytes": self.sh.param_bytes if self.sh is not None else None,
                  **self._fsdp2_meta()},
        )
