"""The step time and the step latency of a pipeline (``analysis.pipeline.combined_steps``), worked out by hand on
fixed-time stage graphs with free send/recv, with and without the gradient-norm rendezvous before the optimizer,
and a hypothesis invariant: the latency exceeds the step time exactly by how much of step ``i + 1`` runs before
step ``i`` ends on the last rank, which with the rendezvous is the optimizer-time difference after it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.analysis.pipeline import combined_steps, first_op_s, step_end_spread_s
from simulator.analysis.summary import step_period_s
from simulator.engine.run import run_ranks
from simulator.graph.builders.pipeline import Comm, stage_actions, transfer_stream
from simulator.graph.op_graph import GraphBuilder
from simulator.graph.ops import OpKind
from tests.conftest import make_hw

MS = 1e-3


def _stage(schedule: str, p: int, m: int, r: int, tf: float, tb: float, t_opt: float, sync: bool,
           t_input: float | None):
    """Rank ``r``: an input copy of ``t_input`` s on stream ``h2d`` first, launched when the rank's loop starts the
    step (free launches; None: none; the first forward waits for it), its passes as fixed-time kernels, its calls as free blocking send/recv rendezvous (as
    ``test_pipeline_schedules``), then with ``sync`` the gradient-norm all-reduce (a free rendezvous of all ``p``
    ranks after the last kernel and call), the optimizer (``t_opt`` s) and the step's host synchronisation."""
    b = GraphBuilder()
    last, prev, wait = -1, [], []
    if t_input is not None:
        wait = [b.add("input", OpKind.COMPUTE, "h2d", fixed_duration_s=t_input)]  # launched by the step's loop
    for a in stage_actions(schedule, p, m, r, 1):
        if isinstance(a, Comm):
            ops = []
            for sending, moves in ((True, a.sends), (False, a.recvs)):
                for d, k, i in moves:
                    ops.append(b.add(f"{d}.{k}.{i}", OpKind.COLLECTIVE, transfer_stream(schedule, p, (d, k, i), sending),
                                     deps=[last, *prev], fixed_duration_s=0.0, launch=False,
                                     meta={"rendezvous": ("pp", d, k, i), "parties": 2}))
            prev = ops
            wait = [*wait, *ops] if a.blocking else wait
            continue
        last = b.add(f"{a.kind}{a.micro_batch}", OpKind.COMPUTE, "compute", deps=wait,
                     fixed_duration_s={"F": tf, "B": tb}[a.kind], launch=False)
        wait = []
    deps = [last, *prev]
    if sync:
        deps = [b.add("pp.grad_norm.all_reduce", OpKind.COLLECTIVE, "comm.pp", deps=deps, fixed_duration_s=0.0,
                      launch=False, meta={"rendezvous": ("pp", "grad_norm"), "parties": p})]
    opt = b.add("adamw", OpKind.COMPUTE, "compute", deps=deps, fixed_duration_s=t_opt, launch=False)
    b.add("step.synchronize", OpKind.SYNC, "host", deps=[opt], launch=False)
    return b.build()


def _run(p, m, tf, tb, t_opt, sync, inputs, schedule="1f1b", steps=2):
    """``(step_time_s, step_latency_s, spread_s, old_latency_s)`` of ``steps`` steps, the first one warm-up;
    ``t_opt`` and ``inputs`` per rank; ``old_latency_s``: with each rank's loop start as its step start."""
    graphs = [_stage(schedule, p, m, r, tf, tb, t_opt[r], sync, inputs[r]) for r in range(p)]
    runs = run_ranks(graphs, [make_hw()] * p, steps=steps)
    parts = [rec.steps.assign(warmup=rec.steps.step < 1) for rec, _ in runs]
    firsts = [first_op_s(rec.spans, steps) for rec, _ in runs]
    period, latency = step_period_s(combined_steps(parts, firsts))
    return period, latency, step_end_spread_s(parts), step_period_s(combined_steps(parts))[1]


# p = 2, m = 2, 1F1B, t_f = 1 ms, t_b = 2 ms: step 0 runs S0 F0 [0,1] F1 [1,2] B0 [4,6] B1 [7,9] and S1 F0 [1,2]
# B0 [2,4] F1 [4,5] B1 [5,7]; (m + p - 1)(t_f + t_b) = 9 ms of passes. Only stage 0 has an input copy (0 s).

