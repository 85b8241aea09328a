"""Policies read the builder's typed facts (``OpGraph.model``, ``param_groups``, op roles), never the builder's
spec through ``graph.meta["spec"]``; the results are those main gave when they did."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from simulator import load_scenario, run_scenario
from simulator.api import build_graph
from simulator.config.loader import resolve_hardware
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.policies.offload_optimizer import gradients, offload_optimizer
from simulator.policies.offload_param import offload_param
from simulator.policies.recompute import recompute
from simulator.policies.registry import PolicyError
from tests.conftest import ROOT

OVERLAP = "scenarios/h200/gpt_184m_b16_offload_overlap.yaml"
#: step_time_s and peak_memory_bytes of main (9baa257), when the policies still read ``meta["spec"]`` (the
#: checkpoint buffers ``reused``: main had no first-touch faults); peak memory since with the norms' statistics and the
#: flash log-sum-exp kept until their backward (+131,072 B on the checkpointed case, +15.86 MB on the others)
MAIN = {
    "scenarios/h200/gpt_184m_b16_ckpt.yaml|activation_checkpointing.cpu_checkpointing=true;"
    "activation_checkpointing.host_buffers=reused":
        (0.22568488297723155, 8839733248),
    f"{OVERLAP}|zero_optimization.stage=3;zero_optimization.offload_param.device=cpu": (0.41540904470483403, 13490380800),
    f"{OVERLAP}|zero_optimization.reduce_bucket_size=20000000": (0.3893397384481239, 13742305280),
    "scenarios/h200/gpt_184m_b16_offload_serial.yaml": (0.3969934549507899, 13742305280),
}


class _NoSpec(dict):
    """Graph meta that fails the test when a policy looks for the builder's spec."""

    def __getitem__(self, k):
        assert k != "spec", "a policy read graph.meta['spec']"
        return super().__getitem__(k)

    def get(self, k, default=None):
        assert k != "spec", "a policy read graph.meta['spec']"
        return super().get(k, default)

    def __contains__(self, k):
        assert k != "spec", "a policy read graph.meta['spec']"
        return super().__contains__(k)


def _cfg(case: str):
    path, _, over = case.partition("|")
    return load_scenario(ROOT / path, over.split(";") if over else [])


def _guarded(graph):
    return graph.with_changes(meta=_NoSpec(graph.meta))


@pytest.mark.parametrize("case", sorted(MAIN))
def test_policy_scenarios_equal_main_without_the_spec(case):
    """Recompute with activation offload, ZeRO-Offload (bucketed, serial) and ZeRO-Infinity parameter offload: the
    built graph carries no spec, and step time and peak memory equal main's exactly."""
    cfg = _cfg(case)
    g = build_graph(cfg)
    assert "spec" not in g.meta and not any(isinstance(v, TransformerSpec) for v in g.meta.values())
    assert g.model is not None and g.model.num_parameters == g.meta["num_parameters"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = run_scenario(cfg).summary
    assert (s["step_time_s"], s["peak_memory_bytes"]) == MAIN[case]


def test_each_policy_runs_on_a_graph_whose_meta_refuses_the_spec():
    cfg = _cfg(f"{OVERLAP}|zero_optimization.stage=3;zero_optimization.offload_param.device=cpu")
    hw = resolve_hardware(cfg)
    g = build_graph(cfg)
    off = offload_optimizer(_guarded(g), hw, mode="overlap")
    fetched = offload_param(_guarded(off), prefetch_depth=1)
    assert fetched.ops == offload_param(offload_optimizer(g, hw, mode="overlap"), prefetch_depth=1).ops
    assert any(op.name.endswith("offload_param.fetch") for op in fetched.ops)
    ck = _cfg("scenarios/h200/gpt_184m_b16_ckpt.yaml|activation_checkpointing.cpu_checkpointing=true")
    assert len(recompute(_guarded(build_graph(ck)), "full", True).ops) > len(build_graph(ck).ops)
    with pytest.raises(PolicyError, match="built with recompute 'full', not 'selective'"):
        recompute(_guarded(build_graph(ck)), "selective")


def test_offload_gradients_of_a_model_without_biases():
    """RMSNorm and no biases (a Llama layout): the gradient walk found the norms only when they had a bias, so
    ZeRO-Offload of such a model was refused as an "unknown graph layout"; by param group every element is there,
    and the uploads after the CPU step carry every parameter once."""
    s = TransformerSpec(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=32,
                        vocab_size=500, micro_batch_size=2, precision="bf16", bias=False, normalization="RMSNorm",
                        position_embedding="rope", swiglu=True, tied_embeddings=False)
    g = build_gpt_step(s)
    grads = gradients(g)
    assert sum(x["bytes"] for x in grads) == 2 * s.num_parameters
    assert len(grads) == len({pg.grad_op for pg in g.param_groups})  # one copy per finishing op
    assert sum(n for _, _, n in g.model.upload_groups) == s.num_parameters
    gpt2 = dataclasses.replace(s, bias=True, normalization="LayerNorm", position_embedding="learned_absolute",
                               swiglu=False, tied_embeddings=True)
    assert sum(n for _, _, n in build_gpt_step(gpt2).model.upload_groups) == gpt2.num_parameters
