"""DeepSpeed ZeRO-1/2's post-step parameter all-gathers: one ``all_gather_into_tensor`` of each whole flat 16-bit
param group (deepspeedai/DeepSpeed@e466bd53 ``deepspeed/runtime/utils.py`` ``all_gather_into_tensor_dp_groups``),
not ``allgather_bucket_size`` chunks (DeepSpeed's fallback without ``all_gather_into_tensor``, not modelled); the
groups are Megatron-DeepSpeed's / Hugging Face's weight-decay and no-weight-decay ones (biases and norm weights)."""

from __future__ import annotations

import copy

import pytest

from simulator.api import build_graph, ineffective_setting_warnings
from simulator.config.loader import scenario_from_dict

from tests.simulator.config.test_deepspeed_clip_default import BASE  # 4 x 512 GPT, bf16, one DGX H100


def _cfg(**zero):
    d = copy.deepcopy(BASE)
    d["zero_optimization"] = zero
    return scenario_from_dict(d)


# The 4 x 512 GPT (f 2048, biases, LayerNorm, 1024-token vocabulary, 256 learned positions, tied) by hand:
# no weight decay per block ln1 2 x 512 + ln2 2 x 512 + the biases of qkv 1536, proj 512, fc1 2048, fc2 512 = 6656,
# x 4 = 26,624, + ln_f 1024 = 27,648; with it per block 3 x 512^2 + 512^2 + 2 x 512 x 2048 = 3,145,728, x 4 =
# 12,582,912, + wte 1024 x 512 + wpe 256 x 512 = 13,238,272.
DECAY, NO_DECAY = 13_238_272, 27_648


@pytest.mark.parametrize("stage", [1, 2])
def test_one_all_gather_per_param_group(stage):
    """A bucket of 100,000 elements, far under the model's P: still one all-gather per whole flat group, the
    weight-decay group first, 2 B (bf16) per element: 2 x 13,238,272 and 2 x 27,648 bytes; together 2 P."""
    g = build_graph(_cfg(stage=stage, allgather_bucket_size=100_000))
    ags = [o for o in g.ops if o.name.startswith("zero.param_all_gather")]
    assert [(o.name, o.meta) for o in ags] == [
        (f"zero.param_all_gather.{k}", {"collective": "all_gather", "bytes": 2 * n, "group": "dp"})
        for k, n in enumerate((DECAY, NO_DECAY))]
    assert DECAY + NO_DECAY == g.model.num_parameters


def test_allgather_bucket_size_given_is_flagged_as_without_effect():
    assert any(w.startswith("zero_optimization.allgather_bucket_size has no effect")
               for w in ineffective_setting_warnings(_cfg(stage=2, allgather_bucket_size=100_000)))
    assert not any("allgather_bucket_size" in w for w in ineffective_setting_warnings(_cfg(stage=2)))
