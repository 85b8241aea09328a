"""Analytic peak GPU memory per rank, without simulating: what ``simulate search`` prunes with.

The estimate mirrors the tensors the GPT builder (``simulator/graph/builders/transformer.py``)
allocates, so that it predicts the simulator's own ``peak_device_memory_bytes``; it is checked
against simulated peaks on bundled scenarios (``tests/simulator/studies/test_memory_estimate.py``:
within ``TOLERANCE``). For pipeline stage ``r`` with ``P`` parameters (``TransformerSpec.rank_num_parameters``:
its blocks split by TP, the embedding on the first stage, the LM head on the last), ``N_d`` data-parallel
ranks, ``T = b s`` tokens per micro-batch, ``t`` the TP size:

* **Model states** (Rajbhandari et al., *ZeRO*, SC20, section 3.1: ``(2 + 2 + K) Psi`` with ``K = 12``
  for mixed-precision Adam, partitioned by ``N_d`` per stage): 16-bit parameters ``2P`` and fp32 master
  ``4P`` (``amp_fp32_params``: fp32 parameters ``4P``, no master), Adam moments ``8P``, fp32 gradients
  ``4P`` (``2P`` for DeepSpeed ZeRO-1/2 in bf16 / fp16: the model dtype, ``_grad_bytes``; DDP with ``N_d > 1`` also keeps its bucket buffers, ``4P``, unless ``gradient_as_bucket_view`` or Megatron's DDP in bf16 / fp16, whose gradients are views of its grad buffer).
  ZeRO-1 divides master and moments by ``N_d``; ZeRO-2 also the gradients (plus, at each bucket's close,
  the full gradients of the buckets not yet reduce-scattered beside the activations not yet freed: one bucket
  without ``overlap_comm``, between one and two with it, timing-dependent, so that case is a band
  ``[low_device_bytes, peak_device_bytes]``: ``_zero2_stage``); DeepSpeed ZeRO-1/2's IPG buffers
  (``contiguous_gradients``, default true: ``reduce_bucket_size`` elements in the model dtype, two with
  ``overlap_comm``; ``_ipg_buffer``), into which ZeRO-2 copies its gradients (no band then); ZeRO-3 all of
  them (plus ``d + 1`` gathered blocks forward and backward, ``d`` the prefetch depth); FSDP fp32 sharded
  parameters, gradients and moments (plus two gathered units; FSDP2: three, padded per parameter, and with an
  int ``fsdp.reshard_after_forward`` r every block's ``1/r`` post-forward shard); the Megatron distributed optimizer shards
  master and moments, keeps the 16-bit parameters and the fp32 gradient buffer whole. Megatron's gradient buffer
  is 16-bit (2 B) with fp16 (``ddp.accumulate_allreduce_grads_in_fp32`` off) or ``ddp.grad_reduce_in_bf16``, and its
  fresh fp32 main grads (``4 P / N_d``) join the step's peak; with ``training.fp8_param_gather`` the block Linear
  weights are 1 B fp8 parameters (+ 1 B transposes where fp8 GEMMs are TN-only, no fp8 workspace) and the step's
  peak holds the bf16 copy of their master shard (``2 P_fp8 / N_d``). DeepSpeed's ``BF16_Optimizer`` (a DeepSpeed
  pipeline with ZeRO stage 0 and bf16): ``2P`` bf16 parameters, a bf16 accumulation buffer of every parameter
  ``2P``, fp32 master and moments ``12P / N_d``, the bf16 ``.grad`` ``2P`` from the first backward, and at the
  step the fp32 copy of the gradient partition ``4P / N_d`` (or the larger fp32 copy its norm makes of the
  largest tensor; ``graph/builders/bf16_optimizer.py``). DeepSpeed's ``FP16_Optimizer`` (ZeRO stage 0 with fp16,
  or bf16 without a pipeline): ``2P`` 16-bit parameters, a flat fp32 master copy ``4P`` and moments ``8P`` of every
  parameter, the 16-bit ``.grad`` ``2P`` from the first backward, and at the step the per-tensor fp32 copies and
  the flat fp32 gradient of the weight-decay group ``8P_0`` beside the ``.grad`` (then of the no-weight-decay
  group beside the first's flat gradient, ``2P_0 + 8P_1``, if larger; a pipe-replicated embedding's stage: the
  norm mask's tensors, if larger; ``graph/builders/fp16_optimizer.py`` ``step_transient_bytes``).
* **Activations** saved per block and micro-batch (Korthikanti et al., *Reducing Activation Recomputation
  in Large Transformer Models*, MLSys 2023, section 4, with flash attention so no ``s^2`` term and no
  dropout masks; the builder's tensors): the residual stream twice (``x``, ``x2``: ``2 a_b T_n h``, ``a_b``
  2 bytes, 4 with ``amp_fp32_params`` under autocast, not with FSDP2 gathering bf16 parameters; ``T_n = T / t`` with sequence parallelism), the two norm outputs
  the GEMMs read (``2 x 2 T h``: 16-bit, all-gathered to ``T`` tokens with SP), QKV ``2 T (h + 2 g d) / t``
  (+ the rotated q, k with rope, except with flash attention: the rotated q, k and V's contiguous copy in its
  place, Transformer Engine's ``get_qkv_layout``; with torchtitan's ``repeat_kv`` q and the ``a``-head K and V,
  ``3 x 2 T a d / t``: ``qkv_layout``), the attention output and its contiguous copy ``2 x 2 T h / t`` (one less
  with selective recompute), fc1 and GELU/SwiGLU outputs ``2 T (f_1 + f) / t``, norm statistics (``norm_stats_bytes``; the final norm's too),
  the flash kernel's fp32 log-sum-exp ``4 b a s / t`` (``flash_lse_bytes``; not with selective recompute), and with
  ``amp_fp32_params`` the bf16 copies of the block's weights (``fp32`` / ``tf32``: every 16-bit size above
  doubles, no master weights, no copies); with ``attention_backend: unfused`` the
  attention output is not kept but the core's ``s^2`` tensors are (``attention.saved_core_bytes``, ``5 a s^2 b
  / t`` with attention dropout; none with selective recompute, which adds them and the core's score gradients
  to the backward transient, the larger of them and the MLP's backward working set), and hidden dropout adds two 1-byte masks ``2 T_n h``. With full recompute only ``x`` is kept
  per block, plus one block's activations during its backward; with torchtitan's every-n-th-block checkpointing
  (``recompute_every`` n) only the blocks ``(i + 1) % n == 0`` are checkpointed, the others keep all, and the rebuilt
  block counts against the later blocks' activations already freed (``_rebuilt_bytes``); torchtitan's per-op policy
  (``activation_checkpoint.selective_ac_option: op``) keeps per block the tensors of ``op_sac.KEPT`` (the builder's
  table) and rebuilds the rest of one block during its backward. A stage keeps ``n_r`` micro-batches in
  flight, counted from its schedule (``pipeline.stage_actions``: ``p - r`` for 1F1B, ``m`` for GPipe,
  Megatron's warm-up for the interleaved schedule; 1 without pipelining).
* **Transients**: the last stage's fp32 logits ``12 T V / t`` with PyTorch's ``F.cross_entropy`` (log-softmax
  output, its gradient and the loss gradient live together in backward; ``4 T V / t`` saved per micro-batch in
  flight); ``6 T V / t`` with Megatron-LM's (``training.cross_entropy: megatron``: the saved fp32 softmax, made
  the gradient in place, beside the 16-bit logits or their gradient; ``4 T V / t`` in fp32 / tf32), the first
  stage's fp32 embedding gradient ``4 V h / t``, one block's backward working set ``2 T (f_1 + f) / t +
  2 a_b T h`` and its largest 16-bit weight gradient.
* **fp8** (``training.fp8``, Transformer Engine): the cached fp8 weight workspace, resident, ``c`` bytes per
  element of the stage's block Linear weights (``c = 2`` where fp8 GEMMs are TN-only: the weight and its transpose;
  1 on Blackwell; ``fp8_workspace_bytes``; none with ``fp8_param_gather``), and each block's four Linear inputs saved in fp8, 1 B per element less:
  ``T (2 h + h / t + f / t)`` per block and micro-batch.
* **Overheads**: ``memory.cuda_context_bytes`` + ``memory.allocator_reserve_fraction`` x tensors (the
  scenario's ``memory`` section, the engine's defaults).

* **Mixture of experts** (every block an MoE block, ``_moe_mlp_delta``): in place of the dense MLP's
  tensors the router's probabilities, routing map and auxiliary-loss scores, the experts' input, fc1 and
  activation outputs over the busiest EP rank's ``N_g`` rows, the routed output the combine reads, with the
  all-gather dispatcher its local routing map and permuted probabilities, the shared expert's; the block's
  backward working set above what is still saved at each point of its backward as the transient
  (``moe_backward_peak``); expert optimizer state sharded over ``edp`` (``moe.sharded_state``).
  Grouped and per-expert GEMMs save the same bytes. Checked against the simulation within 2.4%
  (``tests/simulator/graph/test_moe_sequential_allgather.py``).

Not estimated (``NotEstimated``; the search simulates such points instead of pruning them): optimizer,
parameter or activation offload to the host; LoRA (``training.lora``); mixture-of-experts models with dense
blocks between the MoE blocks (``moe_layer_freq``) or with fp8.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from simulator.config.schema import ScenarioConfig
from simulator.graph.builders import attention as core
from simulator.graph.builders import fp16_optimizer as fp16opt
from simulator.graph.builders import op_sac, qkv_layout
from simulator.graph.builders.pipeline import SPLIT_BACKWARD
from simulator.graph.builders.transformer import FULL_PRECISIONS, MEGATRON_DDP_PRECISIONS
from simulator.studies.moe_backward_peak import moe_dims, working_peak

#: Relative error allowed to ``estimate_memory`` against the simulated ``peak_device_memory_bytes``: every
#: tested case (``tests/simulator/studies/test_memory_estimate.py``: DDP, ZeRO-1/2/3, FSDP, the distributed
#: optimizer, TP with and without SP, recompute, 1F1B, GPipe, interleaved, GQA/SwiGLU/rope) is within it
#: (measured: at most 1.2%). ``search`` prunes a point only when even
#: ``estimate / (1 + TOLERANCE)`` exceeds the GPU's memory, so a point that might fit is simulated.
TOLERANCE = 0.05


class NotEstimated(ValueError):
    """The scenario uses a feature the analytic estimate does not cover (offload)."""


@dataclass(frozen=True)
class StageMemory:
    """Estimated peak of one pipeline stage, bytes per GPU, by category.

    Attributes:
        pp_rank: The stage.
        in_flight: Micro-batch passes whose activations are held at the peak (model chunks x micro-batches).
        by_category_bytes: ``params``, ``grad``, ``optimizer``, ``activations``, ``transient``, ``overheads``;
            with fp8 also ``workspace`` (Transformer Engine's cached fp8 weights, ``fp8_workspace_bytes``).
        slack_bytes: How far below ``total_bytes`` the simulated peak may lie for timing reasons (ZeRO-2 with
            ``overlap_comm``: one bucket's reduce-scatter finished, or not, before the next bucket closes); 0
            where the estimate is a point estimate.
    """

    pp_rank: int
    in_flight: int
    by_category_bytes: dict[str, float] = field(default_factory=dict)
    slack_bytes: float = 0.0

    @property
    def total_bytes(self) -> float:
        """Sum of the categories, bytes."""
        return float(sum(self.by_category_bytes.values()))


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated peak device memory of the worst stage, against the GPU's capacity.

    Attributes:
        peak_device_bytes: Largest stage total, bytes (compare with the summary's ``peak_device_memory_bytes``).
        capacity_bytes: The GPU's memory (``hbm_capacity_bytes``): the smallest over the ranks.
        stages: Every stage's estimate.
        stage_capacity_bytes: Per stage, the smallest memory of the GPUs its ranks run on (``rank_overrides``
            ``gpu``: a stage's or a replica's); empty: every stage has ``capacity_bytes``.
    """

    peak_device_bytes: float
    capacity_bytes: float
    stages: tuple[StageMemory, ...]
    stage_capacity_bytes: tuple[float, ...] = ()

    def _caps(self) -> tuple[float, ...]:
        return self.stage_capacity_bytes or (self.capacity_bytes,) * len(self.stages)

    @property
    def pp_rank(self) -> int:
        """The stage with the largest estimate."""
        return max(self.stages, key=lambda s: s.total_bytes).pp_rank

    @property
    def binding_pp_rank(self) -> int:
        """The stage with the least headroom against its smallest GPU (``rank_overrides`` may put a stage or a
        replica on another GPU); ``pp_rank`` when every rank has the same GPU."""
        caps = self._caps()
        return min(range(len(self.stages)), key=lambda i: (caps[i] - self.stages[i].total_bytes, i))

    @property
    def headroom_bytes(self) -> float:
        """Capacity minus the estimated peak on the tightest stage (negative: does not fit), bytes."""
        caps = self._caps()
        return min(c - s.total_bytes for c, s in zip(caps, self.stages))

    @property
    def low_device_bytes(self) -> float:
        """The lowest peak the simulation can reach, bytes: ``peak_device_bytes`` less each stage's
        ``slack_bytes`` (timing-dependent buckets: DeepSpeed ZeRO-2 with ``overlap_comm``); equal to
        ``peak_device_bytes`` elsewhere. The simulated peak lies in ``[low_device_bytes, peak_device_bytes]``
        within ``TOLERANCE``."""
        return max(s.total_bytes - s.slack_bytes for s in self.stages)

    def surely_over(self, tolerance: float = TOLERANCE) -> bool:
        """True when even the lower end of the estimate's band (``low_device_bytes``, less its error) exceeds
        the capacity."""
        return any((s.total_bytes - s.slack_bytes) / (1.0 + tolerance) > c for c, s in zip(self._caps(), self.stages))


def in_flight_passes(schedule: str, p: int, m: int, rank: int, v: int,
                     split: tuple[int, ...]) -> tuple[int, int, bool]:
    """Peak of the activations a pipeline rank holds: ``(passes, layers, after_backward)``: the number of
    (chunk, micro-batch) forwards not yet run backward and the blocks they hold, at the moment the blocks
    held are the most (``pipeline.stage_actions``'s order), and whether that peak is reached again after a
    backward (then an earlier micro-batch's gradients exist at the peak: 1F1B with ``m > p - r``, not GPipe)."""
    return _peak_passes(schedule, p, m, rank, v, split)[:3]


def chunk_passes_at_peak(schedule: str, p: int, m: int, rank: int, v: int, split: tuple[int, ...]) -> dict[int, int]:
    """At the peak ``in_flight_passes`` finds: the passes in flight per local model chunk (``{chunk: passes}``).
    With an interleaved schedule a rank's passes in flight belong to different chunks, and only the last
    model chunk holds the LM head's saved tensors (the first: the embedding's tokens)."""
    return _peak_passes(schedule, p, m, rank, v, split)[3]


def _peak_passes(schedule: str, p: int, m: int, rank: int, v: int,
                 split: tuple[int, ...]) -> tuple[int, int, bool, dict[int, int]]:
    """``in_flight_passes`` plus the passes per local chunk at that peak (``chunk_passes_at_peak``), from one walk
    of the stage's schedule (the memory estimate needs both)."""
    from simulator.graph.builders.pipeline import Action, stage_actions

    if p == 1:
        return 1, sum(split), m > 1, {0: 1}
    held, passes, best, after, backwards = 0, 0, (0, 0), False, 0
    per: dict[int, int] = {}
    at_best: dict[int, int] = {}
    for a in stage_actions(schedule, p, m, rank, v):
        if not isinstance(a, Action):
            continue
        layers = split[a.chunk * p + rank]
        if a.kind == "F":
            held, passes = held + layers, passes + 1
            per[a.chunk] = per.get(a.chunk, 0) + 1
            if held > best[1]:
                best, after, at_best = (passes, held), False, dict(per)
            if held == best[1] and backwards:
                after = True
        else:
            held, passes, backwards = held - layers, passes - 1, backwards + 1
            per[a.chunk] -= 1
    return best[0], best[1], after, at_best


def norm_stats_bytes(spec) -> int:
    """Bytes of one norm's statistics kept for its backward per micro-batch: fp32 mean and rstd per token
    (LayerNorm, 8 B) or rstd alone (RMSNorm, 4 B), over the ``T_n`` tokens the norm sees (the builder's
    ``_norm_fwd``)."""
    t = spec.tensor_parallel_size
    T = spec.micro_batch_size * spec.seq_length
    Tn = T // t if spec.sequence_parallel and t > 1 else T
    return (8 if spec.normalization == "LayerNorm" else 4) * Tn


def flash_lse_bytes(spec, recompute: str) -> int:
    """Bytes of the flash kernel's fp32 log-sum-exp ``[b, a / t, s]`` a block keeps for its attention backward per
    micro-batch (Dao, *FlashAttention-2*, 2023, Algorithm 1 line 13: the forward writes ``L``, the backward reads it);
    none with the unfused core (it keeps the softmax output) or selective recompute (the recomputed forward writes
    it again)."""
    if spec.attention_backend == "unfused" or recompute == "selective":
        return 0
    return 4 * spec.micro_batch_size * (spec.num_attention_heads // spec.tensor_parallel_size) * spec.seq_length


def _layer_activation_bytes(spec, recompute: str, bf16_gathered: bool = False) -> float:
    """Bytes one block saves for backward per micro-batch (module docstring; the builder's saved tensors)."""
    t = spec.tensor_parallel_size
    sp = spec.sequence_parallel and t > 1
    amp = spec.precision == "amp_fp32_params"
    w = 4 if spec.precision in FULL_PRECISIONS else 2  # bytes of a GEMM operand / activation (fp32, tf32: 4)
    act = spec.residual_bytes  # 4 under autocast or fp32 / tf32, 2 otherwise (FSDP2 bf16: no autocast)
    T = spec.micro_batch_size * spec.seq_length
    Tn = T // t if sp else T
    h, f = spec.hidden_size, spec.ffn_hidden_size
    qo, f1 = spec.qkv_out_size // t, spec.fc1_out_size // t
    residual = act * Tn * h
    if recompute == "full":
        return residual
    if recompute == "op":  # torchtitan's per-op policy: the tensors of op_sac.KEPT
        return sum(op_sac.kept_bytes(spec, w, act).values())
    stats = 2 * norm_stats_bytes(spec) + flash_lse_bytes(spec, recompute)
    # the rotated q, k beside QKV's output; with flash they and V's contiguous copy replace it (builder _contiguous_v)
    rope = (w * T * (h // t + spec.query_groups * spec.head_dim // t)
            if spec.position_embedding == "rope" and spec.attention_backend != "flash" else 0)
    unfused = spec.attention_backend == "unfused"
    if unfused:  # the contiguous context (proj input), plus the core's s^2 tensors unless recomputed
        attn = w * T * h // t + (0 if recompute == "selective" else core.saved_core_bytes(spec, t, w))
    else:
        attn = (1 if recompute == "selective" else 2) * w * T * h // t
    masks = 2 * Tn * h if spec.hidden_dropout > 0 else 0  # bias_dropout_add's 1-byte masks
    # Hugging Face eager kernels (simulator/graph/builders/hf_eager.py): gelu_new's tanh output, 1 + tanh and
    # 0.5 x, and the s x s bool causal mask unless the core is recomputed (the Q, K, V copies replace the QKV output)
    eager = (3 * w * T * (f // t) + (0 if recompute == "selective" else spec.seq_length ** 2)
             if spec.kernels == "hf_eager" else 0)
    # autocast's bf16 copies of the block's weights, saved for backward (not with FSDP's bf16 gathered weights)
    weights16 = 2 * (h * spec.qkv_out_size + h * h + h * spec.fc1_out_size + f * h) if amp and not bf16_gathered else 0
    # fp8 (Transformer Engine): the four Linears' inputs (the two norm outputs, the attention output, the MLP
    # activation) are saved as their fp8 copies, 1 B per element in place of the 16-bit ones (transformer.py
    # _fp8_operands; TE linear.py saves only the fp8 input for backward)
    fp8 = (w - 1) * T * (2 * h + h // t + f // t) if spec.fp8 is not None else 0
    moe_mlp = _moe_mlp_delta(spec)[0] if spec.num_experts else 0  # an MoE block's MLP (bf16 / fp16 only)
    qkv = 3 * spec.attention_width // t if qkv_layout.repeats(spec) else qo  # repeat_kv: q and a heads of K, V
    return (2 * residual + 2 * w * T * h + w * T * qkv + rope + attn + masks + w * T * (f1 + f // t) + stats
            + weights16 + eager - fp8 + moe_mlp)


def _block_bytes(spec, layer: int, bf16_gathered: bool = False) -> float:
    """Bytes block ``layer`` (0-based, of the model) saves for backward per micro-batch: with ``recompute`` full and
    ``recompute_every`` n only the blocks with ``(layer + 1) % n == 0`` are checkpointed, the others keep all (the
    builder's ``_GptBuilder._checkpointed``, torchtitan's ``selective_ac_option`` n)."""
    r = spec.recompute
    if r == "full" and (layer + 1) % spec.recompute_every:
        r = "none"
    return _layer_activation_bytes(spec, r, bf16_gathered)


def _mean_block_bytes(spec, bf16_gathered: bool = False) -> float:
    """``_block_bytes`` averaged over the model's blocks: every block alike but with ``recompute_every`` n > 1,
    which torchtitan allows without a pipeline only (``torchtitan_ac.check_scenario``), so the stage holds them
    all."""
    if spec.recompute_every == 1:
        return _layer_activation_bytes(spec, spec.recompute, bf16_gathered)
    L = spec.num_layers
    return sum(_block_bytes(spec, i, bf16_gathered) for i in range(L)) / L


def _rebuilt_bytes(spec, bf16_gathered: bool = False) -> float:
    """What a recomputed block rebuilds before its backward, above the activations in flight at the first backward:
    op mode (every block): the block's activations but those ``op_sac.KEPT`` holds; full: a whole block's, and with
    ``recompute_every`` n (one pass, no pipeline) the largest over the checkpointed blocks ``j`` of that less the
    saved bytes of the later blocks, already freed by then (0 when no block is checkpointed)."""
    whole = _layer_activation_bytes(spec, "none", bf16_gathered)
    if spec.recompute == "op":
        return whole - _layer_activation_bytes(spec, "op", bf16_gathered)
    L, n = spec.num_layers, spec.recompute_every
    later = [sum(_block_bytes(spec, i, bf16_gathered) for i in range(j + 1, L)) for j in range(L)]
    return max([0.0] + [whole - later[j] for j in range(L) if (j + 1) % n == 0])


def _moe_mlp_delta(spec) -> tuple[float, float]:
    """An MoE block against the dense block of ``_layer_activation_bytes``: ``(saved, working)``, bytes. ``saved``:
    what the MoE layer keeps for backward (``moe.moe_fwd``) less the dense MLP's fc1 / activation outputs and
    its gathered norm output (the MoE layer reads the ``T_n`` tokens of its shard): the router's
    probabilities (``moe_probs_bytes``), routing map (and auxiliary-loss scores), the experts' input, fc1 and activation outputs over
    their ``N_g`` rows, the routed output ``unpermute`` reads (the all-to-all's ``max(N_l, N)`` rows with
    ``ep > 1``, else ``N``), with ``allgather`` the local routing map ``[G T_n, E_l]`` and the permuted
    probabilities ``[N_g]``, and the shared expert's tensors. ``working``: the block's backward working set above
    the saved tensors still alive at each point of its backward (``moe_backward_peak.working_peak``: the shared
    expert's saved tensors are freed before the routed experts' gradients are made), in place of the dense block's."""
    from simulator.graph.builders import moe_allgather as ag

    t, T, Tn, h, E, El, ep, et, fe, f1e, Nl, N, Ng, pb = moe_dims(spec)  # pb: moe_router_dtype, else the model's
    router = (pb + 1) * Tn * E + (4 * Tn * E if spec.moe_router_load_balancing_type == "aux_loss" else 0)
    experts = 2 * Ng * (h + f1e + fe)
    if spec.moe_token_dispatcher_type == "allgather":
        G = ag.group_size(spec)
        R = G * Tn
        routed = 2 * Ng * h + pb * Ng + (R * El if G > 1 or El < E else 0)
    else:
        routed = 2 * h * (max(Nl, N) if ep > 1 else N)
    shared = 0
    fs = spec.moe_shared_expert_intermediate_size
    if fs:
        shared = 2 * T * ((2 if spec.swiglu else 1) * fs // t + fs // t) + (2 * T * h if t > 1 else 0)
        if spec.moe_shared_expert_gate:
            shared += 2 * Tn + 2 * Tn * h
    dense = 2 * T * (spec.fc1_out_size // t + spec.ffn_hidden_size // t) + 2 * T * h - 2 * Tn * h
    return router + experts + routed + shared - dense, working_peak(spec)


def fp8_workspace_bytes(spec) -> int:
    """Transformer Engine's cached fp8 weight workspace of one rank, bytes: ``spec.fp8_weight_copies`` (2 where
    fp8 GEMMs are TN-only, 1 on Blackwell) x the elements of its blocks' Linear weights (QKV, proj, fc1, fc2 per
    TP rank, ``sharding.fp8_weight_numel``), resident for the whole run (transformer.py ``_fp8_operands``); 0 without
    fp8 and with ``fp8_param_gather`` (the fp8 parameters are the GEMM operands: ``_model_state_bytes``)."""
    from simulator.graph.builders.sharding import fp8_weight_numel

    return 0 if spec.fp8_param_gather else spec.fp8_weight_copies * fp8_weight_numel(spec)


def _state_cats(states: dict[str, float], grads: float) -> dict[str, float]:
    """The model-state categories of a stage's estimate: ``params``, ``grad`` (the persistent buffers plus
    ``grads``, those made by backward), ``optimizer``, and fp8's ``workspace`` where there is one."""
    out = {"params": states["params"], "grad": states["grad"] + grads, "optimizer": states["optimizer"]}
    if states.get("workspace"):
        out["workspace"] = states["workspace"]
    return out


def _grad_bytes(spec) -> int:
    """Bytes per element of a ``.grad`` without a sharding spec (and of Megatron's grad buffer): 2 for DeepSpeed
    ZeRO-1/2 in bf16 / fp16 (``TransformerSpec.zero_half_grads``: the model dtype) and for Megatron's 16-bit grad
    buffer (``TransformerSpec.megatron_half_grads``: fp16, or bf16 with ``--grad-reduce-in-bf16``) and DeepSpeed's
    ``BF16_Optimizer`` / ``FP16_Optimizer`` (the 16-bit autograd ``.grad``), else 4 (fp32)."""
    return 2 if (spec.zero_half_grads or spec.megatron_half_grads or spec.deepspeed_bf16_optimizer
                 or spec.deepspeed_fp16_optimizer) else 4


def _half_param_bytes(spec) -> int:
    """A rank's 16-bit model parameters under Megatron's optimizer, bytes: 2 per element, but with
    ``fp8_param_gather`` the block Linear weights (``sharding.fp8_weight_numel``) are fp8, 1 B each plus their
    transposes where ``fp8_weight_copies`` is 2 (transformer.py ``_GptBuilder._half_params``)."""
    from simulator.graph.builders.sharding import fp8_weight_numel

    f8 = fp8_weight_numel(spec) if spec.fp8_param_gather else 0
    return 2 * (spec.rank_num_parameters - f8) + f8 * (2 if spec.fp8_weight_copies == 2 else 1)


def _ipg_buffer(spec) -> tuple[float, bool]:
    """DeepSpeed ZeRO-1/2's IPG gradient buffers, as the builder allocates them (``TransformerSpec.zero_ipg``, the
    rule both use): ``(bytes, at_reduction)``, that many buffers x ``reduce_bucket_size`` elements x the model
    dtype's bytes (``_grad_bytes``); ``(0.0, False)`` without them."""
    buffers, at_reduction = spec.zero_ipg
    return float(buffers * spec.reduce_bucket_elements * _grad_bytes(spec)), at_reduction


def _model_state_bytes(cfg: ScenarioConfig, spec) -> tuple[dict[str, float], float]:
    """``({params, grad, optimizer}, grads_in_backward)``: the persistent model states of one rank and the
    gradient bytes allocated by backward (fp32 ``.grad``, ZeRO-2 shards), bytes (module docstring)."""
    from simulator.api import sharding_spec
    from simulator.graph.builders import moe

    dp = spec.grad_reduce_size  # the model states are sharded over dp x cp
    amp = spec.precision in ("amp_fp32_params", *FULL_PRECISIONS)  # fp32 parameters, no master copy
    P = spec.rank_num_parameters
    z, ddp = cfg.zero_optimization, cfg.ddp
    sh = sharding_spec(cfg) if dp > 1 else None

    def part(n: float) -> float:
        return -(-n // dp)

    if spec.deepspeed_bf16_optimizer:  # bf16 params, the bf16 accumulation buffer of every parameter, fp32 master
        # and moments over dp; the bf16 .grad made by backward (graph/builders/bf16_optimizer.py)
        from simulator.graph.builders.bf16_optimizer import HP_GRAD_BYTES

        return {"params": 2 * P + 4 * part(P), "grad": HP_GRAD_BYTES * P, "optimizer": 8 * part(P)}, 2 * P
    if spec.deepspeed_fp16_optimizer:  # 16-bit params, the flat fp32 master and moments of every parameter; the
        # 16-bit .grad made by backward (graph/builders/fp16_optimizer.py)
        return {"params": 6 * P, "grad": 0, "optimizer": 8 * P}, _grad_bytes(spec) * P
    if sh is None:
        zero = spec.zero_stage
        Ps = moe.sharded_state(spec, P, part) if zero else P  # the experts' over edp (moe.sharded_state)
        params = 4 * P if amp else _half_param_bytes(spec) + 4 * Ps
        buckets = _grad_bytes(spec) * P if dp > 1 and zero == 0 else 0  # DDP's flat bucket buffers (Megatron's
        # buffer: 16-bit with megatron_half_grads)
        if zero == 2:  # shards and the buckets' full gradients over the backward: _zero2_stage
            dynamic = 0
        else:
            # the gradients live in the buckets with gradient_as_bucket_view and in Megatron's DDP (bf16 / fp16:
            # .main_grad views of its contiguous grad buffer; transformer.py _GptBuilder)
            in_buckets = ddp.gradient_as_bucket_view or spec.precision in MEGATRON_DDP_PRECISIONS
            dynamic = 0 if (buckets and in_buckets) else _grad_bytes(spec) * P
        return {"params": params, "grad": buckets, "optimizer": 8 * Ps}, dynamic
    P = spec.rank_num_parameters  # this stage's (ZeRO-3 refuses pipelines; FSDP's are not estimated)
    Ps = sh.shard(P)
    if sh.strategy == "distributed_optimizer":
        Ps = moe.sharded_state(spec, P, sh.shard)  # the fp32 main grads are views of the persistent buffer (fp16
        # buffer: fresh fp32 main grads at the step, stage_memory)
        return {"params": _half_param_bytes(spec) + 4 * Ps, "grad": _grad_bytes(spec) * P, "optimizer": 8 * Ps}, 0
    if sh.strategy == "no_shard":
        return {"params": 4 * P, "grad": 0, "optimizer": 8 * P}, 4 * P
    unit = spec.layer_params
    root = (spec.vocab_per_rank + spec.position_table_rows) * spec.hidden_size
    if sh.strategy == "zero3":  # the root and d + 1 blocks gathered, 16-bit, or the blocks kept from forward to
        # backward by stage3_max_reuse_distance (the last ones, which the turn to backward holds with the window)
        kept = sum(1 for u in sh.kept_after_forward if u >= 0)
        gathered = 2 * unit * max((sh.fwd_prefetch_depth or 0) + 1, kept) + 2 * root
        return {"params": 6 * Ps + gathered, "grad": 2 * Ps, "optimizer": 8 * Ps}, 0
    if sh.version == 2:  # FSDP2 (graph/builders/fsdp2.py): padded per parameter; in forward two all-gather
        # outputs ahead of the unit's unsharded copy
        from simulator.graph.builders import fsdp2
        from simulator.graph.builders.sharding import ROOT, backward_param_order, layer_param_sizes

        w = sh.shard_size
        Ps = fsdp2.sharded_numel(spec, w)
        unit = fsdp2.unit_padded_numel(spec, layer_param_sizes(spec).items(), w)
        root = fsdp2.unit_padded_numel(spec, [(n, k) for n, u, k in backward_param_order(spec) if u == ROOT], w)
        kept = spec.num_layers if not sh.reshard_after_forward else fsdp2.FORWARD_PREFETCH_DEPTH + 1
        # an int reshard_after_forward r: every block's 1/r post-forward shard, alive from its forward to its
        # backward all-gather (Fsdp2ParamGather._reshard_post_forward); counted whole, also at the step's peak
        post = spec.num_layers * (unit // sh.post_forward_size) if sh.post_forward_size else 0
        return {"params": 4 * Ps + sh.param_bytes * (unit * kept + root + post), "grad": 0,
                "optimizer": 8 * Ps}, 4 * Ps
    kept = spec.num_layers if not sh.reshard_after_forward else 2  # SHARD_GRAD_OP keeps forward's gathers
    gathered = sh.param_bytes * (unit * kept + root)
    return {"params": 4 * Ps + gathered, "grad": 0, "optimizer": 8 * Ps}, 4 * Ps


def stage_memory(cfg: ScenarioConfig, pp_rank: int = 0) -> StageMemory:
    """The estimate for pipeline stage ``pp_rank`` (module docstring), bytes per GPU.

    The peak is at the start of a backward pass: every activation in flight plus the largest transient.
    With one micro-batch per step and no pipeline, no gradient exists yet at that moment and the peak is
    the larger of (activations + transient) and the gradients at the end of backward; otherwise the
    gradients of an earlier micro-batch are already there and add to it.

    Raises:
        NotEstimated: offload of the optimizer, parameters or activations; LoRA; a mixture-of-experts model with
            dense blocks or fp8.
    """
    from simulator.api import memory_overheads, transformer_spec

    z = cfg.zero_optimization
    if z.offload_optimizer.device != "none" or z.offload_param.device != "none":
        raise NotEstimated("zero_optimization offload is not covered by the memory estimate")
    if cfg.model.architecture != "decoder":
        raise NotEstimated("a vision transformer is not covered by the memory estimate")
    if cfg.parallelism.pipeline_schedule in SPLIT_BACKWARD:
        raise NotEstimated(f"pipeline_schedule {cfg.parallelism.pipeline_schedule} (activations kept until the "
                           "deferred W passes) is not covered by the memory estimate")
    if cfg.activation_checkpointing.cpu_checkpointing:
        raise NotEstimated("activation_checkpointing.cpu_checkpointing is not covered by the memory estimate")
    if cfg.training.lora is not None:
        raise NotEstimated("training.lora (frozen weights) is not covered by the memory estimate")
    m = cfg.model
    if m.num_experts and (m.moe_layer_freq != 1 or cfg.training.fp8 is not None):
        raise NotEstimated("model.num_experts with dense blocks (moe_layer_freq) or fp8 is not covered by the "
                           "memory estimate")
    if cfg.parallelism.context_parallel_size > 1:
        raise NotEstimated("context parallelism (s / cp tokens per rank, K/V exchange buffers) is not covered by the "
                           "memory estimate")
    if cfg.fsdp is not None and cfg.parallelism.pipeline_model_parallel_size > 1:
        raise NotEstimated("fsdp with pipeline parallelism (units kept gathered across micro-batches, gradients "
                           "reduced once per step) is not covered by the memory estimate")
    spec = transformer_spec(cfg, pp_rank)
    states, grads = _model_state_bytes(cfg, spec)
    end_grads = grads  # the gradients backward leaves (beside the states) when the optimizer step starts
    if spec.fp8 is not None:  # resident like the model states
        states = {**states, "workspace": float(fp8_workspace_bytes(spec))}
    recompute = spec.recompute
    t = spec.tensor_parallel_size
    amp = spec.precision == "amp_fp32_params"
    w = 4 if spec.precision in FULL_PRECISIONS else 2  # bytes of a GEMM operand / activation
    act = spec.residual_bytes  # 4 under autocast or fp32 / tf32, 2 otherwise (FSDP2 bf16: no autocast)
    T = spec.micro_batch_size * spec.seq_length
    h, V = spec.hidden_size, spec.vocab_per_rank
    p, v, m = spec.pipeline_parallel_size, spec.virtual_pipeline_size, spec.num_micro_batches
    passes, layers, after_backward, by_chunk = _peak_passes(spec.pipeline_schedule, p, m, pp_rank, v, spec.layer_split)
    sh = spec.sharding if spec.data_parallel_size > 1 else None
    bf16_gathered = sh is not None and sh.gathers and sh.param_bytes == 2  # the GEMMs read the gathered weights
    block = _mean_block_bytes(spec, bf16_gathered)  # one block's saved activations, averaged over the stage's
    activations = layers * block
    f1 = (spec.fc1_out_size + spec.ffn_hidden_size) // t
    largest_weight = max(h * spec.qkv_out_size, h * spec.fc1_out_size, spec.ffn_hidden_size * h) // t
    transient = w * T * f1 + 2 * act * T * h + w * largest_weight  # one block's backward working set
    if spec.num_experts:  # every block is an MoE block (dense blocks between them are not estimated)
        transient = _moe_mlp_delta(spec)[1] + w * largest_weight
    if recompute in ("full", "op"):  # one block's activations are rebuilt during its backward (op: those not kept)
        transient += _rebuilt_bytes(spec, bf16_gathered)
    if spec.attention_backend == "unfused":  # the core's score gradients (and its recomputed tensors), after
        # the MLP's backward has freed its working set: the larger of the two
        mlp = w * T * f1 + 2 * act * T * h + w * largest_weight
        score = core.backward_working_bytes(spec, t, w) + (core.saved_core_bytes(spec, t, w)
                                                           if recompute == "selective" else 0)
        transient += max(mlp, score) - mlp
    block_transient = transient
    if spec.has_head:  # saved per pass in flight of the last model chunk (the only one with the head; with an
        # interleaved schedule the other chunks' passes hold none): fp32 log-softmax, the final norm's input and output
        activations += min(by_chunk.get(v - 1, 0), m) * (4 * T * V + w * T * h + act * T * h + norm_stats_bytes(spec)
                                                         + (2 * V * h if amp and not bf16_gathered else 0))
        # in backward, F.cross_entropy's log-softmax gradient and NLL gradient, fp32; Megatron-LM's cross-entropy
        # makes its gradient in place in the saved softmax: only the 16-bit logits (forward) or their gradient
        # (backward) beside it, none in fp32 / tf32 (TransformerSpec.cross_entropy)
        head = 8 * T * V if spec.cross_entropy == "pytorch" else (0 if w == 4 else 2 * T * V)
        # a block's working set comes after the head's backward has freed its pass's saved fp32 logits
        transient = max(transient - 4 * T * V, head)
    if spec.has_embedding:
        activations += 16 * T * by_chunk.get(0, 0)  # int64 tokens and labels, held by the first chunk's passes
        if p == 1 or spec.has_head:  # the fp32 embedding gradient; on the first of several stages it is made at the
            # end of the stage's backward, with its activations freed (and counted in the gradients after it)
            transient = max(transient, 4 * V * h)
    dynamic = activations + transient
    o = memory_overheads(cfg)
    if sh is None and spec.zero_stage == 2 and spec.grad_reduce_size > 1:
        per_pass = sum(spec.layer_split[c * p + pp_rank] for c in range(v)) * block / max(1, v)  # the blocks of
        # the pass whose backward runs
        return _zero2_stage(cfg, spec, pp_rank, passes, states, float(activations), float(transient), per_pass,
                            after_backward and m > 1, o, largest_weight)
    # the first block's backward, without pipelining: every gradient but its own (and an untied embedding's),
    # beside its saved activations, its working set and the tokens
    g = _grad_bytes(spec)
    near_end = (grads - g * spec.layer_params - (0 if spec.tied_embeddings else g * V * h)
                + _block_bytes(spec, 0, bf16_gathered) + block_transient + 16 * T
                if sh is None and p == 1 and grads else 0.0)
    if not after_backward and max(grads, near_end) > dynamic:  # the peak is (near) the end of backward
        if near_end > grads:
            grads, activations, transient = near_end - block_transient, 0.0, block_transient
        else:
            activations, transient = 0.0, 0.0
    else:
        grads = grads if after_backward else 0.0
    buf, at_reduction = _ipg_buffer(spec)
    if buf and not at_reduction:  # alive from the first backward on: at the peak whichever it is
        grads += buf
    elif buf:  # one buffer while the step's gradients are reduced, after the last backward: beside all of them
        end = _grad_bytes(spec) * spec.rank_num_parameters + buf
        if end > grads + activations + transient:
            grads, activations, transient = end, 0.0, 0.0
    if spec.megatron_half_grads or spec.fp8_param_gather or spec.deepspeed_bf16_optimizer or spec.deepspeed_fp16_optimizer:
        # the optimizer step, activations freed: the fresh fp32
        # main grads of the shard it updates beside the states and the 16-bit buffer
        # (_GptBuilder._copy_model_grads_to_main_grads), and with fp8 parameters the bf16 copy of the fp8 weights'
        # master shard that quantize_param_shard casts from (_GptBuilder._copy_main_params_to_fp8)
        from simulator.graph.builders.sharding import backward_param_order, fp8_weight_numel

        P = spec.rank_num_parameters
        share = sh.shard(P) / P if sh is not None and sh.strategy == "distributed_optimizer" else 1.0
        main = 4 * P * share if spec.megatron_half_grads else 0.0
        if spec.deepspeed_bf16_optimizer:  # BF16_Optimizer: the fp32 copy of the gradient partition, or before it
            # the fp32 copy of the largest tensor its norm casts (bf16_optimizer.step)
            table = spec.vocab_per_rank * h if spec.has_embedding or spec.has_head else 0
            main = 4 * max(-(-P // spec.grad_reduce_size), table, largest_weight)
        if spec.deepspeed_fp16_optimizer:  # FP16_Optimizer: its flatten (or the norm mask of a pipe replica)
            named = [(n, k) for c in spec.model_chunks for n, _, k in backward_param_order(spec, c)]
            main = float(fp16opt.step_transient_bytes([sum(g) for g in fp16opt.param_groups(named)],
                                                      fp16opt.masked_groups(spec, named)))
        cast = 2 * fp8_weight_numel(spec) * share if spec.fp8_param_gather else 0.0
        if end_grads + main + cast > grads + activations + transient:
            grads, activations, transient = end_grads + main, 0.0, cast
    tensors = sum(states.values()) + grads + activations + transient
    cats = {**_state_cats(states, grads), "activations": float(activations), "transient": float(transient),
            "overheads": o.cuda_context_bytes + o.reserve_bytes(tensors)}
    return StageMemory(pp_rank, passes, {k: float(val) for k, val in cats.items()})


def _zero2_stage(cfg: ScenarioConfig, spec, pp_rank: int, passes: int, states: dict[str, float],
                 activations: float, transient: float, per_pass: float, held: bool, o,
                 largest_weight: int = 0) -> StageMemory:
    """DeepSpeed ZeRO-2 as the builder simulates it: each micro-batch's backward creates gradients (fp32; the model
    dtype in bf16 / fp16, ``_grad_bytes``), bucket
    by bucket (``reduce_bucket_size`` elements ``B``), each freed when its bucket's reduce-scatter ends, which
    leaves a ``1/N_d`` shard, allocated while the bucket is alive (``S`` in all, ``4 P / N_d`` in fp32; after the first micro-batch the step's shards ``S``
    are held and the new ones are partials added at the end). The peak is the larger of the start of a
    backward (``held S`` + activations + transient) and the moment the ``j``-th bucket closes: the unreduced
    full gradients (``j`` buckets at most, plus a tied embedding's gradient, made first by the head's backward
    and reduced last), the shards reduced so far and the activations of the backward's
    blocks not yet reached (a share ``1 - j B / P`` of the pass's blocks). Without ``overlap_comm`` the
    reduction blocks the backward hook, so exactly one bucket is unreduced (``j = 1``); with it the
    reduce-scatters run beside the backward and how many buckets are still unreduced depends on their timing:
    between one (communication faster than a bucket's backward) and two (DeepSpeed's double-buffered IPG
    bucket), so the estimate takes two and reports the gap to one as ``slack_bytes``.

    With DeepSpeed's IPG buffers (``contiguous_gradients``, the default: ``_ipg_buffer``) the gradients are copied
    into the buffers as they are made and take no memory of their own: the buffers (alive from the backward's
    start), the shards reduced so far and the activations not yet freed, whatever the timing (no slack).

    A parameter larger than ``reduce_bucket_size`` is not copied: DeepSpeed reduces it alone from its own
    gradient tensor (``extra_large_param_to_reduce``), one such gradient counted beside the buffers.
    """
    P = spec.rank_num_parameters
    dp = spec.grad_reduce_size
    z = cfg.zero_optimization
    g = float(_grad_bytes(spec))  # 4 (fp32), 2 in bf16 / fp16 (DeepSpeed's model dtype)
    S = g * -(-P // dp)
    B = g * min(P, z.reduce_bucket_size or 500_000_000)  # the largest bucket's gradients
    kept = S if held else 0.0

    # a tied embedding's gradient is made by the head's backward, first, but reduced in the last bucket
    early = g * spec.vocab_per_rank * spec.hidden_size if (
        spec.tied_embeddings and spec.has_head and spec.has_embedding) else 0.0

    def bucket_peak(j: int) -> float:  # the j-th bucket's reduce-scatter allocates its shard, j buckets unreduced
        done = min(1.0, j * B / (g * P))
        return kept + min(S, j * B / dp) + min(g * P, j * B + early) + activations - done * per_pass

    buf, _ = _ipg_buffer(spec)
    if buf:
        biggest = max(largest_weight, spec.vocab_per_rank * spec.hidden_size if spec.has_embedding or spec.has_head
                      else 0)
        # a gradient larger than the buffer keeps its own tensor until its reduce-scatter (one at a time)
        extra = g * biggest if biggest > spec.reduce_bucket_elements else 0.0
        buckets = -(-int(g * P) // int(B))

        def ipg_peak(j: int) -> float:  # the j-th reduce-scatter allocates its shard beside the buffers
            return kept + min(S, j * B / dp) + buf + extra + activations - min(1.0, j * B / (g * P)) * per_pass

        start = kept + buf + activations + transient
        j = max(range(1, buckets + 1), key=ipg_peak)
        hi = ipg_peak(j)
        base = sum(states.values())
        if hi > start:
            acts = activations - per_pass * min(1.0, j * B / (g * P))
            grads, trans = hi - acts, 0.0
        else:
            grads, acts, trans = kept + buf, activations, transient
        tensors = base + grads + acts + trans
        cats = {**_state_cats(states, grads), "activations": acts, "transient": trans,
                "overheads": o.cuda_context_bytes + o.reserve_bytes(tensors)}
        return StageMemory(pp_rank, passes, {k: float(val) for k, val in cats.items()})
    start = kept + activations + transient
    lo = bucket_peak(1)
    hi = max(lo, bucket_peak(2)) if z.overlap and B < g * P else lo
    base = sum(states.values())
    if hi > start:  # the peak is a bucket's close: its gradients, the activations not yet freed, no transient
        acts = activations - per_pass * min(1.0, (2 if hi > lo else 1) * B / (g * P))
        grads, trans = hi - acts, 0.0
    else:
        grads, acts, trans = kept, activations, transient
    tensors = base + grads + acts + trans
    low_tensors = base + max(start, lo)
    cats = {**_state_cats(states, grads), "activations": acts, "transient": trans,
            "overheads": o.cuda_context_bytes + o.reserve_bytes(tensors)}
    slack = (tensors + o.reserve_bytes(tensors)) - (low_tensors + o.reserve_bytes(low_tensors))
    return StageMemory(pp_rank, passes, {k: float(val) for k, val in cats.items()}, float(slack))


def estimate_memory(cfg: ScenarioConfig, capacity_bytes: float | None = None) -> MemoryEstimate:
    """Estimated peak device memory per GPU over the pipeline stages (module docstring).

    Args:
        cfg: A validated scenario.
        capacity_bytes: The GPU's memory, bytes (default: ``resolve_hardware(cfg).gpu.hbm_capacity_bytes``).

    Raises:
        NotEstimated: offload of the optimizer, parameters or activations.
        ScenarioError: the hardware presets do not resolve (only without ``capacity_bytes``).
    """
    stages = tuple(stage_memory(cfg, r) for r in range(cfg.parallelism.pipeline_model_parallel_size))
    caps = (float(capacity_bytes),) * len(stages) if capacity_bytes is not None else stage_capacities(cfg)
    return MemoryEstimate(max(s.total_bytes for s in stages), min(caps), stages, caps)


def stage_capacities(cfg: ScenarioConfig) -> tuple[float, ...]:
    """Per pipeline stage, the smallest GPU memory among its ranks, bytes: the scenario's GPU
    (``resolve_hardware``, with its overrides), a stage's ``rank_overrides`` ``gpu`` in its place, and each
    overridden replica's ``gpu`` (the schema refuses a stage's and a replica's gpu on one rank).

    Raises:
        ScenarioError: the hardware presets do not resolve.
    """
    from hardware_models import presets
    from simulator.config.loader import resolve_hardware

    main = float(resolve_hardware(cfg).gpu.hbm_capacity_bytes)
    p = cfg.parallelism.pipeline_model_parallel_size
    dp = cfg.parallelism.data_parallel_size or 1

    def cap(name: str | None) -> float:
        return main if name is None else float(presets.get("gpus", name).hbm_capacity_bytes)

    by_pp = {o.pp_rank: o.gpu for o in cfg.rank_overrides if o.pp_rank is not None}
    by_dp = {o.dp_rank: o.gpu for o in cfg.rank_overrides if o.dp_rank is not None}
    out = []
    for r in range(p):
        stage = cap(by_pp.get(r))
        replicas = [cap(g) for j, g in by_dp.items() if g is not None and j < dp]
        out.append(min([stage, *replicas]))
    return tuple(out)
