"""Pipeline schedules run on the engine with fixed pass times and free send/recv: the step times of
Narayanan et al. (SC21, section 2.2) exactly, and no deadlock for any (p, m, v)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.engine.run import SimulationError, run_ranks
from simulator.graph.builders.pipeline import Action, Comm, chunk_rank, rank_chunks, stage_actions, transfer_stream
from simulator.graph.op_graph import GraphBuilder
from simulator.graph.ops import OpKind, TensorAlloc
from tests.conftest import make_hw


def _stage_graph(schedule: str, p: int, m: int, r: int, v: int, tf: float, tb: float, stall: float = 0.0,
                 tw: float = 0.0, act: int = 0, keep: int = 0):
    """Rank ``r``'s passes as fixed-time kernels (``tf`` forward, ``tb`` backward, ``tw`` weight-gradient pass per
    chunk) and its calls as free send/recv rendezvous, with the builder's rule: a call's ops are posted after
    the previous kernel and the previous call; the next kernel waits for them (blocking, as Megatron-LM's p2p
    calls) unless the call is an asynchronous send (``Comm.blocking`` false); a ``detached`` send is waited
    for by the end of the step only. ``act`` bytes: the activation a forward saves, freed when its gradients
    are done (its W, else its B); ``keep`` bytes: what a backward keeps for its W (the output gradients of the
    weight-gradient GEMMs), allocated by the B and freed by the W (by the B itself without W passes)."""
    b = GraphBuilder()
    last, prev, wait, detached = -1, [], [], []
    for a in stage_actions(schedule, p, m, r, v):
        if isinstance(a, Comm):
            ops = []
            for sending, moves in ((True, a.sends), (False, a.recvs)):
                for d, k, i in moves:
                    stream = transfer_stream(schedule, p, (d, k, i), sending)
                    ops.append(b.add(f"{d}.{k}.{i}", OpKind.COLLECTIVE, stream, deps=[last, *prev],
                                     fixed_duration_s=0.0, launch=False,
                                     meta={"rendezvous": ("pp", d, k, i), "parties": 2}))
            if a.detached:
                detached += ops
                continue
            prev = ops
            wait = ops if a.blocking else []
            continue
        t = {"F": tf, "B": tb, "W": tw}[a.kind] * (1 + stall)
        tag = f"{a.chunk}.{a.micro_batch}"
        mem = {}
        if act and a.kind == "F":
            mem = {"allocs": (TensorAlloc(f"act.{tag}", act),)}
        elif act and a.kind == "B":
            mem = {"allocs": (TensorAlloc(f"keep.{tag}", keep),), "uses": (f"act.{tag}", f"keep.{tag}")}
        elif act:
            mem = {"uses": (f"act.{tag}", f"keep.{tag}")}
        last = b.add(f"{a.kind}{tag}", OpKind.COMPUTE, "compute", deps=wait, fixed_duration_s=t, launch=False, **mem)
        wait = []
    b.add("end", OpKind.SYNC, "host", deps=[last, *prev, *detached], launch=False)
    return b.build()


def _peaks(schedule: str, p: int, m: int, v: int, act: int, keep: int, tw: float) -> list[int]:
    """Peak device bytes per rank of ``_stage_graph`` runs with tensors (unit pass times)."""
    hw = make_hw()
    graphs = [_stage_graph(schedule, p, m, r, v, 1e-3, 1e-3, 0.0, tw, act, keep) for r in range(p)]
    return [rec.memory["gpu"].peak for rec, _ in run_ranks(graphs, [hw] * p, steps=1)]


def _step(schedule: str, p: int, m: int, v: int, tf: float, tb: float, stalls=None, tw: float = 0.0) -> float:
    hw = make_hw()
    graphs = [_stage_graph(schedule, p, m, r, v, tf, tb, (stalls or {}).get(r, 0.0), tw) for r in range(p)]
    runs = run_ranks(graphs, [hw] * p, steps=1)
    return max(rec.steps.end_s.iloc[0] for rec, _ in runs)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_step_is_m_plus_p_minus_1_passes(schedule):
    # p = 4 stages, m = 8 micro-batches, t_f = 1 ms, t_b = 2 ms: (8 + 3) x 3 ms = 33 ms
    assert _step(schedule, 4, 8, 1, 1e-3, 2e-3) == pytest.approx(33e-3, rel=1e-12)


def test_interleaved_step_is_m_plus_p_minus_1_over_v_passes():
    # p = 4, v = 2 chunks of half the work (t_f = 0.5, t_b = 1 ms each), m = 8: (8 + 3/2) x 3 ms = 28.5 ms
    assert _step("interleaved_1f1b", 4, 8, 2, 0.5e-3, 1e-3) == pytest.approx(28.5e-3, rel=1e-12)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_one_micro_batch_crosses_every_stage_twice(schedule):
    # m = 1: the forward runs stage after stage, then the backward back; stage 2 is 20% slower:
    # (3 x 1 + 1.2) ms forward + (3 x 2 + 2.4) ms backward = 12.6 ms
    assert _step(schedule, 4, 1, 1, 1e-3, 2e-3, stalls={2: 0.2}) == pytest.approx(12.6e-3, rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 12), v=st.integers(1, 3), schedule=st.sampled_from(
    ["gpipe", "1f1b", "interleaved_1f1b"]))
def test_every_schedule_finishes_with_the_textbook_step(p, m, v, schedule):
    if schedule != "interleaved_1f1b":
        v = 1
    elif v == 1 or p == 1 or m % p:
        return
    tf, tb = 1e-3 / v, 2e-3 / v
    want = (m + (p - 1) / v) * 3e-3
    assert _step(schedule, p, m, v, tf, tb) == pytest.approx(want, rel=1e-9)


def test_peak_activations_are_p_minus_r_micro_batches_with_1f1b_and_m_with_gpipe():
    """Issue 11's hand check, on the engine's memory accounting: each forward saves 1000 bytes, freed by its
    backward (nothing kept for a W). p = 4, m = 8: 1F1B's rank r runs p - r warm-up forwards before its first
    backward and then one forward per backward, so it peaks at (p - r) x 1000 (stage 0: p); GPipe runs all m
    forwards first: m x 1000 on every rank."""
    assert _peaks("1f1b", 4, 8, 1, 1000, 0, 0.0) == [4000, 3000, 2000, 1000]
    assert _peaks("gpipe", 4, 8, 1, 1000, 0, 0.0) == [8000] * 4


def test_actions_cover_every_pass_once_and_backward_follows_forward():
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 3)):
        for r in range(4):
            acts = [a for a in stage_actions(schedule, 4, 8, r, v) if isinstance(a, Action)]
            order = {(a.kind, a.chunk, a.micro_batch): n for n, a in enumerate(acts)}
            want = {(c, i) for c in range(v) for i in range(8)}
            assert len(acts) == 2 * len(want) and {(c, i) for k, c, i in order} == want
            assert all(order["F", c, i] < order["B", c, i] for c, i in want)
            assert sum(a.last for a in acts) == v


def test_sends_and_receives_pair_up_in_the_same_order():
    for schedule, p, m, v in (("gpipe", 3, 5, 1), ("1f1b", 4, 6, 1), ("interleaved_1f1b", 4, 8, 2)):
        sent: dict[int, list] = {r: [] for r in range(p)}
        got: dict[int, list] = {r: [] for r in range(p)}
        for r in range(p):
            for a in stage_actions(schedule, p, m, r, v):
                if isinstance(a, Comm):
                    sent[r] += [x for x in a.sends]
                    got[r] += [x for x in a.recvs]
        n = p * v
        assert sum(map(len, sent.values())) == sum(map(len, got.values())) == 2 * m * (n - 1)
        for r in range(p):  # what rank r sends forward, rank r + 1 receives in that order
            assert [x for x in sent[r] if x[0] == "act"] == [x for x in got[(r + 1) % p] if x[0] == "act"]


def test_1f1b_warmup_is_p_minus_rank_minus_1():
    acts = [a for a in stage_actions("1f1b", 4, 8, 1, 1) if isinstance(a, Action)]
    assert [a.kind for a in acts[:4]] == ["F", "F", "F", "B"]  # 2 warm-up forwards, then 1F1B


def test_a_missing_partner_is_a_named_deadlock():
    hw = make_hw()
    b = GraphBuilder()
    b.add("recv", OpKind.COLLECTIVE, "comm.pp.recv_prev", fixed_duration_s=0.0, launch=False,
          meta={"rendezvous": ("pp", "act", 0, 0), "parties": 2})
    lone = b.build()
    with pytest.raises(SimulationError, match="deadlocked at rendezvous"):
        run_ranks([lone, GraphBuilder().build()], [hw, hw], steps=1)


def test_zero_bubble_h1_step_by_hand():
    """ZB-H1 (Qi et al., ICLR 2024, section 3.1): p = 4, m = 8, t_f = t_b = t_w = 1 ms: 8 x 3 ms of work plus a
    bubble of (p - 1)(t_f + t_b - t_w) = 3 ms = 27 ms, against 1F1B's (8 + 3) x 3 ms = 33 ms with B and W fused."""
    assert _step("zero_bubble_h1", 4, 8, 1, 1e-3, 1e-3, tw=1e-3) == pytest.approx(27e-3, rel=1e-12)
    assert _step("1f1b", 4, 8, 1, 1e-3, 2e-3) == pytest.approx(33e-3, rel=1e-12)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 6), extra=st.integers(0, 6), tb=st.sampled_from([1.0, 1.2, 2.0]),
       tw=st.sampled_from([0.25, 0.5, 0.8, 1.0]))
