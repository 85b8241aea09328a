"""NVMe drives behind the GPUs' PCIe switches (``hardware_models.pcie_switches``, ``hardware.host.pcie_switches``):
the swaps share the switch uplink with the GPU copies (``simulator.policies.offload_nvme`` ``SWITCH_NAMES``), worked
by hand on the max-min network, and the topologies refused in one line."""

from __future__ import annotations

import pytest
import simpy

from hardware_models.fabrics import FluidNetwork
from hardware_models.pcie_switches import PcieSwitch, PcieSwitchTopology, parse_pcie_switches
from simulator.cli import main
from simulator.config.loader import load_scenario, resolve_hardware
from simulator.policies.offload_nvme import (NVME_LINK, SWITCH_DUPLEX, SWITCH_NAMES, SWITCH_UP, rank_switch,
                                             swap_links)
from tests.conftest import ROOT
from tests.simulator.policies.test_nvme_links import _ends

NVME = ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_zero3_nvme.yaml"
#: the four DGX-like switches, 2 GPUs, 2 NICs and 2 of the 8 drives each, Gen5 x16 uplinks (the cluster preset's)
SWITCHES = """  host:
    preset: dgx-h100-host
    pcie_switches:
      - {gpus: [0, 1], nics: [0, 1], drives: [0, 1], uplink_bytes_per_s: "63 GB/s"}
      - {gpus: [2, 3], nics: [2, 3], drives: [2, 3], uplink_bytes_per_s: "63 GB/s"}
      - {gpus: [4, 5], nics: [4, 5], drives: [4, 5], uplink_bytes_per_s: "63 GB/s"}
      - {gpus: [6, 7], nics: [6, 7], drives: [6, 7], uplink_bytes_per_s: "63 GB/s"}
"""


def _scenario(tmp_path, switches: str = SWITCHES):
    text = NVME.read_text()
    line = next(ln for ln in text.splitlines(keepends=True) if ln.startswith("  host: dgx-h100-host"))
    p = tmp_path / "nvme_switches.yaml"
    p.write_text(text.replace(line, switches))
    return p


def _network(weight: float):
    """One rank: its GPU's D2H link 8 GB/s, its share of the switch uplink 10 GB/s up (20 GB/s both ways), drives
    14 GB/s, host DRAM out of the way; the swaps cross the uplink by ``weight``."""
    env = simpy.Environment()
    net = FluidNetwork(env, {"pcie.d2h": 8e9, "pcie.duplex": 30e9, "pcie.uplink.d2h": 10e9, "pcie.uplink.h2d": 10e9,
                             "pcie.uplink.duplex": 20e9, NVME_LINK: 14e9, "host.dram": 1e12})
    for name, link in SWITCH_NAMES.items():
        net.add_weighted_name(name, link, weight)
    return env, net


COPY = ("pcie.d2h", "pcie.duplex", "pcie.uplink.d2h", "pcie.uplink.duplex")


def test_a_read_and_a_d2h_copy_through_one_switch_uplink_share_it_max_min():
    # weight 1: copy + read <= 10 GB/s up -> 5 GB/s each (the copy's own 8 GB/s and the drives' 14 do not bind):
    # 5 GB each ends at 1 s
    env, net = _network(1.0)
    read = (NVME_LINK, SWITCH_UP, SWITCH_DUPLEX, "host.dram")
    assert _ends(env, net, [(5e9, COPY), (5e9, read)]) == [1.0, 1.0]
    # weight 2 (the node's ranks put twice this rank's bytes on the switch's drives): c + 2 r <= 10 -> 10/3 each
    env, net = _network(2.0)
    assert _ends(env, net, [(10e9 / 3, COPY), (10e9 / 3, read)]) == [pytest.approx(1.0, rel=1e-12)] * 2
    # alone, the read takes the uplink's 10 GB/s / 2 = 5 GB/s (below the drives' 14)
    env, net = _network(2.0)
    assert _ends(env, net, [(5e9, read)]) == [1.0]


