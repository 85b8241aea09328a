"""The routed experts of one MoE block, as grouped GEMMs or one MLP per local expert (Megatron-LM core
``megatron/core/transformer/moe/experts.py``).

``moe.moe_fwd`` / ``moe.moe_bwd`` call ``experts_fwd`` / ``experts_bwd`` on the ``[N_g, h]`` 16-bit rows the
dispatcher put in local-expert order (``N_g``: the busiest EP rank's rows after the expert-TP all-gather,
``moe.expert_tokens x etp``); ``f_e`` is one expert's width per expert-TP rank, ``E_l`` the local experts.

* ``moe_grouped_gemm: true`` (Megatron ``--moe-grouped-gemm``: ``GroupedMLP`` / ``TEGroupedMLP``, one grouped GEMM
  ``gmm`` per projection over all local experts): fc1 ``[N_g, h] x [h, 2 f_e]`` (SwiGLU; ``f_e`` without), the
  activation, fc2 ``[N_g, f_e] x [f_e, h]``, each priced as one GEMM of the ``N_g`` stacked rows; the weight
  tensors ``experts.fc1`` / ``experts.fc2`` hold every local expert.
* ``moe_grouped_gemm: false`` (``SequentialMLP``: ``tokens_list = torch.split(permuted_local_hidden_states,
  tokens_per_expert)``, then ``expert(tokens)`` for each local expert in turn, ``torch.cat`` of the outputs):
  expert ``j`` is a plain MLP (``MLP(..., is_expert=True)``: its own fc1 and fc2 weights, ``experts.<j>.fc1`` /
  ``experts.<j>.fc2``) over its ``n_j`` rows (``local_expert_rows``): fc1 GEMM ``[n_j, h] x [h, 2 f_e]``, the
  activation, fc2 GEMM, each priced by the GEMM cost model at ``n_j`` rows and launched once per expert. The
  split is views (no kernel); the ``torch.cat`` of the ``E_l`` outputs is one copy of ``[N_g, h]`` (reads and
  writes ``2 N_g h`` bytes). Backward runs the experts from the last to the first (autograd follows the
  reverse creation order): fc2's input and weight gradients, the activation's backward, fc1's, and the split's
  backward concatenates the input gradients (one more copy of ``[N_g, h]``). With one local expert Megatron
  calls it on the whole input, no split and no cat (``SequentialMLP.forward``: ``if self.num_local_experts ==
  1``, Megatron-LM core 0.9 onwards). An expert that receives no rows (``moe_tokens_per_expert`` with a 0
  share) launches nothing forward (PyTorch returns early on empty GEMMs and elementwise ops) and its weight
  gradients are zeros written by ``grad_accum`` alone; it still has its gradient and its optimizer state.
  Kernels per MoE block and micro-batch: ``3 E_l`` forward (two GEMMs and an activation each, plus one cat with
  ``E_l > 1``), ``5 E_l`` backward GEMMs and activations (dgrad and wgrad per projection, one activation
  backward) plus the weight-gradient accumulations; the grouped path has 3 forward and 5 backward.
"""

from __future__ import annotations

from simulator.graph.ops import CostClass as C


def local_expert_rows(s, T: int) -> list[int]:
    """Rows ``n_j`` each local expert of the busiest EP rank processes per micro-batch (after the expert-TP
    all-gather): expert ``j`` of EP rank ``r`` gets ``ep`` x its kept copies of each rank's ``T`` tokens, times
    ``etp``; ``sum(n_j) = N_g = expert_tokens x etp``. The rounding is of cumulative sums, so the rows add up
    exactly. Balanced: ``ep etp T k / E`` each."""
    from simulator.graph.builders import moe

    kept, El, ep, et = moe._kept(s, T), s.local_experts, s.expert_parallel_size, s.expert_tensor_parallel_size
    loads = moe.ep_rank_loads(s, T)
    r = loads.index(max(loads))
    cum = [round(ep * sum(kept[r * El:r * El + j])) for j in range(El + 1)]
    return [et * (cum[j + 1] - cum[j]) for j in range(El)]


