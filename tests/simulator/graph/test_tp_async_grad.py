"""Megatron-LM's asynchronous column-parallel backward (``tp_async_grad_reduce``; schema
``parallelism.async_tensor_model_parallel_allreduce``): where the input-gradient reduction and, with sequence
parallelism, the re-gather of the saved input shard sit in the graph (NVIDIA/Megatron-LM @02bb1f5
``megatron/mpu/layers.py``: ``ColumnParallelLinearWithAsyncAllreduce``,
``ColumnParallelLinearWithSequenceParallelism``), and what they hide on a toy machine."""

from __future__ import annotations

from collections import Counter

import pytest

from simulator.api import simulate_graph
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from tests.simulator.graph.test_tensor_parallel import BSH2, TINY, _priced, _toy_hw


def _g(**kw):
    return build_gpt_step(TransformerSpec(**{**TINY, "tensor_parallel_size": 2, **kw}))


def _op(g, name):
    return next(o for o in g.ops if o.name == name)


def _per_layer(g, layer):
    return Counter((o.meta["collective"], o.meta["bytes"]) for o in g.ops if o.stream == "comm.tp" and o.layer == layer)


@pytest.mark.parametrize("lin", ["qkv", "fc1"])
def test_all_reduce_starts_after_dgrad_and_is_waited_for_after_the_bias_grad(lin):
    g = _g(tp_async_grad_reduce=True)
    ar, dgrad = _op(g, f"L0.bwd.tp.{lin}.grad.all_reduce"), _op(g, f"L0.bwd.{lin}.dgrad")
    wgrad, bias, acc = (_op(g, f"L0.bwd.{lin}.{k}") for k in ("wgrad", "bias_grad", "grad_accum"))
    assert set(ar.deps) == {dgrad.id}
    assert ar.id not in wgrad.deps and ar.id not in bias.deps and ar.id in acc.deps
    # the same 4 all-reduces of b s h per layer as the blocking backward
    assert _per_layer(g, 0) == _per_layer(_g(), 0) == {("all_reduce", BSH2): 4}
    # the blocking one starts after the layer's whole weight-gradient work (its grad_accum)
    blk = _g()
    deps = set(_op(blk, f"L0.bwd.tp.{lin}.grad.all_reduce").deps)
    assert deps == {_op(blk, f"L0.bwd.{lin}.dgrad").id, _op(blk, f"L0.bwd.{lin}.grad_accum").id}


def test_lm_head_input_gradient_all_reduce_runs_beside_its_weight_gradient():
    g = _g(tp_async_grad_reduce=True)
    ar = _op(g, "bwd.tp.lm_head.grad.all_reduce")
    assert set(ar.deps) == {_op(g, "bwd.wte.dgrad").id} and ar.id not in _op(g, "bwd.wte.wgrad").deps


def test_sequence_parallel_regathers_the_saved_shard_beside_dgrad_and_reduce_scatters_beside_wgrad():
    g = _g(sequence_parallel=True, tp_async_grad_reduce=True)
    # per layer: forward AG, RS, AG, RS; backward AG (fc2, proj grads), AG (qkv, fc1 inputs again), RS (qkv, fc1)
    assert _per_layer(g, 0) == {("all_gather", BSH2): 6, ("reduce_scatter", BSH2): 4}
    assert _per_layer(_g(sequence_parallel=True), 0) == {("all_gather", BSH2): 4, ("reduce_scatter", BSH2): 4}
    for lin, norm in (("qkv", "ln1"), ("fc1", "ln2")):
        ag, rs = _op(g, f"L0.bwd.tp.{lin}.input.all_gather"), _op(g, f"L0.bwd.tp.{lin}.grad.reduce_scatter")
        dgrad, wgrad, acc = (_op(g, f"L0.bwd.{lin}.{k}") for k in ("dgrad", "wgrad", "grad_accum"))
        assert ag.id not in dgrad.deps and ag.id in wgrad.deps  # only the weight gradient reads the gathered input
        assert set(rs.deps) == {dgrad.id} and rs.id not in wgrad.deps and rs.id in acc.deps
        # what it gathers is the forward LayerNorm's b s h / t output, saved in place of the gathered input
        fwd_norm = _op(g, f"L0.fwd.{norm}")
        shard = fwd_norm.allocs[0]
        assert shard.nbytes == BSH2 // 2 and ag.uses == (shard.name,) and fwd_norm.id in ag.deps
        assert shard.name in wgrad.uses or ag.allocs[0].name in wgrad.uses


@pytest.mark.parametrize("sp", [False, True])
def test_toy_machine_hides_only_communication(sp):
    # no interference on the toy machine: the compute is the same, so the step falls by exactly the exposed time
    # it no longer waits (the collectives still take their priced time)
    hw = _toy_hw(2)
    blk = simulate_graph(_g(sequence_parallel=sp, precision="bf16"), hw, steps=1).summary
    ga = _g(sequence_parallel=sp, precision="bf16", tp_async_grad_reduce=True)
    asy = simulate_graph(ga, _toy_hw(2), steps=1).summary
    assert asy["comm_s_by_group"] == {"tp": pytest.approx(_priced(ga), rel=1e-9)}
    assert asy["exposed_comm_s"] < _priced(ga)
    if not sp:  # the same collectives: the step is shorter by the hidden communication
        assert blk["step_time_s"] - asy["step_time_s"] == pytest.approx(
            blk["exposed_comm_s"] - asy["exposed_comm_s"], rel=1e-6)
