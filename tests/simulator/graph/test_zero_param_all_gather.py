"""DeepSpeed ZeRO-1/2's post-step parameter all-gather: one ``all_gather_into_tensor`` of the whole flat 16-bit
partition group (deepspeedai/DeepSpeed@e466bd53 ``deepspeed/runtime/utils.py`` ``all_gather_dp_groups``), not
``allgather_bucket_size`` chunks (DeepSpeed's fallback without ``all_gather_into_tensor``, not modelled)."""

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


@pytest.mark.parametrize("stage", [1, 2])
def test_one_all_gather_of_the_whole_partition_group(stage):
    """A bucket of 100,000 elements, far under the model's P: still one all-gather of 2 P bytes (bf16)."""
    g = build_graph(_cfg(stage=stage, allgather_bucket_size=100_000))
    ags = [o for o in g.ops if o.name.startswith("zero.param_all_gather")]
    assert len(ags) == 1
    assert ags[0].meta == {"collective": "all_gather", "bytes": 2 * g.model.num_parameters, "group": "dp"}


def test_allgather_bucket_size_given_is_flagged_as_without_effect():
    assert any(w.startswith("zero_optimization.allgather_bucket_size has no effect")
               for w in ineffective_setting_warnings(_cfg(stage=2, allgather_bucket_size=100_000)))
    assert not any("allgather_bucket_size" in w for w in ineffective_setting_warnings(_cfg(stage=2)))