def test_zero_bubble_h1_bubble_is_p_minus_1_times_f_plus_b_minus_w(p, extra, tb, tw):
    """With m >= p micro-batches and W no longer than F: step = m (t_f + t_b + t_w) + (p - 1)(t_f + t_b - t_w)."""
    m, tf = p + extra, 1.0
    want = (m * (tf + tb + tw) + (p - 1) * (tf + tb - tw)) * 1e-3
    assert _step("zero_bubble_h1", p, m, 1, tf * 1e-3, tb * 1e-3, tw=tw * 1e-3) == pytest.approx(want, rel=1e-9)


def test_zero_bubble_h1_actions():
    """Every (micro-batch) F, B and W once, W after its B; rank r holds back min(r, m - (p - r - 1)) W passes; the
    chunk's last W carries ``last``; at most p micro-batches in flight (F run, W not yet) on any rank."""
    p, m = 4, 8
    for r in range(p):
        acts = [a for a in stage_actions("zero_bubble_h1", p, m, r) if isinstance(a, Action)]
        pos = {(a.kind, a.micro_batch): n for n, a in enumerate(acts)}
        assert len(acts) == 3 * m and all(pos["F", i] < pos["B", i] < pos["W", i] for i in range(m))
        assert [a.last for a in acts].count(True) == 1 and acts[-1].kind == "W" and acts[-1].last
        live = peak = 0
        for a in acts:
            live += {"F": 1, "B": 0, "W": -1}[a.kind]
            peak = max(peak, live)
        assert peak <= p
        first_w = next(n for n, a in enumerate(acts) if a.kind == "W")
        assert sum(a.kind == "B" for a in acts[:first_w]) == min(r, m - (p - r - 1)) + 1


