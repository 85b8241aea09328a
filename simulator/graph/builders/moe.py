"""Mixture-of-experts MLP of one decoder block, kernel by kernel, as Megatron-LM core runs it
(``megatron/core/transformer/moe``: ``MoELayer`` with ``TopKRouter``, the ``alltoall`` token
dispatcher ``MoEAlltoAllTokenDispatcher`` (``moe_token_dispatcher_type: allgather``:
``MoEAllGatherTokenDispatcher``, ``simulator.graph.builders.moe_allgather``) and grouped-GEMM experts
``GroupedMLP`` (``moe_grouped_gemm: false``: ``SequentialMLP``, ``simulator.graph.builders.moe_experts``); Fedus
et al., *Switch Transformers*, JMLR 2022; Jiang et al., *Mixtral of Experts*, 2024).

The transformer builder (``transformer._GptBuilder``) calls ``moe_fwd`` / ``moe_bwd`` in place of
its dense MLP; the functions use its emitter and Linear helpers. Shapes: ``T`` tokens on this rank
(``b s``), ``h`` hidden, ``E`` experts, ``k`` experts per token, ``ep`` expert-parallel ranks,
``E_l = E / ep`` local experts, ``f_e`` expert width, ``N`` routed token copies this rank's experts
process (``routed_tokens``).

Forward, per block:

* **router**: the gating GEMM ``[T, h] x [h, E]`` (a replicated weight), one top-k + softmax kernel
  writing the probabilities (the logits' dtype: ``TransformerSpec.moe_probs_bytes``, 2 bytes in bf16 unless
  ``moe_router_dtype`` fp32) and the boolean routing map ``[T, E]``; with
  ``moe_router_load_balancing_type: aux_loss`` the auxiliary loss (Fedus et al. 2022, eq. 4): a
  softmax of the logits over all experts and a reduction to per-expert sums.
* **dispatch**: the tokens-per-expert count (``[E]`` int64), all-gathered over the EP group
  (``[ep, E]``), copied to the host and waited for (a host synchronisation per block: the
  all-to-all splits and the grouped GEMM's batch sizes are host values in Megatron's dropless
  path); ``permute`` gathers the ``N`` token copies into expert order; with ``ep > 1`` the
  **dispatch all-to-all** over the ``ep`` group (``2 N h`` bytes per rank) and, with ``E_l > 1``,
  ``sort_chunks_by_idxs`` (from source-rank order to local-expert order).
* **experts**: grouped GEMMs fc1 ``[N, h] x [h, 2 f_e]`` (SwiGLU; ``f_e`` without), the activation,
  fc2 ``[N, f_e] x [f_e, h]``; one grouped GEMM is priced as one GEMM of the ``N`` stacked rows
  (the per-expert tile padding is ignored); or one MLP per local expert (``moe_experts``).
* **combine**: the reverse chunk sort, the **combine all-to-all**, ``unpermute`` (probability-
  weighted scatter-add back to ``[T, h]``); a shared expert (``moe_shared_expert_intermediate_size``)
  is a dense MLP on all ``T`` tokens whose output is added.

Backward mirrors it: unpermute backward (also the probability gradient), the combine all-to-all's
backward (an all-to-all), the grouped weight and input gradients, the dispatch all-to-all's
backward, permute backward (scatter-add), the router's softmax/top-k and auxiliary-loss backward,
the router GEMM's gradients, and the adds of the router (and shared expert) input gradients:
**4 all-to-alls per MoE block** (2 forward, 2 backward) of ``2 N h`` bytes each.

**Routing**: balanced by default (stated in the run's warnings): every expert receives ``T k / E`` token
copies from every EP rank, so each rank's ``E_l`` experts process ``N = T k`` rows in all (``ep T k / E`` per
expert) and each rank sends and receives ``2 T k h`` bytes per all-to-all (``b s h x k`` 16-bit values). With a
capacity factor ``c`` (Megatron ``get_capacity``: ``ceil(c T k / E)`` copies per expert from ``T`` tokens, the
rest dropped, no padding) ``N = min(T k, E ceil(c T k / E))``. With ``moe_tokens_per_expert`` (shares ``f_i``,
the same on every source rank) expert ``i`` gets ``T k f_i`` copies of each rank's tokens (at most the
capacity), EP rank ``r`` receives ``ep`` x the copies of its experts ``r E_l .. (r + 1) E_l - 1``, and the rank
built is the busiest one: its grouped GEMMs process its ``N = max_r`` rows and every all-to-all moves
``max(N_l, N)`` rows (its receive in dispatch, its send in combine; ``N_l``: the copies leaving its own router,
which permute/unpermute handle). The other EP ranks wait for it at the combine all-to-all, so the step follows
it (``expert_tokens``, ``load_imbalance``).

**Tensor and expert tensor parallelism** (Megatron ``--expert-tensor-parallel-size`` ``etp``, default ``t``):
attention is split over the ``t`` TP ranks as the dense path and, as Megatron requires, with sequence
parallelism (arguments.py: "When using MoE and tensor parallelism, sequence parallelism must be used"): the
MoE layer takes the ``T_n = T / t`` tokens of the rank's sequence shard, not gathered. The router runs on them
(its weight replicated; its gradient joins the sequence-parallel LayerNorm all-reduce). The dispatcher is
Megatron core's ``MoEAlltoAllTokenDispatcher`` (``megatron/core/transformer/moe/token_dispatcher.py``:
"permute->A2A(EP)->AG(TP)->sort_chunk ... sort_chunk->RS(TP)->A2A(EP)->unpermute", with its ``tp_group`` the
expert-tensor-parallel group): after the dispatch all-to-all the ``N`` rows are all-gathered over ``etp``
(``etp N`` rows, each expert's ``f_e / etp`` columns on this rank), the fc2 partial sums reduce-scattered back
to ``N`` rows before the combine all-to-all (16-bit; backward: the reverse pair). The tokens-per-expert counts
are gathered over Megatron's ``tp_ep`` group (``ep etp`` ranks), priced over ``ep`` (``etp`` when ``ep = 1``).
The shared expert is a dense MLP over the ``t`` TP ranks (all-gather, column/row-parallel GEMMs,
reduce-scatter). The rank groups follow Megatron's expert grid (``initialize_model_parallel``: ``RankGenerator(
tp=etp, ep=ep, dp=edp)``, ``edp = t dp / (ep etp)`` per stage): ``etp`` consecutive ranks, ``ep`` ranks at
stride ``etp``. Not modelled (refused): ``etp > t``, ``etp`` not dividing ``t``, context parallelism with
experts, the ``alltoall_seq`` and ``flex`` dispatchers, the probabilities' small all-to-all beside the tokens'.

Expert gradients: with data parallelism they are reduced over the expert-data-parallel group
``edp`` (``dp / ep`` ranks: Megatron rank order tp-cp-ep-dp), one all-reduce per expert weight
tensor when its gradient is ready (Megatron buckets expert parameters in their own buffer; the
bucketing is not modelled); nothing with ``edp`` of one rank. ``edp = t dp / (ep etp)`` (``dp / ep`` without
TP) and it is the dense ``dp`` group when ``ep = 1`` and ``etp = t`` (then the expert gradients share the
dense buckets). Dense parameters (attention, norms,
router, shared expert, embeddings) are reduced over the whole ``dp`` group as before.
"""