def test_sync_equal_optimizers_latency_is_the_step_time():
    # rendezvous at 9 (S1 waits there from 7); both optimizers 1 ms: both end at 10, step 1 repeats at 10..20
    period, latency, spread, _ = _run(2, 2, 1 * MS, 2 * MS, [1 * MS, 1 * MS], True, [0.0, None])
    assert period == pytest.approx(10 * MS, abs=1e-12) and latency == pytest.approx(10 * MS, abs=1e-12)
    assert spread == pytest.approx(0.0, abs=1e-12)


def test_sync_longer_last_optimizer_overlaps_the_next_step():
    # rendezvous at 9; S0's optimizer [9,10], S1's [9,13]: step 0 ends at 13, but S0 starts step 1 at 10: F0
    # [10,11] F1 [11,12]; S1 F0 [13,14] B0 [14,16] F1 [16,17] B1 [17,19]; S0 B0 [16,18] B1 [19,21];
    # rendezvous 21, S1's optimizer ends 25. Period 25 - 13 = 12 ms; latency 25 - 10 = 15 ms: 3 ms overlap,
    # the optimizer difference; the stages' ends lie 13 - 10 = 3 ms apart
    period, latency, spread, _ = _run(2, 2, 1 * MS, 2 * MS, [1 * MS, 4 * MS], True, [0.0, None])
    assert period == pytest.approx(12 * MS, abs=1e-12) and latency == pytest.approx(15 * MS, abs=1e-12)
    assert spread == pytest.approx(3 * MS, abs=1e-12)


def test_no_sync_a_waiting_stage_does_not_start_the_step():
    # no rendezvous, 1 ms optimizers: S1 ends step 0 at 7 + 1 = 8, S0 at 9 + 1 = 10; S1's loop starts step 1 at 8
    # but its first op is the receive of S0's F0 (at 11): step 1 starts at 10 (S0's input), ends at 20 -> period
    # = latency = 10 ms. Counting S1's loop start (8) the latency read 12 ms: the old false overlap
    period, latency, spread, old = _run(2, 2, 1 * MS, 2 * MS, [1 * MS, 1 * MS], False, [0.0, None])
    assert period == pytest.approx(10 * MS, abs=1e-12) and latency == pytest.approx(10 * MS, abs=1e-12)
    assert spread == pytest.approx(2 * MS, abs=1e-12) and old == pytest.approx(12 * MS, abs=1e-12)


def test_no_sync_early_input_on_the_last_stage_is_overlap():
    # as above, but S1 loads its labels (a 0.5 ms copy) as soon as its step starts: at 8, 2 ms before step 0's
    # end -> latency 20 - 8 = 12 ms, the step time stays 10 ms
    period, latency, _, _ = _run(2, 2, 1 * MS, 2 * MS, [1 * MS, 1 * MS], False, [0.0, 0.5 * MS])
    assert period == pytest.approx(10 * MS, abs=1e-12) and latency == pytest.approx(12 * MS, abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 4), m=st.integers(1, 6), schedule=st.sampled_from(["gpipe", "1f1b"]),
       tf=st.integers(1, 4), tb=st.integers(1, 8), t_opt=st.lists(st.integers(1, 6), min_size=4, max_size=4),
       last_input=st.booleans())
def test_with_the_sync_latency_exceeds_the_step_time_by_the_optimizer_difference(p, m, schedule, tf, tb, t_opt,
                                                                                 last_input):
    # every rank meets at the rendezvous, then runs its own optimizer t_o,r: step i ends at sync + max t_o, and
    # step i + 1's first op is the input copy of a rank with one (stage 0; the last stage too with last_input) at
    # sync + its t_o. So latency - step time = max(0, max_r t_o,r - min over those ranks of t_o,r), and 0 when the
    # optimizers take the same time: the rendezvous then makes the step end together
    t_opt = [t * MS for t in t_opt[:p]]
    inputs = [0.0] + [None] * (p - 2) + [0.0 if last_input else None]
    period, latency, spread, _ = _run(p, m, tf * MS, tb * MS, t_opt, True, inputs, schedule, steps=3)
    starters = [t_opt[0]] + ([t_opt[-1]] if last_input else [])
    assert latency - period == pytest.approx(max(0.0, max(t_opt) - min(starters)), abs=1e-12)
    assert spread == pytest.approx(max(t_opt) - min(t_opt), abs=1e-12)
    same, lat_same, _, _ = _run(p, m, tf * MS, tb * MS, [t_opt[0]] * p, True, inputs, schedule, steps=3)
    assert lat_same == pytest.approx(same, abs=1e-12)
