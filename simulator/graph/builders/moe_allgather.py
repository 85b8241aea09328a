"""Megatron-LM core's all-gather token dispatcher (``--moe-token-dispatcher-type allgather``,
``MoEAllGatherTokenDispatcher`` in ``megatron/core/transformer/moe/token_dispatcher.py``, the routing-map
version of core 0.10 onwards: ``token_permutation`` / ``token_unpermutation``, later split into
``dispatch_preprocess`` ... ``combine_postprocess`` with the same collectives), kernel by kernel.

``moe.moe_fwd`` / ``moe.moe_bwd`` call these in place of the all-to-all dispatcher. Shapes: ``T`` tokens of this
rank's sequence shard, ``h`` hidden, ``E`` experts, ``E_l`` local experts, ``G = ep x etp`` the ranks of
Megatron's ``tp_ep_group`` ("this allgather spans the communication domain of TP*EP"), ``R = G T`` gathered
rows, ``N_g`` the rows of this rank's local experts (``moe.expert_tokens x etp``: each local expert gets its
kept copies of all ``R`` tokens).

Forward, with ``G > 1`` (``gather_from_sequence_parallel_region(..., group=tp_ep_group)``, one all-gather
each): the routing map ``[T, E]`` bool (``G T E`` bytes gathered, under ``no_grad``), the probabilities
(``p G T E``; ``p = TransformerSpec.moe_probs_bytes``: the logits' dtype, 2 in bf16 / fp16 unless
``moe_router_dtype`` fp32, 4) and the tokens ``[T, h]`` (``2 G T h`` 16-bit, into Megatron's global memory buffer,
``use_global_buffer=True``; here a tensor freed after ``permute``, as the simulator's sequence-parallel
gathers are). Then the local experts' columns of map and probabilities made contiguous (``[R, E_l]``: copies
when ``E_l < E``), ``tokens_per_expert = local_map.sum(0).cpu()`` (a reduction, a copy to the host and a host
synchronisation), ``permute`` of the ``N_g`` copies into expert order (no chunk sort, no expert-TP all-gather:
the rows already come from every rank of ``tp_ep``). Combine: the permuted probabilities
(``local_probs.T.masked_select(local_map.T)``, ``p N_g`` bytes), the probability-weighted ``unpermute`` into
``[R, h]`` in the probabilities' dtype (16-bit expert output times fp32 probabilities is fp32: "may change
permuted_tokens to higher precision if probs use fp32"; bf16 times bf16 stays bf16), the **reduce-scatter** of
that ``[R, h]`` over ``tp_ep`` (``p G T h`` bytes; later versions cast to ``local_probs.dtype`` before it: the
same), and, with fp32 probabilities, the cast of the ``[T, h]`` result back to 16 bits.

Backward, the mirror: the cast's backward (to fp32, with fp32 probabilities), the reduce-scatter's backward (an
all-gather of ``p G T h``), ``unpermute``'s backward (the ``[N_g, h]`` 16-bit gradient to the experts and the
``[N_g]`` probability gradient), the masked select's backward (``[R, E_l]``), the experts, ``permute``'s backward (a
scatter-add into ``[R, h]``), the column slice's backward (``[R, E]``, zeros elsewhere, when ``E_l < E``) and
the two all-gathers' backward: **reduce-scatters** of the token gradient (``2 G T h``) and of the probability
gradient (``p G T E``). With ``G = 1`` no collective runs and the rest is as above.

Collectives per MoE block and micro-batch: forward 3 all-gathers (``G T (E + p E + 2 h)`` bytes) and 1
reduce-scatter (``p G T h``); backward 1 all-gather (``p G T h``) and 2 reduce-scatters (``2 G T h + p G T E``).
"""

from __future__ import annotations

from simulator.graph.ops import CostClass as C


def group_size(s) -> int:
    """Ranks ``G`` of Megatron's ``tp_ep_group``: ``ep x etp``."""
    return s.expert_parallel_size * s.expert_tensor_parallel_size


def group_name(s) -> str:
    """The process group of the dispatcher's collectives: ``ep`` (``etp = 1``), ``etp`` (``ep = 1``), else
    ``tp_ep`` (the ``ep x etp`` consecutive ranks of Megatron's expert grid)."""
    if s.expert_tensor_parallel_size == 1:
        return "ep"
    return "etp" if s.expert_parallel_size == 1 else "tp_ep"