def test_zero_bubble_h1_on_one_stage_is_1f1b():
    """Without a pipeline there is no bubble to fill: the ZB-H1 order is 1F1B's (no W passes)."""
    assert stage_actions("zero_bubble_h1", 1, 6, 0) == stage_actions("1f1b", 1, 6, 0)


def _zbv_grid(p: int, m: int) -> dict[tuple[int, str, int, int], int]:
    """The ZB-V figure's time grid: rank r's passes in unit slots from slot r on, back to back."""
    return {(r, *a): r + n for r in range(p) for n, a in enumerate(
        (a.kind, a.chunk, a.micro_batch) for a in stage_actions("zero_bubble_v", p, m, r, 2) if isinstance(a, Action))}


def _zbv_deps(p: int, r: int, kind: str, c: int, i: int) -> list[tuple[int, str, int, int]]:
    """The passes (rank, kind, chunk, micro-batch) that pass (r, kind, c, i) of ZB-V reads: a forward the previous
    model chunk's forward, a backward the next chunk's backward (the loss chunk: its own forward), W its B."""
    if kind == "W":
        return [(r, "B", c, i)]
    k = rank_chunks("zero_bubble_v", p, r, 2)[c]
    j = k - 1 if kind == "F" else k + 1
    if not 0 <= j < 2 * p:
        return [(r, "F", c, i)] if kind == "B" else []
    rj = chunk_rank("zero_bubble_v", p, j)
    return [(rj, kind, rank_chunks("zero_bubble_v", p, rj, 2).index(j), i)]


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 5), (4, 7)])
def test_zero_bubble_v_grid_is_feasible(p, m):
    """The hand schedule on a grid of unit slots (t_F = t_B = t_W = 1, free transfers): rank r runs its 6 m passes
    back to back from slot r. For m >= 2 p - 1 every pass's inputs finish in an earlier slot (checked here pass by
    pass), so the grid is a valid timeline and the step is 6 m + p - 1 slots: rank p - 1 cannot start before slot
    p - 1 and has 6 m slots of work, and every rank finishes by slot r + 6 m <= 6 m + p - 1."""
    grid = _zbv_grid(p, m)
    assert len(grid) == 6 * m * p
    for (r, kind, c, i), slot in grid.items():
        for d in _zbv_deps(p, r, kind, c, i):
            assert grid[d] < slot, (r, kind, c, i, d)
    assert max(grid.values()) + 1 == 6 * m + p - 1


