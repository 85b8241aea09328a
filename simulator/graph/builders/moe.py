"""Mixture-of-experts MLP of one decoder block, kernel by kernel, as Megatron-LM core runs it
(``megatron/core/transformer/moe``: ``MoELayer`` with ``TopKRouter``, the ``alltoall`` token
dispatcher ``MoEAlltoAllTokenDispatcher`` and grouped-GEMM experts ``GroupedMLP``; Fedus et al.,
*Switch Transformers*, JMLR 2022; Jiang et al., *Mixtral of Experts*, 2024).

The transformer builder (``transformer._GptBuilder``) calls ``moe_fwd`` / ``moe_bwd`` in place of
its dense MLP; the functions use its emitter and Linear helpers. Shapes: ``T`` tokens on this rank
(``b s``), ``h`` hidden, ``E`` experts, ``k`` experts per token, ``ep`` expert-parallel ranks,
``E_l = E / ep`` local experts, ``f_e`` expert width, ``N`` routed token copies this rank's experts
process (``routed_tokens``).

Forward, per block:

* **router**: the gating GEMM ``[T, h] x [h, E]`` (a replicated weight), one top-k + softmax kernel
  writing the fp32 probabilities and the boolean routing map ``[T, E]``; with
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
  (the per-expert tile padding is ignored).
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

Expert gradients: with data parallelism they are reduced over the expert-data-parallel group
``edp`` (``dp / ep`` ranks: Megatron rank order tp-cp-ep-dp), one all-reduce per expert weight
tensor when its gradient is ready (Megatron buckets expert parameters in their own buffer; the
bucketing is not modelled); nothing with ``edp`` of one rank. Dense parameters (attention, norms,
router, shared expert, embeddings) are reduced over the whole ``dp`` group as before.
"""

from __future__ import annotations

import math

from simulator.graph.op_graph import ParamGroup
from simulator.graph.ops import CostClass as C
from simulator.graph.ops import OpKind

#: ``moe_router_load_balancing_type`` values modelled (Megatron also has seq_aux_loss and sinkhorn)
LOAD_BALANCING = ("aux_loss", "none")


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
                or s.moe_tokens_per_expert is not None):
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
    if s.moe_router_load_balancing_type not in LOAD_BALANCING:
        raise ValueError(f"moe_router_load_balancing_type must be one of {LOAD_BALANCING}, got "
                         f"{s.moe_router_load_balancing_type!r}")
    w = s.moe_tokens_per_expert
    if w is not None and (len(w) != E or min(w) < 0 or not sum(w) > 0):
        raise ValueError(f"moe_tokens_per_expert must be {E} (num_experts) non-negative numbers, not all 0; got "
                         f"{len(w)} numbers")
    if ep <= 0 or E % ep:
        raise ValueError(f"expert_parallel_size ({ep}) must divide num_experts ({E})")
    if ep > 1 and s.data_parallel_size % ep:
        raise ValueError(f"expert_parallel_size ({ep}) must divide data_parallel_size ({s.data_parallel_size}): EP "
                         "ranks lie inside the data-parallel dimension")
    if s.tensor_parallel_size > 1:
        raise ValueError("num_experts with tensor_parallel_size > 1 (expert tensor parallelism) is not modelled yet")
    if s.precision == "amp_fp32_params":
        raise ValueError("num_experts is modelled for Megatron precisions bf16 and fp16, not amp_fp32_params")
    if s.bias:
        raise ValueError("num_experts with biases (add_bias_linear) is not modelled (Megatron GroupedMLP has none)")
    if ep > 1 and s.zero_stage and s.data_parallel_size > 1:
        raise ValueError("ZeRO with expert_parallel_size > 1 is not modelled yet")


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
            + (_mlp_weights(s, shared) if shared else 0))


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


