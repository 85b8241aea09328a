"""Pipeline-parallel schedules: the order in which one pipeline rank runs its forward and backward passes.

A model of ``L`` blocks is cut into ``p * v`` *model chunks* of consecutive layers (``p`` pipeline
ranks, ``v`` virtual stages per rank); rank ``r`` holds model chunks ``r, r + p, ..., r + (v - 1) p``
(Megatron-LM ``--num-layers-per-virtual-pipeline-stage``; its local chunk ``c`` is model chunk
``c p + r``). The activation of model chunk ``k`` goes to chunk ``k + 1`` (on rank ``(r + 1) mod p``)
and its gradient comes back.

Schedules (``stage_actions``), for ``m`` micro-batches:

* ``gpipe`` (Huang et al., *GPipe*, NeurIPS 2019): every forward, then every backward in reverse
  micro-batch order; ``m`` micro-batches' activations are alive at the peak.
* ``1f1b`` (Narayanan et al., *PipeDream-Flush* / Megatron-LM
  ``forward_backward_pipelining_without_interleaving``): ``min(p - r - 1, m)`` warm-up forwards,
  then one forward and one backward alternately, then the remaining backwards; rank 0 keeps ``p``
  micro-batches in flight.
* ``interleaved_1f1b`` (Narayanan et al., SC21, section 2.2.2; Megatron-LM
  ``forward_backward_pipelining_with_interleaving``): ``v`` chunks per rank visited in groups of
  ``p`` micro-batches; ``(p - r - 1) * 2 + (v - 1) p`` warm-up forwards; needs ``m`` a multiple of
  ``p`` (Megatron's rule).
* ``zero_bubble_h1`` (Qi et al., *Zero Bubble Pipeline Parallelism*, ICLR 2024, section 3.1, ZB-H1):
  the backward is split into ``B`` (input gradients, sent on at once) and ``W`` (weight gradients,
  needed by nobody else); 1F1B's order of ``F`` and ``B`` and its calls, with rank ``r`` holding back
  the ``W`` of its first ``min(r, m - w_r)`` steady-state micro-batches (``w_r = p - r - 1`` warm-up
  forwards) to fill its cool-down waits: after each later ``B`` it runs the oldest pending ``W``, after
  the last ``B`` the rest. The send of a ``B``'s gradient does not hold up that ``W`` (posted
  asynchronously, as the paper's implementation does). At most ``p`` micro-batches are in flight per
  rank, 1F1B's peak on rank 0. With ``m >= p`` and uniform stages the step is
  ``m (t_f + t_b + t_w) + (p - 1)(t_f + t_b - t_w)`` against 1F1B's ``(m + p - 1)(t_f + t_b + t_w)``
  (tested); ``m < p`` leaves more.
* ``zero_bubble_h2`` (Qi et al., *Zero Bubble Pipeline Parallelism*, ICLR 2024, section 3.1 and Table 1, ZB-H2;
  the handcrafted counterpart of the reference's automatic ZB-2p, sail-sg/zero-bubble-pipeline-parallelism
  ``--enable-zero-bubble --zero-bubble-max-pending-backward 2p``): the backward split into ``B`` and ``W`` as
  ZB-H1, with extra warm-up forwards filling the wait before the first ``B`` and the ``W`` passes moved to the
  tail, so that the schedule is a parallelogram. Rank ``r`` runs groups ``x = 0 .. m + 2 (p - 1) - 1``, each
  ``F_x``, then ``B_{x - 2 (p - 1 - r)}``, then ``W_{x - 2 (p - 1)}`` (the passes whose micro-batch lies in
  ``0..m-1``): ``2 (p - 1 - r)`` forwards, ``2 r`` (F, B) pairs, steady (F, B, W) triples, ``2 (p - 1 - r)``
  (B, W) pairs, ``2 r`` W passes. ``2 p - 1`` micro-batches in flight (F run, W not yet) on every rank once
  ``m >= 2 p - 1`` (the paper's ``(2 p - 1) M_B`` against 1F1B's ``p M_B``). With ``t_F = t_B = t_W = t``,
  free transfers and ``m >= 2 p - 1`` every rank runs its ``3 m`` passes back to back from ``r t``
  (tested): the bubble inside the parallelogram is zero (the paper's ``(p - 1)(t_F + t_B - 2 t_W)``), and the
  step is ``(3 m + p - 1) t`` when every rank's optimizer starts together (the gradient-norm or found-inf
  all-reduce before it, ``TransformerSpec.pipeline_step_end_sync``), ``3 m t`` per step from one step to the
  next without it (the paper's optimizer post-validation; ``training.clip_grad: 0`` with bf16). Transfers as ZB-V (``Comm.detached`` sends, each receive just before its pass).
* ``zero_bubble_v`` (ZB-V: Qi et al., *Zero Bubble Pipeline Parallelism*, ICLR 2024; ZB-V in the arXiv
  version 2401.10241, and *Pipeline Parallelism with Controllable Memory*, 2024, arXiv 2405.15362; the
  handcrafted schedule of sail-sg/zero-bubble-pipeline-parallelism ``megatron/core/pipeline_parallel/
  handcrafted_zb_v``): exactly 2 chunks per rank placed in a V, rank ``r`` holding model chunks ``r`` and
  ``2 p - 1 - r`` (so the last rank passes its chunk 0's output to its own chunk 1 without a transfer and
  rank 0 holds both the embedding and the loss); the backward split into ``B`` and ``W`` as ZB-H1. Rank ``r``
  runs, on ``n = max(m, 2 p - 1)`` micro-batch slots (the passes of slots ``>= m`` left out, as the reference
  does for small ``m``): ``2 (p - r) - 1`` forwards of chunk 0; ``r`` pairs (chunk 1 forward, chunk 0
  forward); ``p - r`` triples (chunk 1 F, B, W); then, while chunk 0 has forwards left or chunk 1 is behind,
  (chunk 0 F if any left, chunk 0 B, W, chunk 1 F, B, W); cool-down ``r`` pairs (chunk 0 B, chunk 1 B),
  ``p - r`` pairs (chunk 0 B, the oldest pending chunk 0 W); then the pending chunk 1 W, then chunk 0 W. At
  most ``2 p`` chunk activations (``p`` micro-batches of a whole stage, 1F1B's rank-0 peak) are held on every
  rank. With uniform chunk times ``t_F = t_B = t_W = t``, free transfers and ``m >= 2 p - 1`` the step is
  ``(6 m + p - 1) t`` (each rank's ``6 m`` passes back to back after its ``r t`` start; tested), against
  1F1B's ``(m + p - 1) 6 t`` for the same work. Transfers are posted as the ZB runtime's asynchronous p2p
  (``Comm.detached`` sends; each receive just before the pass that reads it); twice 1F1B's volume (the
  reference README's table). The reference runtime's cost-aware variant (``zerobubble/scheduler/zbv.py``,
  a greedy search on profiled ``t_F, t_B, t_W``) is not modelled: with unequal pass times the order stays
  the handcrafted one.

With uniform stages and no communication, the step is ``(m + p - 1)(t_f + t_b)`` for GPipe and
1F1B and ``(m + (p - 1) / v)(t_f + t_b)`` for the interleaved schedule (Narayanan et al., SC21,
section 2.2), ``t_f, t_b`` a whole rank's forward and backward of one micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble_h1", "zero_bubble_h2", "zero_bubble_v")
#: schedules that split the backward into ``B`` and ``W`` passes
SPLIT_BACKWARD = ("zero_bubble_h1", "zero_bubble_h2", "zero_bubble_v")


@dataclass(frozen=True)
class Action:
    """One pass of one micro-batch through one local chunk.

    Attributes:
        kind: ``"F"`` (forward), ``"B"`` (backward; with ``SPLIT_BACKWARD`` schedules the input gradients only) or
            ``"W"`` (``SPLIT_BACKWARD``: the weight gradients of an earlier ``"B"``).
        chunk: Local chunk index ``0..v-1`` (model chunk ``rank_chunks(...)[chunk]``: ``chunk * p + rank``, or
            the V of ``zero_bubble_v``).
        micro_batch: Micro-batch index ``0..m-1``.
        last: For the pass that completes the weight gradients (``"B"``, or ``"W"`` with ``SPLIT_BACKWARD``
            schedules): the chunk's final one of the step (its gradients are then complete).
    """

    kind: str
    chunk: int
    micro_batch: int
    last: bool = False


@dataclass(frozen=True)
class Comm:
    """One blocking point-to-point call of the schedule (Megatron-LM ``p2p_communication``: the sends and
    receives of one call are posted together and the call returns when all have finished).

    Transfers are ``(direction, boundary, micro_batch)``: ``("act", k, i)`` is the activation of model
    chunk ``k`` for micro-batch ``i`` going to chunk ``k + 1``, ``("grad", k, i)`` its gradient coming back.

    Attributes:
        sends: Transfers this rank sends.
        recvs: Transfers this rank receives.
        blocking: The next pass waits for the call (false: an asynchronous send that only the next call
            waits for; ``zero_bubble_h1``'s send of a gradient before a ``W``).
        detached: An asynchronous send that no later call waits for either, only the end of the step
            (``zero_bubble_v``: the ZB runtime's isend; implies not ``blocking``).
    """

    sends: tuple[tuple[str, int, int], ...] = ()
    recvs: tuple[tuple[str, int, int], ...] = ()
    blocking: bool = True
    detached: bool = False


def chunk_rank(schedule: str, p: int, k: int) -> int:
    """The pipeline rank holding model chunk ``k``: ``k mod p``, or with ``zero_bubble_v`` the V (``k`` for
    ``k < p``, else ``2 p - 1 - k``)."""
    if schedule == "zero_bubble_v":
        return k if k < p else 2 * p - 1 - k
    return k % p


def rank_chunks(schedule: str, p: int, rank: int, v: int) -> tuple[int, ...]:
    """Model chunks of pipeline rank ``rank`` by local chunk: ``c p + rank``; ``zero_bubble_v``: ``(rank,
    2 p - 1 - rank)``."""
    if schedule == "zero_bubble_v":
        return (rank, 2 * p - 1 - rank)
    return tuple(c * p + rank for c in range(v))


def transfer_stream(schedule: str, p: int, key: tuple[str, int, int], sending: bool) -> str:
    """The stream of one side of transfer ``key`` (``Comm``): per direction of the tensor (``act`` goes down
    the model chunks, ``grad`` up) and, with ``zero_bubble_v``, per side of the V (chunk 1's activations go
    to the previous rank and its gradients to the next: their own streams, so that no transfer queues behind
    one going the other way)."""
    direction, k, _ = key
    name = {("act", True): "send_next", ("act", False): "recv_prev",
            ("grad", True): "send_prev", ("grad", False): "recv_next"}[direction, sending]
    if schedule == "zero_bubble_v" and k >= p:  # the V's second arm
        name += ".v"
    return "comm.pp." + name

def check_schedule(schedule: str, p: int, m: int, v: int) -> None:
    """Raises ValueError: an unknown schedule, non-positive sizes, ``v > 1`` without the interleaved
    schedule, or the interleaved schedule with ``m`` not a multiple of ``p`` (Megatron-LM's rule)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {SCHEDULES}, got {schedule!r}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline sizes must be >= 1 (p {p}, m {m}, v {v})")
    if schedule == "zero_bubble_v":
        if v != 2:
            raise ValueError(f"the zero_bubble_v schedule places exactly 2 model chunks per rank, not {v}")
        if p < 2:
            raise ValueError("the zero_bubble_v schedule needs a pipeline (more than one pipeline rank)")
        return
    if v > 1 and schedule != "interleaved_1f1b":
        raise ValueError(f"virtual pipeline size {v} > 1 needs the interleaved_1f1b schedule, not {schedule!r}")
    if v > 1 and p == 1:
        raise ValueError(f"virtual pipeline size {v} > 1 needs more than one pipeline rank")
    if schedule == "interleaved_1f1b" and p > 1 and m % p:
        raise ValueError(f"the interleaved schedule needs the number of micro-batches ({m}) to be a multiple of the "
                         f"pipeline size ({p}) (Megatron-LM)")


def stage_actions(schedule: str, p: int, m: int, rank: int, v: int = 1) -> list[Action | Comm]:
    """The passes and point-to-point calls pipeline rank ``rank`` runs in one step, in order.

    Args:
        schedule: One of ``SCHEDULES``.
        p: Pipeline ranks.
        m: Micro-batches per step.
        rank: This rank, ``0..p-1``.
        v: Chunks per rank (``interleaved_1f1b``; 2 with ``zero_bubble_v``; 1 otherwise).

    Returns:
        ``2 m v`` ``Action``s (every (chunk, micro-batch) forward and backward exactly once, each backward
        after its forward; ``SPLIT_BACKWARD``: ``3 m v``, each ``W`` after its ``B``) and the ``Comm`` calls
        between them, in Megatron-LM's order. A pass that needs a received tensor comes after the call that
        receives it.

    Raises:
        ValueError: see ``check_schedule``; ``rank`` outside ``0..p-1``.
    """
    check_schedule(schedule, p, m, v)
    if not 0 <= rank < p:
        raise ValueError(f"pipeline rank {rank} outside 0..{p - 1}")
    if schedule == "zero_bubble_v":
        return _mark_last(_async_p2p(schedule, p, rank, _zero_bubble_v_order(p, m, rank)))
    if schedule == "zero_bubble_h2" and p > 1:  # p 1: no bubble to fill, 1F1B's order (as zero_bubble_h1)
        return _mark_last(_async_p2p(schedule, p, rank, _zero_bubble_h2_order(p, m, rank)))
    if schedule != "interleaved_1f1b" or v == 1:
        v = 1
    sched = _Schedule(p, m, rank, v)
    if schedule == "gpipe":
        sched.set_orders([(0, i) for i in range(m)], [(0, i) for i in reversed(range(m))])
        for i in range(m):
            sched.recv_forward()
            sched.forward(0, i)
            sched.send_forward()
        for i in reversed(range(m)):
            sched.recv_backward()
            sched.backward(0, i)
            sched.send_backward()
    elif v == 1:
        _one_f_one_b(sched, p, m, rank, zero_bubble=schedule == "zero_bubble_h1" and p > 1)  # p 1: no bubble to fill
    else:
        _interleaved(sched, p, m, rank, v)
    return _mark_last(sched.items)


class _Schedule:
    """Collects a rank's passes and calls; works out which transfer each send and receive carries (the
    receives of one direction arrive in the order this rank consumes them, as Megatron's queues do)."""

    def __init__(self, p: int, m: int, rank: int, v: int):
        self.p, self.rank, self.n = p, rank, p * v
        self.items: list[Action | Comm] = []
        self.outbox: list[tuple[str, int, int]] = []  # what the last pass produced for a neighbour
        self.fwd_order: list[tuple[int, int]] = []
        self.bwd_order: list[tuple[int, int]] = []
        self._fwd_in: list[tuple[str, int, int]] | None = None
        self._bwd_in: list[tuple[str, int, int]] | None = None

    def set_orders(self, fwd: list[tuple[int, int]], bwd: list[tuple[int, int]]) -> None:
        """The (chunk, micro-batch) order of this rank's forwards and backwards (the receive queues)."""
        k = lambda c: c * self.p + self.rank  # noqa: E731 - model chunk of local chunk c
        self._fwd_in = [("act", k(c) - 1, i) for c, i in fwd if k(c) > 0]
        self._bwd_in = [("grad", k(c), i) for c, i in bwd if k(c) < self.n - 1]

    def forward(self, c: int, i: int) -> None:
        self.items.append(Action("F", c, i))
        k = c * self.p + self.rank
        self.outbox = [("act", k, i)] if k < self.n - 1 else []

    def backward(self, c: int, i: int) -> None:
        self.items.append(Action("B", c, i))
        k = c * self.p + self.rank
        self.outbox = [("grad", k - 1, i)] if k > 0 else []

    def weight(self, c: int, i: int) -> None:
        self.items.append(Action("W", c, i))

    def call(self, send: bool = False, recv_prev: bool = False, recv_next: bool = False,
             sends: list | None = None, blocking: bool = True) -> None:
        out = list(sends if sends is not None else (self.outbox if send else []))
        recvs = []
        if recv_prev and self._fwd_in:
            recvs.append(self._fwd_in.pop(0))
        if recv_next and self._bwd_in:
            recvs.append(self._bwd_in.pop(0))
        if out or recvs:
            self.items.append(Comm(tuple(out), tuple(recvs), blocking))

    # Megatron-LM's named calls (no-ops where the rank has no neighbour in that direction)
    def recv_forward(self) -> None:
        self.call(recv_prev=True)

    def recv_backward(self) -> None:
        self.call(recv_next=True)

    def send_forward(self) -> None:
        self.call(send=True)

    def send_backward(self) -> None:
        self.call(send=True)


def _one_f_one_b(sched: _Schedule, p: int, m: int, rank: int, zero_bubble: bool = False) -> None:
    """Megatron-LM ``forward_backward_pipelining_without_interleaving``; ``zero_bubble``: ZB-H1's ``W`` passes
    (module docstring) after the ``B`` passes, each after the asynchronous send of that ``B``'s gradient."""
    warm = min(p - rank - 1, m)
    rest = m - warm
    held = min(rank, rest)  # ZB-H1: steady-state W passes held back to fill the cool-down
    pending: list[int] = []
    sched.set_orders([(0, i) for i in range(m)], [(0, i) for i in range(m)])

    def after_backward(i: int, recv_prev: bool) -> None:
        if not zero_bubble:
            sched.call(send=True, recv_prev=recv_prev)  # send_backward(_recv_forward)
            return
        sched.call(send=True, blocking=False)
        pending.append(i)
        if len(pending) > held:
            sched.weight(0, pending.pop(0))
        if recv_prev:
            sched.recv_forward()

    for i in range(warm):
        sched.recv_forward()
        sched.forward(0, i)
        sched.send_forward()
    if rest:
        sched.recv_forward()
    for i in range(rest):
        sched.forward(0, warm + i)
        sched.call(send=True, recv_next=True)  # send_forward_recv_backward
        sched.backward(0, i)
        after_backward(i, recv_prev=i < rest - 1)
    for i in range(warm):
        sched.recv_backward()
        sched.backward(0, rest + i)
        after_backward(rest + i, recv_prev=False)  # ZB-H1 cool-down: one held-back W after each B
    for i in pending:
        sched.weight(0, i)


def _interleaved(sched: _Schedule, p: int, m: int, rank: int, v: int) -> None:
    """Megatron-LM ``forward_backward_pipelining_with_interleaving`` (without ``overlap_p2p_comm``):
    forward pass ``k`` runs chunk ``(k mod p v) // p`` on micro-batch ``(k // p v) p + k mod p``, backward
    pass ``k`` the same with the chunks reversed; warm-up ``(p - r - 1) 2 + (v - 1) p`` forwards (all of
    them when ``m = p``); one call after each warm-up forward, one after each steady forward + backward pair,
    one after each cool-down backward."""
    total = m * v

    def fwd(k: int) -> tuple[int, int]:
        return (k % (p * v)) // p, (k // (p * v)) * p + k % p

    def bwd(k: int) -> tuple[int, int]:
        return v - 1 - (k % (p * v)) // p, (k // (p * v)) * p + k % p

    sched.set_orders([fwd(k) for k in range(total)], [bwd(k) for k in range(total)])
    all_warm = m == p
    warm = total if all_warm else min((p - rank - 1) * 2 + (v - 1) * p, total)
    rest = total - warm
    first, last = rank == 0, rank == p - 1
    if not first:  # the first rank's chunk 0 reads the embedding, not a neighbour
        sched.recv_forward()
    for k in range(warm):
        sched.forward(*fwd(k))
        recv_prev = not (first and k + 1 < total and fwd(k + 1)[0] == 0) and k < total - 1
        if k == warm - 1 and not all_warm:  # send_forward_backward_recv_forward_backward
            sched.call(send=True, recv_prev=recv_prev, recv_next=not last)
        else:  # send_forward_recv_forward
            sched.call(send=True, recv_prev=recv_prev)
    for k in range(rest):
        fk = warm + k
        sched.forward(*fwd(fk))
        out = sched.outbox
        sched.backward(*bwd(k))
        # the first (last) rank receives what the last (first) rank produced p - 1 passes earlier
        recv_prev = fwd(fk - (p - 1))[0] != v - 1 if first else True
        recv_next = bwd(k - (p - 1))[0] != 0 if last else True
        sched.call(sends=out + sched.outbox, recv_prev=recv_prev and k < rest - 1, recv_next=recv_next)
    if all_warm and not last:  # the last rank's last chunk starts backward from its own loss
        sched.recv_backward()
    for k in range(rest, total):
        sched.backward(*bwd(k))
        recv_next = not (last and k + 1 < total and bwd(k + 1)[0] == v - 1) and k < total - 1
        sched.call(send=True, recv_next=recv_next)


def _zero_bubble_v_order(p: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """The handcrafted ZB-V order of rank ``rank``'s passes ``(kind, local chunk, micro-batch)`` (module
    docstring), on ``max(m, 2 p - 1)`` micro-batch slots with the passes of slots ``>= m`` left out."""
    n = max(m, 2 * p - 1)
    order: list[tuple[str, int, int]] = []
    done = {(k, c): 0 for k in "FBW" for c in (0, 1)}  # passes issued per (kind, chunk)

    def run(kind: str, c: int, i: int | None = None) -> None:
        i = done[kind, c] if i is None else i
        done[kind, c] += 1
        order.append((kind, c, i))

    for _ in range(2 * (p - rank) - 1):  # warm-up: chunk 0 forwards
        run("F", 0)
    for _ in range(rank):
        run("F", 1)
        run("F", 0)
    for _ in range(p - rank):  # chunk 1's first backwards, each with its W at once
        run("F", 1)
        run("B", 1)
        run("W", 1)
    while done["F", 1] < done["F", 0] or done["F", 0] < n:  # steady state
        if done["F", 0] < n:
            run("F", 0)
        for c in (0, 1):
            run("B", c)
            run("W", c)
            if c == 0:
                run("F", 1)
    w0 = done["W", 0]
    for _ in range(rank):  # cool-down: backwards first, the W passes fill the tail
        run("B", 0)
        run("B", 1)
    for _ in range(p - rank):
        run("B", 0)
        order.append(("W", 0, w0))
        w0 += 1
    for i in range(done["W", 1], done["B", 1]):
        order.append(("W", 1, i))
    for i in range(w0, done["B", 0]):
        order.append(("W", 0, i))
    return [a for a in order if a[2] < m]


def _zero_bubble_h2_order(p: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """The ZB-H2 order of rank ``rank``'s passes ``(kind, 0, micro-batch)`` (module docstring): group ``x`` is
    ``F_x``, ``B_{x - 2 (p - 1 - rank)}``, ``W_{x - 2 (p - 1)}``, each where its micro-batch is in ``0..m-1``."""
    order: list[tuple[str, int, int]] = []
    for x in range(m + 2 * (p - 1)):
        for kind, i in (("F", x), ("B", x - 2 * (p - 1 - rank)), ("W", x - 2 * (p - 1))):
            if 0 <= i < m:
                order.append((kind, 0, i))
    return order


def _async_p2p(schedule: str, p: int, rank: int, order: list[tuple[str, int, int]]) -> list[Action | Comm]:
    """Passes ``order`` with the ZB runtime's transfers (``zero_bubble_h2``, ``zero_bubble_v``): a blocking receive
    before each pass that reads a tensor from another rank, a detached send after each pass that produces one (ZB-V's last rank hands
    its chunk 0's output to its chunk 1, on the same rank, without either)."""
    v = 2 if schedule == "zero_bubble_v" else 1
    n_chunks = p * v
    items: list[Action | Comm] = []
    for kind, c, i in order:
        k = rank_chunks(schedule, p, rank, v)[c]
        if kind == "F":
            need = ("act", k - 1, i) if k > 0 else None
            give = ("act", k, i) if k < n_chunks - 1 else None
        elif kind == "B":
            need = ("grad", k, i) if k < n_chunks - 1 else None
            give = ("grad", k - 1, i) if k > 0 else None
        else:
            need = give = None
        # a tensor from (to) chunk k - 1 or k + 1 on this rank is handed over without a transfer
        if need is not None and chunk_rank(schedule, p, need[1] + (need[0] == "grad")) != rank:
            items.append(Comm(recvs=(need,)))
        items.append(Action(kind, c, i))
        if give is not None and chunk_rank(schedule, p, give[1] + (give[0] == "act")) != rank:
            items.append(Comm(sends=(give,), blocking=False, detached=True))
    return items


def _mark_last(items: list[Action | Comm]) -> list[Action | Comm]:
    seen: set[int] = set()
    out: list[Action | Comm] = []
    grads = "W" if any(isinstance(a, Action) and a.kind == "W" for a in items) else "B"
    for a in reversed(items):
        if isinstance(a, Action) and a.kind == grads and a.chunk not in seen:
            seen.add(a.chunk)
            a = Action(a.kind, a.chunk, a.micro_batch, last=True)
        out.append(a)
    return out[::-1]


def uniform_split(num_layers: int, chunks: int) -> tuple[int, ...]:
    """Layers per model chunk for an even split (Megatron-LM's default).

    Raises:
        ValueError: ``chunks`` does not divide ``num_layers`` (give the split explicitly).
    """
    if num_layers % chunks:
        raise ValueError(f"{chunks} pipeline chunks do not divide num_layers {num_layers} (give the layers per "
                         "stage explicitly)")
    return (num_layers // chunks,) * chunks


def chunk_layers(split: tuple[int, ...], k: int) -> range:
    """Layer indices of model chunk ``k`` for ``split`` (layers per model chunk)."""
    lo = sum(split[:k])
    return range(lo, lo + split[k])
