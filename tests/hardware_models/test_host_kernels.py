"""Host roofline of streaming optimizer kernels: hand-worked cases on round-number hosts, invariants, bad specs."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hardware_models.host import HostCpuSpec
from hardware_models.host_kernels import (
    MMAP_THRESHOLD_BYTES,
    StreamPass,
    adamw_passes,
    adamw_step_s,
    pass_time_s,
    stream_bandwidth,
    vector_slots_per_s,
)

# 2 sockets x 4 cores, 1000 MHz, 256-bit (8 fp32 lanes), 1 FMA pipe: 8e9 slots/s per core.
# 4 channels x 1000 MT/s x 8 B = 32 GB/s peak per socket, x 0.5 sustained = 16 GB/s per socket.
ROUND = HostCpuSpec("round", 8, 1e10, sockets=2, simd_width_bits=256, fma_units_per_core=1, base_clock_mhz=1000,
                    memory_channels_per_socket=4, memory_rate_mt_per_s=1000, sustained_bandwidth_fraction=0.5,
                    per_core_bandwidth_bytes_per_s=5e9, page_fault_s=4096e-9)


def test_bandwidths_by_hand():
    assert ROUND.peak_memory_bandwidth_bytes_per_s == 64e9
    assert ROUND.sustained_bandwidth_bytes_per_s == 32e9
    assert stream_bandwidth(ROUND) == 32e9  # 8 threads x 5 GB/s = 40 > 2 nodes x 16
    assert stream_bandwidth(ROUND, memory_nodes=1) == 16e9  # memory on one node
    assert stream_bandwidth(ROUND, threads=2) == 10e9  # 2 cores x 5 GB/s bind
    assert vector_slots_per_s(ROUND) == 8 * 1e9 * 1 * 8


def test_bandwidth_bound_pass_exact():
    """1e9 elements x 16 B / 32 GB/s = 0.5 s; compute 1 slot x 1e9 / 64e9 = 15.6 ms: memory wins."""
    assert pass_time_s(StreamPass("add", 12, 4), 1e9, ROUND) == pytest.approx(0.5)


def test_compute_bound_pass_exact():
    """100 slots/element: 1e9 x 100 / 64e9 slots/s = 1.5625 s > 16 B / 32 GB/s = 0.5 s."""
    assert pass_time_s(StreamPass("heavy", 12, 4, slots=100), 1e9, ROUND) == pytest.approx(1.5625)


def test_first_touch_by_hand():
    """4 fresh B/element x 1e9 = 4e9 B = 976562.5 pages x 4096 ns / 8 threads = 0.5 s on top of
    8 B / 32 GB/s = 0.25 s."""
    assert pass_time_s(StreamPass("sqrt", 4, 0, 4), 1e9, ROUND, fresh_elements=1e9) == pytest.approx(0.75)


def test_foreach_step_by_hand():
    """One fp32 tensor of 1e9: 80 B / 32 GB/s = 2.5 s, the sqrt output faults (0.5 s); compute:
    sqrt 6 slots / 64e9 = 94 ms < its 8 B / 32 GB/s = 250 ms, so memory binds every pass. 9
    dispatches of 1 ms."""
    assert adamw_step_s(ROUND, "torch_foreach", [1e9], dispatch_s=1e-3) == pytest.approx(2.5 + 0.5 + 9e-3)
    # torch_single: a second fresh temporary (the div), same 80 B
    assert adamw_step_s(ROUND, "torch_single", [1e9]) == pytest.approx(2.5 + 1.0)
    # DeepSpeed: one pass, 16 B read + 12 B written + 2 B half copy; nothing fresh
    assert adamw_step_s(ROUND, "deepspeed_cpu_adam", [1e9]) == pytest.approx(30e9 / 32e9)
    # DeepSpeed 0.3 (2020): the AVX loop 28 B, then the fp16 copy loop (reads 4 B, writes 2 B) bound by its
    # scalar conversion, 13.175 cycles x 1e9 / (8 cores x 1 GHz); one call
    assert adamw_step_s(ROUND, "deepspeed_cpu_adam_2020", [1e9], dispatch_s=1e-3) == \
        pytest.approx(28e9 / 32e9 + 13.175 / 8 + 1e-3)


def test_small_fresh_outputs_do_not_fault():
    """Fresh outputs totalling under 32 MiB are recycled by malloc: no page-fault term."""
    n = MMAP_THRESHOLD_BYTES / 4 - 1
    assert adamw_step_s(ROUND, "torch_foreach", [n]) == pytest.approx(80 * n / 32e9)


def test_pass_bytes_match_the_documented_traffic():
    assert sum(p.bytes for p in adamw_passes("torch_foreach")) == 80
    assert sum(p.bytes for p in adamw_passes("deepspeed_cpu_adam")) == 30
    assert [p.bytes for p in adamw_passes("deepspeed_cpu_adam_2020")] == [28, 6]
    assert sum(p.bytes for p in adamw_passes("torch_fused")) == 28
    assert sum(p.bytes for p in adamw_passes("torch_foreach", state_bytes=2, grad_bytes=2)) == 40
    with pytest.raises(ValueError, match="unknown optimizer implementation"):
        adamw_passes("adafactor")


@settings(max_examples=60, deadline=None)
@given(impl=st.sampled_from(["torch_foreach", "torch_single", "torch_fused", "deepspeed_cpu_adam"]),
       threads=st.integers(1, 7), bw_scale=st.floats(1.0, 8.0), per_core=st.floats(1e9, 4e10),
       n=st.floats(1e6, 1e10))
def test_more_bandwidth_or_threads_never_slower(impl, threads, bw_scale, per_core, n):
    base = dataclasses.replace(ROUND, per_core_bandwidth_bytes_per_s=per_core, threads_used=threads)
    t0 = adamw_step_s(base, impl, [n], dispatch_s=1e-6)
    more_bw = dataclasses.replace(base, sustained_bandwidth_fraction=min(1.0, 0.5 * bw_scale))
    more_t = dataclasses.replace(base, threads_used=threads + 1)
    assert adamw_step_s(more_bw, impl, [n], dispatch_s=1e-6) <= t0 * (1 + 1e-12)
    assert adamw_step_s(more_t, impl, [n], dispatch_s=1e-6) <= t0 * (1 + 1e-12)


@pytest.mark.parametrize("kw, match", [
    ({"threads_used": 9}, "threads 9 exceeds the 8 physical cores"),
    ({"numa_node": 2}, "numa_node 2 does not exist: this host has 2 NUMA node"),
    ({"numa_node": 1, "threads_used": 5}, "exceeds the 4 physical cores of NUMA node 1"),
    ({"sockets": 3}, "sockets must be > 0 and divide cores"),
    ({"simd_width_bits": 384}, "simd_width_bits"),
    ({"sustained_bandwidth_fraction": 1.5}, "sustained_bandwidth_fraction"),
])
def test_bad_cpu_specs_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(ROUND, **kw)


def test_bound_node_gets_its_cores_and_one_node_of_bandwidth():
    bound = dataclasses.replace(ROUND, numa_node=1)
    assert bound.threads == 4 and stream_bandwidth(bound) == 16e9


def test_default_page_fault_is_the_fitted_one():
    """Hosts without their own page_fault_s borrow the H200 host's fitted value (module docstring)."""
    from hardware_models import presets
    from hardware_models.host_kernels import DEFAULT_PAGE_FAULT_S

    assert presets.get("hosts", "h200-measured-host")[0].page_fault_s == pytest.approx(DEFAULT_PAGE_FAULT_S, rel=1e-3)


