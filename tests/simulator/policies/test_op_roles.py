"""Policies find the builder's ops by their typed role (``OpRole``), not by name: the same rewrite on a graph
whose ops are renamed."""

from __future__ import annotations

import dataclasses

from simulator.api import transformer_spec
from simulator.config.loader import scenario_from_dict
from simulator.graph.builders.transformer import build_gpt_step
from simulator.graph.ops import OpRole
from simulator.policies.dataloader import insert_dataloader_ops
from simulator.policies.offload_optimizer import gradients
from simulator.policies.recompute import offload_activations

CFG = {"name": "roles", "hardware": {"gpu": "h200-sxm-141gb"},
       "model": {"num_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 128, "vocab_size": 512},
       "training": {"micro_batch_size": 2, "global_batch_size": 4, "precision": "bf16",
                    "recompute_granularity": "full"}}


def _graph():
    spec = transformer_spec(scenario_from_dict(CFG))
    return spec, build_gpt_step(spec)


def _renamed(g):
    return g.with_changes(ops=tuple(dataclasses.replace(op, name=f"op{op.id}") for op in g.ops))


def test_builder_gives_the_roles_the_policies_use():
    _, g = _graph()
    by = {r: [op.name for op in g.ops if op.role is r] for r in OpRole}
    assert by[OpRole.INPUT_COPY] == ["fwd.input.h2d", "fwd.input.h2d"]  # two micro-batches
    assert all(n.endswith(".wgrad") for n in by[OpRole.WEIGHT_GRAD]) and len(by[OpRole.WEIGHT_GRAD]) >= 2 * 2 * 4
    assert all(n.endswith("grad_accum") for n in by[OpRole.GRAD_ACCUM])
    fwd = [op.name for op in g.ops if op.role is OpRole.BLOCK_INPUT_NORM and op.phase.value == "fwd"]
    assert fwd == ["L0.fwd.ln1", "L1.fwd.ln1"] * 2  # (recomputed forwards in backward carry it too)


def test_policies_rewrite_a_renamed_graph_the_same_way():
    spec, g = _graph()
    r = _renamed(g)
    a, b = insert_dataloader_ops(g, True, None), insert_dataloader_ops(r, True, None)
    assert len(a.ops) == len(b.ops) == len(g.ops) + 2
    assert [op.kind for op in a.ops] == [op.kind for op in b.ops]
    a, b = offload_activations(g), offload_activations(r)
    assert len(a.ops) > len(g.ops) and [op.kind for op in a.ops] == [op.kind for op in b.ops]
    # the gradients ZeRO-Offload copies: found by param group and role, the same on the renamed graph
    assert sum(x["bytes"] for x in gradients(g)) == 2 * spec.num_parameters
    assert gradients(r) == gradients(g)
