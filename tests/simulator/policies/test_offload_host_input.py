"""Bad host input for the ZeRO-Offload CPU step: one line on stderr, exit 2; and the host what-ifs."""

from __future__ import annotations

import pytest

from hardware_models.host_kernels import DEFAULT_PAGE_FAULT_S
from simulator import load_scenario, run_scenario
from simulator.cli import main
from tests.conftest import ROOT

SCEN = str(ROOT / "scenarios/h200/gpt_184m_b16_offload_overlap.yaml")


@pytest.mark.parametrize("override, fragments", [
    # the measured host is a KVM guest (its preset's vcpus: true): its 16 CPUs are vCPUs, not physical cores
    ("hardware.host.threads=17", ["hardware.host", "threads 17 exceeds the 16 vCPUs", "allowed 1..16"]),
    ("hardware.host.threads=999", ["threads 999 exceeds the 16 vCPUs of the host", "allowed 1..16"]),
    ("hardware.host.overrides.threads_used=64", ["threads 64 exceeds the 16 vCPUs"]),
    ("hardware.host=xeon-9999", ["unknown host preset 'xeon-9999'", "known: ", "dgx2-v100-host"]),
    ("hardware.host.numa_node=1", ["numa_node 1 does not exist: this host has 1 NUMA node(s)", "allowed 0..0"]),
])
def test_bad_host_one_line_exit_2(capsys, override, fragments):
    assert main(["run", SCEN, "--set", override]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and SCEN in err
    for f in fragments:
        assert f in err, f"{f!r} not in {err!r}"


def test_physical_cores_wording(capsys):
    """A host whose preset does not say vCPUs keeps "physical cores" (the rule is the same: threads <= cores)."""
    assert main(["run", SCEN, "--set", "hardware.host.overrides.vcpus=false", "--set", "hardware.host.threads=17"]) == 2
    err = capsys.readouterr().err
    assert "threads 17 exceeds the 16 physical cores" in err and "vCPU" not in err.split("(")[0]


def _cpu_s(**host) -> float:
    cfg = load_scenario(SCEN)
    cfg = cfg.model_copy(update={"hardware": cfg.hardware.model_copy(update={"host": host_ref(**host)})})
    return run_scenario(cfg).summary["offload_cpu_optimizer_s"]


def host_ref(preset: str = "h200-measured-host", **kw):
    from simulator.config.schema import HostRef

    return HostRef(preset=preset, **kw)


def test_fewer_threads_slower_and_bound_node_on_a_two_socket_host():
    """Threads: 4 of the 16 cores stream at most 4 x 12 GB/s (the per-core default) instead of the
    fitted 98 GB/s. DGX-2: pinned buffers are on one node either way, so binding to node 0 halves
    the threads (24 of 48 still saturate the node's bandwidth) and only the page faults of the
    8 B/param fresh outputs (grad cast, sqrt) slow down: 185,759,744 x 8 B / 4 KiB pages x
    page_fault_s x (1/24 - 1/48), the DGX-2 preset's published 1.71 us a page (not the borrowed default)."""
    from hardware_models import presets

    assert _cpu_s(threads=4) > 1.9 * _cpu_s()
    dgx2 = _cpu_s(preset="dgx2-v100-host")
    pf = presets.get("hosts", "dgx2-v100-host")[0].page_fault_s
    assert pf == pytest.approx(1.71e-6) and pf != DEFAULT_PAGE_FAULT_S
    faults = 185_759_744 * 8 / 4096 * pf * (1 / 24 - 1 / 48)
    assert _cpu_s(preset="dgx2-v100-host", numa_node=0) == pytest.approx(dgx2 + faults, rel=1e-9)
    assert _cpu_s(preset="ryzen-5-5600-desktop") > dgx2  # 41 GB/s against 102 GB/s


def test_too_little_host_memory_is_a_result_on_the_command_line(capsys):
    """`simulate run --json` on a 1 GB host: a result (JSON on stdout, exit 1 as for a GPU OOM), not an error. The
    pinned pool holds 185,759,744 params x 16 B (fp32 master + two moments, 12 B; bf16 gradient and parameter
    staging, 2 B each) = 2.97 GB; the first buffer over capacity is the first moment, 4 B/param = 0.743 GB."""
    import json

    assert main(["run", SCEN, "--json", "--set", "hardware.host.overrides.memory.capacity_bytes=1 GB"]) == 1
    out, err = capsys.readouterr()
    oom = json.loads(out)["oom"]
    assert oom.startswith("out of memory on host.pinned: peak demand 2.97 GB exceeds the capacity 1.00 GB by 1.97 GB")
    assert "first allocation over capacity: optimizer.exp_avg.host (0.743 GB)" in oom
    assert "Traceback" not in err and "error" not in err
