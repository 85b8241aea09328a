"""Block stamps (``simulator.graph.builders.stamp_blocks``): the layer-fidelity graph made from a graph whose
repeated layer passes were stamped as their blocks equals, op for op, the one ``coarsen`` makes of the kernel-level
graph (ids, names, layers, costs, dependencies, tensors and their sizes, each block's kernels and folded TP
collectives), on the tiny pipeline cases of the stamping tests and on every stage of the bundled GPT-3 175B scale
scenario; where a condition of ``stamp_blocks.check`` fails the builder makes the kernel-level graph instead."""

from __future__ import annotations

import pytest

from simulator.graph.blocks import coarsen
from simulator.graph.builders import stamp_blocks as sb
from simulator.graph.builders.stamp_blocks import SCRATCH
from simulator.graph.builders.transformer import TransformerSpec, _GptBuilder, build_gpt_step
from simulator.graph.ops import Op, OpKind
from simulator.graph.side_blocks import fold_overlapped_tp
from tests.conftest import ROOT
from tests.simulator.graph.test_stamp import CASES, PIPELINE, TINY

#: the stamping cases, and Megatron's asynchronous column-parallel backward under sequence parallelism (the saved
#: LayerNorm output shards, gathered again on comm.tp in backward, end the forward's blocks)
CASES = {**CASES, "pp2_tp2_sp_async": {**PIPELINE, "tp_async_grad_reduce": True},
         "tp2_sp_async_no_recompute": dict(tensor_parallel_size=2, sequence_parallel=True, tp_async_grad_reduce=True)}

_PART = ("kind", "stream", "phase", "layer", "cost_class", "flops", "bytes_read", "bytes_written", "shape", "dtype",
         "role", "launch", "pinned", "host_s", "fixed_duration_s")


#: what prices a block's kernels (``RooflineCostModel.fused_s``, ``System.block_tail_s``): not their layer or
#: name (a stamped block holds the kernels of the first pass of its shape)
_PRICED = tuple(f for f in _PART if f != "layer")


def _scratch(name: str) -> bool:
    return name.startswith((SCRATCH, "activations.block_scratch#", "activations.block_scratch.tp#"))


def _op_view(op) -> tuple:
    """What the engine reads of an op, less the per-graph names of block scratch tensors and of a block's parts."""
    meta = dict(op.meta)
    parts = meta.pop("fused", ())
    return (op.id, op.name, op.deps, *(getattr(op, f) for f in _PART),
            tuple((None if _scratch(a.name) else a.name, a.nbytes, a.device) for a in op.allocs), op.uses,
            tuple((c.id, c.name, c.stream, c.meta) for c in op.folded_comm),
            tuple(tuple(getattr(p, f) for f in _PRICED) for p in parts), meta)


def _assert_same(new, ref) -> None:
    assert len(new.ops) == len(ref.ops)
    for x, y in zip(new.ops, ref.ops):
        assert _op_view(x) == _op_view(y), (x.name, y.name)
    assert new.persistent == ref.persistent and new.param_groups == ref.param_groups


def assert_same_layer_graph(spec: TransformerSpec, fold_tp: bool, prefold: bool | None = None) -> dict:
    """Layer-fidelity graphs of ``spec`` made both ways are equal (``coarsen``, then with ``fold_tp`` the side TP
    fold, as ``LayerFidelity`` makes them; without the pre-folded stamps ``coarsen`` alone too); returns the block
    build's ``meta["layer_blocks"]``."""
    kernels = build_gpt_step(spec)
    built = build_gpt_step(spec, blocks=True, fold_tp=fold_tp, prefold=prefold)
    if prefold is False or not fold_tp:
        _assert_same(coarsen(built, fold_tp), coarsen(kernels, fold_tp))
    if fold_tp:
        _assert_same(fold_overlapped_tp(coarsen(built, True)), fold_overlapped_tp(coarsen(kernels, True)))
    return built.meta["layer_blocks"]


