"""Frames a run's summary does not read are built when first read: a pipeline result's stacked counters and
launches (``api.simulate_ranks``), and a run's recorded level samples apart from its memory timelines
(``RunRecords.samples``: what a stage's ``compute_clock_mhz`` reads)."""

from __future__ import annotations

import warnings

import pandas as pd

from simulator import load_scenario, run_scenario
from simulator.analysis.pipeline import compute_clock_mhz
from simulator.engine.run import run_graph
from simulator.graph.op_graph import GraphBuilder
from simulator.graph.ops import OpKind, TensorAlloc
from simulator.recording.deferred import Deferred, DeferredField
from tests.conftest import ROOT

SCALE = ROOT / "scenarios/scale/gpt3_175b_tp8_pp8_dp16.yaml"
#: GPT-3 175B layers as TP8 x PP2 x DP8 on 16 DGX H100 nodes at layer fidelity, a power limit (DVFS: clock samples)
SMALL = ["hardware.cluster.nodes=16", "parallelism.pipeline_model_parallel_size=2", "model.num_layers=24",
         "training.global_batch_size=64", "run.fidelity=layer"]


class _Levels:
    """A runtime recording a level ``gpu0 / sm_clock_mhz`` as each op starts: 1000 + 100 x its id."""

    components: list = []

    def __init__(self, system):
        self.system = system

    def hooks(self):
        return [self]

    def host_handlers(self):
        return {}

    def on_op_start(self, op, step, system):
        system.recorder.counter(system.env.now, "gpu0", "sm_clock_mhz", 1000 + 100 * op.id)


def test_samples_are_the_recorded_levels_without_the_memory_timelines(toy_hw):
    b = GraphBuilder()
    a = b.add("a", OpKind.COMPUTE, "compute", fixed_duration_s=1.0, allocs=(TensorAlloc("x", 8),))
    b.add("b", OpKind.COMPUTE, "compute", fixed_duration_s=2.0, deps=[a], uses=("x",))
    rec, _ = run_graph(b.build(), toy_hw, steps=2, attach=lambda env, system: _Levels(system))
    assert isinstance(DeferredField.raw(rec, "samples"), Deferred)  # not built by the run
    # ops a, b start at 0, 1 (step 0) and 3, 4 (step 1)
    want = pd.DataFrame({"t_s": [0.0, 1.0, 3.0, 4.0], "scope": ["gpu0"] * 4, "metric": ["sm_clock_mhz"] * 4,
                         "value": [1000, 1100, 1000, 1100]})
    pd.testing.assert_frame_equal(rec.samples, want.astype({"scope": rec.samples.scope.dtype,
                                                              "metric": rec.samples.metric.dtype}))
    levels = rec.counters[~rec.counters.metric.astype(str).str.startswith("memory_bytes")].reset_index(drop=True)
    pd.testing.assert_frame_equal(levels, rec.samples)  # the same rows of the counters, in their order


def test_pipeline_counters_and_launches_stacked_when_read():
    cfg = load_scenario(SCALE, [*SMALL, "dvfs.kind=power_cap", "dvfs.power_limit_w=500"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = run_scenario(cfg)
    assert isinstance(DeferredField.raw(r, "counters"), Deferred)
    assert isinstance(DeferredField.raw(r, "launches"), Deferred)
    stages = r.summary["pipeline"]["stages"]
    assert sorted(r.counters.pp_rank.unique()) == [0, 1] and sorted(r.launches.pp_rank.unique()) == [0, 1]
    for st in stages:  # each stage's clock from its recorded samples alone = from its whole counters frame
        k = st["pp_rank"]
        spans = r.spans[r.spans.pp_rank == k]
        counters = r.counters[r.counters.pp_rank == k]
        steps = r.steps.assign(warmup=r.steps.step < cfg.run.warmup_steps)
        assert st["compute_clock_mhz"] == compute_clock_mhz(spans, counters, steps)
        assert 0 < st["compute_clock_mhz"] < 1980  # held below the H100's boost clock by the 500 W limit