def moe_fwd(bld, x: str, save: bool) -> tuple[str, dict]:
    """The MoE layer's forward on the normalised ``[T, h]`` 16-bit input ``x`` (see the module text).

    Returns:
        The ``[T, h]`` 16-bit output (before the residual add) and the tensors saved for ``moe_bwd``.
    """
    s, e, T = bld.s, bld.e, bld.T
    h, E, El, ep = s.hidden_size, s.num_experts, s.local_experts, s.expert_parallel_size
    fe = expert_ffn(s)
    Nl, N = routed_tokens(s, T), expert_tokens(s, T)  # copies leaving the router; rows at the busiest rank's experts
    Na = max(Nl, N)  # all-to-all buffer rows: the busiest rank's receive (dispatch) / send (combine)
    sv: dict = {}
    logits, sv["router"] = bld._linear_fwd("router", x, h, E, x_fp32=True, save=save)
    probs, rmap = e.fresh("router.probs"), e.fresh("router.routing_map")
    e.kernel("router.topk_softmax", C.SOFTMAX, reads=2 * T * E, writes=5 * T * E,
             out=[(probs, 4 * T * E), (rmap, T * E)], uses=[logits])
    scores = None
    if s.moe_router_load_balancing_type == "aux_loss":  # softmax over all E, per-expert sums (switch loss)
        scores = e.fresh("router.aux_loss.scores")
        e.kernel("router.aux_loss.softmax", C.SOFTMAX, reads=2 * T * E, writes=4 * T * E,
                 out=[(scores, 4 * T * E)], uses=[logits], dtype="fp32")
        e.kernel("router.aux_loss", C.REDUCTION, reads=5 * T * E, writes=12 * E, uses=[scores, rmap], dtype="fp32")
    # dispatcher preprocess: tokens per expert, gathered over EP, to the host (a synchronisation)
    counts = e.fresh("moe.tokens_per_expert")
    e.kernel("moe.tokens_per_expert", C.REDUCTION, reads=T * E, writes=8 * E, out=[(counts, 8 * E)], uses=[rmap],
             dtype="int64")
    if ep > 1:
        counts = _ep(bld, "moe.tokens_per_expert.all_gather", "all_gather", 8 * E * ep, counts,
                     "moe.global_tokens_per_expert", dtype="int64")
    d2h = e.kernel("moe.tokens_per_expert.d2h", C.COPY, kind=OpKind.MEMCPY_D2H, stream="d2h", reads=8 * E * ep,
                   uses=[counts], dtype="int64")
    bld.b.add(f"L{e.layer}.{e.phase.value}.moe.tokens_per_expert.sync", OpKind.SYNC, "host", deps=[d2h],
              phase=e.phase, layer=e.layer, launch=False)
    perm = e.fresh("moe.permuted")
    e.kernel("moe.permute", C.COPY, reads=2 * Nl * h + T * E, writes=2 * Nl * h, out=[(perm, 2 * Nl * h)],
             uses=[x, rmap])
    if ep > 1:
        perm = _ep(bld, "moe.dispatch.all_to_all", "all_to_all", 2 * Na * h, perm, "moe.dispatched")
        if El > 1:
            perm = _copy(bld, "moe.sort_chunks", perm, 2 * N * h)
    fc1, sv["fc1"] = bld._linear_fwd("experts.fc1", perm, h, (2 if s.swiglu else 1) * fe, x_fp32=False, save=save,
                                     tokens=N, groups=El)
    act = bld._act_fwd("experts.", fc1, N, fe)
    y, sv["fc2"] = bld._linear_fwd("experts.fc2", act, fe, h, x_fp32=False, save=save, tokens=N, groups=El)
    if ep > 1:
        if El > 1:
            y = _copy(bld, "moe.unsort_chunks", y, 2 * N * h)
        y = _ep(bld, "moe.combine.all_to_all", "all_to_all", 2 * Na * h, y, "moe.combined")
    out = e.fresh("moe.out")
    e.kernel("moe.unpermute", C.ELEMENTWISE, reads=2 * Nl * h + 4 * T * E + T * E, writes=2 * T * h,
             flops=2 * Nl * h, out=[(out, 2 * T * h)], uses=[y, probs, rmap])
    fs = s.moe_shared_expert_intermediate_size
    if fs:
        s1, sv["shared.fc1"] = bld._linear_fwd("shared_expert.fc1", x, h, (2 if s.swiglu else 1) * fs, x_fp32=True,
                                               save=save)
        sa = bld._act_fwd("shared_expert.", s1, T, fs)
        s2, sv["shared.fc2"] = bld._linear_fwd("shared_expert.fc2", sa, fs, h, x_fp32=False, save=save)
        out = bld._add("moe.shared_expert.add", out, s2, 2, 2, 2)
        sv["shared.act_in"] = s1
    sv.update(probs=probs, rmap=rmap, scores=scores, fc1_out=fc1, combined=y)
    return out, sv


