"""Sharded data parallelism for the GPT builder: DeepSpeed ZeRO-3, PyTorch FSDP and Megatron-LM's
distributed optimizer.

One representative data-parallel rank is built (as for DDP and ZeRO-1/2 in
``simulator/graph/builders/transformer.py``). This module holds the sharding logic the builder
calls; the builder only calls its hooks (``enter`` at the start of a unit's compute, ``leave`` at
the end of a layer's backward, ``weight`` / ``backward_weight`` for the tensor a GEMM reads).

**Units.** A unit is what is gathered at once: one transformer block (FSDP's
``transformer_auto_wrap_policy`` wraps every block; DeepSpeed ZeRO-3 fetches a block's parameters
module by module, approximated here as one fetch per block) plus the *root* (token and position
embeddings, final norm, LM head: FSDP's root instance). The root is gathered once per phase (the
tied token table serves both the embedding and the LM head).

**Prefetch** (one rule for ZeRO-3 and FSDP, the one of ``simulator/policies/offload_param.py``):
with depth ``d`` a rank holds at most ``d + 1`` gathered units per phase; the all-gather of the
``k``-th unit of a phase is issued when the ``(k - d)``-th unit starts, i.e. after unit ``k - d - 1``
finished with its buffer, and overlaps the compute of the units in between. ``d = 0`` gathers on
demand: every gather is exposed. The units of a phase are ``[root, 0 .. L-1]`` forward and
``[root, L-1 .. 0]`` backward. All data-parallel collectives of a group run in issue order on one
stream (ProcessGroupNCCL has one NCCL stream per group and device).

* ZeRO-3 (Rajbhandari et al., *ZeRO*, SC20, section 5.3 and 7.2.2; DeepSpeed
  ``deepspeed/runtime/zero/partitioned_param_coordinator.py``): ``d`` is the number of following
  blocks whose parameters fit in ``stage3_prefetch_bucket_size`` elements with at most
  ``stage3_max_live_parameters`` elements gathered at once (block granularity), in forward and in
  backward. Parameters of at most ``stage3_param_persistence_threshold`` elements (norms, biases)
  are not partitioned: they stay whole on every rank and are all-gathered once after the optimizer
  step (DeepSpeed ``_post_step``: ``persistent_parameters[0].all_gather(...)``).
* FSDP (Zhao et al., *PyTorch FSDP*, VLDB 2023, section 3.3 and 4; ``torch.distributed.fsdp``):
  forward ``d = 1`` with ``limit_all_gathers`` (the rate limiter keeps two all-gathers in flight) or
  ``forward_prefetch``, else every block's all-gather is issued as soon as the host reaches it (no
  bound). Backward ``BACKWARD_PRE``: ``d = 1`` (the next unit's all-gather is issued before the
  current gradients' reduce-scatter); ``BACKWARD_POST``: the next unit's all-gather is issued after
  the current unit's gradient computation, before its reduce-scatter; ``None``: on demand, after the
  reduce-scatter. The root is not resharded after forward (FSDP keeps the root gathered). One
  reduce-scatter per unit after its backward. With a 16-bit ``param_dtype`` (``casts_shards``) each all-gather
  is preceded by the cast of the unit's fp32 shard, ``ceil(n / shard_size)`` elements, into a 16-bit low-precision
  shard that the all-gather reads (``_unshard``: ``pre_unshard`` -> ``_use_low_precision_shard`` on the pre-unshard
  stream, which the unshard stream waits for; ``post_unshard`` -> ``_free_low_precision_sharded_param`` frees it,
  here when the gather ends; pytorch/pytorch@00ae0bc torch/distributed/fsdp/_runtime_utils.py, @fe03cf6
  _flat_param.py): a memory-bound kernel reading 4, writing 2 bytes per shard element, wherever a unit is gathered
  (forward, and backward where it was resharded), none where it is still gathered (``needs_unshard`` false).

**Gathered state** (one rule for every strategy): a unit stays gathered until it is resharded; a pass
gathers only the units that are not. After a forward pass the blocks are resharded with
``reshard_after_forward`` (the root with ``reshard_root``); after a backward pass everything (FSDP's
post-backward reshard, ZeRO-3's release), so without a pipeline every micro-batch gathers again. With a
pipeline (FSDP per stage under ``torch.distributed.pipelining``: ``set_reshard_after_backward(False)`` and
``set_requires_gradient_sync(False)`` until the stage's last backward, ``stage.py``
``backward_maybe_with_nosync``) a backward keeps its units gathered, so under 1F1B FULL_SHARD gathers the
blocks in each warm-up forward and each backward, SHARD_GRAD_OP once per step; each stage's units are its own
blocks and the root parameters it holds (``backward_param_order``), and the gradients are reduce-scattered
once per step (the builder's ``_every_mb`` is false).

**NO_SHARD** keeps the fp32 parameters whole (DDP). With a 16-bit ``param_dtype`` the same schedule runs with a
cast kernel in place of each all-gather: before a unit's forward and again before its backward FSDP casts its fp32
flat parameter into a 16-bit copy (``FlatParamHandle.pre_unshard`` -> ``_use_low_precision_shard``, on FSDP's
pre-unshard stream; here on the compute stream, a memory-bound kernel that would share HBM with the compute it
overlaps), freed after the pass (``post_reshard`` -> ``_free_low_precision_sharded_param``, root included:
``reshard_root``). Gradients are made in ``param_dtype``, cast to ``reduce_dtype`` and all-reduced per unit; a
16-bit reduction is cast back to the fp32 ``.grad`` after its all-reduce (``_reduce_grad_no_shard`` ->
``_cast_grad_to_param_dtype``, on the post-backward stream: here the data-parallel stream).

**Byte counts** (``meta["bytes"]`` of the collectives; bytes on the wire per GPU are ``(n-1)/n`` of
it): ZeRO-3 and FULL_SHARD move ``3 Psi`` 16-bit elements per step (forward gather, backward
gather, gradient reduce-scatter), ZeRO-1/2 and DDP ``2 Psi`` (ZeRO paper, section 7).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from simulator.graph.builders.pipeline import chunk_layers
from simulator.graph.ops import CostClass, OpKind, Phase, TensorAlloc

STRATEGIES = ("zero3", "full_shard", "shard_grad_op", "hybrid_shard", "no_shard", "distributed_optimizer")
BACKWARD_PREFETCH = ("pre", "post", None)
#: Unit key of the root (embeddings, final norm, LM head)
ROOT = -1


@dataclass(frozen=True)
class ShardingSpec:
    """How the model states are sharded over the data-parallel group (see the module docstring).

    Attributes:
        strategy: One of ``STRATEGIES``.
        shard_size: Ranks a state is sharded over (dp; HYBRID_SHARD: the data-parallel ranks of one node).
        replicate_size: Shard replicas all-reduced across nodes (HYBRID_SHARD), else 1.
        fwd_prefetch_depth: Units gathered ahead in forward (``None``: all, no bound).
        bwd_prefetch: ``"pre"`` (depth 1), ``"post"`` or ``None`` (on demand) in backward; ZeRO-3: ``"pre"``
            with ``bwd_prefetch_depth``.
        bwd_prefetch_depth: Units gathered ahead in backward with ``"pre"``.
        reshard_after_forward: Gathered block parameters are freed after forward and gathered again
            for backward (ZeRO-3, FULL_SHARD, HYBRID_SHARD); false: kept from forward to backward.
        reshard_root: The root is gathered again for backward (ZeRO-3; FSDP keeps the root gathered).
        param_bytes: Bytes per element of a gathered parameter (16-bit, or 4 for FSDP fp32 param_dtype).
        sharded_param_bytes: Bytes per element of the sharded parameter (ZeRO-3: 2, the 16-bit
            partition beside the fp32 master; FSDP: 4, the fp32 flat parameter that the optimizer updates).
        grad_bytes: Bytes per element of the unsharded gradient and of its reduce-scatter (ZeRO-3 16-bit;
            FSDP ``reduce_dtype``; Megatron fp32 main grads).
        persistence_threshold: ZeRO-3 parameters of at most this many elements stay whole (0: none).
        bucket_elements: Megatron-LM gradient bucket size, elements (``None``: one bucket).
        overlap_param_gather: Megatron-LM ``--overlap-param-gather``: the parameter all-gathers run at
            the start of the next forward, each block waiting for its bucket; else after the step.
        version: FSDP's API: 1 ``FullyShardedDataParallel`` (flat parameters), 2 ``fully_shard`` (per-parameter
            shards with copy-in / copy-out kernels, ``simulator/graph/builders/fsdp2.py``).
        post_forward_size: FSDP2 ``reshard_after_forward`` as an int r (1 < r < ``shard_size``, dividing it): the
            group size blocks are resharded to after forward and all-gathered over in backward; 0: none.
        kept_after_forward: Units (``ROOT`` or block indices) not resharded after forward whatever
            ``reshard_after_forward`` / ``reshard_root`` say: ZeRO-3's ``stage3_max_reuse_distance``
            (``zero3_kept_after_forward``), so their backward gathers nothing.
    """

    strategy: str
    shard_size: int
    replicate_size: int = 1
    fwd_prefetch_depth: int | None = 1
    bwd_prefetch: str | None = "pre"
    bwd_prefetch_depth: int = 1
    reshard_after_forward: bool = True
    reshard_root: bool = False
    param_bytes: int = 2
    sharded_param_bytes: int = 2
    grad_bytes: int = 2
    persistence_threshold: int = 0
    bucket_elements: int | None = None
    overlap_param_gather: bool = False
    version: int = 1
    post_forward_size: int = 0
    kept_after_forward: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        """Raises: ValueError: an unknown strategy or prefetch mode, non-positive sizes, a version other than 1 or 2
        (2 only with the FSDP strategies that gather), a post-forward size that is not a factor of the shard size
        between 1 and it (exclusive)."""
        if self.version not in (1, 2) or (self.version == 2 and self.strategy not in (
                "full_shard", "shard_grad_op", "hybrid_shard")):
            raise ValueError(f"version must be 1, or 2 with an FSDP strategy that shards, got {self.version} with "
                             f"{self.strategy!r}")
        if self.post_forward_size and (self.version != 2 or not 1 < self.post_forward_size < self.shard_size
                                       or self.shard_size % self.post_forward_size):
            raise ValueError(f"post_forward_size {self.post_forward_size} must be 0, or with version 2 a factor > 1 "
                             f"of shard_size {self.shard_size} smaller than it")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"sharding strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.bwd_prefetch not in BACKWARD_PREFETCH:
            raise ValueError(f"bwd_prefetch must be one of {BACKWARD_PREFETCH}, got {self.bwd_prefetch!r}")
        if self.shard_size < 1 or self.replicate_size < 1:
            raise ValueError("shard_size and replicate_size must be >= 1")
        if (self.fwd_prefetch_depth is not None and self.fwd_prefetch_depth < 0) or self.bwd_prefetch_depth < 0:
            raise ValueError("prefetch depths must be >= 0")

    @property
    def gathers(self) -> bool:
        """Parameters are sharded and gathered before use (ZeRO-3 and FSDP sharding strategies)."""
        return self.strategy in ("zero3", "full_shard", "shard_grad_op", "hybrid_shard")

    @property
    def casts_units(self) -> bool:
        """FSDP NO_SHARD with a 16-bit ``param_dtype``: each unit's whole fp32 parameters are cast into a 16-bit copy
        before its forward and its backward (``FlatParamHandle._use_low_precision_shard``), on the schedule of the
        gathers (``ParamGather`` with ``op_suffix="param_cast"``)."""
        return self.strategy == "no_shard" and self.param_bytes == 2

    @property
    def casts_shards(self) -> bool:
        """FSDP1 (``version`` 1) FULL_SHARD / SHARD_GRAD_OP / HYBRID_SHARD with a 16-bit ``param_dtype`` over fp32 flat
        parameters: before each all-gather the unit's fp32 shard is cast into a 16-bit low-precision shard that the
        all-gather reads (``ParamGather._emit``, ``shard_cast``)."""
        return (self.version == 1 and self.strategy in ("full_shard", "shard_grad_op", "hybrid_shard")
                and self.param_bytes < self.sharded_param_bytes)

    @property
    def unit_buckets(self) -> bool:
        """Gradients are reduced once per FSDP unit (FSDP strategies)."""
        return self.strategy in ("full_shard", "shard_grad_op", "hybrid_shard", "no_shard")

    @property
    def shards_grads(self) -> bool:
        """Gradients are reduce-scattered (every strategy but NO_SHARD)."""
        return self.strategy != "no_shard"

    def shard(self, n: int) -> int:
        """Elements of one rank's shard of ``n`` (the flat buffer is padded to the shard size)."""
        return -(-n // self.shard_size)


def zero3_prefetch_depth(unit_numel: int, num_units: int, prefetch_bucket: int, max_live: int) -> int:
    """Blocks gathered ahead by ZeRO-3: the largest ``d <= num_units`` with ``d * unit_numel`` within
    ``stage3_prefetch_bucket_size`` and ``(d + 1) * unit_numel`` within ``stage3_max_live_parameters``
    (elements; block granularity of DeepSpeed's per-parameter prefetch). 0 when a block is larger than
    the bucket (every fetch on demand)."""
    if unit_numel <= 0:
        return 0
    d = 0
    while d < num_units and (d + 1) * unit_numel <= prefetch_bucket and (d + 2) * unit_numel <= max_live:
        d += 1
    return d


def zero3_kept_after_forward(unit_numel: int, num_units: int, head_numel: int, max_reuse: int) -> frozenset[int]:
    """The units ZeRO-3 does not release after their forward because they are reused within ``max_reuse``
    parameter elements (``stage3_max_reuse_distance``; DeepSpeed default 1e9).

    DeepSpeed's rule (deepspeedai/DeepSpeed@00a31c99 ``deepspeed/runtime/zero/partitioned_param_coordinator.py``
    ``__params_to_release``): releasing a module after its forward, the coordinator walks the recorded forward +
    backward module trace from the next module on, adding up the elements of the modules it passes, and stops
    once the sum reaches ``max_reuse``; a parameter of the module met before then is not released. At block
    granularity (one fetch per block, as the module docstring says): block ``i`` of ``n`` (``unit_numel`` elements
    each) is reached in backward after the forward of blocks ``i+1 .. n-1``, the LM head's forward and backward
    (``head_numel``: final norm and head weight) and the backward of blocks ``n-1 .. i+1``, so it is kept iff
    ``2 (n - 1 - i) unit_numel + 2 head_numel < max_reuse``. The root (``ROOT``) is kept iff ``max_reuse > 0``: its
    LM head is reused at once (forward then backward), and the unit is gathered whole here. The trace is one
    micro-batch's forward and backward (``reset_step`` at every forward: deepspeedai/DeepSpeed@042b847a
    ``deepspeed/runtime/zero/parameter_offload.py`` ``_start_of_forward_hook``), so nothing is kept past a backward
    (``ParamGather.start_pass`` drops every unit then). Not modelled: a block
    kept in part (its last modules are reused sooner than its first), and the kept elements counting against
    ``stage3_max_live_parameters`` in the prefetch budget.

    Returns:
        Block indices ``0 .. num_units - 1`` and ``ROOT`` that stay gathered from forward to backward.
    """
    kept = {i for i in range(num_units) if 2 * (num_units - 1 - i) * unit_numel + 2 * head_numel < max_reuse}
    return frozenset(kept | ({ROOT} if max_reuse > 0 else set()))


def layer_param_sizes(spec, experts: bool = True, layer: int | None = None) -> dict[str, int]:
    """Parameters of one block on one TP rank, name -> elements, in the order backward finishes their
    gradients (``fc2``, ``fc1``, ``ln2``, ``proj``, ``qkv``, ``ln1``; bias before weight for Linears; a
    mixture of experts: shared-expert gate, fc2, fc1, the experts' fc2, fc1, the router in place of ``fc2``,
    ``fc1``). ``experts`` false: without the routed experts (reduced over their own group, ``moe.own_expert_grads``);
    ``layer``: that block (a dense block of a mixed model, ``moe_layer_pattern``; ``None``: an MoE block).
    Sums to ``spec.layer_params`` with ``t = 1``."""
    h, t = spec.hidden_size, spec.tensor_parallel_size
    f = spec.ffn_hidden_size
    qkv, fc1 = spec.qkv_out_size, spec.fc1_out_size
    bias = spec.bias
    out: dict[str, int] = {}

    def lin(name, i, o, has_bias, bias_n):
        if has_bias:
            out[f"{name}.bias"] = bias_n
        out[f"{name}.weight"] = i * o // t

    def norm(name):
        out[f"{name}.weight"] = h
        if spec.norm_has_bias:
            out[f"{name}.bias"] = h

    if spec.num_experts and (layer is None or spec.moe_layer_pattern is None or spec.moe_layer_pattern[layer]):
        _moe_param_sizes(spec, out, experts)
    else:
        lin("fc2", f, h, bias, h)
        lin("fc1", h, fc1, bias, fc1 // t)
    norm("ln2")
    lin("proj", h, h, bias, h)
    lin("qkv", h, qkv, bias or spec.qkv_bias, qkv // t)
    norm("ln1")
    return out


def is_fp8_weight(name: str) -> bool:
    """A block parameter (its ``layer_param_sizes`` name, ``qkv.weight``) that Transformer Engine runs in fp8
    with ``training.fp8``: a Linear weight (not a norm's, not a bias)."""
    return name.endswith(".weight") and not name.startswith("ln")


def fp8_weight_numel(spec) -> int:
    """Elements of one rank's block Linear weights (QKV, proj, fc1, fc2 per TP rank, ``is_fp8_weight``): those with
    an fp8 workspace, or fp8 parameters with ``fp8_param_gather``; 0 without ``spec.fp8``."""
    if spec.fp8 is None:
        return 0
    return spec.rank_layers * sum(n for k, n in layer_param_sizes(spec).items() if is_fp8_weight(k))


def _moe_param_sizes(spec, out: dict[str, int], experts: bool) -> None:
    """The MoE layer's parameters on one rank in backward order (``moe.moe_bwd``), added to ``out``."""
    h, t = spec.hidden_size, spec.tensor_parallel_size
    fs = spec.moe_shared_expert_intermediate_size
    g = 3 if spec.swiglu else 2
    if fs:
        if spec.moe_shared_expert_gate:
            out["shared_expert.gate.weight"] = h
        out["shared_expert.fc2.weight"] = fs * h // t
        out["shared_expert.fc1.weight"] = h * (g - 1) * fs // t
    if experts:
        fe = (spec.moe_ffn_hidden_size or spec.ffn_hidden_size) // spec.expert_tensor_parallel_size
        if spec.moe_grouped_gemm:
            out["experts.fc2.weight"] = spec.local_experts * fe * h
            out["experts.fc1.weight"] = spec.local_experts * h * (g - 1) * fe
        else:  # SequentialMLP: one fc1 and fc2 per local expert, the last expert's first (moe_experts.experts_bwd)
            for j in reversed(range(spec.local_experts)):
                out[f"experts.{j}.fc2.weight"] = fe * h
                out[f"experts.{j}.fc1.weight"] = h * (g - 1) * fe
    out["router.weight"] = h * spec.num_experts


def root_param_sizes(spec) -> dict[str, int]:
    """Parameters outside the blocks, name -> elements, in backward order (LM head if untied, final
    norm, token table, position table)."""
    h = spec.hidden_size
    out: dict[str, int] = {}
    if not spec.tied_embeddings:
        out["lm_head.weight"] = spec.vocab_per_rank * h
    out["ln_f.weight"] = h
    if spec.norm_has_bias:
        out["ln_f.bias"] = h
    out["wte.weight"] = spec.vocab_per_rank * h
    if spec.position_table_rows:
        out["wpe.weight"] = spec.position_table_rows * h
    return out


def backward_param_order(spec, chunk: int = 0, experts: bool = True) -> list[tuple[str, int, int]]:
    """``(name, unit, elements)`` of every parameter of model chunk ``chunk`` in the order backward finishes
    its gradient (the builder's ``param_groups`` order): on the last model chunk the LM head (with tied
    embeddings and a pipeline, the last rank's copy of the token table) and the final norm, then the chunk's
    blocks in reverse, then on model chunk 0 the embeddings. With one pipeline rank chunk 0 is the whole
    model: LM head and final norm, blocks ``L-1 .. 0``, embeddings (``experts``: as ``layer_param_sizes``)."""
    sizes = root_param_sizes(spec)
    root = list(sizes.items())
    head, emb = [], []
    if chunk == spec.pipeline_parallel_size * spec.virtual_pipeline_size - 1:
        if spec.embedding_copy:
            head.append(("wte.weight", ROOT, sizes["wte.weight"]))
        head += [(n, ROOT, k) for n, k in root if not n.startswith(("wte", "wpe"))]
    if chunk == 0:
        emb = [(n, ROOT, k) for n, k in root if n.startswith(("wte", "wpe"))]
    blocks = [(f"L{layer}.{n}", layer, k) for layer in reversed(chunk_layers(spec.layer_split, chunk))
              for n, k in layer_param_sizes(spec, experts, layer).items()]
    return head + blocks + emb


@dataclass
class MegatronBuffer:
    """One model chunk's contiguous gradient buffer and its buckets (Megatron-LM ``_ParamAndGradBuffer``;
    with a virtual pipeline every model chunk is its own ``DistributedDataParallel`` with its own buffer).

    Attributes:
        first_bucket: Index of its first bucket among the rank's buckets (their names).
        bucket_len: Parameters per bucket, in backward order.
        bucket_numel: Elements per bucket.
        hook_buckets: Builder hook (a layer; -1 the embeddings, ``num_layers`` the head) -> the buckets
            holding its parameters (which the hook's forward waits for with ``overlap_param_gather``).
        bucket_fp8_numel: Elements per bucket that are fp8 parameters (``spec.fp8_param_gather``; else 0s).
        closed: Buckets whose gradients are complete (filled in by the builder).
        gather_ops: Bucket -> its parameter all-gather op (filled in by the builder).
        transposed: Buckets whose fp8 weights' transposes were made this step (filled in by the builder).
    """

    first_bucket: int
    bucket_len: list[int]
    bucket_numel: list[int]
    hook_buckets: dict[int, list[int]]
    bucket_fp8_numel: list[int] = field(default_factory=list)
    closed: int = 0
    gather_ops: dict[int, int] = field(default_factory=dict)
    transposed: set[int] = field(default_factory=set)


def megatron_buffer(spec, chunk: int, first_bucket: int = 0, experts: bool = True) -> MegatronBuffer:
    """The gradient buffer of model chunk ``chunk`` (``backward_param_order`` split by ``megatron_buckets``;
    ``experts`` false: the expert parameters, reduced over their own group, are not in it)."""
    order = backward_param_order(spec, chunk, experts)
    buckets = megatron_buckets([k for _, _, k in order], spec.sharding.bucket_elements)
    hooks: dict[int, set[int]] = {}
    L = spec.num_layers
    for bi, b in enumerate(buckets):
        for i in b:
            name, unit, _ = order[i]
            emb = name.startswith(("wte", "wpe")) and chunk == 0
            hooks.setdefault(unit if unit >= 0 else (-1 if emb else L), set()).add(bi)
            if emb and name == "wte.weight" and spec.tied_embeddings and not spec.embedding_copy:
                hooks.setdefault(L, set()).add(bi)  # the tied head reads the token table
    fp8 = [spec.fp8_param_gather and unit >= 0 and is_fp8_weight(name.split(".", 1)[1]) for name, unit, _ in order]
    return MegatronBuffer(first_bucket, [len(b) for b in buckets], [sum(order[i][2] for i in b) for b in buckets],
                          {h: sorted(v) for h, v in hooks.items()},
                          [sum(order[i][2] for i in b if fp8[i]) for b in buckets])


def megatron_buckets(sizes: list[int], bucket_elements: int | None) -> list[list[int]]:
    """Indices of ``sizes`` (parameters in backward order) per gradient bucket: a bucket closes once it
    holds at least ``bucket_elements`` elements (Megatron-LM ``_ParamAndGradBuffer``); ``None``: one."""
    out: list[list[int]] = [[]]
    n = 0
    for i, k in enumerate(sizes):
        out[-1].append(i)
        n += k
        if bucket_elements is not None and n >= bucket_elements and i < len(sizes) - 1:
            out.append([])
            n = 0
    return [b for b in out if b]


def megatron_default_bucket_elements(dp: int, overlap_grad_reduce: bool) -> int | None:
    """Megatron-LM's bucket size when ``--ddp-bucket-size`` is not given: ``max(4e7, 1e6 dp)``
    elements with ``--overlap-grad-reduce``, else one bucket (``DistributedDataParallel.__init__``)."""
    return max(40_000_000, 1_000_000 * dp) if overlap_grad_reduce else None


#: Stream of FSDP1's pre-unshard logic, the low-precision cast (``_init_streams``: ``state._streams["pre_unshard"]``;
#: ``_unshard`` runs ``pre_unshard`` on it and makes the unshard stream wait for it; pytorch/pytorch@00ae0bc
#: torch/distributed/fsdp/_runtime_utils.py)
PRE_UNSHARD_STREAM = "fsdp.pre_unshard"
#: Op name suffix (after ``<unit>.<phase>.``) of FSDP1's cast of a unit's fp32 shard before its all-gather
LOW_PRECISION_SHARD = "fsdp.low_precision_shard"


def shard_cast(b, name: str, stream: str, n: int, deps, phase: Phase, tensor: str, layer: int = -1) -> int:
    """The memory-bound kernel casting ``n`` fp32 elements into a new 16-bit tensor ``tensor`` (reads ``4 n``, writes
    ``2 n`` bytes; allocates ``2 n`` bytes), on ``stream`` of builder ``b``: FSDP1's ``_use_low_precision_shard``
    (``_mp_shard.copy_(_local_shard)``, pytorch/pytorch@fe03cf6 torch/distributed/fsdp/_flat_param.py), NO_SHARD's
    unit cast (``unit_param_cast``) and FSDP2's all-gather copy-in cast (``fsdp2.Fsdp2ParamGather``). Returns the
    op id."""
    return b.add(name, OpKind.COMPUTE, stream, deps=deps, phase=phase, layer=layer, cost_class=CostClass.CAST,
                 bytes_read=4.0 * n, bytes_written=2.0 * n, allocs=(TensorAlloc(tensor, 2 * n),), dtype="fp32")


def unit_param_cast(b, name: str, op: str, nbytes: int, deps, phase: Phase, allocs=()) -> int:
    """NO_SHARD with a 16-bit ``param_dtype``: the kernel that casts a unit's ``nbytes / 2`` fp32 parameters into its
    16-bit copy (``shard_cast``; ``allocs``: the copy, one tensor of ``nbytes``), on the compute stream;
    ``ParamGather``'s op in place of an all-gather (``op`` is unused). Returns the op id."""
    (copy,) = allocs
    return shard_cast(b, name, "compute", nbytes // 2, deps, phase, copy.name)


def grad_cast_back(b, k: int, nbytes: int, reduce_op: int, tensors, group: str = "dp") -> tuple[int, str]:
    """NO_SHARD with ``reduce_dtype`` bf16: after unit bucket ``k``'s all-reduce of ``nbytes`` 16-bit gradient bytes,
    their cast to the fp32 ``.grad`` (``_cast_grad_to_param_dtype``: reads 2 n, writes 4 n bytes) on the stream of the
    reduction (FSDP's post-backward stream). Returns ``(op id, the fp32 gradient tensor)``."""
    n = nbytes // 2
    out = f"grad.fp32.b{k}"
    i = b.add(f"fsdp.grad_cast_fp32.{k}", OpKind.COMPUTE, f"comm.{group}", deps=[reduce_op], phase=Phase.BWD,
              cost_class=CostClass.CAST, bytes_read=2.0 * n, bytes_written=4.0 * n, uses=tuple(tensors),
              allocs=(TensorAlloc(out, 4 * n),), dtype="fp32")
    return i, out


#: Parameters replicated over the TP ranks whose gradients are partial per rank under sequence parallelism (the
#: ``sequence_parallel_params`` of the builder's spec): norms, row-parallel biases, the MoE router and shared gate
TP_REPLICATED = ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "proj.bias", "fc2.bias", "router.weight",
                 "shared_expert.gate.weight", "ln_f.weight", "ln_f.bias")


def sp_unit_grads(builder, bucket) -> int | None:
    """FSDP (over dp) with Megatron-style TP + sequence parallelism inside: before a unit's gradient reduce-scatter,
    one all-reduce over the TP group of the unit's TP-replicated gradients (``TP_REPLICATED``: a LayerNorm sees
    ``T / t`` tokens per TP rank, so its weight gradient is a partial sum), in ``param_dtype`` (the gradient's dtype
    before FSDP casts it to ``reduce_dtype``). PyTorch FSDP2 + DTensor SP: ``FSDPParam._get_grad_inner_tensor``
    redistributes a ``Partial`` gradient to the parameter's ``Replicate`` TP placement before ``foreach_reduce``
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py); Megatron-LM's own DDP instead all-reduces them once per
    step (``_allreduce_layernorm_grads``). The unit's reduce-scatter waits for it (``builder._bucket`` gets its op as
    the finishing op of those gradients). Returns the op id, or None without such parameters."""
    rep = [i for i, g in enumerate(bucket) if g.name.split(".", 1)[-1] in TP_REPLICATED or g.name in TP_REPLICATED]
    if not rep:
        return None
    n = sum(bucket[i].numel for i in rep)
    e = builder.e
    e.phase, layer, e.layer = Phase.BWD, e.layer, bucket[rep[0]].layer  # named L<unit>.bwd.tp.sp_grads.all_reduce
    i = builder._tp_op("sp_grads.all_reduce", "all_reduce", builder.sh.param_bytes * n,
                       deps=[bucket[j].grad_op for j in rep], dtype="fp32" if builder.sh.param_bytes == 4 else None)
    e.layer = layer
    for j in rep:
        bucket[j] = bucket[j].with_grad_op(i)
    return i


class ParamGather:
    """Per-unit all-gathers of sharded parameters with prefetch, for one builder.

    Args:
        spec: The builder's ``TransformerSpec`` (its ``sharding`` set, ``gathers`` true).
        emitter: The builder's ``KernelEmitter``.
        collective: ``collective(name, op, nbytes, deps, phase, allocs=...) -> op id`` on the shard group (NO_SHARD
            with a 16-bit ``param_dtype``: the cast kernel that makes the unit's 16-bit copy).
        op_suffix: Op name after ``<unit>.<phase>.`` (``param_all_gather``; ``param_cast`` for NO_SHARD).
    """

    def __init__(self, spec, emitter, collective, op_suffix: str = "param_all_gather"):
        sh = spec.sharding
        self.sh, self.e, self._coll = sh, emitter, collective
        self._suffix = op_suffix
        thr = sh.persistence_threshold
        chunks = spec.model_chunks  # this pipeline rank's model chunks (the whole model without a pipeline)
        layers = [u for k in chunks for u in chunk_layers(spec.layer_split, k)]
        self.num_layers = spec.num_layers
        lay = layer_param_sizes(spec)
        root = [n for k in chunks for _, u, n in backward_param_order(spec, k) if u == ROOT]
        #: elements gathered per unit (parameters above the persistence threshold) of this rank's units
        self.numel = {u: sum(k for k in lay.values() if k > thr) for u in layers}
        self.numel[ROOT] = sum(k for k in root if k > thr)
        #: elements kept whole on every rank (at most the threshold each)
        self.persistent_numel = (len(layers) * sum(k for k in lay.values() if k <= thr)
                                 + sum(k for k in root if k <= thr))
        self.order = {Phase.FWD: [ROOT, *layers], Phase.BWD: [ROOT, *reversed(layers)]}
        self._pos = {p: {u: i for i, u in enumerate(o)} for p, o in self.order.items()}
        #: pipelines (``torch.distributed.pipelining`` with FSDP: ``set_reshard_after_backward(False)`` until the
        #: step's last backward): a unit gathered by a backward stays gathered for the next passes
        self.keep_after_backward = spec.pipeline_parallel_size > 1
        self._live: dict[int, tuple[int, str]] = {}  # unit -> (its gather op, the gathered tensor), while gathered
        self._unit_of: dict[str, int] = {}
        self._entered: set[int] = set()
        self._pass: Phase | None = None

    # -- schedule --------------------------------------------------------------------------
    def _depth(self, phase: Phase) -> int:
        if phase == Phase.FWD:
            d = self.sh.fwd_prefetch_depth
            return self.num_layers + 1 if d is None else d
        return self.sh.bwd_prefetch_depth if self.sh.bwd_prefetch == "pre" else 0

    def _emit(self, phase: Phase, unit: int) -> None:
        if unit in self._live or not self.numel.get(unit):
            return
        nbytes = self.sh.param_bytes * self.numel[unit]
        tensor = self.e.fresh(f"params.L{unit}.gathered.{phase.value}" if unit >= 0 else
                              f"params.root.gathered.{phase.value}")
        deps = [self.e.last_compute] if self.e.last_compute >= 0 else []
        tag = "root" if unit == ROOT else f"L{unit}"
        kw = {}
        if self.sh.casts_shards:  # pre_unshard -> _use_low_precision_shard, freed by post_unshard after the gather
            mp = self.e.fresh(f"params.{tag}.low_precision_shard.{phase.value}")
            deps = [shard_cast(self.e.b, f"{tag}.{phase.value}.{LOW_PRECISION_SHARD}", PRE_UNSHARD_STREAM,
                               self.sh.shard(self.numel[unit]), deps, phase, mp, max(unit, -1))]
            kw["uses"] = (mp,)
        op = self._coll(f"{tag}.{phase.value}.{self._suffix}", "all_gather", nbytes, deps, phase,
                        allocs=(TensorAlloc(tensor, nbytes),), **kw)
        self._live[unit] = (op, tensor)
        self._unit_of[tensor] = unit

    def unit_of_hook(self, hook: int) -> int:
        """The unit a builder hook belongs to (``num_layers``: the LM head, part of the root)."""
        return ROOT if hook < 0 or hook >= self.num_layers else hook

    def start_pass(self, phase: Phase) -> None:
        """Start of a forward or backward pass (of one micro-batch through one model chunk): reshard what the
        previous pass released. After a forward: the blocks with ``reshard_after_forward`` (and the root with
        ``reshard_root``); after a backward: everything (FSDP's post-backward reshard, ZeRO-3's release), except
        with a pipeline (``keep_after_backward``), where the gathered units stay until the step ends."""
        prev, self._pass = self._pass, phase
        self._entered.clear()
        if prev == Phase.FWD:
            drop = [u for u in self._live if u not in self.sh.kept_after_forward
                    and (self.sh.reshard_root if u == ROOT else self.sh.reshard_after_forward)]
        elif prev == Phase.BWD and not self.keep_after_backward:
            drop = list(self._live)
        else:
            drop = []
        for u in drop:
            del self._live[u]

    def new_micro_batch(self) -> None:
        """Start of a micro-batch's forward (``start_pass(Phase.FWD)``)."""
        self.start_pass(Phase.FWD)

    def enter(self, hook: int, phase: Phase) -> None:
        """Start of a unit's compute in ``phase``: issue the gathers the prefetch window allows (and this
        unit's, on demand, unless it is still gathered) and make the next compute kernel wait for this unit's
        gather."""
        unit = self.unit_of_hook(hook)
        if unit in self._entered:
            return
        self._entered.add(unit)
        order, j = self.order[phase], self._pos[phase][unit]
        for u in order[j:j + self._depth(phase) + 1]:
            self._emit(phase, u)
        got = self._live.get(unit)
        if got is not None:
            self.e.wait_for.append(got[0])

    def leave(self, hook: int, phase: Phase) -> None:
        """End of a block's backward compute: with ``BACKWARD_POST`` issue the next unit's gather now
        (before this unit's reduce-scatter)."""
        if phase != Phase.BWD or self.sh.bwd_prefetch != "post":
            return
        order, j = self.order[phase], self._pos[phase][self.unit_of_hook(hook)]
        if j + 1 < len(order):
            self._emit(phase, order[j + 1])

    def weight(self, hook: int, phase: Phase) -> str | None:
        """The gathered tensor a GEMM of this unit reads now (``None``: the unit is not gathered)."""
        got = self._live.get(self.unit_of_hook(hook))
        return got[1] if got else None

    def backward_weight(self, tensor: str) -> str:
        """The gathered copy a backward reads in place of a forward-gathered tensor saved for backward (the
        unit's gather of this pass, or the same tensor when it was kept)."""
        unit = self._unit_of.get(tensor)
        if unit is None:
            return tensor
        got = self._live.get(unit)
        return got[1] if got else tensor
