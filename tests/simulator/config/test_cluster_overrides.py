"""``hardware.cluster.overrides`` / ``network_overrides`` in a run: errors name the key written, a throttled
network slows the inter-node collectives, a network on one node is flagged."""

from __future__ import annotations

import warnings

import pytest

from simulator.api import run_scenario
from simulator.cli import main
from simulator.config.errors import ScenarioWarning
from simulator.config.loader import load_scenario
from tests.conftest import ROOT

TWO_NODES = str(ROOT / "scenarios/cluster/gpt_6p7b_2x_dgx_h100.yaml")
ONE_NODE = str(ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml")


@pytest.mark.parametrize("setting,key", [
    ("hardware.cluster.overrides={nvlink_bytes_per_s: -5}", "hardware.cluster.overrides: "),
    ("hardware.cluster.overrides={nic_bytes_per_s: 5}", "hardware.cluster.overrides: "),
    ("hardware.cluster.network_overrides={nic_bytes_per_s: -1}", "hardware.cluster.network_overrides: "),
    ("hardware.cluster.network_overrides={nic_byte: 3}", "hardware.cluster.network_overrides: "),
])
def test_override_errors_name_the_override_key(capsys, setting, key):
    assert main(["run", TWO_NODES, "--set", setting]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and key in err


def test_throttled_network_slows_the_inter_node_traffic():
    """The 2-node 6.7B case reduces its DP gradients over the NDR rails (8 x 400 Gb/s per node): NICs at
    10 GB/s (a fifth of 50 GB/s) leave the step longer and more communication exposed."""
    base = run_scenario(load_scenario(TWO_NODES)).summary
    slow = run_scenario(load_scenario(TWO_NODES, ['hardware.cluster.network_overrides={nic_bytes_per_s: "10 GB/s"}'])
                        ).summary
    assert slow["step_time_s"] > base["step_time_s"] and slow["exposed_comm_s"] > base["exposed_comm_s"]


def test_a_network_on_one_node_is_flagged():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        load_scenario(ONE_NODE, ["hardware.cluster.network=ib-hdr"])
    assert any(issubclass(x.category, ScenarioWarning) and "one node has no scale-out network" in str(x.message)
               for x in w)
