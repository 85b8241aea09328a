"""``simulate collective``: JSON output and one-line bad-input errors (exit 2)."""

from __future__ import annotations

import json

import pytest

from simulator.cli import main


def test_json_fields_and_values(capsys):
    assert main(["collective", "dgx-h100", "--op", "all_reduce", "--ranks", "8", "--bytes", "1MiB,1GiB",
                 "--algo", "ring", "--proto", "simple", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [o["bytes"] for o in out] == [2**20, 2**30]
    for o in out:
        assert {"op", "ranks", "ranks_per_node", "bytes", "time_s", "algbw_bytes_per_s", "busbw_bytes_per_s",
                "algorithm", "protocol"} <= set(o)
        assert (o["op"], o["ranks"], o["ranks_per_node"], o["algorithm"], o["protocol"]) == (
            "all_reduce", 8, 8, "Ring", "Simple")
        assert o["busbw_bytes_per_s"] == pytest.approx(o["bytes"] / o["time_s"] * 1.75)


def test_two_nodes(capsys):
    assert main(["collective", "dgx-h100", "--ranks", "16", "--ranks-per-node", "8", "--bytes", "1GiB", "--json"]) == 0
    o = json.loads(capsys.readouterr().out)[0]
    assert o["ranks_per_node"] == 8 and o["ranks"] == 16


@pytest.mark.parametrize("argv,msg", [
    (["dgx-h100", "--ranks", "12"], "multiple of --ranks-per-node"),
    (["dgx-h100", "--ranks-per-node", "9"], "--ranks-per-node must be in 1..8"),
    (["dgx-a100", "--algo", "nvls"], "NVSwitch with in-switch reduction"),
    (["dgx-h100", "--set", "nvlink_bytes_per_s=0"], "nvlink_bytes_per_s must be > 0"),
    (["dgx-h100", "--ranks", "16", "--set", "network.nic_bytes_per_s=-1"], "nic_bytes_per_s: must be > 0 (a bandwidth"),
    (["dgx-h100", "--ranks", "16", "--set", "network.nic_bytes_per_s=0"], "nic_bytes_per_s: must be > 0 (a bandwidth"),
    (["no-such-cluster"], "unknown cluster preset"),
    (["4x-a100-pcie", "--ranks", "8"], "no NICs"),
    (["dgx-h100", "--op", "gather"], "op 'gather' is not modelled"),
    # the node bound said in the flags given (was "cluster.nodes: 12500 is above ...", a key the user never wrote)
    (["dgx-h100", "--ranks", "100000"], "error: --ranks 100000 (12,500 nodes of 8 ranks) is above the 4,096 nodes "
                                        "this simulator builds (32,768 GPUs of NVIDIA DGX H100)\n"),
    (["dgx-h100", "--ranks", "8192", "--ranks-per-node", "1"], "--ranks 8192 (8,192 nodes of 1 rank) is above"),
])
def test_bad_input_one_line_exit_2(capsys, argv, msg):
    assert main(["collective", *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1


def test_a_one_rank_collective_is_refused(capsys):
    assert main(["collective", "dgx-h100", "--op", "all_reduce", "--ranks", "1", "--bytes", "1MiB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--ranks must be >= 2" in err[0]


def test_send_recv_is_a_pair_and_plain_byte_counts(capsys):
    assert main(["collective", "dgx-h100", "--op", "send_recv", "--ranks", "16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "send_recv is point to point between 2 ranks" in err
    assert main(["collective", "dgx-h100", "--op", "send_recv", "--ranks", "2", "--ranks-per-node", "1",
                 "--bytes", "8,1024", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(o["bytes"], o["ranks"], o["ranks_per_node"]) for o in out] == [(8, 2, 1), (1024, 2, 1)]


def test_network_settings_on_one_node_are_checked_and_flagged(capsys):
    assert main(["collective", "dgx-h100", "--bytes", "1GiB", "--set", "network.bogus=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown key(s) bogus (allowed: " in err
    assert main(["collective", "dgx-h100", "--bytes", "1GiB", "--set", "network.nic_bytes_per_s=-1"]) == 2
    assert "nic_bytes_per_s" in capsys.readouterr().err
    assert main(["collective", "dgx-h100", "--bytes", "1GiB", "--set", 'network.nic_bytes_per_s="10 GB/s"']) == 0
    assert "the network settings have no effect" in capsys.readouterr().err
    assert main(["collective", "4x-a100-pcie", "--ranks", "4", "--bytes", "1MiB", "--network", "ib-hdr"]) == 0
