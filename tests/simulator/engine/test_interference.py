"""Compute/communication interference: SMs stolen with wave quantisation, HBM share, collectives slowed
by compute (hand-worked on a toy machine), a monotonicity property and the dp8 scenario against the
published figures (Lee et al. 2025, arXiv 2507.03114)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hardware_models.collectives import NcclConfig, load_collective_profile
from hardware_models.gpu import GpuSpec
from hardware_models.presets import PresetError
from simulator.api import run_scenario, simulate_graph
from simulator.config.loader import load_scenario
from simulator.cost.interference import MIN_HBM_SHARE, CommLoad, kernel_share
from simulator.cost.roofline import RooflineCostModel
from simulator.graph.op_graph import GraphBuilder
from simulator.graph.ops import CostClass, OpKind
from tests.conftest import ROOT, make_hw

DP8 = ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml"
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # the profile-for-another-GPU notice


class _ToyModel:
    """A collective model: t = bytes / 1 GB/s, busbw as given; interference factors as given."""

    def __init__(self, sm: int = 10, beta: float = 2.0, gamma: float = 0.25, busbw: float = 100e9):
        self.profile = SimpleNamespace(name="toy", host_dispatch_s=0.0, nccl_sm_channels=sm,
                                       hbm_bytes_per_bus_byte=beta, overlap_comm_slowdown=gamma)
        self.busbw = busbw

    def price(self, op, group, nbytes, nccl):
        return SimpleNamespace(time_s=nbytes / 1e9, busbw_bytes_per_s=self.busbw)


def _hw(interference: bool = True, **kw):
    """make_hw (100 SMs, 1 PFLOP/s bf16, 1 TB/s memory kernels, 1x1 GEMM tiles) with a toy collective model."""
    hw = make_hw()
    hw.collectives, hw.dp_group, hw.world_size = _ToyModel(**kw), (0, 1), 2
    hw.nccl = NcclConfig(interference=interference)
    return hw


def _ar(b, nbytes, deps=()):
    return b.add("AR", OpKind.COLLECTIVE, "comm.dp", deps=deps,
                 meta={"collective": "all_reduce", "bytes": int(nbytes), "group": "dp"})


def _gemm(b, tiles, wave_s=1e-3, deps=()):
    # (tiles, 1, k) on 1x1 tiles: one tile = 2k flop at 1e15 / 100 SMs per SM -> k = wave_s * 5e12
    return b.add("G", OpKind.COMPUTE, "compute", deps=deps, cost_class=CostClass.GEMM, dtype="bf16",
                 shape=(tiles, 1, int(wave_s * 5e12)))


def _span(r, name):
    return r.spans[r.spans.name == name].iloc[0]


@pytest.mark.parametrize("tiles, held, waves", [(100, 0, 1), (100, 1, 2), (100, 10, 2), (100, 50, 2), (100, 75, 4),
                                                (50, 50, 1), (50, 51, 2), (250, 10, 3)])
def test_gemm_beside_a_collective_takes_the_quantised_waves(tiles, held, waves):
    # a 1 s all-reduce holds `held` SMs for the GEMM's whole life: ceil(tiles / (100 - held)) waves of 1 ms
    # instead of the fitted tiles / 100 (held = 0: interference on, nothing stolen)
    b = GraphBuilder()
    _ar(b, 1e9)
    _gemm(b, tiles)
    r = simulate_graph(b.build(samples_per_step=1.0), _hw(sm=held), steps=1)
    base = tiles / 100 * 1e-3
    assert _span(r, "G").duration_s == pytest.approx(base * waves / np.ceil(tiles / 100), rel=1e-9)


def test_one_wave_h100_gemm_doubles_beside_an_all_gather_holding_24_sms():
    # forum thread 337991: 132 blocks on 132 SMs, 24 taken -> a second wave (tile model without overheads)
    gpu = GpuSpec(name="h", peak_flops_per_s={"bf16": 989e12}, hbm_capacity_bytes=80e9,
                  hbm_bandwidth_bytes_per_s=3.35e12, sm_count=132, max_sm_clock_mhz=1980)
    from simulator.config.loader import generic_profile
    from tests.conftest import make_hw as _m

    cost = RooflineCostModel(gpu, generic_profile(gpu, _m().pcie, "h"))
    m, n = 128 * 12, 256 * 11  # 132 tiles of 128 x 256
    alone = cost.gemm_compute_s(m, n, 4096, "bf16")
    assert cost.gemm_compute_s(m, n, 4096, "bf16", sm_held=24) == pytest.approx(2 * alone, rel=1e-12)
    assert cost.gemm_compute_s(m, n, 4096, "bf16", sm_held=0) == alone


def test_memory_bound_kernel_keeps_its_hbm_share():
    # collective traffic 2 x 100 GB/s of the 1 TB/s HBM -> the kernel keeps 0.8: 1 ms of bytes takes 1.25 ms
    b = GraphBuilder()
    _ar(b, 1e9)
    b.add("E", OpKind.COMPUTE, "compute", cost_class=CostClass.ELEMENTWISE, bytes_read=1e9)
    r = simulate_graph(b.build(samples_per_step=1.0), _hw(), steps=1)
    assert _span(r, "E").duration_s == pytest.approx(1.25e-3, rel=1e-9)
    assert kernel_share([CommLoad(10, 2e11), CommLoad(95, 9e11)], 100, 1e12) == (99, MIN_HBM_SHARE)


def test_collective_overlapped_by_compute_is_slowed_by_gamma_then_runs_alone():
    # A [0, 1 ms]; then the all-reduce (1.01 ms alone) and B (1 ms of bytes) start together.
    # B keeps 0.8 of HBM: 1.25 ms, ends at 2.25 ms. The all-reduce runs at 1 / 1.25 = 0.8 while B runs:
    # 1.0 ms of its work by 2.25 ms, the last 0.01 ms alone -> ends at 2.26 ms; exposed = 0.01 ms.
    def graph():
        b = GraphBuilder()
        a = b.add("A", OpKind.COMPUTE, "compute", cost_class=CostClass.ELEMENTWISE, bytes_read=1e9)
        _ar(b, 1_010_000, deps=[a])
        b.add("B", OpKind.COMPUTE, "compute", cost_class=CostClass.ELEMENTWISE, bytes_read=1e9)
        return b.build(samples_per_step=1.0)

    r = simulate_graph(graph(), _hw(), steps=1)
    assert _span(r, "AR").end_s == pytest.approx(2.26e-3, rel=1e-9)
    assert _span(r, "B").end_s == pytest.approx(2.25e-3, rel=1e-9)
    assert r.summary["step_time_s"] == pytest.approx(2.26e-3, rel=1e-9)
    assert r.summary["exposed_comm_s"] == pytest.approx(1e-5, rel=1e-6)
    off = simulate_graph(graph(), _hw(interference=False), steps=1).summary
    assert off["step_time_s"] == pytest.approx(2.01e-3, rel=1e-9)  # 1 ms + 1.01 ms, B hidden


def test_collective_alone_keeps_its_isolated_time():
    b = GraphBuilder()
    a = b.add("A", OpKind.COMPUTE, "compute", cost_class=CostClass.ELEMENTWISE, bytes_read=1e9)
    c = _ar(b, 1_010_000, deps=[a])
    b.add("B", OpKind.COMPUTE, "compute", deps=[c], cost_class=CostClass.ELEMENTWISE, bytes_read=1e9)
    s = simulate_graph(b.build(samples_per_step=1.0), _hw(), steps=1).summary
    assert s["step_time_s"] == pytest.approx(3.01e-3, rel=1e-9)


def test_collective_starting_mid_kernel_re_rates_the_kernel():
    # GEMM of one 1 ms wave from 0; a host op of 0.5 ms delays the 10 ms all-reduce to 0.5 ms. The GEMM does
    # half its work alone, the other half at 1/2 (two waves on 90 SMs): ends at 1.5 ms. The all-reduce runs at
    # 0.8 for that 1 ms (0.8 ms of work), the remaining 9.2 ms alone: ends at 10.7 ms.
    b = GraphBuilder()
    _gemm(b, 100)
    h = b.add("H", OpKind.HOST, "host", host_s=0.5e-3)
    _ar(b, 1e7, deps=[h])
    r = simulate_graph(b.build(samples_per_step=1.0), _hw(), steps=1)
    assert _span(r, "G").end_s == pytest.approx(1.5e-3, rel=1e-9)
    assert _span(r, "AR").start_s == pytest.approx(0.5e-3, rel=1e-9)
    assert _span(r, "AR").end_s == pytest.approx(10.7e-3, rel=1e-9)


_op = st.tuples(st.sampled_from(["gemm", "mem", "coll", "host"]), st.integers(1, 400), st.floats(1e-5, 2e-3),
                st.lists(st.integers(0, 30), max_size=3))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, min_size=1, max_size=14), sm=st.integers(0, 99), beta=st.floats(0, 20),
       gamma=st.floats(0, 2), steps=st.integers(1, 2))
def test_interference_never_makes_a_step_faster(ops, sm, beta, gamma, steps):
    def graph():
        b = GraphBuilder()
        for i, (kind, tiles, t, deps) in enumerate(ops):
            d = [x for x in deps if x < i]
            if kind == "gemm":
                _gemm(b, tiles, t, deps=d)
            elif kind == "mem":
                b.add(f"E{i}", OpKind.COMPUTE, "compute", deps=d, cost_class=CostClass.ELEMENTWISE, bytes_read=t * 1e12)
            elif kind == "coll":
                _ar(b, t * 1e9, deps=d)
            else:
                b.add(f"H{i}", OpKind.HOST, "host", deps=d, host_s=t)
        return b.build(samples_per_step=1.0)

    kw = {"sm": sm, "beta": beta, "gamma": gamma}
    on = simulate_graph(graph(), _hw(True, **kw), steps=steps)
    off = simulate_graph(graph(), _hw(False, **kw), steps=steps)
    assert on.summary["step_time_s"] >= off.summary["step_time_s"] * (1 - 1e-12)
    d_on = on.spans.set_index(["step", "op_id"]).duration_s
    d_off = off.spans.set_index(["step", "op_id"]).duration_s.reindex(d_on.index)
    assert (d_on >= d_off * (1 - 1e-9) - 1e-15).all()


# -- the bundled dp8 scenario -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dp8():
    short = ["run.steps=2", "run.warmup_steps=1"]
    return {i: run_scenario(load_scenario(DP8, short + [f"nccl.interference={i}"])) for i in ("true", "false")}


def test_dp8_overlapped_compute_slowdown_in_the_published_range(dp8):
    on, off = dp8["true"].spans, dp8["false"].spans
    coll = on[on.kind == "collective"][["start_s", "end_s"]].to_numpy()
    comp = on[on.kind == "compute"]
    overlapped = [((coll[:, 0] < e) & (coll[:, 1] > s)).any() for s, e in zip(comp.start_s, comp.end_s)]
    k = comp[overlapped].set_index(["step", "op_id"]).duration_s
    base = off[off.kind == "compute"].set_index(["step", "op_id"]).duration_s.reindex(k.index)
    slowdown = k.sum() / base.sum() - 1
    assert 0.10 <= slowdown <= 0.40, (
        f"overlapped compute {slowdown:.1%} slower; published: 18.9% on average, up to 40% (Lee et al. 2025, "
        "arXiv 2507.03114)")
    s_on, s_off = dp8["true"].summary, dp8["false"].summary
    assert s_on["step_time_s"] > s_off["step_time_s"]
    # every bucket overlaps backward, so the all-reduces take close to 1 + gamma = 1.3x their isolated time
    assert 1.15 < s_on["comm_s_by_group"]["dp"] / s_off["comm_s_by_group"]["dp"] <= 1.3 + 1e-9


def test_dp8_reports_the_factors_or_that_interference_is_off(dp8):
    w_on = dp8["true"].summary["warnings"]
    assert any("holds 24 of 132 SMs" in x and "1.30x slower" in x and "3 x its bus bandwidth" in x for x in w_on)
    assert not any("interference off" in x for x in w_on)
    assert any("interference off (nccl.interference: false)" in x for x in dp8["false"].summary["warnings"])


def test_nchannels_sets_the_sms_held():
    cfg = load_scenario(DP8, ["nccl.nchannels=8"])
    from simulator.api import run_warnings
    from simulator.config.loader import resolve_hardware

    assert any("holds 8 of 132 SMs (nccl.nchannels" in x for x in run_warnings(resolve_hardware(cfg), cfg))


def test_every_collective_preset_has_cited_factors():
    for name in ("dgx-h100", "dgx-h200", "dgx-a100", "pcie-gen4", "pcie-gen5"):
        p = load_collective_profile(name)
        for f in ("nccl_sm_channels", "hbm_bytes_per_bus_byte", "overlap_comm_slowdown"):
            assert p.sources.get(f), (name, f)
    assert load_collective_profile("dgx-h100").nccl_sm_channels == 24
    with pytest.raises(PresetError, match="nccl_sm_channels"):
        load_collective_profile("dgx-h100", {"nccl_sm_channels": -1})
    with pytest.raises(PresetError, match="overlap_comm_slowdown"):
        load_collective_profile("dgx-h100", {"overlap_comm_slowdown": -0.1})


def test_bad_interference_value_is_one_line_exit_2():
    p = subprocess.run([sys.executable, "-m", "simulator", "run", str(DP8), "--set", "nccl.interference=sometimes"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "nccl.interference" in p.stderr and len(p.stderr.strip().splitlines()) == 1