def test_zero_bubble_v_step_by_hand():
    """ZB-V (Qi et al., *Zero Bubble Pipeline Parallelism*, arXiv 2401.10241; the handcrafted order of
    sail-sg/zero-bubble-pipeline-parallelism), t_F = t_B = t_W = 1 ms per chunk pass, free transfers.

    p = 2, m = 4 (V: rank 0 holds model chunks 0 and 3 with the loss, rank 1 chunks 1 and 2), by hand:
      rank 0: F0_0 F0_1 F0_2 F1_0 B1_0 W1_0 F1_1 B1_1 W1_1 F0_3 B0_0 W0_0 F1_2 B1_2 W1_2 B0_1 W0_1 F1_3 B1_3 W1_3
              B0_2 W0_2 B0_3 W0_3                                     (slots 0-23)
      rank 1: F0_0 F1_0 F0_1 F1_1 B1_0 W1_0 F0_2 B0_0 W0_0 F1_2 B1_1 W1_1 F0_3 B0_1 W0_1 F1_3 B1_2 W1_2 B0_2 B1_3
              B0_3 W0_2 W1_3 W0_3                                     (slots 1-24)
      every input is ready in time (rank 1's F0_i at slots 1, 3, 7, 13 after rank 0's at 0, 1, 2, 9; rank 0's F1_i
      at 3, 6, 12, 17 after rank 1's at 2, 4, 10, 16; rank 1's B1_i at 5, 11, 17, 20 after rank 0's at 4, 7, 13,
      18; rank 0's B0_i at 10, 15, 20, 22 after rank 1's at 8, 14, 19, 21), so the step is 1 + 24 = 25 ms.
    p = 4, m = 8: rank 3 starts at 3 ms and runs 48 passes back to back (grid test above): 51 ms.
    The same work as 1F1B with stage passes F = 2 ms, B + W = 4 ms: (m + p - 1) x 6 ms = 30 ms and 66 ms; ZB-H1:
    m (2 + 2 + 2) + (p - 1)(2 + 2 - 2) = 26 ms and 54 ms."""
    assert _step("zero_bubble_v", 2, 4, 2, 1e-3, 1e-3, tw=1e-3) == pytest.approx(25e-3, rel=1e-12)
    assert _step("zero_bubble_v", 4, 8, 2, 1e-3, 1e-3, tw=1e-3) == pytest.approx(51e-3, rel=1e-12)
    assert _step("1f1b", 2, 4, 1, 2e-3, 4e-3) == pytest.approx(30e-3, rel=1e-12)
    assert _step("zero_bubble_h1", 2, 4, 1, 2e-3, 2e-3, tw=2e-3) == pytest.approx(26e-3, rel=1e-12)
    assert _step("zero_bubble_h1", 4, 8, 1, 2e-3, 2e-3, tw=2e-3) == pytest.approx(54e-3, rel=1e-12)