@pytest.mark.parametrize("fold_tp, prefold", [(True, True), (True, False), (False, None)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_block_stamps_give_the_coarsened_graph(case, fold_tp, prefold):
    kw = {**TINY, **CASES[case]}
    for rank in range(kw.get("pipeline_parallel_size", 1)):
        info = assert_same_layer_graph(TransformerSpec(**kw, pipeline_rank=rank), fold_tp, prefold)
        if "async" in case:  # the fast path is taken
            assert info["kernel_build"] is None and info["stamped"] > 0, info


@pytest.mark.parametrize("stage", [0, 3, 7])
def test_gpt3_175b_stages_stamped_as_blocks(stage):
    """The scale scenario's first and last stages (embedding, head): the fast path is taken for ~2,000 passes and
    gives the same layer-fidelity graph."""
    from simulator import load_scenario
    from simulator.api import transformer_spec

    cfg = load_scenario(ROOT / "scenarios/scale/gpt3_175b_tp8_pp8_dp16.yaml", ["run.fidelity=layer"])
    info = assert_same_layer_graph(transformer_spec(cfg, stage), True)
    assert info["kernel_build"] is None and info["stamped"] > 2000


def test_check_refuses_a_wait_inside_a_block_and_the_builder_falls_back(monkeypatch):
    """An op on another stream using a tensor made by a kernel inside a stamped block (not its last) would end that
    block at kernel level: ``check`` names it; and the fallback cases give the kernel-level graph (full recompute:
    the recompute pass's input is read after it), where the block stamps alone would not."""
    spec = TransformerSpec(**{**TINY, **CASES["pp2_tp2_sp_selective_dp2"]}, pipeline_rank=0)
    b = _GptBuilder(spec, True, True, True)
    g = b.build()
    inst = b.stamper.instances
    assert inst and sb.check(g.ops, inst) is None
    i = next(i for i in inst if i.bt.mid)
    tensor = i.table[i.bt.mid[0]]
    extra = Op(id=len(g.ops), name="probe", kind=OpKind.MEMCPY_D2H, stream="d2h", uses=(tensor,))
    assert sb.check((*g.ops, extra), inst) == "op probe on stream d2h uses a tensor made inside a stamped block"
    full = TransformerSpec(**{**TINY, **CASES["pp2_full_recompute"]}, pipeline_rank=0)
    info = assert_same_layer_graph(full, True)
    assert (info["stamped"], info["kernel_build"]) == (0, "an input of a stamped pass of layer 1 is used after it")
    monkeypatch.setattr(sb, "check", lambda ops, inst: None)
    with pytest.raises(AssertionError):
        assert_same_layer_graph(full, True)


def test_layer_fidelity_run_builds_blocks_only_where_no_policy_reads_kernels():
    """``build_graph`` with the machine at layer fidelity stamps blocks; with a dataloader (a policy rewriting the
    kernel-level graph) or at kernel fidelity it does not."""
    from simulator import load_scenario
    from simulator.api import build_graph
    from simulator.config.loader import resolve_hardware

    path = ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_tp2_dp4.yaml"
    for sets, blocks in ((["run.fidelity=layer"], True), ([], False)):
        cfg = load_scenario(path, sets)
        g = build_graph(cfg, 0, resolve_hardware(cfg))
        assert ("layer_blocks" in g.meta) is blocks
    cfg = load_scenario(ROOT / "scenarios/h200/dataloader_w2.yaml", ["run.fidelity=layer"])
    assert "layer_blocks" not in build_graph(cfg, 0, resolve_hardware(cfg)).meta


def test_check_refuses_a_block_end_nothing_on_another_stream_waits_for():
    """Check 5: a block a template ends at a tensor the builder said another stream waits for (the saved LayerNorm
    shard the asynchronous backward gathers again) must be waited for so in the graph, by an op no TP fold can
    take: with that all-gather's dependency on it dropped, ``check`` names the pass."""
    from dataclasses import replace

    spec = TransformerSpec(**{**TINY, **CASES["tp2_sp_async_no_recompute"]}, pipeline_rank=0)
    b = _GptBuilder(spec, True, True, True)
    g = b.build()
    inst = b.stamper.instances
    assert sb.check(g.ops, inst) is None
    i = next(i for i in inst if i.bt.waited)
    p = i.start + i.bt.waited[0][1]
    ops = [replace(op, deps=tuple(d for d in op.deps if d != p)) if op.stream != "compute" else op for op in g.ops]
    assert sb.check(ops, inst) == f"a block of a stamped pass of layer {i.layer} ends where no other stream waits for it"
    # the all-gather made to wait for the compute op right before the first one waiting for it: foldable for all
    # the check knows, so it may not end the block either
    u = next(op for op in g.ops if op.id >= i.end and op.stream != "compute" and p in op.deps)
    b0 = min(op.id for op in g.ops if u.id in op.deps)
    a = max(op.id for op in g.ops[:b0] if op.stream == "compute")
    ops = [replace(op, deps=(p, a)) if op is u else op for op in g.ops]
    assert sb.check(ops, inst) == f"a block of a stamped pass of layer {i.layer} ends where no other stream waits for it"


def test_prefolded_stamps_carry_the_side_collectives_and_give_the_folded_graph():
    """With the TP collectives beside compute folded into the block templates (``BlockTemplate.prefold``), the
    asynchronous backward's passes are stamped with no TP op left, and ``fold_overlapped_tp(coarsen(...))`` of the
    graph is the one made from the kernel-level graph."""
    spec = TransformerSpec(**{**TINY, **CASES["tp2_sp_async_no_recompute"]}, pipeline_rank=0)
    plain = build_gpt_step(spec, blocks=True, fold_tp=True, prefold=False)
    info = assert_same_layer_graph(spec, True, True)
    assert info["kernel_build"] is None and info["prefold"] is None and info["stamped"] > 0
    folded = build_gpt_step(spec, blocks=True, fold_tp=True)
    tp = [sum(op.stream.startswith("comm.tp") for op in g.ops) for g in (folded, plain)]
    assert tp[0] < tp[1], tp


def test_check_6_refuses_a_stream_neighbour_a_prefolded_pass_cannot_stand_for(monkeypatch):
    """Check 6: the TP op after a pass stamped with its TP collectives folded must wait for a kernel from the pass's
    last block on (else ``fold_overlapped_tp`` might keep the pass's last collective apart), and the compute op
    after it must be of another layer or phase; the builder then stamps the graph again unfolded."""
    from dataclasses import replace

    spec = TransformerSpec(**{**TINY, **CASES["tp2_sp_async_no_recompute"]}, pipeline_rank=0)
    b = _GptBuilder(spec, True, True, True, True)
    g = b.build()
    inst = b.stamper.instances
    assert sb.check(g.ops, inst) is None
    i = next(i for i in inst if i.bt.prefold and any(op.id >= i.end and op.stream.startswith("comm.tp")
                                                     for op in g.ops))
    x = next(op for op in g.ops if op.id >= i.end and op.stream == i.bt.edges[0][0])
    early = max(op.id for op in g.ops[:i.start] if op.stream == "compute")
    ops = [replace(op, deps=(early,)) if op is x else op for op in g.ops]
    assert sb.check(ops, inst) == f"a TP op after a folded pass of layer {i.layer} does not wait for a kernel after it"
    nxt = next(op for op in g.ops[i.end:] if op.stream == "compute")
    last = g.ops[i.end - 1]
    ops = [replace(op, layer=last.layer, phase=last.phase) if op is nxt else op for op in g.ops]
    assert sb.check(ops, inst) == \
        f"a pass of layer {i.layer} stamped with its TP collectives folded has a neighbour of its phase"
    # the builder's fallback where check 6 fails: the graph without pre-folded stamps, checks 1-5 passing
    sb_check = sb.check
    monkeypatch.setattr(sb, "check", lambda ops, inst: "probe" if any(j.bt.prefold for j in inst) else sb_check(ops, inst))
    info = build_gpt_step(spec, blocks=True, fold_tp=True).meta["layer_blocks"]
    assert info["prefold"] == "probe" and info["kernel_build"] is None and info["stamped"] > 0


@pytest.mark.parametrize("case", ["pp2_tp2_sp_async", "tp2_sp_async_no_recompute"])
def test_forwards_folded_across_the_saved_shard_give_the_folded_graph(case):
    """``build_gpt_step(waits_fold=True)``: once a layer's backward of a micro-batch class was stamped with its TP
    collectives folded (its re-gather of the saved shard too), later forwards of that layer are stamped folded
    across the shard's producer; ``fold_overlapped_tp(coarsen(...))`` of the graph is the kernel-level one's, with
    fewer ops than stamping those forwards unfolded."""
    kw = {**TINY, **CASES[case], "num_micro_batches": 8}
    for rank in range(kw.get("pipeline_parallel_size", 1)):
        spec = TransformerSpec(**kw, pipeline_rank=rank)
        info = assert_same_layer_graph(spec, True, True)
        assert info["kernel_build"] is None and info["prefold"] is None and info["waits_fold"] is None, info
        if case != "tp2_sp_async_no_recompute":  # the pipeline's tiny backwards are not stamped folded
            continue
        b = _GptBuilder(spec, True, True, True, True, True)
        b.build()
        assert sum(i.bt.waits_folded for i in b.stamper.instances) > 0
        plain = build_gpt_step(spec, blocks=True, fold_tp=True, waits_fold=False)
        assert len(build_gpt_step(spec, blocks=True, fold_tp=True).ops) < len(plain.ops)


def test_a_wrong_waits_fold_word_is_refused_and_the_builder_falls_back(monkeypatch):
    """Every forward stamped folded across its saved shard, also where the backward's re-gather is left as an op
    (the first and last micro-batches): the check refuses it (check 1: the re-gather uses a tensor made inside the
    folded block) and the graph is built again without, the same graph (the patch forcing the word in the rebuild
    too, that ends at the build without prefolding)."""
    from simulator.graph.builders.stamp import Stamper

    run = Stamper.run

    def eager(self, key, layer, fn, inputs, waits_fold=False):
        return run(self, key, layer, fn, inputs, waits_fold or key[0][0] == "fwd")

    monkeypatch.setattr(Stamper, "run", eager)
    spec = TransformerSpec(**{**TINY, **CASES["tp2_sp_async_no_recompute"]}, pipeline_rank=0)
    info = assert_same_layer_graph(spec, True, True)
    assert info["waits_fold"] is not None and "inside a stamped block" in info["waits_fold"], info


def test_passes_beside_the_pipeline_send_recv_are_stamped_folded_with_the_cut_collective_left():
    """Check 6 with a TP op that no graph folds left in the template (``stamp_blocks._cut_off``): stage 0's last
    layer backward, whose sequence-parallel gather of the received gradient waits for the pipeline receive, and
    stage 1's first layer forward, whose residual add (waiting for the received activation) starts a block after
    the attention's reduce-scatter, are stamped with their other TP collectives folded, that one left as an op;
    stage 0's last forward then is folded across its saved shard too (the backward's re-gather is folded), the
    warm-up forwards on the builder's guess for a backward class not yet built (``_GptBuilder._block_fwd``). The
    same layer graph op for op, from 568 / 394 ops instead of 676 / 422 (the 6 backwards and 6 of the 8 forwards
    of each edge layer: the first and last micro-batches' re-gathers stay ops)."""
    from collections import Counter

    kw = {**TINY, **CASES["pp2_tp2_sp_async"], "num_micro_batches": 8}
    want = {0: ({(1, "bwd", ("bwd.tp.fc2.grad.all_gather",)): 6, (1, "fwd", ()): 6}, 568),
            1: ({(2, "bwd", ()): 6, (3, "bwd", ()): 6, (2, "fwd", ("fwd.tp.proj.reduce_scatter",)): 6,
                 (3, "fwd", ()): 6}, 394)}
    for rank, (folded, n_ops) in want.items():
        spec = TransformerSpec(**kw, pipeline_rank=rank)
        info = assert_same_layer_graph(spec, True, True)
        assert info["kernel_build"] is None and info["prefold"] is None and info["waits_fold"] is None, info
        b = _GptBuilder(spec, True, True, True, True, True)
        g = b.build()
        assert sb.check(g.ops, b.stamper.instances) is None and len(g.ops) == n_ops
        left = Counter((i.layer, i.phase.value, tuple(op.name.split(".", 1)[1] for op in g.ops[i.start:i.end]
                                                      if op.stream != "compute"))
                       for i in b.stamper.instances if i.bt.prefold)
        assert left == folded
