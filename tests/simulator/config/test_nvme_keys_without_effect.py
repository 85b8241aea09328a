"""NVMe settings that change nothing in a run are named in its warnings (they were silently ignored): ``hardware.nvme``
and the device-nvme-only offload keys without an offload device nvme, ``aio`` likewise, and
``offload_param.max_in_cpu`` (accepted, not priced) with one."""

from __future__ import annotations

import pytest

from simulator.api import run_warnings
from simulator.config.loader import load_scenario, resolve_hardware
from tests.conftest import ROOT

CPU_OFFLOAD = ROOT / "scenarios/h200/gpt_184m_b16_offload_overlap.yaml"
NVME = ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_zero3_nvme.yaml"


def _warnings(path, sets):
    cfg = load_scenario(path, sets)
    return [w for w in run_warnings(resolve_hardware(cfg), cfg) if "nvme" in w.lower() or w.startswith("aio.")]


@pytest.mark.parametrize(("key", "line"), [
    ("hardware.nvme.storage=samsung-pm1733-3.84tb",
     "hardware.nvme has no effect: no zero_optimization offload device nvme (the drives are read only by "
     "ZeRO-Infinity NVMe offload)"),
    ("zero_optimization.offload_optimizer.pipeline_read=true",
     "zero_optimization.offload_optimizer.pipeline_read has no effect with device cpu (DeepSpeed reads it for device "
     "nvme only)"),
    ("zero_optimization.offload_param.buffer_size=1000",
     "zero_optimization.offload_param.buffer_size has no effect with device none (DeepSpeed reads it for device "
     "nvme only)"),
    ("aio.queue_depth=32",
     "aio.queue_depth has no effect: no zero_optimization offload device nvme (the aio section sets DeepSpeed's NVMe "
     "swapper)"),
])
def test_an_nvme_setting_without_nvme_offload_is_named(key, line):
    assert _warnings(CPU_OFFLOAD, [key]) == [line]


def test_pcie_switches_without_nvme_offload_are_named(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(CPU_OFFLOAD.read_text().replace(
        "  host: h200-measured-host ", "  host: {preset: h200-measured-host, pcie_switches: [{gpus: [0], "
        "uplink_bytes_per_s: 63e9}]} "))
    assert _warnings(p, []) == ["hardware.host.pcie_switches has no effect: no zero_optimization offload device nvme "
                                "(the GPUs' switch uplinks are priced from hardware.cluster; the switches' drives are "
                                "read only by NVMe offload)"]


def test_defaults_given_again_stay_quiet():
    """A resolved config carries every key at its default: no line for them."""
    assert _warnings(CPU_OFFLOAD, ["zero_optimization.offload_optimizer.buffer_count=4",
                                   "zero_optimization.offload_param.max_in_cpu=1000000000"]) == []


def test_max_in_cpu_with_parameter_nvme_is_flagged_not_priced():
    lines = _warnings(NVME, ["zero_optimization.offload_param.max_in_cpu=5"])
    assert ("zero_optimization.offload_param.max_in_cpu accepted, not priced: every parameter partition is swapped "
            "from NVMe at each fetch") in lines
    assert not any("no effect" in w for w in lines), lines