from __future__ import annotations

import math

from simulator.graph.builders import moe_allgather as ag
from simulator.graph.builders import moe_experts as experts
from simulator.graph.op_graph import ParamGroup
from simulator.graph.ops import CostClass as C
from simulator.graph.ops import OpKind, TensorAlloc

#: ``moe_router_load_balancing_type`` values modelled (Megatron also has seq_aux_loss and sinkhorn)
LOAD_BALANCING = ("aux_loss", "none")
#: ``moe_token_dispatcher_type`` values modelled (Megatron also has alltoall_seq and flex)
DISPATCHERS = ("alltoall", "allgather")


# -- counts ------------------------------------------------------------------------------------
def check_moe_spec(s) -> None:
    """Check the MoE fields of a ``TransformerSpec``.

    Raises:
        ValueError: MoE fields without ``num_experts``; ``moe_router_topk`` outside ``1..E``; a non-positive
            width or capacity factor; an unknown load-balancing type; ``ep`` not dividing ``E`` or the
            data-parallel size; experts with tensor parallelism, ``amp_fp32_params``, biases or ZeRO
            with ``ep > 1`` (not modelled).
    """
    E, ep = s.num_experts, s.expert_parallel_size
    if E is None:
        if (s.moe_ffn_hidden_size or s.moe_shared_expert_intermediate_size or s.moe_expert_capacity_factor is not None
                or s.moe_tokens_per_expert is not None or s.moe_layer_pattern is not None):
            raise ValueError("moe_* fields need num_experts")
        if ep != 1:
            raise ValueError(f"expert_parallel_size ({ep}) > 1 needs num_experts")
        return
    if E <= 0:
        raise ValueError(f"num_experts must be > 0, got {E}")
    if not 1 <= s.moe_router_topk <= E:
        raise ValueError(f"moe_router_topk ({s.moe_router_topk}) must be between 1 and num_experts ({E})")
    for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_expert_capacity_factor"):
        v = getattr(s, name)
        if v is not None and v <= 0:
            raise ValueError(f"{name} must be > 0, got {v}")
    if s.moe_token_dispatcher_type not in DISPATCHERS:
        raise ValueError(f"moe_token_dispatcher_type must be one of {DISPATCHERS}, got {s.moe_token_dispatcher_type!r}")
    if s.moe_router_load_balancing_type not in LOAD_BALANCING:
        raise ValueError(f"moe_router_load_balancing_type must be one of {LOAD_BALANCING}, got "
                         f"{s.moe_router_load_balancing_type!r}")
    pat = s.moe_layer_pattern
    if pat is not None and (len(pat) != s.num_layers or set(pat) - {0, 1} or 1 not in pat):
        raise ValueError(f"moe_layer_pattern must be {s.num_layers} (num_layers) values 0 or 1 with at least one 1")
    if pat is not None and 0 in pat and s.sharding is not None and s.sharding.gathers and s.data_parallel_size > 1:
        raise ValueError(f"moe_layer_pattern (dense and MoE blocks) with {s.sharding.strategy} (per-block gathers of "
                         "uniform blocks) is not modelled")
    w = s.moe_tokens_per_expert
    if w is not None and (len(w) != E or min(w) < 0 or not sum(w) > 0):
        raise ValueError(f"moe_tokens_per_expert must be {E} (num_experts) non-negative numbers, not all 0; got "
                         f"{len(w)} numbers")
    if ep <= 0 or E % ep:
        raise ValueError(f"expert_parallel_size ({ep}) must divide num_experts ({E})")
    t, et = s.tensor_parallel_size, s.expert_tensor_parallel_size
    if et <= 0 or expert_ffn(s) % et:
        raise ValueError(f"expert_tensor_parallel_size ({et}) must divide the expert width ({expert_ffn(s)})")
    if et > t:
        raise ValueError(f"expert_tensor_parallel_size ({et}) above tensor_parallel_size ({t}) is not modelled")
    if (ep > 1 or et > 1) and (t * s.data_parallel_size) % (ep * et):
        raise ValueError(f"expert_parallel_size x expert_tensor_parallel_size ({ep} x {et}) must divide "
                         f"tensor_parallel_size x data_parallel_size ({t} x {s.data_parallel_size}): Megatron's "
                         "expert grid etp-ep-edp spans the tp x dp ranks of a stage")
    if t > 1 and not s.sequence_parallel:
        raise ValueError("num_experts with tensor_parallel_size > 1 needs sequence_parallel (Megatron-LM)")
    fs = s.moe_shared_expert_intermediate_size
    if fs and fs % t:
        raise ValueError(f"tensor_parallel_size ({t}) must divide moe_shared_expert_intermediate_size ({fs})")
    if s.moe_shared_expert_gate and not fs:
        raise ValueError("moe_shared_expert_gate needs moe_shared_expert_intermediate_size")
    if s.precision == "amp_fp32_params":
        raise ValueError("num_experts is modelled for Megatron precisions bf16 and fp16, not amp_fp32_params")
    if s.bias:
        raise ValueError("num_experts with biases (add_bias_linear) is not modelled (Megatron GroupedMLP has none; "
                         "SequentialMLP's expert biases are not modelled either)")
    if own_expert_grads(s) and s.data_parallel_size > 1 and s.sharding is not None and \
            s.sharding.strategy != "distributed_optimizer":
        raise ValueError(f"{s.sharding.strategy} with expert parallelism (expert gradients over edp) is not modelled "
                         "yet (ZeRO-1/2 and the distributed optimizer are)")


