"""``side_blocks._plan``'s rounds: cutting the runs where the dropped collectives cut them (``_split``) gives the plan
that walking the compute stream again each round gives, on the TP graphs whose collectives run beside compute."""

from __future__ import annotations

import warnings
from functools import lru_cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator import load_scenario
from simulator.api import build_graph
from simulator.graph import side_blocks
from simulator.graph.blocks import coarsen
from simulator.graph.ops import Op
from tests.conftest import ROOT

_TP2 = ("scenarios/cluster/gpt_1p3b_dgx_h100_tp2_dp4.yaml", ("training.global_batch_size=128",))
GRAPHS = [
    ("scenarios/scale/gpt3_175b_tp8_pp8_dp16.yaml",
     ("model.num_layers=8", "training.global_batch_size=8", "hardware.cluster.nodes=8")),
    _TP2,
    (_TP2[0], (*_TP2[1], "parallelism.sequence_parallel=true")),
]


@lru_cache(maxsize=None)
def _coarse(path: str, over: tuple[str, ...]):
    """The scenario's first stage at layer fidelity before ``fold_overlapped_tp``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = load_scenario(ROOT / path, ["run.fidelity=layer", *over])
        return coarsen(build_graph(cfg), fold_tp=True)


def _rounds(ops) -> int:
    """How many rounds ``_plan`` takes (``_runs`` is walked once, then once more per round without ``_split``)."""
    calls = []
    real = side_blocks._runs

    def counted(*a):
        calls.append(1)
        return real(*a)

    side_blocks._runs = counted
    try:
        side_blocks._plan(ops, split=False)
    finally:
        side_blocks._runs = real
    return len(calls)


@pytest.mark.parametrize("path, over", GRAPHS)
def test_split_rounds_give_the_plan_of_walking_again(path, over):
    """Each graph drops candidates in its first round (so ``_split`` is exercised), and the plans are equal."""
    ops = _coarse(path, over).ops
    assert _rounds(ops) >= 2
    plan = side_blocks._plan(ops)
    assert plan[0] and plan == side_blocks._plan(ops, split=False)


def _unfoldable(op: Op) -> Op:
    """``op`` with a rendezvous mark: ``foldable_tp``'s metadata rule keeps it an op."""
    from simulator.graph.blocks import _renumbered

    return _renumbered(op, op.id, op.deps, {**op.meta, "rendezvous": "test"})


@settings(max_examples=25, deadline=None)
@given(k=st.integers(0, len(GRAPHS) - 1), data=st.data())
def test_split_rounds_hold_with_collectives_kept_at_random(k, data):
    """With any TP collectives beside compute made unfoldable (which cuts their runs and cascades over the stream
    neighbours' rules), splitting the runs each round still gives the plan of walking the stream again."""
    ops = list(_coarse(*GRAPHS[k]).ops)
    tp = [op.id for op in ops if op.stream.startswith("comm.tp")]
    keep = data.draw(st.sets(st.sampled_from(tp), max_size=max(1, len(tp) // 4)))
    for i in keep:
        ops[i] = _unfoldable(ops[i])
    assert side_blocks._plan(ops) == side_blocks._plan(ops, split=False)


@pytest.mark.parametrize("path, over", GRAPHS)
def test_coarsen_folded_is_fold_after_coarsen(path, over):
    """``coarsen_folded`` (one renumbering of the ops both passes leave) gives ``fold_overlapped_tp(coarsen(...))``
    op for op, with the same ``meta["fidelity"]`` and the folded collectives' ids, on the block-stamped graph the
    layer-fidelity build makes and on the kernel-level one."""
    from simulator.api import transformer_spec
    from simulator.graph.builders.transformer import build_gpt_step
    from tests.simulator.graph.test_stamp_blocks import _assert_same

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = load_scenario(ROOT / path, ["run.fidelity=layer", *over])
    spec = transformer_spec(cfg, 0)
    for g in (build_gpt_step(spec, blocks=True, fold_tp=True), build_gpt_step(spec)):
        ref, new = side_blocks.fold_overlapped_tp(coarsen(g, True, comm_ids=False)), side_blocks.coarsen_folded(g)
        _assert_same(new, ref)
        assert new.meta == ref.meta and len(new.ops) < len(g.ops)
        assert [c.id for op in new.ops for c in op.folded_comm] == [c.id for op in ref.ops for c in op.folded_comm]
