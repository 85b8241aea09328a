"""Host dispatch time per op: one resolution, the host's value moves with the host (issue 9 item 10)."""

from __future__ import annotations

import dataclasses

import pytest

from hardware_models import presets
from hardware_models.host import HostCpuSpec
from hardware_models.machine import GENERIC_LAUNCH_OVERHEAD_S, resolve_launch_overhead
from tests.conftest import make_hw


def _hw(host_s=None, host_phase=None, prof_s=None, prof_phase=None, override=None, host_fixed=None, prof_fixed=None):
    hw = make_hw()
    cpu = HostCpuSpec("cpu", 4, 1e10, launch_overhead_s=host_s, launch_overhead_by_phase_s=host_phase or {},
                      host_phase_fixed_s=host_fixed or {})
    prof = dataclasses.replace(hw.profile, launch_overhead_s=prof_s, launch_overhead_by_phase_s=prof_phase or {},
                               host_phase_fixed_s=prof_fixed or {})
    return dataclasses.replace(hw, host_cpu=cpu, profile=prof, launch_overhead_s=override)


def test_order_scenario_then_profile_fit_then_host_then_generic():
    assert _hw().launch == (GENERIC_LAUNCH_OVERHEAD_S, {}, "generic", {})
    assert _hw(host_s=7e-6, host_phase={"fwd": 3e-5}, host_fixed={"opt": 1e-4}).launch == (
        7e-6, {"fwd": 3e-5}, "host", {"opt": 1e-4})
    # a profile fit replaces the host's per-phase times and its fixed parts together
    assert _hw(host_s=7e-6, prof_phase={"bwd": 4e-5}, host_fixed={"opt": 1e-4}).launch == (
        7e-6, {"bwd": 4e-5}, "profile", {})
    assert _hw(host_s=7e-6, prof_s=0.0).launch == (0.0, {}, "profile", {})  # an explicit 0 is kept
    assert _hw(host_s=7e-6, host_phase={"fwd": 3e-5}, host_fixed={"opt": 1e-4}, override=2e-6).launch == (
        2e-6, {}, "scenario", {})


def test_shipped_gpu_profiles_carry_no_host_time_and_the_h200_host_does():
    for name in presets.list_presets("profiles")["profiles"]:
        prof = presets.get("profiles", name)
        assert prof.launch_overhead_s is None and not prof.launch_overhead_by_phase_s, name
    cpu, _ = presets.get("hosts", "h200-measured-host")
    assert cpu.launch_overhead_s == pytest.approx(9.5553e-6, rel=1e-4)  # measurements.json tiny_kernel_us_eager
    assert cpu.launch_overhead_by_phase_s["bwd"] == pytest.approx(35.923e-6, rel=1e-4)
    assert "tiny_kernel_us_eager" in cpu.sources["launch_overhead_s"]


def test_negative_host_launch_time_is_rejected():
    with pytest.raises(ValueError, match="launch_overhead_s"):
        HostCpuSpec("cpu", 4, 1e10, launch_overhead_s=-1e-6)
    with pytest.raises(ValueError, match="host_phase_fixed_s"):
        HostCpuSpec("cpu", 4, 1e10, host_phase_fixed_s={"opt": -1e-6})


def test_resolve_is_a_plain_function_of_specs():
    hw = _hw(host_s=5e-6)
    assert resolve_launch_overhead(None, hw.host_cpu, hw.profile).per_op_s == 5e-6


def test_copy_rates_are_chosen_in_one_place_with_their_source():
    """A rate measured in the profile wins over the link preset; an unset duplex is the sum of both directions."""
    from hardware_models.fabrics import LinkSpec
    from hardware_models.machine import resolve_copy_rates
    from hardware_models.profile import EfficiencyProfile

    link = LinkSpec("toy", 10e9, latency_s=2e-6, pageable_h2d_bytes_per_s=4e9)
    prof = EfficiencyProfile(name="p", gpu="g", gemm={}, attention_efficiency={}, memory_bandwidth_bytes_per_s={},
                             h2d_bytes_per_s=8e9)
    c = resolve_copy_rates(prof, link)
    assert (c.h2d_bytes_per_s, c.d2h_bytes_per_s, c.duplex_bytes_per_s) == (8e9, 10e9, 18e9)
    assert (c.pageable_h2d_bytes_per_s, c.pageable_d2h_bytes_per_s, c.latency_s) == (4e9, 0.0, 2e-6)
    assert c.sources["h2d_bytes_per_s"] == "profile" and c.sources["d2h_bytes_per_s"] == "link"
    assert c.sources["duplex_bytes_per_s"] == "derived"
