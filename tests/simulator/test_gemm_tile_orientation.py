"""The GEMM tile model prices ``m x n x k`` and ``n x m x k`` alike (``C^T = B^T A^T``: the same product).

A fixed ``tile_m x tile_n`` = 128 x 256 tile used only one way round padded a 1024 x 128 output (the unfused
attention's ``probs @ V``, n = head dim 128) to 1024 x 256: half the tile FLOPs were padding, so the batched
GEMM was priced at twice its work. cuBLAS / CUTLASS ship both tile orientations (e.g. a CUTLASS 256 x 128
threadblock tile, NVIDIA/cutlass#956) and a GEMM may be run transposed.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hardware_models import presets
from hardware_models.profile import EfficiencyProfile, GemmEfficiency
from simulator.cost.roofline import RooflineCostModel


def _model(gpu_name="v100-sxm2-32gb", eff=0.7, wave_s=0.0):
    gpu = presets.get("gpus", gpu_name)
    prof = EfficiencyProfile(name="t", gpu=gpu.name,
                             gemm={"fp16": GemmEfficiency(eff, wave_overhead_s=wave_s, tile_m=128, tile_n=256)},
                             attention_efficiency={}, memory_bandwidth_bytes_per_s={"elementwise": 1e12})
    return gpu, RooflineCostModel(gpu, prof)


def test_skinny_n_uses_the_transposed_tile_worked_by_hand():
    gpu, cm = _model()
    # probs @ V of one MLM20 1.2B layer on a V100: 120 (batch x heads) products of 1024 x 128 x 1024.
    # 256 x 128 tiles: 120 x 4 x 1 = 480 tiles on 80 SMs = 6 waves of 2 * 128 * 256 * 1024 FLOPs at 0.7 x peak / 80
    # (the 128 x 256 orientation would take 960 tiles, half of each padding)
    t = cm.gemm_compute_s(1024, 128, 1024, "fp16", batch=120)
    per_sm = 125e12 / 80 * 0.7
    assert t == pytest.approx(480 / 80 * 2 * 128 * 256 * 1024 / per_sm, rel=1e-12)
    # = the useful FLOPs at 70% of peak: no padding left
    assert t == pytest.approx(2 * 120 * 1024 * 128 * 1024 / (125e12 * 0.7), rel=1e-12)


def test_shapes_that_both_orientations_tile_exactly_are_unchanged():
    gpu, cm = _model()
    # 8192 x 4096: 64 x 16 = 1024 tiles either way round
    t = cm.gemm_compute_s(8192, 4096, 1024, "fp16")
    assert t == pytest.approx(1024 / 80 * 2 * 128 * 256 * 1024 / (125e12 / 80 * 0.7), rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(m=st.integers(1, 20000), n=st.integers(1, 20000), k=st.integers(1, 8192), batch=st.integers(1, 300),
       wave=st.sampled_from([0.0, 4.6e-6]), held=st.integers(0, 40))
def test_transpose_invariant(m, n, k, batch, wave, held):
    _, cm = _model(wave_s=wave)
    a = cm.gemm_compute_s(m, n, k, "fp16", sm_held=held, batch=batch)
    b = cm.gemm_compute_s(n, m, k, "fp16", sm_held=held, batch=batch)
    assert a == pytest.approx(b, rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(m=st.integers(1, 20000), n=st.integers(1, 20000), k=st.integers(1, 8192))
def test_never_slower_than_the_single_orientation(m, n, k):
    import math

    gpu, cm = _model()
    one_way = math.ceil(m / 128) * math.ceil(n / 256) / 80 * 2 * 128 * 256 * k / (125e12 / 80 * 0.7)
    assert cm.gemm_compute_s(m, n, k, "fp16") <= one_way * (1 + 1e-12)
