"""Pipeline schedules run on the engine with fixed pass times and free send/recv: the step times of
Narayanan et al. (SC21, section 2.2) exactly, and no deadlock for any (p, m, v)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.engine.run import SimulationError, run_ranks
from simulator.graph.builders.pipeline import Action, Comm, stage_actions
from simulator.graph.op_graph import GraphBuilder
from simulator.graph.ops import OpKind
from tests.conftest import make_hw


def _stage_graph(schedule: str, p: int, m: int, r: int, v: int, tf: float, tb: float, stall: float = 0.0,
                 tw: float = 0.0):
    """Rank ``r``'s passes as fixed-time kernels (``tf`` forward, ``tb`` backward, ``tw`` weight-gradient pass per
    chunk) and its calls as free send/recv rendezvous, with the builder's rule: a call's ops are posted after
    the previous kernel and the previous call; the next kernel waits for them (blocking, as Megatron-LM's p2p
    calls) unless the call is an asynchronous send (``Comm.blocking`` false)."""
    b = GraphBuilder()
    last, prev, wait = -1, [], []
    for a in stage_actions(schedule, p, m, r, v):
        if isinstance(a, Comm):
            ops = []
            for sending, moves in ((True, a.sends), (False, a.recvs)):
                for d, k, i in moves:
                    stream = "comm.pp." + {("act", True): "send_next", ("act", False): "recv_prev",
                                           ("grad", True): "send_prev", ("grad", False): "recv_next"}[d, sending]
                    ops.append(b.add(f"{d}.{k}.{i}", OpKind.COLLECTIVE, stream, deps=[last, *prev],
                                     fixed_duration_s=0.0, launch=False,
                                     meta={"rendezvous": ("pp", d, k, i), "parties": 2}))
            prev = ops
            wait = ops if a.blocking else []
            continue
        t = {"F": tf, "B": tb, "W": tw}[a.kind] * (1 + stall)
        last = b.add(f"{a.kind}{a.chunk}.{a.micro_batch}", OpKind.COMPUTE, "compute", deps=wait,
                     fixed_duration_s=t, launch=False)
        wait = []
    b.add("end", OpKind.SYNC, "host", deps=[last, *prev], launch=False)
    return b.build()


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