def _peak_in_flight(schedule: str, p: int, m: int, r: int, v: int) -> int:
    """Chunk activations held at the peak: +1 at a forward, -1 when its gradients are done (its W, or its B
    without W passes)."""
    acts = [a for a in stage_actions(schedule, p, m, r, v) if isinstance(a, Action)]
    done = "W" if any(a.kind == "W" for a in acts) else "B"
    live = peak = 0
    for a in acts:
        live += 1 if a.kind == "F" else (-1 if a.kind == done else 0)
        peak = max(peak, live)
    return peak


def test_zero_bubble_v_keeps_2p_half_stage_activations_on_every_rank():
    """By hand from the orders above: p = 2, m = 4: rank 0 holds F0_0-2 (3), F1_0 (4), W1_0 frees one (3), F1_1 (4)
    ...: peak 4; rank 1 F0_0, F1_0, F0_1, F1_1 (4) before its first W: peak 4. In general rank r's warm-up runs
    2 (p - r) - 1 + 2 r = 2 p - 1 forwards before its first W, plus the F1 just before it: 2 p chunk activations,
    each half a stage's layers: p whole-stage micro-batches, 1F1B's peak on rank 0 (and every rank, not only rank 0
    as with 1F1B and ZB-H1)."""
    assert [_peak_in_flight("zero_bubble_v", 2, 4, r, 2) for r in range(2)] == [4, 4]
    assert [_peak_in_flight("zero_bubble_v", 4, 8, r, 2) for r in range(4)] == [8] * 4
    assert [_peak_in_flight("1f1b", 4, 8, r, 1) for r in range(4)] == [4, 3, 2, 1]  # whole-stage micro-batches
    for p in range(2, 9):  # exactly 2 p once m >= 2 p - 1, never more
        for m in range(1, 21):
            assert {_peak_in_flight("zero_bubble_v", p, m, r, 2) <= 2 * p for r in range(p)} == {True}
            if m >= 2 * p - 1:
                assert {_peak_in_flight("zero_bubble_v", p, m, r, 2) for r in range(p)} == {2 * p}