def expert_data_parallel_size(s) -> int:
    """Ranks ``edp`` holding the same expert shard: ``t dp / (ep etp)`` (Megatron ``expert_data_parallel_size``
    = world / (etp x ep x pp), one stage's ``t dp`` ranks without context parallelism)."""
    return s.tensor_parallel_size * s.data_parallel_size // (s.expert_parallel_size * s.expert_tensor_parallel_size)


def is_moe_layer(s, layer: int) -> bool:
    """Block ``layer`` has the MoE MLP (every block of an MoE model unless ``moe_layer_pattern`` says 0)."""
    if not s.num_experts:
        return False
    pat = s.moe_layer_pattern
    return pat is None or bool(pat[layer])


def moe_layer_count(s, layers) -> int:
    """How many of the block indices ``layers`` are MoE blocks."""
    return sum(1 for i in layers if is_moe_layer(s, i))


def rank_layer_ids(s) -> list[int]:
    """The block indices held by this pipeline rank (its model chunks' layers)."""
    from simulator.graph.builders.pipeline import chunk_layers

    return [i for k in s.model_chunks for i in chunk_layers(s.layer_split, k)]


def expert_ffn(s) -> int:
    """Width ``f_e`` of one routed expert (``moe_ffn_hidden_size``, else ``ffn_hidden_size``)."""
    return s.moe_ffn_hidden_size or s.ffn_hidden_size


def _mlp_weights(s, f: int) -> int:
    """Weights of one (gated) MLP of width ``f``: ``3 h f`` with SwiGLU, else ``2 h f`` (no biases)."""
    return (3 if s.swiglu else 2) * s.hidden_size * f