def test_an_h2d_copy_and_a_read_share_only_the_two_way_limit():
    # full duplex: the H2D copy goes down, the read up; both ways 12 GB/s binds: 6 GB/s each (uplink 10 per way)
    env = simpy.Environment()
    net = FluidNetwork(env, {"pcie.h2d": 8e9, "pcie.duplex": 30e9, "pcie.uplink.d2h": 10e9, "pcie.uplink.h2d": 10e9,
                             "pcie.uplink.duplex": 12e9, NVME_LINK: 14e9, "host.dram": 1e12})
    for name, link in SWITCH_NAMES.items():
        net.add_weighted_name(name, link, 1.0)
    h2d = ("pcie.h2d", "pcie.duplex", "pcie.uplink.h2d", "pcie.uplink.duplex")
    read = (NVME_LINK, SWITCH_UP, SWITCH_DUPLEX, "host.dram")
    assert _ends(env, net, [(6e9, h2d), (6e9, read)]) == [1.0, 1.0]


def test_the_declared_switches_route_the_swaps_over_the_rank_uplink(tmp_path):
    cfg = load_scenario(_scenario(tmp_path))
    hw = resolve_hardware(cfg)
    assert rank_switch(hw) == 0
    # the drives' own bound from the topology: 2 drives per 63 GB/s uplink, 8 drives: 8 x 63 / 2 = 252 GB/s
    assert (hw.nvme.drives_per_uplink, hw.nvme.uplink_read_bytes_per_s) == (2, 252e9)
    assert swap_links(hw.nvme, False, True)[2:4] == ("nvme.switch.up", SWITCH_DUPLEX)
    from simulator import run_scenario
    s = run_scenario(cfg).summary
    assert any("shares PCIe switch 0 (2 of the 8 drives, 63 GB/s uplink per direction" in w for w in s["warnings"])


def test_a_switch_without_drives_under_the_rank_routes_nothing(tmp_path):
    sw = SWITCHES.replace("drives: [0, 1], ", "").replace("drives: [2, 3]", "drives: [0, 1, 2, 3]")
    hw = resolve_hardware(load_scenario(_scenario(tmp_path, sw)))
    assert rank_switch(hw) is None
    assert (hw.nvme.drives_per_uplink, hw.nvme.uplink_read_bytes_per_s) == (4, 8 * 63e9 / 4)


def test_topology_checks():
    with pytest.raises(ValueError, match=r"pcie_switches\[1\].gpus: gpu 1 is listed also in pcie_switches\[0\]"):
        PcieSwitchTopology((PcieSwitch(gpus=(0, 1), uplink_bytes_per_s=1e9),
                            PcieSwitch(gpus=(1,), uplink_bytes_per_s=1e9)))
    topo = parse_pcie_switches([{"gpus": [0], "drives": [3], "uplink_bytes_per_s": "31.5 GB/s"}])
    assert topo.switches[0].uplink_bytes_per_s == 31.5e9
    with pytest.raises(ValueError, match=r"drives: drive 3 does not exist \(the node has 2; allowed: 0..1\)"):
        topo.check(gpus=1, drives=2)
    with pytest.raises(ValueError, match="uplink_bytes_per_s must be a positive finite rate"):
        parse_pcie_switches([{"gpus": [0], "uplink_bytes_per_s": 0}])


