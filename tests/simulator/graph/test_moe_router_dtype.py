"""The MoE routing probabilities' dtype (Megatron ``--moe-router-dtype``, issue 11): the model dtype by default
(NVIDIA/Megatron-LM@005742ff ``megatron/core/transformer/moe/router.py`` ``Router.gating``: ``router_dtype =
input.dtype`` unless fp32 / fp64; the probabilities are cast to the logits' dtype), fp32 when asked. The
all-to-all dispatcher's kernels that write, weigh with or differentiate them, worked by hand on a tiny block."""

from __future__ import annotations

import pytest

from simulator.config.errors import ScenarioError
from simulator.config.loader import load_scenario
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from tests.conftest import ROOT
from tests.simulator.graph.test_moe import TINY, E, T, _mixtral, _scenario, _spec


@pytest.mark.parametrize("router_dtype,p", [(None, 2), ("fp32", 4)])
def test_alltoall_probabilities_bytes_by_hand(router_dtype, p):
    """T = 32 tokens, E = 4 experts, p bytes per probability: the top-k softmax writes the [T, E] probabilities and
    the bool routing map ((p + 1) T E bytes), unpermute reads them (p T E + T E beside the routed rows), the
    unpermute backward writes their gradient (p T E), and the softmax backward reads gradient and probabilities
    (2 p T E + T E)."""
    g = build_gpt_step(_spec(moe_router_dtype=router_dtype))
    ops = {o.name: o for o in g.ops if o.layer == 0}
    assert ops["L0.fwd.router.topk_softmax"].bytes_written == (p + 1) * T * E
    Nl, h = T * 2, TINY["hidden_size"]  # topk 2: 64 routed copies of 64-wide rows, 16-bit
    assert ops["L0.fwd.moe.unpermute"].bytes_read == 2 * Nl * h + p * T * E + T * E
    assert ops["L0.bwd.moe.unpermute.dgrad"].bytes_written == 2 * Nl * h + p * T * E
    assert ops["L0.bwd.router.topk_softmax.dgrad"].bytes_read == 2 * p * T * E + T * E


def test_probabilities_follow_the_model_dtype_by_default():
    assert TransformerSpec(**TINY).moe_probs_bytes == 2
    assert TransformerSpec(**{**TINY, "precision": "fp16"}).moe_probs_bytes == 2
    assert TransformerSpec(**TINY, moe_router_dtype="fp32").moe_probs_bytes == 4


def test_router_dtype_key_and_its_warning(tmp_path):
    """model.moe_router_dtype fp32 is accepted (the router GEMM itself in the model dtype is flagged); fp64 is
    refused in one line naming the key; it needs experts."""
    from simulator.api import run_scenario

    p = _scenario(tmp_path, _mixtral(num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8,
                                     vocab_size=4000))
    w = run_scenario(load_scenario(p, ["model.moe_router_dtype=fp32", "run.steps=2"])).summary["warnings"]
    assert any(x.startswith("model.moe_router_dtype fp32: the routing probabilities") for x in w)
    with pytest.raises(ScenarioError, match="moe_router_dtype: fp64 is not modelled"):
        load_scenario(p, ["model.moe_router_dtype=fp64"])
    with pytest.raises(ScenarioError, match="moe_router_dtype needs model.num_experts"):
        load_scenario(ROOT / "scenarios/h200/gpt_184m_b4.yaml", ["model.moe_router_dtype=fp32"])
