"""Shared fixtures: a tiny machine with round numbers so timings can be worked out by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from hardware_models.fabrics import LinkSpec
from hardware_models.gpu import GpuSpec
from hardware_models.host import HostCpuSpec, HostMemorySpec
from hardware_models.machine import Hardware
from hardware_models.profile import EfficiencyProfile, GemmEfficiency

ROOT = Path(__file__).resolve().parents[1]


def make_hw(gpu_mem: float = 1e12, launch_s: float = 0.0, pcie_bw: float = 1e9, kernel_fixed_s: float = 0.0,
            duplex: float = 0.0) -> Hardware:
    """A machine with 1 PFLOP/s bf16, 1 TB/s memory kernels and a 1 GB/s PCIe link per direction."""
    gpu = GpuSpec(name="toy", peak_flops_per_s={"bf16": 1e15, "fp32": 1e14}, hbm_capacity_bytes=gpu_mem,
                  hbm_bandwidth_bytes_per_s=1e12, sm_count=100, max_sm_clock_mhz=1000, mem_clock_mhz=1000)
    prof = EfficiencyProfile(name="toy", gpu="toy", gemm={"bf16": GemmEfficiency(1.0, tile_m=1, tile_n=1)},
                             attention_efficiency={"fwd": 0.5, "bwd": 0.5},
                             memory_bandwidth_bytes_per_s={"elementwise": 1e12}, kernel_fixed_s=kernel_fixed_s,
                             launch_overhead_s=launch_s, h2d_bytes_per_s=pcie_bw, d2h_bytes_per_s=pcie_bw,
                             duplex_bytes_per_s=duplex or 2 * pcie_bw)
    return Hardware(gpu, prof, LinkSpec("toy-pcie", pcie_bw), HostCpuSpec("toy-cpu", 4, 1e10),
                    HostMemorySpec(1e12))


@pytest.fixture
def toy_hw() -> Hardware:
    return make_hw()


def refused_in_one_line(tmp_path: Path, capsys, scenario: dict) -> str:
    """Write ``scenario`` as YAML, ``simulate run`` it and check it is refused as bad input: exit 2 with one line
    on stderr, no traceback, naming the file. Returns that line."""
    import yaml

    from simulator.cli import main

    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(scenario))
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and str(p) in err, err
    return err