def experts_fwd(bld, x: str, Ng: int, fe: int, save: bool, sv: dict) -> str:
    """The local experts' forward on the ``[Ng, h]`` 16-bit rows ``x`` (``fe``: expert width per expert-TP rank);
    saves into ``sv`` what ``experts_bwd`` reads. Returns the ``[Ng, h]`` 16-bit output in the same row order."""
    s, h = bld.s, bld.s.hidden_size
    El, f1 = s.local_experts, (2 if s.swiglu else 1) * fe
    if s.moe_grouped_gemm:
        fc1, sv["fc1"] = bld._linear_fwd("experts.fc1", x, h, f1, x_fp32=False, save=save, tokens=Ng, groups=El)
        act = bld._act_fwd("experts.", fc1, Ng, fe)
        y, sv["fc2"] = bld._linear_fwd("experts.fc2", act, fe, h, x_fp32=False, save=save, tokens=Ng, groups=El)
        sv["fc1_out"] = fc1
        return y
    rows = local_expert_rows(s, bld.Tn)
    outs, per = [], []
    for j, n in enumerate(rows):
        if n == 0:
            per.append(None)
            continue
        fc1, s1 = bld._linear_fwd(f"experts.{j}.fc1", x, h, f1, x_fp32=False, save=save, tokens=n)
        act = bld._act_fwd(f"experts.{j}.", fc1, n, fe)
        y, s2 = bld._linear_fwd(f"experts.{j}.fc2", act, fe, h, x_fp32=False, save=save, tokens=n)
        outs.append(y)
        per.append((s1, s2, fc1))
    sv["experts"] = per
    return _concat(bld, "experts.cat", outs, Ng, x)


def experts_bwd(bld, g: str, sv: dict, Ng: int, fe: int) -> str:
    """Backward of ``experts_fwd`` from the ``[Ng, h]`` 16-bit gradient ``g``; returns the gradient of its input."""
    s, h = bld.s, bld.s.hidden_size
    El, f1 = s.local_experts, (2 if s.swiglu else 1) * fe
    if s.moe_grouped_gemm:
        ga = bld._linear_bwd("experts.fc2", g, sv["fc2"], fe, h, g_fp32=False, tokens=Ng, groups=El)
        ga = bld._act_bwd("experts.", ga, sv["fc1_out"], Ng, fe)
        return bld._linear_bwd("experts.fc1", ga, sv["fc1"], h, f1, g_fp32=False, tokens=Ng, groups=El)
    rows = local_expert_rows(s, bld.Tn)
    dxs = []
    for j in reversed(range(El)):
        if sv["experts"][j] is None:  # no rows: zero weight gradients, accumulated and reduced as any other
            _zero_expert_grads(bld, j, h, f1, fe)
            continue
        s1, s2, fc1 = sv["experts"][j]
        n = rows[j]
        ga = bld._linear_bwd(f"experts.{j}.fc2", g, s2, fe, h, g_fp32=False, tokens=n)
        ga = bld._act_bwd(f"experts.{j}.", ga, fc1, n, fe)
        dxs.append(bld._linear_bwd(f"experts.{j}.fc1", ga, s1, h, f1, g_fp32=False, tokens=n))
    return _concat(bld, "experts.split.dgrad", dxs, Ng, g)


def _concat(bld, name: str, parts: list[str], Ng: int, alone: str) -> str:
    """``torch.cat`` of the local experts' ``[n_j, h]`` 16-bit tensors ``parts`` into ``[Ng, h]``: one copy kernel
    ``name`` (reads and writes ``2 Ng h`` bytes); with one local expert its tensor itself (``alone``, the tensor it
    would have read, when it had no rows)."""
    if bld.s.local_experts == 1:
        return parts[0] if parts else alone
    h = bld.s.hidden_size
    y = bld.e.fresh(name)
    bld.e.kernel(name, C.COPY, reads=2 * Ng * h, writes=2 * Ng * h, out=[(y, 2 * Ng * h)], uses=parts)
    return y


def _zero_expert_grads(bld, j: int, h: int, f1: int, fe: int) -> None:
    """An expert with no rows: its fc2 and fc1 weight gradients are zeros (``grad_accum`` of a zero-filled
    16-bit gradient, as PyTorch's empty GEMM writes), ready for their reduction like the others'."""
    e = bld.e
    for name, W in ((f"experts.{j}.fc2", fe * h), (f"experts.{j}.fc1", h * f1)):
        def zero(name=name, W=W) -> None:
            dw = e.fresh(f"{name}.dw16")
            e.kernel(f"{name}.wgrad.zero", C.ELEMENTWISE, writes=bld.w * W, out=[(dw, bld.w * W)])
            wid, gname = bld._accumulate_grad(name, dw, W)
            bld._grad_ready(f"{name}.weight", W, wid, gname)

        bld._weight_grads(zero)
