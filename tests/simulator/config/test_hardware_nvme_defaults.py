"""A key ``hardware.nvme`` leaves out is the host preset's (``--set hardware.nvme.drives=4`` on a DGX H100 used to fail
with "hardware.nvme.storage: required key is missing")."""

from __future__ import annotations

import pytest

from simulator.config.loader import ScenarioError, load_scenario, resolve_hardware
from tests.conftest import ROOT

NVME = ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_zero3_nvme.yaml"  # dgx-h100-host: 8x samsung-pm1733-3.84tb


def _array(sets):
    return resolve_hardware(load_scenario(NVME, sets)).nvme


def test_drives_alone_keep_the_hosts_drive():
    nv = _array(["hardware.nvme.drives=4"])
    assert (nv.drive.name, nv.drives) == ("Samsung PM1733 3.84 TB NVMe SSD (U.2, PCIe 4.0 x4)", 4)
    assert (nv.read_bytes_per_s, nv.write_bytes_per_s) == (4 * 7.0e9, 4 * 3.8e9)  # 28.0 / 15.2 GB/s
    assert "storage from the host preset" in nv.source


def test_storage_alone_keeps_the_hosts_drive_count():
    sets = ["hardware.nvme.storage={name: slow, read_bandwidth_bytes_per_s: 2 GB/s, write_bandwidth_bytes_per_s: 1 GB/s}"]
    nv = _array(sets)
    assert (nv.drive.name, nv.drives, nv.read_bytes_per_s, nv.write_bytes_per_s) == ("slow", 8, 16e9, 8e9)


def test_both_given_ignore_the_preset():
    nv = _array(["hardware.nvme={storage: samsung-pm1733-3.84tb, drives: 2}"])
    assert (nv.drives, nv.source) == (2, "scenario hardware.nvme")


def test_drives_alone_on_a_host_without_drives_is_refused():
    with pytest.raises(ScenarioError, match=r"hardware\.nvme\.storage: needed, hardware\.host 'h200-measured-host' "
                                            r"names no NVMe drive \(allowed: a storage preset"):
        _array(["hardware.host=h200-measured-host", "hardware.nvme.drives=2"])
