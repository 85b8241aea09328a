"""The working set of one MoE block's backward over what it still keeps saved, for the memory estimate.

The simulation frees a tensor at its last use (a saved tensor after the weight-gradient GEMM that reads it last),
so a block's backward working set coexists only with what is still saved at that point of its backward: the
shared expert's backward runs first (``moe.moe_bwd``) and frees its saved tensors before the routed experts'
gradients are made, the combine's saved rows are freed before the experts' fc2 gradient, and so on. ``working_peak``
walks the builder's order (``moe.moe_bwd``, ``moe_allgather.combine_bwd`` / ``dispatch_bwd``,
``moe._alltoall_bwd``, ``moe_experts.experts_bwd``) as ``(allocated, freed)`` steps and returns the largest excess
of the live bytes over the block's saved tensors at the start of its backward (``peak_excess``). Weight gradients
are left out (the estimate adds the largest one beside it). Sequential experts (``moe_grouped_gemm: false``) are
walked as the grouped GEMM over all ``N_g`` rows: one expert at a time makes at most that (an upper bound).
"""

from __future__ import annotations


def peak_excess(steps, start: float = 0.0) -> float:
    """Largest live bytes above the saved tensors over ordered steps.

    Args:
        steps: ``(allocated, freed)`` bytes per step, in backward order: the step's output is allocated beside
            everything live, then its inputs used for the last time (gradients, saved tensors) are freed.
        start: Bytes live above the saved tensors before the first step (the incoming gradient).

    Returns:
        ``max(start, max_i(live_i + allocated_i))`` where ``live_{i+1} = live_i + allocated_i - freed_i``, bytes.
    """
    live, peak = start, start
    for alloc, freed in steps:
        peak = max(peak, live + alloc)
        live += alloc - freed
    return peak


def moe_dims(spec) -> tuple[int, ...]:
    """One MoE block's sizes on this rank: ``(t, T, T_n, h, E, E_l, ep, etp, f_e, f1_e, N_l, N, N_g, pb)``: TP size,
    micro-batch tokens ``b s``, the rank's tokens (``T / t`` with sequence parallelism), hidden size, experts, local
    experts, EP and expert-TP sizes, expert width per expert-TP rank, fc1's width (``2 f_e`` with SwiGLU), routed and
    expert rows (``moe.routed_tokens`` / ``moe.expert_tokens``), expert GEMM rows ``N etp``, and the routing
    probabilities' bytes per element (``moe_probs_bytes``)."""
    from simulator.graph.builders import moe

    t = spec.tensor_parallel_size
    T = spec.micro_batch_size * spec.seq_length
    Tn = T // t if spec.sequence_parallel and t > 1 else T
    et = spec.expert_tensor_parallel_size
    fe = moe.expert_ffn(spec) // et
    N = moe.expert_tokens(spec, Tn)
    return (t, T, Tn, spec.hidden_size, spec.num_experts, spec.local_experts, spec.expert_parallel_size, et, fe,
            (2 if spec.swiglu else 1) * fe, moe.routed_tokens(spec, Tn), N, N * et, spec.moe_probs_bytes)


def working_peak(spec) -> float:
    """Bytes above its saved tensors one MoE block's backward reaches (module docstring), for the rank's ``T_n``
    tokens (``T / t`` with sequence parallelism): starts from the incoming ``[T_n, h]`` 16-bit gradient."""
    from simulator.graph.builders import moe_allgather as ag

    t, T, Tn, h, E, El, ep, et, fe, f1e, Nl, N, Ng, pb = moe_dims(spec)
    g_in = 2 * Tn * h
    steps: list[tuple[float, float]] = []
    fs = spec.moe_shared_expert_intermediate_size
    if fs:  # moe_bwd: the shared expert first, its saved fc2 input and activation input freed as it goes
        fs //= t
        f1s = (2 if spec.swiglu else 1) * fs
        gathered = 2 * T * h if t > 1 else 0  # the gathered gradient, and fc1's gathered saved input
        if spec.moe_shared_expert_gate:  # the gated gradient; the saved shared output freed after
            steps.append((2 * Tn * h, 2 * Tn * h))
        if gathered:
            steps.append((gathered, 0))
        steps += [(2 * T * fs, 2 * T * fs + gathered),  # fc2 dgrad; its saved input and the gradient after wgrad
                  (2 * T * f1s, 2 * T * fs + 2 * T * f1s),  # activation backward; frees fc2's dx, fc1's output
                  (2 * T * h, 2 * T * f1s + gathered)]  # fc1 dgrad; frees the activation's dx, the gathered input
        if t > 1:  # reduce(-scatter) of fc1's input gradient to the T_n tokens
            steps.append((2 * Tn * h, 2 * T * h))
    if spec.moe_token_dispatcher_type == "allgather":
        G = ag.group_size(spec)
        R = G * Tn
        cast = pb * Tn * h if pb != 2 else 0
        if cast:
            steps.append((cast, 0))
        gath = pb * R * h if G > 1 else 0
        if gath:
            steps.append((gath, cast))
        src = gath or cast
        # the incoming gradient is last read here (or by the cast / all-gather just before): freed with the combine's
        # saved rows [N_g, h] and permuted probabilities [N_g]
        steps += [(2 * Ng * h + pb * Ng, src + g_in + 2 * Ng * h + pb * Ng),
                  (pb * R * El, pb * Ng)]  # the local probabilities' gradient (kept to the dispatch's backward)
        head = 2 * Ng * h  # the experts' output gradient
    else:
        Na = max(Nl, N)
        routed = 2 * h * (Na if ep > 1 else N)
        steps.append((2 * Nl * h + pb * Tn * E, g_in + routed))
        head = 2 * Nl * h
        if ep > 1:
            steps.append((2 * Na * h, head))
            head = 2 * Na * h
        if et > 1:
            steps.append((2 * Ng * h, head))
            head = 2 * Ng * h
        if El > 1 and (ep > 1 or et > 1):
            steps.append((2 * Ng * h, head))
            head = 2 * Ng * h
    # experts_bwd: fc2 dgrad (its saved activation output and the output gradient freed after wgrad), the
    # activation's backward (fc1's saved output freed), fc1 dgrad (its saved input freed)
    steps += [(2 * Ng * fe, head + 2 * Ng * fe), (2 * Ng * f1e, 2 * Ng * fe + 2 * Ng * f1e),
              (2 * Ng * h, 2 * Ng * f1e + 2 * Ng * h)]
    if spec.moe_token_dispatcher_type == "allgather":  # dispatch_bwd: the permutation's backward to [R, h]
        steps.append((2 * R * h, 2 * Ng * h))
        if G > 1:
            steps.append((2 * Tn * h, 2 * R * h))
    else:  # the reverse chain back to the T_n tokens (moe._alltoall_bwd)
        steps.append((2 * Tn * h, 2 * Ng * h))
    return peak_excess(steps, g_in)