@settings(max_examples=50, deadline=None)
@given(p=st.integers(2, 6), m=st.integers(1, 14))
def test_zero_bubble_v_covers_every_pass_and_never_deadlocks(p, m):
    """Any p >= 2 and m >= 1: every (chunk, micro-batch) F, B and W once, F before B before W; sends and receives
    pair up; the run finishes; with m >= 2 p - 1 in (6 m + p - 1) t exactly, otherwise no sooner than 6 m t and no
    later than the padded grid's 6 max(m, 2 p - 1) + p - 1 slots."""
    sent, got = [], []
    for r in range(p):
        items = stage_actions("zero_bubble_v", p, m, r, 2)
        acts = [a for a in items if isinstance(a, Action)]
        pos = {(a.kind, a.chunk, a.micro_batch): n for n, a in enumerate(acts)}
        assert len(acts) == 6 * m == len(pos)
        assert all(pos["F", c, i] < pos["B", c, i] < pos["W", c, i] for c in (0, 1) for i in range(m))
        assert sum(a.last for a in acts) == 2
        for a in items:
            if isinstance(a, Comm):
                sent += a.sends
                got += a.recvs
    assert sorted(sent) == sorted(got) and len(sent) == 2 * m * (2 * p - 2)  # the last rank's hand-off is local
    step = _step("zero_bubble_v", p, m, 2, 1.0, 1.0, tw=1.0)
    if m >= 2 * p - 1:
        assert step == pytest.approx(6 * m + p - 1, rel=1e-12)
    else:
        assert 6 * m <= step <= 6 * (2 * p - 1) + p - 1


def test_zero_bubble_v_memory_holds_what_w_needs_until_w_runs():
    """The engine's memory with ZB-V, p = 2, m = 4, A = 1000 B saved per chunk forward, G = 1000 B kept by a B for
    its W. By hand from the orders of test_zero_bubble_v_step_by_hand, live bytes in units of 1000 (F +A, B +G,
    W -A -G):
      rank 0: F0 F0 F0 3, F1 4, B1 5, W1 3, F1 4, B1 5, W1 3, F0 4, B0 5, W0 3, ... then only lower: peak 5 (4 A + G)
      rank 1: F0 1, F1 2, F0 3, F1 4, B1 5, W1 3, ... steady 4-5-3; cool-down after W1_2 at 3: B0_2 4, B1_3 5,
              B0_3 6, W0_2 4, W1_3 2, W0_3 0: peak 6 (3 A + 3 G: three B passes ahead of their W)
    1F1B on the same work (a stage forward saves 2 A, its fused backward holds 2 G while it runs): rank 0 F 2, F 4,
    B 6, then 2 A freed with the 2 G at the end of each B: peak 6; rank 1 F 2, B 4: peak 4."""
    assert _peaks("zero_bubble_v", 2, 4, 2, 1000, 1000, 1e-3) == [5000, 6000]
    assert _peaks("1f1b", 2, 4, 1, 2000, 2000, 0.0) == [6000, 4000]


@settings(max_examples=30, deadline=None)
@given(p=st.integers(2, 5), m=st.integers(1, 10), tb=st.sampled_from([0.5, 1.0, 2.0]),
       tw=st.sampled_from([0.25, 1.0, 1.5]), slow=st.integers(0, 4))
def test_zero_bubble_v_with_unequal_passes_finishes_no_sooner_than_its_busiest_rank(p, m, tb, tw, slow):
    """Unequal F, B, W times and one rank 50% slower: no deadlock, and the step is at least that rank's own work
    2 m (t_f + t_b + t_w) x 1.5 and at most the whole pipeline's work run one pass at a time."""
    stalls = {slow % p: 0.5}
    step = _step("zero_bubble_v", p, m, 2, 1.0, tb, stalls=stalls, tw=tw)
    work = 2 * m * (1.0 + tb + tw)
    assert work * 1.5 - 1e-9 <= step <= work * (p + 0.5) + 1e-9


def _steps_without_sync(schedule: str, p: int, m: int, k: int, tw: float) -> list[tuple[list[float], list[float]]]:
    """``k`` steps of ``_stage_graph`` (unit F and B, ``tw`` W): per rank its steps' starts and ends. The graph
    ends each step on its own rank (no cross-rank all-reduce before the optimizer), so a rank starts its next step
    as soon as its own passes are done: the paper's optimizer post-validation, which ZB-H2 assumes."""
    hw = make_hw()
    graphs = [_stage_graph(schedule, p, m, r, 1, 1.0, 1.0, 0.0, tw) for r in range(p)]
    return [(list(rec.steps.start_s), list(rec.steps.end_s)) for rec, _ in run_ranks(graphs, [hw] * p, steps=k)]


