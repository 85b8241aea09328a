"""A sweep reuses work across points (``safe_yaml.loads`` by text, ``api.build_graph`` by ``TransformerSpec`` inside
``api.reusing_graphs``); every point's row must still equal a fresh single run of that point."""

from __future__ import annotations

import math

import pytest

from hardware_models import safe_yaml
from simulator import api
from simulator.config.loader import load_scenario, resolve_hardware
from simulator.graph.ops import OpRole
from simulator.policies.registry import PolicyError, apply_graph_policies
from simulator.studies import sweep
from tests.conftest import ROOT

SCEN = ROOT / "scenarios/h200/dataloader_w2.yaml"
BASE = ["model.num_layers=2", "run.steps=3", "run.warmup_steps=1", "dvfs.kind=locked_clock"]
#: graph-sharing points (same micro-batch, other clocks / dataloader workers) around one that builds another graph
POINTS = [{"training.micro_batch_size": 2, "dvfs.locked_clocks_mhz": 1980, "dataloader.num_workers": 1},
          {"training.micro_batch_size": 2, "dvfs.locked_clocks_mhz": 1410, "dataloader.num_workers": 3},
          {"training.micro_batch_size": 3, "dvfs.locked_clocks_mhz": 1980, "dataloader.num_workers": 1},
          {"training.micro_batch_size": 2, "dvfs.locked_clocks_mhz": 1605, "dataloader.num_workers": 2}]
#: points of one built graph whose dataloader policy rewrites it otherwise (pageable input copies; a bigger batch
#: to copy) between points that share the rewritten graph: each must get its own (``api.policy_graph``)
POLICY_POINTS = [{"dataloader.pin_memory": p, "dataloader.sample.bytes": b, "dataloader.num_workers": w,
                  "dvfs.locked_clocks_mhz": 1980}
                 for p, b, w in [(True, "8200 B", 1), (False, "8200 B", 1), (True, "8 MB", 1), (True, "8200 B", 3)]]


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("points", [POINTS, POLICY_POINTS], ids=["built", "rewritten"])
def test_each_row_equals_a_fresh_run_of_its_point(points):
    api.forget_graphs()
    factors = {k: list(dict.fromkeys(p[k] for p in points)) for k in points[0]}
    df = sweep.run_sweep(SCEN, factors, BASE, workers=1, progress=False, points=points, log=lambda m: None)
    assert df["error"].isna().all()
    for point, row in zip(points, df.to_dict("records")):
        api.forget_graphs()
        safe_yaml._LOADS_CACHE.clear()
        fresh = sweep.flatten_summary(api.run_scenario(load_scenario(SCEN, BASE + [f"{k}={v}" for k, v in
                                                                                  point.items()])).summary)
        assert fresh["step_time_s"] > 0
        diff = {k: (row[k], v) for k, v in fresh.items() if not _same(row[k], v)}
        assert not diff, (point, diff)
    # the points did differ where the shared graph does not reach (clocks, workers), and where it does (pinning,
    # bytes per batch): each changes the step time
    assert len(set(df["step_time_s"])) == len(points)