def moe_mlp_params(s, experts: int) -> int:
    """Parameters of one block's MoE layer counting ``experts`` routed experts: the router ``h E``,
    ``experts x 3 h f_e`` (SwiGLU; ``2 h f_e`` without) and the shared expert. Mixtral-8x7B
    (``h`` 4096, ``f_e`` 14336, ``E`` 8): 32,768 + 8 x 176,160,768 (Hugging Face ``MixtralSparseMoeBlock``:
    ``gate`` ``[E, h]``, experts ``w1, w2, w3``)."""
    shared = s.moe_shared_expert_intermediate_size
    return (s.hidden_size * s.num_experts + experts * _mlp_weights(s, expert_ffn(s))
            + (_mlp_weights(s, shared) + (s.hidden_size if s.moe_shared_expert_gate else 0) if shared else 0))


def moe_rank_params(s, experts: int) -> int:
    """One block's MoE parameters on one rank: the replicated router (and shared-expert gate), ``experts`` routed
    experts split over ``etp`` ranks, the shared expert split over the ``t`` attention TP ranks."""
    shared = s.moe_shared_expert_intermediate_size
    h, t = s.hidden_size, s.tensor_parallel_size
    return (h * s.num_experts + experts * _mlp_weights(s, expert_ffn(s)) // s.expert_tensor_parallel_size
            + (_mlp_weights(s, shared) // t + (h if s.moe_shared_expert_gate else 0) if shared else 0))


def expert_shares(s) -> tuple[float, ...]:
    """Fraction of the routed token copies each expert receives, ``E`` numbers summing to 1: the normalised
    ``moe_tokens_per_expert`` (counts or fractions, e.g. Megatron's per-expert token counts), else ``1 / E`` each
    (balanced routing)."""
    E = s.num_experts
    w = s.moe_tokens_per_expert
    if w is None:
        return (1 / E,) * E
    tot = sum(w)
    return tuple(x / tot for x in w)


def _kept(s, T: int) -> list[float]:
    """Token copies of one rank's ``T`` tokens routed to each expert and kept: ``T k f_i``, at most the capacity
    ``ceil(c T k / E)`` with capacity factor ``c`` (Megatron ``moe_utils.get_capacity(num_tokens * topk,
    num_experts, capacity_factor)``, applied per expert to each rank's tokens). Every rank routes with the same
    shares ``f_i`` (``expert_shares``)."""
    n = T * s.moe_router_topk
    c = s.moe_expert_capacity_factor
    cap = math.inf if c is None else math.ceil(n / s.num_experts * c)
    return [min(n * f, cap) for f in expert_shares(s)]


def routed_tokens(s, T: int) -> int:
    """Token copies ``N_l`` of this rank's ``T`` tokens that leave the router (permute, dispatch, unpermute):
    ``T k`` dropless; with capacity factor ``c`` the sum over experts of ``min(T k f_i, ceil(c T k / E))``
    (``min(T k, E ceil(c T k / E))`` balanced)."""
    return round(sum(_kept(s, T)))


def ep_rank_loads(s, T: int) -> list[float]:
    """Token copies the local experts of each EP rank ``r`` receive from the whole EP group: ``ep`` x the kept
    copies of its experts ``r E_l .. (r + 1) E_l - 1`` (Megatron ``local_expert_indices``; every source rank has
    the same shares). Balanced and dropless: ``T k`` on every rank."""
    kept, El, ep = _kept(s, T), s.local_experts, s.expert_parallel_size
    return [ep * sum(kept[r * El:(r + 1) * El]) for r in range(ep)]


def expert_tokens(s, T: int) -> int:
    """Rows ``N`` the grouped expert GEMMs of the busiest EP rank process per micro-batch (before the expert
    tensor-parallel all-gather): ``max_r ep_rank_loads``. The step follows that rank: the others wait for it at
    the combine all-to-all, so the representative rank is built with its load."""
    return round(max(ep_rank_loads(s, T)))


def load_imbalance(s, T: int) -> float:
    """The busiest EP rank's expert rows over the mean rank's (1.0 balanced): ``expert_tokens / mean``."""
    loads = ep_rank_loads(s, T)
    return max(loads) / (sum(loads) / len(loads))


# -- kernels -----------------------------------------------------------------------------------
def _ep(bld, name: str, op: str, nbytes: int, x: str, out: str, dtype: str | None = None) -> str:
    """A blocking collective over the ``ep`` group that reads ``x`` and allocates ``out`` (``nbytes``)."""
    y = bld.e.fresh(out)
    bld._tp_op(name, op, nbytes, uses=[x], out=[(y, nbytes)], dtype=dtype, group="ep")
    return y


def _copy(bld, name: str, x: str, nbytes: int) -> str:
    """A permutation copy of ``nbytes`` (``sort_chunks_by_idxs``)."""
    y = bld.e.fresh(name)
    bld.e.kernel(name, C.COPY, reads=nbytes, writes=nbytes, out=[(y, nbytes)], uses=[x])
    return y


def _etp(bld, name: str, op: str, nbytes: int, x: str, out: str, out_bytes: int) -> str:
    """A blocking collective over the expert-tensor-parallel group ``etp`` (``nbytes``: the gathered array)."""
    y = bld.e.fresh(out)
    bld._tp_op(name, op, nbytes, uses=[x], out=[(y, out_bytes)], group="etp")
    return y


def host_sync(bld, counts: str, nbytes: int) -> None:
    """The tokens-per-expert counts ``counts`` (``nbytes``) copied to the host and waited for (a host
    synchronisation per block: the all-to-all splits and the expert GEMMs' row counts are host values in
    Megatron's dropless path)."""
    e = bld.e
    d2h = e.kernel("moe.tokens_per_expert.d2h", C.COPY, kind=OpKind.MEMCPY_D2H, stream="d2h", reads=nbytes,
                   uses=[counts], dtype="int64")
    bld.b.add(f"L{e.layer}.{e.phase.value}.moe.tokens_per_expert.sync", OpKind.SYNC, "host", deps=[d2h],
              phase=e.phase, layer=e.layer, launch=False)


def _alltoall_fwd(bld, x: str, probs: str, rmap: str, save: bool, sv: dict) -> str:
    """``MoEAlltoAllTokenDispatcher``'s dispatch, the experts and its combine on the ``[T_n, h]`` input ``x``
    (module text). Returns the ``[T_n, h]`` 16-bit routed output."""
    s, e, T = bld.s, bld.e, bld.Tn
    h, E, El, ep, et = s.hidden_size, s.num_experts, s.local_experts, s.expert_parallel_size, s.expert_tensor_parallel_size
    fe = expert_ffn(s) // et
    Nl, N = routed_tokens(s, T), expert_tokens(s, T)  # copies leaving the router; rows at the busiest rank's experts
    Na = max(Nl, N)  # all-to-all buffer rows: the busiest rank's receive (dispatch) / send (combine)
    Ng = N * et  # rows of the expert GEMMs after the etp all-gather
    # dispatcher preprocess: tokens per expert, gathered over EP x ETP, to the host (a synchronisation)
    counts = e.fresh("moe.tokens_per_expert")
    e.kernel("moe.tokens_per_expert", C.REDUCTION, reads=T * E, writes=8 * E, out=[(counts, 8 * E)], uses=[rmap],
             dtype="int64")
    n_gather = ep * et  # Megatron gathers them over the tp_ep group (ep x etp ranks): priced over ep (else etp)
    if n_gather > 1:
        y = e.fresh("moe.global_tokens_per_expert")
        bld._tp_op("moe.tokens_per_expert.all_gather", "all_gather", 8 * E * n_gather, uses=[counts],
                   out=[(y, 8 * E * n_gather)], dtype="int64", group="ep" if ep > 1 else "etp")
        counts = y
    host_sync(bld, counts, 8 * E * n_gather)
    perm = e.fresh("moe.permuted")
    e.kernel("moe.permute", C.COPY, reads=2 * Nl * h + T * E, writes=2 * Nl * h, out=[(perm, 2 * Nl * h)],
             uses=[x, rmap])
    if ep > 1:
        perm = _ep(bld, "moe.dispatch.all_to_all", "all_to_all", 2 * Na * h, perm, "moe.dispatched")
    if et > 1:
        perm = _etp(bld, "moe.dispatch.all_gather", "all_gather", 2 * Ng * h, perm, "moe.gathered", 2 * Ng * h)
    if El > 1 and (ep > 1 or et > 1):
        perm = _copy(bld, "moe.sort_chunks", perm, 2 * Ng * h)
    y = experts.experts_fwd(bld, perm, Ng, fe, save, sv)
    if El > 1 and (ep > 1 or et > 1):
        y = _copy(bld, "moe.unsort_chunks", y, 2 * Ng * h)
    if et > 1:  # partial sums of the etp ranks' slices of f_e, summed and scattered back to this rank's rows
        y = _etp(bld, "moe.combine.reduce_scatter", "reduce_scatter", 2 * Ng * h, y, "moe.scattered", 2 * N * h)
    if ep > 1:
        y = _ep(bld, "moe.combine.all_to_all", "all_to_all", 2 * Na * h, y, "moe.combined")
    out = e.fresh("moe.out")
    pb = s.moe_probs_bytes
    e.kernel("moe.unpermute", C.ELEMENTWISE, reads=2 * Nl * h + pb * T * E + T * E, writes=2 * T * h,
             flops=2 * Nl * h, out=[(out, 2 * T * h)], uses=[y, probs, rmap])
    sv["combined"] = y
    return out


def moe_fwd(bld, x: str, save: bool) -> tuple[str, dict]:
    """The MoE layer's forward on the normalised ``[T_n, h]`` 16-bit input ``x`` (``T_n = T / t`` with tensor
    and sequence parallelism; see the module text).

    Returns:
        The ``[T_n, h]`` 16-bit output (before the residual add) and the tensors saved for ``moe_bwd``.
    """
    s, e, T = bld.s, bld.e, bld.Tn
    h, E, et = s.hidden_size, s.num_experts, s.expert_tensor_parallel_size
    fe = expert_ffn(s) // et
    Ng = expert_tokens(s, T) * et  # rows of the expert GEMMs (after the etp all-gather)
    sv: dict = {}
    logits, sv["router"] = bld._linear_fwd("router", x, h, E, x_fp32=True, save=save, tokens=T)
    probs, rmap = e.fresh("router.probs"), e.fresh("router.routing_map")
    pb = s.moe_probs_bytes
    e.kernel("router.topk_softmax", C.SOFTMAX, reads=2 * T * E, writes=(pb + 1) * T * E,
             out=[(probs, pb * T * E), (rmap, T * E)], uses=[logits])
    scores = None
    if s.moe_router_load_balancing_type == "aux_loss":  # softmax over all E, per-expert sums (switch loss)
        scores = e.fresh("router.aux_loss.scores")
        e.kernel("router.aux_loss.softmax", C.SOFTMAX, reads=2 * T * E, writes=4 * T * E,
                 out=[(scores, 4 * T * E)], uses=[logits], dtype="fp32")
        e.kernel("router.aux_loss", C.REDUCTION, reads=5 * T * E, writes=12 * E, uses=[scores, rmap], dtype="fp32")
    if s.moe_token_dispatcher_type == "allgather":
        perm = ag.dispatch_fwd(bld, x, probs, rmap, Ng, sv)
        y = experts.experts_fwd(bld, perm, Ng, fe, save, sv)
        out = ag.combine_fwd(bld, y, Ng, sv)
    else:
        out = _alltoall_fwd(bld, x, probs, rmap, save, sv)
    fs = s.moe_shared_expert_intermediate_size
    if fs:  # a dense MLP split over the attention TP group (Megatron SharedExpertMLP), as the dense path
        fs //= bld.tp
        xs = bld._tp_gather("shared_expert", x)
        s1, sv["shared.fc1"] = bld._linear_fwd("shared_expert.fc1", xs, h, (2 if s.swiglu else 1) * fs,
                                               x_fp32=True, save=save)
        sa = bld._act_fwd("shared_expert.", s1, bld.T, fs)
        s2, sv["shared.fc2"] = bld._linear_fwd("shared_expert.fc2", sa, fs, h, x_fp32=False, save=save)
        s2 = bld._tp_reduce("shared_expert.fc2", s2)
        if s.moe_shared_expert_gate:  # Qwen2-MoE: sigmoid(x w_g) [T, 1] scales the shared expert's output
            sg, sv["shared.gate"] = bld._linear_fwd("shared_expert.gate", x, h, 1, x_fp32=True, save=save, tokens=T)
            s2g = e.fresh("shared_expert.gated")
            e.kernel("shared_expert.gate.sigmoid_mul", C.ELEMENTWISE, reads=2 * T * h + 2 * T, writes=2 * T * h,
                     flops=5 * T * h, out=[(s2g, 2 * T * h)], uses=[s2, sg])
            sv["shared.gate_in"], sv["shared.out"] = sg, s2
            s2 = s2g
        out = bld._add("moe.shared_expert.add", out, s2, 2, 2, 2)
        sv["shared.act_in"] = s1
    sv.update(probs=probs, rmap=rmap, scores=scores)
    return out, sv


def _alltoall_bwd(bld, g: str, sv: dict) -> tuple[str, str]:
    """Backward of ``_alltoall_fwd`` from the ``[T_n, h]`` gradient ``g``: the ``[T_n, h]`` 16-bit input gradient
    and the ``[T_n, E]`` gradient of the router probabilities (``moe_probs_bytes`` per element)."""
    s, e, T = bld.s, bld.e, bld.Tn
    h, E, El, ep, et = s.hidden_size, s.num_experts, s.local_experts, s.expert_parallel_size, s.expert_tensor_parallel_size
    fe = expert_ffn(s) // et
    Nl, N = routed_tokens(s, T), expert_tokens(s, T)  # as in _alltoall_fwd
    Na, Ng = max(Nl, N), N * et
    gy, gp = e.fresh("moe.unpermute.dx"), e.fresh("router.probs.dx")
    pb = s.moe_probs_bytes
    e.kernel("moe.unpermute.dgrad", C.ELEMENTWISE, reads=2 * T * h + 2 * Nl * h + pb * T * E + T * E,
             writes=2 * Nl * h + pb * T * E, flops=2 * Nl * h, out=[(gy, 2 * Nl * h), (gp, pb * T * E)],
             uses=[g, sv["combined"], sv["probs"], sv["rmap"]])
    if ep > 1:
        gy = _ep(bld, "moe.combine.dgrad.all_to_all", "all_to_all", 2 * Na * h, gy, "moe.combine.dx")
    if et > 1:  # the reduce-scatter's backward
        gy = _etp(bld, "moe.combine.dgrad.all_gather", "all_gather", 2 * Ng * h, gy, "moe.combine.dx_gathered",
                  2 * Ng * h)
    if El > 1 and (ep > 1 or et > 1):
        gy = _copy(bld, "moe.unsort_chunks.dgrad", gy, 2 * Ng * h)
    gx = experts.experts_bwd(bld, gy, sv, Ng, fe)
    if El > 1 and (ep > 1 or et > 1):
        gx = _copy(bld, "moe.sort_chunks.dgrad", gx, 2 * Ng * h)
    if et > 1:  # the all-gather's backward: the etp ranks' input-gradient slices summed
        gx = _etp(bld, "moe.dispatch.dgrad.reduce_scatter", "reduce_scatter", 2 * Ng * h, gx,
                  "moe.dispatch.dx_scattered", 2 * N * h)
    if ep > 1:
        gx = _ep(bld, "moe.dispatch.dgrad.all_to_all", "all_to_all", 2 * Na * h, gx, "moe.dispatch.dx")
    g_in = e.fresh("moe.permute.dx")
    e.kernel("moe.permute.dgrad", C.ELEMENTWISE, reads=2 * Nl * h + T * E, writes=2 * T * h, flops=Nl * h,
             out=[(g_in, 2 * T * h)], uses=[gx, sv["rmap"]])
    return g_in, gp


def moe_bwd(bld, g: str, sv: dict) -> str:
    """The MoE layer's backward from the gradient ``g`` of its ``[T_n, h]`` output; returns the gradient of its
    input (``[T_n, h]`` 16-bit)."""
    s, e, T = bld.s, bld.e, bld.Tn
    h, E, et = s.hidden_size, s.num_experts, s.expert_tensor_parallel_size
    fe = expert_ffn(s) // et
    Ng = expert_tokens(s, T) * et  # as in moe_fwd
    fs = s.moe_shared_expert_intermediate_size
    g_shared = None
    if fs:
        fs //= bld.tp
        gs = g
        if s.moe_shared_expert_gate:  # d(shared out) = g sigmoid, d(gate logit) = sum(g out) sigmoid'
            gs, gg = e.fresh("shared_expert.gate.dx"), e.fresh("shared_expert.gate.dlogit")
            e.kernel("shared_expert.gate.sigmoid_mul.dgrad", C.ELEMENTWISE, reads=2 * 2 * T * h + 2 * T,
                     writes=2 * T * h + 2 * T, flops=7 * T * h, out=[(gs, 2 * T * h), (gg, 2 * T)],
                     uses=[g, sv["shared.out"], sv["shared.gate_in"]])
            g_gate = bld._linear_bwd("shared_expert.gate", gg, sv["shared.gate"], h, 1, g_fp32=False, tokens=T)
        gs = bld._linear_bwd("shared_expert.fc2", bld._tp_gather("shared_expert.fc2.grad", gs), sv["shared.fc2"], fs,
                             h, g_fp32=True)
        gs = bld._act_bwd("shared_expert.", gs, sv["shared.act_in"], bld.T, fs)
        g_shared = bld._tp_reduce("shared_expert.fc1.grad",
                                  bld._linear_bwd("shared_expert.fc1", gs, sv["shared.fc1"], h,
                                                  (2 if s.swiglu else 1) * fs, g_fp32=False))
        if s.moe_shared_expert_gate:
            g_shared = bld._add("shared_expert.gate.dx.add", g_shared, g_gate, 2, 2, 2)
    if s.moe_token_dispatcher_type == "allgather":
        gy = ag.combine_bwd(bld, g, Ng, sv)
        gx = experts.experts_bwd(bld, gy, sv, Ng, fe)
        g_in, gp = ag.dispatch_bwd(bld, gx, Ng, sv)
    else:
        g_in, gp = _alltoall_bwd(bld, g, sv)
    gl = e.fresh("router.logits.dx")
    e.kernel("router.topk_softmax.dgrad", C.SOFTMAX, reads=2 * s.moe_probs_bytes * T * E + T * E, writes=2 * T * E,
             out=[(gl, 2 * T * E)], uses=[gp, sv["probs"], sv["rmap"]])
    if sv["scores"] is not None:  # the auxiliary loss's softmax backward, added to the logits' gradient
        gl2 = e.fresh("router.logits.dx")
        e.kernel("router.aux_loss.dgrad", C.SOFTMAX, reads=4 * T * E + 2 * T * E, writes=2 * T * E,
                 out=[(gl2, 2 * T * E)], uses=[gl, sv["scores"]], dtype="fp32")
        gl = gl2
    g_router = bld._linear_bwd("router", gl, sv["router"], h, E, g_fp32=False, tokens=T)
    g_in = bld._add("moe.router.dx.add", g_in, g_router, 2, 2, 2)
    if g_shared is not None:
        g_in = bld._add("moe.shared_expert.dx.add", g_in, g_shared, 2, 2, 2)
    return g_in


def own_expert_grads(s) -> bool:
    """Expert gradients are reduced over their own group ``edp`` (not with the dense ones over ``dp``): with
    ``ep > 1`` or ``etp != t``, where the ranks holding the same expert shard are not the data-parallel group."""
    return bool(s.num_experts) and (s.expert_parallel_size > 1
                                    or s.expert_tensor_parallel_size != s.tensor_parallel_size)


def own_expert_params(s) -> int:
    """Routed-expert parameters of this rank whose gradients and optimizer state go over ``edp`` (0 unless
    ``own_expert_grads``): ``MoE blocks on the rank x E_l x 3 h f_e / etp`` (SwiGLU; ``2 h f_e`` without)."""
    if not own_expert_grads(s):
        return 0
    n = moe_layer_count(s, rank_layer_ids(s))
    return n * s.local_experts * _mlp_weights(s, expert_ffn(s)) // s.expert_tensor_parallel_size


def sharded_state(s, P: int, shard) -> int:
    """Elements of one rank's optimizer-state partition of its ``P`` parameters under ZeRO-1/2 or Megatron's
    distributed optimizer: the dense ``P - P_e`` sharded over ``dp`` (``shard``), the experts' ``P_e``
    (``own_expert_params``) over ``edp`` (ceil; DeepSpeed partitions expert parameter groups over the expert
    data-parallel group, Megatron keeps expert parameters in their own buffer over ``expt_dp``)."""
    pe = own_expert_params(s)
    return shard(P - pe) + -(-pe // expert_data_parallel_size(s))


def expert_param_gathers(bld, opt: int) -> None:
    """ZeRO-1/2 and the distributed optimizer after the step: the updated 16-bit expert parameters
    all-gathered over ``edp`` (one collective; nothing with ``edp`` of one rank)."""
    pe = own_expert_params(bld.s)
    if pe and expert_data_parallel_size(bld.s) > 1:
        bld.comm_ops.append(bld._collective("edp.param_all_gather", "all_gather", 2 * pe, [opt], bld.e.phase,
                                            group="edp"))


def reduce_expert_grad(bld, pg: ParamGroup) -> None:
    """With ``own_expert_grads``: all-reduce (ZeRO-1/2, distributed optimizer: reduce-scatter) the finished
    gradient of one expert weight tensor (``pg.grad_bytes_per_element``: fp32, or 16-bit with Megatron's fp16 /
    ``--grad-reduce-in-bf16`` buffer and DeepSpeed ZeRO-1/2's model-dtype gradients; the collective's dtype label
    follows) over the expert-data-parallel group ``edp`` (``expert_data_parallel_size``) on stream ``comm.edp``;
    nothing when that group is one rank (``t dp = ep etp``: no other rank holds these experts)."""
    s = bld.s
    if expert_data_parallel_size(s) <= 1:
        return
    tensors = [pg.grad_tensor] if pg.grad_tensor else []
    if not (bld.zero in (1, 2) or (bld.sh is not None and bld.sh.strategy == "distributed_optimizer")):
        bld.moe_grad_ops.append(bld._collective(f"edp.grad_all_reduce.{pg.name}", "all_reduce", pg.grad_bytes,
                                                [pg.grad_op], bld.e.phase, uses=tensors, group="edp",
                                                elem_bytes=pg.grad_bytes_per_element))
        return
    allocs = ()  # ZeRO-2: the reduced 1/edp shard stays, the full gradient is freed after the reduce-scatter
    if bld.zero == 2:
        shard = bld.e.fresh(f"grad.shard.{pg.name}")
        bld.grad_shards.append(shard)
        allocs = (TensorAlloc(shard, -(-pg.grad_bytes // expert_data_parallel_size(s))),)
    bld.moe_grad_ops.append(bld._collective(f"edp.grad_reduce_scatter.{pg.name}", "reduce_scatter", pg.grad_bytes,
                                            [pg.grad_op], bld.e.phase, uses=tensors if bld.zero == 2 else (),
                                            allocs=allocs, group="edp", elem_bytes=pg.grad_bytes_per_element))