def test_zero_bubble_h2_step_by_hand():
    """ZB-H2 (Qi et al., ICLR 2024, section 3.1), p = 2, m = 4, t_F = t_B = t_W = 1 ms, free transfers. By hand
    from the group rule (group x: F_x, B_{x - 2 (p - 1 - r)}, W_{x - 2 (p - 1)}):
      rank 0: F0 F1 F2 B0 W0 F3 B1 W1 B2 W2 B3 W3     (slots 0-11: 2p - 1 = 3 forwards before the first B)
      rank 1: F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3     (slots 1-12: the W passes moved to the tail)
    every input is ready in time (rank 1's F_i at 1, 3, 5, 8 after rank 0's at 0, 1, 2, 5; rank 0's B_i at 3, 6,
    8, 10 after rank 1's at 2, 4, 6, 9), so each rank runs its 12 passes back to back and the step, ending on both
    ranks together, is 1 + 12 = 13 ms; p = 4, m = 8: 3 + 24 = 27 ms. With the step ending together this equals
    ZB-H1 at equal pass times (m (3 t) + (p - 1) t); 1F1B (B and W fused): (m + p - 1) 3 ms = 15 and 33 ms."""
    assert _step("zero_bubble_h2", 2, 4, 1, 1e-3, 1e-3, tw=1e-3) == pytest.approx(13e-3, rel=1e-12)
    assert _step("zero_bubble_h2", 4, 8, 1, 1e-3, 1e-3, tw=1e-3) == pytest.approx(27e-3, rel=1e-12)
    assert _step("zero_bubble_h1", 4, 8, 1, 1e-3, 1e-3, tw=1e-3) == pytest.approx(27e-3, rel=1e-12)
    assert _step("1f1b", 2, 4, 1, 1e-3, 2e-3) == pytest.approx(15e-3, rel=1e-12)
    acts = [[(a.kind, a.micro_batch) for a in stage_actions("zero_bubble_h2", 2, 4, r) if isinstance(a, Action)]
            for r in range(2)]
    assert acts[0] == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("W", 0), ("F", 3), ("B", 1), ("W", 1), ("B", 2),
                       ("W", 2), ("B", 3), ("W", 3)]
    assert acts[1] == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("W", 0), ("F", 3), ("B", 3),
                       ("W", 1), ("W", 2), ("W", 3)]


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 7)])
def test_zero_bubble_h2_has_no_bubble_without_the_step_end_sync(p, m):
    """The paper's claim (Table 1: bubble (p - 1)(t_F + t_B - 2 t_W) = 0 at equal pass times, the optimizer-step
    synchronisation removed): with free transfers, t_F = t_B = t_W = 1 and no all-reduce tying the ranks' step
    ends, rank r runs step j from r + 3 m j to r + 3 m (j + 1): no idle time on any rank after its first pass,
    3 steps in 9 m + p - 1. ZB-H1 under the same conditions keeps its trapezoid: every rank's step is
    3 m + p - 1 (its bubble (p - 1)(t_F + t_B - t_W) = p - 1 per step)."""
    k = 3
    for r, (starts, ends) in enumerate(_steps_without_sync("zero_bubble_h2", p, m, k, 1.0)):
        assert starts == pytest.approx([0.0] + [r + 3 * m * j for j in range(1, k)], abs=1e-12)
        assert ends == pytest.approx([r + 3 * m * (j + 1) for j in range(k)], abs=1e-12)
    for starts, ends in _steps_without_sync("zero_bubble_h1", p, m, k, 1.0):
        assert ends == pytest.approx([(3 * m + p - 1) * (j + 1) for j in range(k)], abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 6), m=st.integers(1, 14))
