"""First-touch host memory in the ZeRO-Offload CPU step: numbers worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest

from hardware_models import presets
from hardware_models.host import HostCpuSpec, HostMemorySpec
from simulator.policies.offload_optimizer import cpu_step_times, first_touch_bw
from tests.conftest import make_hw

P = 1_000_000  # parameters
BW = 1e10  # host memory bandwidth, bytes/s (read + write)
FT = 2e9  # first-touch write bandwidth, bytes/s


def toy_hw(first_touch: float = FT, launch: float = 0.0):
    cpu = HostCpuSpec("toy-cpu", 4, BW, adam_params_per_s={"torch_foreach": ((1e3, 1e6), (1e6, 1e6))},
                      first_touch_bytes_per_s=first_touch)
    return dataclasses.replace(make_hw(), host_cpu=cpu, host_memory=HostMemorySpec(1e12), launch_overhead_s=launch)


def test_first_touch_by_hand():
    """1M params, 1e6 params/s AdamW, 10 GB/s memory, 2 GB/s first touch, no launch cost.

    grad_cast: 2 MB read / 10 GB/s + 4 MB fresh / 2 GB/s = 0.2 ms + 2.0 ms = 2.2 ms.
    adam: 1M / 1e6 = 1 s, plus the 4 MB sqrt temporary moved from 10 to 2 GB/s:
          4e6 * (1/2e9 - 1/1e10) = 2.0 ms - 0.4 ms = 1.6 ms -> 1.0016 s.
    param_cast: 6 MB in place / 10 GB/s = 0.6 ms (pinned buffer allocated once).
    """
    t = cpu_step_times(P, 10, "torch_foreach", toy_hw())
    assert t["cpu.grad_cast"] == pytest.approx(2.2e-3)
    assert t["cpu.adam"] == pytest.approx(1.0016)
    assert t["cpu.param_cast"] == pytest.approx(0.6e-3)


def test_deepspeed_kernel_allocates_nothing():
    """DeepSpeed's fused kernel: 1 s / (80/30) = 0.375 s, no sqrt temporary; the grad cast still 2.2 ms."""
    t = cpu_step_times(P, 10, "deepspeed_cpu_adam", toy_hw())
    assert t["cpu.adam"] == pytest.approx(0.375)
    assert t["cpu.grad_cast"] == pytest.approx(2.2e-3)
    assert t["cpu.param_cast"] == 0.0


def test_zero_means_memory_bandwidth():
    """first_touch_bytes_per_s = 0: old model, 6 MB / 10 GB/s = 0.6 ms per cast, adam 1 s; launches add 10 us each."""
    assert first_touch_bw(toy_hw(0.0)) == BW
    t = cpu_step_times(P, 10, "torch_foreach", toy_hw(0.0, launch=1e-6))
    assert t["cpu.grad_cast"] == pytest.approx(0.6e-3 + 10e-6)
    assert t["cpu.param_cast"] == pytest.approx(0.6e-3 + 10e-6)
    assert t["cpu.adam"] == pytest.approx(1.0 + 10 * 9 * 1e-6)


def test_negative_first_touch_rejected():
    with pytest.raises(ValueError, match="first_touch_bytes_per_s"):
        HostCpuSpec("bad", 4, BW, first_touch_bytes_per_s=-1.0)


def test_h200_host_preset_has_fitted_value_with_source():
    cpu = presets.get("hosts", "h200-measured-host")[0]
    assert cpu.first_touch_bytes_per_s == pytest.approx(16.63e9)
    assert "fit_host_first_touch.py" in cpu.sources["first_touch_bytes_per_s"]
    assert "trace_gpt_184m_b16_offload_overlap" in cpu.sources["first_touch_bytes_per_s"]
