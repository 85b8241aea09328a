"""A ``parallelism`` that is not a mapping is refused, not replaced by the derived data-parallel size."""

import pytest

from simulator.config.errors import ScenarioError
from simulator.config.loader import scenario_from_dict


def test_parallelism_scalar_refused_with_cluster():
    data = {"hardware": {"gpu": "h100-sxm-80gb", "cluster": {"preset": "dgx-h100", "nodes": 1}},
            "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                      "vocab_size": 128},
            "training": {"micro_batch_size": 1}, "parallelism": 5}
    with pytest.raises(ScenarioError, match=r"parallelism: expected a mapping"):
        scenario_from_dict(data, "x.yaml")