def test_first_touch_by_hand():
    """ROUND faults a page in 4.096 us: 1 MiB = 256 pages = 1.048576 ms on one thread, a quarter on 4."""
    from hardware_models.host_kernels import first_touch_s

    assert first_touch_s(ROUND, 2**20) == pytest.approx(256 * 4096e-9, rel=1e-12)
    assert first_touch_s(ROUND, 2**20, threads=4) == pytest.approx(64 * 4096e-9, rel=1e-12)
    assert first_touch_s(ROUND, 0.0) == 0.0
    with pytest.raises(ValueError, match="nbytes must be >= 0 and threads >= 1"):
        first_touch_s(ROUND, -1.0)


def test_first_touch_without_a_host_figure_borrows_the_default():
    from hardware_models.host_kernels import DEFAULT_PAGE_FAULT_S, first_touch_s

    assert first_touch_s(None, 4096) == first_touch_s(dataclasses.replace(ROUND, page_fault_s=0.0), 4096) \
        == DEFAULT_PAGE_FAULT_S


def test_half_conversion_is_a_scalar_pass_by_hand():
    """DeepSpeed 0.3's (__half) loop: 22.52 instructions / 4 per cycle + 0.503 mispredicts x 15 cycles = 5.63 + 7.545
    = 13.175 cycles per element; on ROUND (8 cores at 1 GHz) 1e9 elements take 13.175 / 8 = 1.646875 s against
    6 B x 1e9 / 32 GB/s = 0.1875 s of DRAM: the scalar code binds."""
    from hardware_models.host_kernels import HALF_CONVERT_CYCLES

    assert HALF_CONVERT_CYCLES == pytest.approx(13.175, rel=1e-12)
    half = adamw_passes("deepspeed_cpu_adam_2020")[1]
    assert (half.bytes, half.slots, half.scalar_cycles) == (6.0, 0.0, HALF_CONVERT_CYCLES)
    assert pass_time_s(half, 1e9, ROUND) == pytest.approx(13.175 / 8, rel=1e-12)
    assert pass_time_s(half, 1e9, dataclasses.replace(ROUND, base_clock_mhz=0)) == pytest.approx(0.1875)


def test_release_avx_loop_divides_twice_by_hand():
    """DeepSpeed 0.3's AVX-512 loop: 8 FMA-pipe ops (weight decay, 2 momentum, 3 variance, + eps, the update), one
    sqrt (6 slots) and two divisions (``sqrt(v) / bias2_sqrt`` and ``m / (.. + eps)``, 5 slots each) = 24 slots per
    element; the later kernel divides once: 19. On ROUND at 100 MHz (8 cores x 0.1 GHz x 1 pipe x 8 lanes =
    6.4e9 slots/s) 1e9 elements take 24e9 / 6.4e9 = 3.75 s (19: 2.96875 s), above 28 B x 1e9 / 32 GB/s = 0.875 s."""
    slow = dataclasses.replace(ROUND, base_clock_mhz=100)
    release, later = adamw_passes("deepspeed_cpu_adam_2020")[0], adamw_passes("deepspeed_cpu_adam", copy_bytes=0)[0]
    assert (release.slots, later.slots) == (24.0, 19.0)
    assert pass_time_s(release, 1e9, slow) == pytest.approx(3.75, rel=1e-12)
    assert pass_time_s(later, 1e9, slow) == pytest.approx(2.96875, rel=1e-12)