def test_rewritten_graphs_are_shared_only_for_the_same_policy_settings():
    api.forget_graphs()
    cfg = {name: load_scenario(SCEN, BASE + ["dvfs.locked_clocks_mhz=1980"] + extra) for name, extra in {
        "a": [],
        "b": ["dvfs.locked_clocks_mhz=1410", "dataloader.num_workers=4"],  # read by no graph policy
        "pageable": ["dataloader.pin_memory=false"],
        "bigger": ["dataloader.sample.bytes=8 MB"],
        "offload": ["training.recompute_granularity=full", "activation_checkpointing.cpu_checkpointing=true"]}.items()}
    hw = {k: resolve_hardware(c) for k, c in cfg.items()}

    def graph(k):
        return api.policy_graph(cfg[k], 0, hw[k])

    assert graph("a") is not graph("a")  # outside the block: rewritten afresh each time
    with api.reusing_graphs():
        ga = graph("a")
        assert graph("b") is ga and graph("a") is ga
        assert graph("pageable") is not ga and graph("bigger") is not ga
        assert graph("offload") is not graph("offload")  # activation offload reads the host: never kept
        kept = {k: graph(k) for k in ("a", "pageable", "bigger")}
    api.forget_graphs()
    for k, g in kept.items():  # a kept graph is the graph a fresh rewrite gives
        fresh = apply_graph_policies(api.build_graph(cfg[k], 0, hw[k]), cfg[k], hw[k])
        assert g.ops == fresh.ops and g.policies == fresh.policies == ("dataloader",)
    inputs = [op for op in kept["pageable"].ops if op.role is OpRole.INPUT_COPY]
    assert inputs and not any(op.pinned for op in inputs)


def test_a_refused_policy_setting_is_refused_inside_reusing_graphs_too():
    bad = load_scenario(SCEN, BASE + ["dvfs.locked_clocks_mhz=1980", "dataloader.batch_size=3"])  # micro-batch 8: one batch is one micro-batch
    hw = resolve_hardware(bad)
    with api.reusing_graphs(), pytest.raises(PolicyError, match="must equal training.micro_batch_size"):
        api.policy_graph(bad, 0, hw)
    api.forget_graphs()


def test_graphs_are_shared_only_inside_reusing_graphs_and_only_for_the_same_spec():
    api.forget_graphs()
    a = load_scenario(SCEN, BASE + ["dvfs.locked_clocks_mhz=1980"])
    b = load_scenario(SCEN, BASE + ["dvfs.locked_clocks_mhz=1410", "dataloader.num_workers=4"])
    c = load_scenario(SCEN, BASE + ["dvfs.locked_clocks_mhz=1980", "training.micro_batch_size=3"])
    assert api.build_graph(a) is not api.build_graph(a)  # outside the block: a fresh build each time
    with api.reusing_graphs():
        ga = api.build_graph(a)
        assert api.build_graph(b) is ga  # the builder reads neither clocks nor dataloader settings
        assert api.build_graph(c) is not ga and len(api.build_graph(c)) == len(ga)
    api.forget_graphs()


def test_the_graph_cache_is_bounded_by_ops(monkeypatch):
    api.forget_graphs()
    monkeypatch.setattr(api._GraphCache, "MAX_OPS", 1)  # smaller than any graph: nothing is kept
    with api.reusing_graphs():
        cfg = load_scenario(SCEN, BASE + ["dvfs.locked_clocks_mhz=1980"])
        assert api.build_graph(cfg) is not api.build_graph(cfg)
    assert not api._GRAPHS.graphs


def test_loads_hands_out_copies_of_a_cached_parse():
    text = "a: {b: [1, 2]}\nc: 3\n"
    first = safe_yaml.loads(text)
    first["a"]["b"].append(99)
    first["c"] = 0
    assert safe_yaml.loads(text) == {"a": {"b": [1, 2]}, "c": 3}
    with pytest.raises(safe_yaml.YamlInputError):  # a refused text is refused every time, not cached
        safe_yaml.loads("a: 1\na: 2\n")
    with pytest.raises(safe_yaml.YamlInputError):
        safe_yaml.loads("a: 1\na: 2\n")


def test_loads_keeps_no_long_text():
    text = "a: " + "x" * (safe_yaml.LOADS_CACHE_MAX_TEXT + 1) + "\n"
    assert safe_yaml.loads(text) == {"a": "x" * (safe_yaml.LOADS_CACHE_MAX_TEXT + 1)}
    assert text not in safe_yaml._LOADS_CACHE
    safe_yaml.loads("c: 3\n")
    assert "c: 3\n" in safe_yaml._LOADS_CACHE  # a short one is kept