@pytest.mark.parametrize(("old", "new", "line"), [
    ("gpus: [2, 3]", "gpus: [1, 3]", "pcie_switches[1].gpus: gpu 1 is listed also in pcie_switches[0]"),
    ("drives: [6, 7]", "drives: [6, 8]", "pcie_switches[3].drives: drive 8 does not exist (the node has 8; allowed: "
                                         "0..7)"),
    ("gpus: [6, 7]", "gpus: [6, 8]", "pcie_switches[3].gpus: gpu 8 does not exist (the node has 8"),
    ("nics: [6, 7]", "nics: [6, 9]", "pcie_switches[3].nics: nic 9 does not exist"),
    ("drives: [2, 3]", "drives: [2, 1]", "pcie_switches[1].drives: drive 1 is listed also in pcie_switches[0]"),
    ("gpus: [0, 1], nics: [0, 1], drives: [0, 1], uplink_bytes_per_s: \"63 GB/s\"",
     "gpus: [0, 1], nics: [0, 1], drives: [0, 1], uplink_bytes_per_s: \"31.5 GB/s\"",
     "pcie_switches[0].uplink_bytes_per_s: 31.5 GB/s, but the cluster preset"),
])
def test_inconsistent_topologies_are_one_line_exit_2(tmp_path, capsys, old, new, line):
    assert old in SWITCHES
    assert main(["run", str(_scenario(tmp_path, SWITCHES.replace(old, new)))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hardware.host.pcie_switches: " + line in err[0], err


def test_gpus_grouped_against_the_cluster_preset_are_refused(tmp_path, capsys):
    sw = SWITCHES.replace("gpus: [0, 1]", "gpus: [0, 2]").replace("gpus: [2, 3]", "gpus: [1, 3]")
    assert main(["run", str(_scenario(tmp_path, sw))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ("pcie_switches[0].gpus: [0, 2] behind one switch, but the cluster preset 'NVIDIA DGX "
                              "H100") in err[0] and "puts GPU 0 behind one with GPUs [0, 1]" in err[0], err


def test_every_problem_of_the_list_is_its_own_line(tmp_path, capsys):
    """GPU 0 in two switches, GPU 9 and drive 12 beyond the node's 8: three lines in one run, not the first."""
    sw = (SWITCHES.replace("gpus: [2, 3]", "gpus: [0, 3]").replace("gpus: [6, 7]", "gpus: [6, 9]")
          .replace("drives: [6, 7]", "drives: [6, 12]"))
    assert main(["run", str(_scenario(tmp_path, sw))]) == 2
    err = [line.split("hardware.host.pcie_switches: ", 1)[-1] for line in capsys.readouterr().err.strip().splitlines()]
    assert err == ["pcie_switches[1].gpus: gpu 0 is listed also in pcie_switches[0] (a device sits behind one switch)",
                   "pcie_switches[3].gpus: gpu 9 does not exist (the node has 8; allowed: 0..7)",
                   "pcie_switches[3].drives: drive 12 does not exist (the node has 8; allowed: 0..7)"], err


def test_a_host_presets_own_list_reports_every_problem_as_a_scenarios_does(monkeypatch, capsys):
    """The same three problems in the host preset's own ``pcie_switches`` (no shipped preset has a bad one: the
    preset read is patched to add it) give the same three lines, each naming the preset, in one run. Before, the
    preset's list was parsed without the node's counts: only the layout line (GPU 0 twice) was reported."""
    from hardware_models import presets

    bad = [{"gpus": [0, 1], "nics": [0, 1], "drives": [0, 1], "uplink_bytes_per_s": "63 GB/s"},
           {"gpus": [0, 3], "nics": [2, 3], "drives": [2, 3], "uplink_bytes_per_s": "63 GB/s"},
           {"gpus": [4, 5], "nics": [4, 5], "drives": [4, 5], "uplink_bytes_per_s": "63 GB/s"},
           {"gpus": [6, 9], "nics": [6, 7], "drives": [6, 12], "uplink_bytes_per_s": "63 GB/s"}]
    load = presets._load

    def with_switches(family, name):
        data = load(family, name)
        return {**data, "pcie_switches": bad} if (family, name) == ("hosts", "dgx-h100-host") else data

    monkeypatch.setattr(presets, "_load", with_switches)
    assert main(["run", str(NVME)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    key = "hardware.host 'dgx-h100-host' (its preset's pcie_switches): preset hosts/dgx-h100-host."
    assert all(key in line for line in lines), lines
    assert [line.split(key, 1)[-1] for line in lines] == [
        "pcie_switches[1].gpus: gpu 0 is listed also in pcie_switches[0] (a device sits behind one switch)",
        "pcie_switches[3].gpus: gpu 9 does not exist (the node has 8; allowed: 0..7)",
        "pcie_switches[3].drives: drive 12 does not exist (the node has 8; allowed: 0..7)"], lines
