"""DVFS properties (hypothesis): lower locked clocks on GEMM-bound and memory-bound steps."""

from __future__ import annotations

import warnings

from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.config.loader import resolve_hardware, scenario_from_dict
from simulator.api import simulate_graph
from simulator.graph.op_graph import GraphBuilder
from simulator.graph.ops import CostClass, OpKind, Phase
from tests.conftest import ROOT

import yaml

BASE = yaml.safe_load((ROOT / "scenarios/h200/gpt_184m_b8.yaml").read_text())
SUPPORTED = [1980.0 - 15 * i for i in range(110)]  # the H200's list, 1980..345 MHz


def cfg_at(clock: float):
    d = {**BASE, "dvfs": {"kind": "locked_clock", "locked_clocks_mhz": clock}}
    return scenario_from_dict(d)


def run(graph, clock: float) -> dict:
    cfg = cfg_at(clock)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return simulate_graph(graph, resolve_hardware(cfg), steps=3, warmup_steps=1, cfg=cfg).summary


@st.composite
def gemm_graphs(draw):
    b = GraphBuilder()
    prev = []
    for i in range(draw(st.integers(1, 6))):
        m, n, k = (draw(st.sampled_from([2048, 4096, 8192])) for _ in range(3))
        prev = [b.add(f"g{i}", OpKind.COMPUTE, "compute", deps=prev, phase=Phase.FWD, cost_class=CostClass.GEMM,
                      shape=(m, n, k), flops=2.0 * m * n * k, bytes_read=2.0 * (m * k + k * n), bytes_written=2.0 * m * n)]
    return b.build(samples_per_step=1, tokens_per_step=1)


@st.composite
def memory_graphs(draw):
    b = GraphBuilder()
    prev = []
    for i in range(draw(st.integers(1, 6))):
        nbytes = draw(st.sampled_from([2**28, 2**29, 2**30]))
        prev = [b.add(f"e{i}", OpKind.COMPUTE, "compute", deps=prev, phase=Phase.FWD,
                      cost_class=draw(st.sampled_from([CostClass.ELEMENTWISE, CostClass.CAST, CostClass.NORM])),
                      flops=draw(st.sampled_from([0.0, nbytes / 8])), bytes_read=nbytes, bytes_written=nbytes / 2,
                      dtype="fp32")]
    return b.build(samples_per_step=1, tokens_per_step=1)


clock_pairs = st.tuples(st.sampled_from(SUPPORTED), st.sampled_from(SUPPORTED)).map(sorted).filter(lambda p: p[0] < p[1])


@settings(max_examples=25, deadline=None)
@given(gemm_graphs(), clock_pairs)
def test_gemm_bound_step_lower_clock_never_faster_never_more_power(g, clocks):
    lo, hi = clocks
    s_lo, s_hi = run(g, lo), run(g, hi)
    assert s_lo["step_time_s"] >= s_hi["step_time_s"] * (1 - 1e-9)
    assert s_lo["avg_power_w"] <= s_hi["avg_power_w"] * (1 + 1e-9)
    assert s_lo["energy_j_per_step"] > 0


@settings(max_examples=25, deadline=None)
@given(memory_graphs(), clock_pairs)
def test_memory_bound_step_slows_far_less_than_the_clock(g, clocks):
    lo, hi = clocks
    s_lo, s_hi = run(g, lo), run(g, hi)
    slowdown = s_lo["step_time_s"] / s_hi["step_time_s"] - 1
    proportional = hi / lo - 1
    assert slowdown <= 0.25 * proportional + 1e-9
    assert s_lo["avg_power_w"] <= s_hi["avg_power_w"] * (1 + 1e-9)