def _probs(s) -> tuple[int, str | None]:
    """Bytes per element and kernel dtype of the routing probabilities (``TransformerSpec.moe_probs_bytes``): fp32,
    or the model's 16-bit dtype (``None``: the emitter's default)."""
    pb = s.moe_probs_bytes
    return pb, ("fp32" if pb == 4 else None)


def _collective(bld, name: str, op: str, nbytes: int, x: str, out_bytes: int, dtype: str | None = None) -> str:
    """A blocking collective over ``tp_ep`` reading ``x``, allocating its ``out_bytes`` result."""
    y = bld.e.fresh(name)
    bld._tp_op(name, op, nbytes, uses=[x], out=[(y, out_bytes)], dtype=dtype, group=group_name(bld.s))
    return y


def dispatch_fwd(bld, x: str, probs: str, rmap: str, Ng: int, sv: dict) -> str:
    """Gather tokens, probabilities and routing map over ``tp_ep`` and permute this rank's experts' ``Ng``
    copies (``[T, h]`` 16-bit ``x``, ``[T, E]`` ``probs`` of ``moe_probs_bytes`` and bool ``rmap``). Returns the ``[Ng, h]``
    16-bit rows; saves the local map and probabilities into ``sv``."""
    from simulator.graph.builders import moe

    s, e, T = bld.s, bld.e, bld.Tn
    h, E, El, G = s.hidden_size, s.num_experts, s.local_experts, group_size(s)
    R = G * T
    pb, pdt = _probs(s)
    if G > 1:
        rmap = _collective(bld, "moe.dispatch.routing_map.all_gather", "all_gather", R * E, rmap, R * E, "bool")
        probs = _collective(bld, "moe.dispatch.probs.all_gather", "all_gather", pb * R * E, probs, pb * R * E, pdt)
        x = _collective(bld, "moe.dispatch.all_gather", "all_gather", 2 * R * h, x, 2 * R * h)
    lmap, lprobs = rmap, probs
    if El < E:  # routing_map[:, local experts].contiguous(), probs likewise
        lmap, lprobs = e.fresh("moe.local_map"), e.fresh("moe.local_probs")
        e.kernel("moe.local_map", C.COPY, reads=R * El, writes=R * El, out=[(lmap, R * El)], uses=[rmap])
        e.kernel("moe.local_probs", C.COPY, reads=pb * R * El, writes=pb * R * El, out=[(lprobs, pb * R * El)],
                 uses=[probs], dtype=pdt)
    counts = e.fresh("moe.tokens_per_expert")
    e.kernel("moe.tokens_per_expert", C.REDUCTION, reads=R * El, writes=8 * El, out=[(counts, 8 * El)], uses=[lmap],
             dtype="int64")
    moe.host_sync(bld, counts, 8 * El)
    perm = e.fresh("moe.permuted")
    e.kernel("moe.permute", C.COPY, reads=2 * Ng * h + R * El, writes=2 * Ng * h, out=[(perm, 2 * Ng * h)],
             uses=[x, lmap])
    sv.update(ag_lmap=lmap, ag_lprobs=lprobs)
    return perm


def combine_fwd(bld, y: str, Ng: int, sv: dict) -> str:
    """Weight the experts' ``[Ng, h]`` 16-bit output by its probabilities, unpermute into ``[R, h]`` in the
    probabilities' dtype, reduce-scatter over ``tp_ep`` and (fp32 probabilities) cast to 16 bits. Returns the
    ``[T, h]`` 16-bit output."""
    s, e, T = bld.s, bld.e, bld.Tn
    h, El, G = s.hidden_size, s.local_experts, group_size(s)
    R = G * T
    pb, pdt = _probs(s)
    pp = e.fresh("moe.permuted_probs")
    e.kernel("moe.permuted_probs", C.COPY, reads=(pb + 1) * R * El, writes=pb * Ng, out=[(pp, pb * Ng)],
             uses=[sv["ag_lprobs"], sv["ag_lmap"]], dtype=pdt)
    u = e.fresh("moe.unpermuted")
    e.kernel("moe.unpermute", C.ELEMENTWISE, reads=2 * Ng * h + pb * Ng + R * El, writes=pb * R * h,
             flops=2 * Ng * h, out=[(u, pb * R * h)], uses=[y, pp, sv["ag_lmap"]], dtype=pdt)
    if G > 1:
        u = _collective(bld, "moe.combine.reduce_scatter", "reduce_scatter", pb * R * h, u, pb * T * h, pdt)
    out = u
    if pb != 2:
        out = e.fresh("moe.out")
        e.kernel("moe.combine.cast", C.CAST, reads=pb * T * h, writes=2 * T * h, out=[(out, 2 * T * h)], uses=[u],
                 dtype=pdt)
    sv.update(ag_pprobs=pp, combined=y)
    return out