def moe_bwd(bld, g: str, sv: dict) -> str:
    """The MoE layer's backward from the gradient ``g`` of its ``[T, h]`` output; returns the gradient of its
    input (``[T, h]`` 16-bit)."""
    s, e, T = bld.s, bld.e, bld.T
    h, E, El, ep = s.hidden_size, s.num_experts, s.local_experts, s.expert_parallel_size
    fe = expert_ffn(s)
    Nl, N = routed_tokens(s, T), expert_tokens(s, T)  # as in moe_fwd
    Na = max(Nl, N)
    fs = s.moe_shared_expert_intermediate_size
    g_shared = None
    if fs:
        gs = bld._linear_bwd("shared_expert.fc2", g, sv["shared.fc2"], fs, h, g_fp32=True)
        gs = bld._act_bwd("shared_expert.", gs, sv["shared.act_in"], T, fs)
        g_shared = bld._linear_bwd("shared_expert.fc1", gs, sv["shared.fc1"], h, (2 if s.swiglu else 1) * fs,
                                   g_fp32=False)
    gy, gp = e.fresh("moe.unpermute.dx"), e.fresh("router.probs.dx")
    e.kernel("moe.unpermute.dgrad", C.ELEMENTWISE, reads=2 * T * h + 2 * Nl * h + 4 * T * E + T * E,
             writes=2 * Nl * h + 4 * T * E, flops=2 * Nl * h, out=[(gy, 2 * Nl * h), (gp, 4 * T * E)],
             uses=[g, sv["combined"], sv["probs"], sv["rmap"]])
    if ep > 1:
        gy = _ep(bld, "moe.combine.dgrad.all_to_all", "all_to_all", 2 * Na * h, gy, "moe.combine.dx")
        if El > 1:
            gy = _copy(bld, "moe.unsort_chunks.dgrad", gy, 2 * N * h)
    ga = bld._linear_bwd("experts.fc2", gy, sv["fc2"], fe, h, g_fp32=False, tokens=N, groups=El)
    ga = bld._act_bwd("experts.", ga, sv["fc1_out"], N, fe)
    gx = bld._linear_bwd("experts.fc1", ga, sv["fc1"], h, (2 if s.swiglu else 1) * fe, g_fp32=False, tokens=N,
                         groups=El)
    if ep > 1:
        if El > 1:
            gx = _copy(bld, "moe.sort_chunks.dgrad", gx, 2 * N * h)
        gx = _ep(bld, "moe.dispatch.dgrad.all_to_all", "all_to_all", 2 * Na * h, gx, "moe.dispatch.dx")
    g_in = e.fresh("moe.permute.dx")
    e.kernel("moe.permute.dgrad", C.ELEMENTWISE, reads=2 * Nl * h + T * E, writes=2 * T * h, flops=Nl * h,
             out=[(g_in, 2 * T * h)], uses=[gx, sv["rmap"]])
    gl = e.fresh("router.logits.dx")
    e.kernel("router.topk_softmax.dgrad", C.SOFTMAX, reads=8 * T * E + T * E, writes=2 * T * E,
             out=[(gl, 2 * T * E)], uses=[gp, sv["probs"], sv["rmap"]])
    if sv["scores"] is not None:  # the auxiliary loss's softmax backward, added to the logits' gradient
        gl2 = e.fresh("router.logits.dx")
        e.kernel("router.aux_loss.dgrad", C.SOFTMAX, reads=4 * T * E + 2 * T * E, writes=2 * T * E,
                 out=[(gl2, 2 * T * E)], uses=[gl, sv["scores"]], dtype="fp32")
        gl = gl2
    g_router = bld._linear_bwd("router", gl, sv["router"], h, E, g_fp32=False)
    g_in = bld._add("moe.router.dx.add", g_in, g_router, 2, 2, 2)
    if g_shared is not None:
        g_in = bld._add("moe.shared_expert.dx.add", g_in, g_shared, 2, 2, 2)
    return g_in


def reduce_expert_grad(bld, pg: ParamGroup) -> None:
    """With ``ep > 1`` and data parallelism: all-reduce the finished fp32 gradient of one expert weight tensor
    over the expert-data-parallel group ``edp`` (``dp / ep`` ranks) on stream ``comm.edp``; nothing when that
    group is one rank (``dp = ep``: every replica of these experts is on this rank)."""
    s = bld.s
    if s.data_parallel_size // s.expert_parallel_size <= 1:
        return
    tensors = [pg.grad_tensor] if pg.grad_tensor else []
    bld.moe_grad_ops.append(bld._collective(f"edp.grad_all_reduce.{pg.name}", "all_reduce", pg.grad_bytes,
                                            [pg.grad_op], bld.e.phase, uses=tensors, group="edp"))