def test_zero_bubble_h2_grid_and_coverage(p, m):
    """Any p >= 2, m >= 1: every F, B and W once, F before B before W, one ``last`` W, sends and receives pair up,
    the run finishes. For m >= 2 p - 1 the unit-slot grid (rank r's 3 m passes back to back from slot r) is
    feasible pass by pass, so the step with unit passes is exactly 3 m + p - 1; for fewer micro-batches the
    ranks wait (the warm-up cannot hold 2 p - 1 forwards) and the step is no shorter than that."""
    sent, got, grid = [], [], {}
    for r in range(p):
        items = stage_actions("zero_bubble_h2", p, m, r)
        acts = [a for a in items if isinstance(a, Action)]
        pos = {(a.kind, a.micro_batch): n for n, a in enumerate(acts)}
        assert len(acts) == 3 * m == len(pos) and sum(a.last for a in acts) == 1 and acts[-1].last
        assert all(pos["F", i] < pos["B", i] < pos["W", i] for i in range(m))
        grid.update({(r, kind, i): r + n for (kind, i), n in pos.items()})
        for a in items:
            if isinstance(a, Comm):
                sent += a.sends
                got += a.recvs
    assert sorted(sent) == sorted(got) and len(sent) == 2 * m * (p - 1)
    step = _step("zero_bubble_h2", p, m, 1, 1.0, 1.0, tw=1.0)
    if m >= 2 * p - 1:
        for (r, kind, i), slot in grid.items():
            dep = {"F": (r - 1, "F", i), "B": (r + 1, "B", i) if r < p - 1 else (r, "F", i), "W": (r, "B", i)}[kind]
            if dep[0] >= 0:
                assert grid[dep] < slot, (r, kind, i, dep)
        assert step == pytest.approx(3 * m + p - 1, rel=1e-12)
    else:
        assert step >= 3 * m + p - 1 - 1e-9


def test_zero_bubble_h2_keeps_2p_minus_1_micro_batches_in_flight():
    """Paper Table 1: ZB-H2's peak is (2 p - 1) M_B against 1F1B's and ZB-H1's p M_B. By hand from the orders of
    test_zero_bubble_h2_step_by_hand (+1 at F, -1 at W): rank 0 F0 F1 F2 = 3, rank 1 F0 B0 F1 B1 F2 = 3 before its
    first W: 2 p - 1 = 3 on both ranks (1F1B: 2 and 1). Every rank reaches 2 p - 1 once m >= 2 p - 1 (group x
    holds F_x and W_{x - 2 (p - 1)}: x + 1 - (x - 2 p + 2) passes after its F), never more; fewer micro-batches
    hold at most m."""
    assert [_peak_in_flight("zero_bubble_h2", 2, 4, r, 1) for r in range(2)] == [3, 3]
    assert [_peak_in_flight("1f1b", 2, 4, r, 1) for r in range(2)] == [2, 1]
    assert [_peak_in_flight("zero_bubble_h2", 4, 8, r, 1) for r in range(4)] == [7] * 4
    for p in range(2, 8):
        for m in range(1, 20):
            peaks = {_peak_in_flight("zero_bubble_h2", p, m, r, 1) for r in range(p)}
            assert max(peaks) <= min(m, 2 * p - 1)
            if m >= 2 * p - 1:
                assert peaks == {2 * p - 1}


def test_zero_bubble_h2_memory_holds_what_w_needs_until_w_runs():
    """The engine's memory, p = 2, m = 4, A = 1000 B saved per forward, G = 1000 B kept by a B for its W (freed
    with A by the W). By hand from the orders above, live bytes / 1000:
      rank 0: F F F 3, B 4, W 2, F 3, B 4, W 2, B 3, W 1, B 2, W 0: peak 4 (3 A + G)
      rank 1: F 1, B 2, F 3, B 4, F 5, B 6, W 4, F 5, B 6, W 4, W 2, W 0: peak 6 (3 A + 3 G: three B passes
              ahead of their W at the tail of the parallelogram)"""
    assert _peaks("zero_bubble_h2", 2, 4, 1, 1000, 1000, 1e-3) == [4000, 6000]