def combine_bwd(bld, g: str, Ng: int, sv: dict) -> str:
    """Backward of ``combine_fwd`` from the ``[T, h]`` 16-bit gradient ``g``: returns the ``[Ng, h]`` 16-bit
    gradient of the experts' output (and keeps the local probabilities' gradient in ``sv``)."""
    s, e, T = bld.s, bld.e, bld.Tn
    h, El, G = s.hidden_size, s.local_experts, group_size(s)
    R = G * T
    pb, pdt = _probs(s)
    g32 = g
    if pb != 2:
        g32 = e.fresh("moe.combine.cast.dgrad")
        e.kernel("moe.combine.cast.dgrad", C.CAST, reads=2 * T * h, writes=pb * T * h, out=[(g32, pb * T * h)],
                 uses=[g])
    if G > 1:
        g32 = _collective(bld, "moe.combine.dgrad.all_gather", "all_gather", pb * R * h, g32, pb * R * h, pdt)
    gy, gpp = e.fresh("moe.unpermute.dx"), e.fresh("moe.permuted_probs.dx")
    e.kernel("moe.unpermute.dgrad", C.ELEMENTWISE, reads=pb * R * h + 2 * Ng * h + pb * Ng + R * El,
             writes=2 * Ng * h + pb * Ng, flops=3 * Ng * h, out=[(gy, 2 * Ng * h), (gpp, pb * Ng)],
             uses=[g32, sv["combined"], sv["ag_pprobs"], sv["ag_lmap"]], dtype=pdt)
    glp = e.fresh("moe.local_probs.dx")
    e.kernel("moe.permuted_probs.dgrad", C.COPY, reads=pb * Ng + R * El, writes=pb * R * El, out=[(glp, pb * R * El)],
             uses=[gpp, sv["ag_lmap"]], dtype=pdt)
    sv["ag_glp"] = glp
    return gy


def dispatch_bwd(bld, gx: str, Ng: int, sv: dict) -> tuple[str, str]:
    """Backward of ``dispatch_fwd`` from the experts' ``[Ng, h]`` input gradient ``gx``: returns the ``[T, h]``
    16-bit gradient of the MoE input and the ``[T, E]`` gradient of the router probabilities (``moe_probs_bytes``)."""
    s, e, T = bld.s, bld.e, bld.Tn
    h, E, El, G = s.hidden_size, s.num_experts, s.local_experts, group_size(s)
    R = G * T
    gh = e.fresh("moe.permute.dx")
    e.kernel("moe.permute.dgrad", C.ELEMENTWISE, reads=2 * Ng * h + R * El, writes=2 * R * h, flops=Ng * h,
             out=[(gh, 2 * R * h)], uses=[gx, sv["ag_lmap"]])
    gp = sv["ag_glp"]
    pb, pdt = _probs(s)
    if El < E:  # the column slice's backward: zeros for the other experts' columns
        y = e.fresh("moe.probs.dx")
        e.kernel("moe.local_probs.dgrad", C.COPY, reads=pb * R * El, writes=pb * R * E, out=[(y, pb * R * E)],
                 uses=[gp], dtype=pdt)
        gp = y
    if G > 1:
        gh = _collective(bld, "moe.dispatch.dgrad.reduce_scatter", "reduce_scatter", 2 * R * h, gh, 2 * T * h)
        gp = _collective(bld, "moe.dispatch.probs.dgrad.reduce_scatter", "reduce_scatter", pb * R * E, gp, pb * T * E,
                         pdt)
    return gh, gp
