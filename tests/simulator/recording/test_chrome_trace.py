"""The Perfetto trace: host launch slices, waits, ProfilerStep annotations and flows.

The tiny case is worked out by hand on the toy machine (tests/conftest.py): launches cost 0.1 s,
a 1 GB H2D copy at 1 GB/s takes 1 s, the kernel 0.5 s, and the host then waits on a SYNC:
    host   launch copy [0, 0.1]  launch k [0.1, 0.2]  wait: sync [0.2, 1.6]
    h2d    copy [0.1, 1.1]       compute  k [1.1, 1.6]
Step 1 repeats it 1.6 s later.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from simulator.api import simulate_graph
from simulator.graph.op_graph import GraphBuilder
from simulator.graph.ops import OpKind
from simulator.recording.chrome_trace import result_trace
from tests.conftest import make_hw


@pytest.fixture(scope="module")
def tiny():
    b = GraphBuilder()
    c = b.add("copy", OpKind.MEMCPY_H2D, "h2d", bytes_read=1e9)
    k = b.add("k", OpKind.COMPUTE, "compute", deps=[c], fixed_duration_s=0.5)
    b.add("sync", OpKind.SYNC, "host", deps=[k])
    return result_trace(simulate_graph(b.build(), make_hw(launch_s=0.1), steps=2))


def _x(trace, **match):
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and all(e.get(k) == v for k, v in match.items())]


def _round(events):
    return [(e["name"], round(e["ts"] / 1e6, 9), round((e["ts"] + e["dur"]) / 1e6, 9)) for e in events]


def test_host_track_holds_launches_waits_and_steps(tiny):
    host = sorted(_x(tiny, pid=0), key=lambda e: (e["ts"], -e["dur"]))
    assert _round(host) == [
        ("ProfilerStep#0", 0.0, 1.6), ("cudaMemcpyAsync", 0.0, 0.1), ("cudaLaunchKernel", 0.1, 0.2),
        ("wait: sync", 0.2, 1.6),
        ("ProfilerStep#1", 1.6, 3.2), ("cudaMemcpyAsync", 1.6, 1.7), ("cudaLaunchKernel", 1.7, 1.8),
        ("wait: sync", 1.8, 3.2),
    ]
    assert all(e["dur"] > 0 for e in host)
    # the zero-length SYNC itself is an instant event, not a slice
    assert [(e["name"], e["ts"] / 1e6) for e in tiny["traceEvents"] if e["ph"] == "i"] == [("sync", 1.6), ("sync", 3.2)]


def test_flows_link_launch_to_gpu_op_and_cross_stream_dependencies(tiny):
    tid_name = {(e["pid"], e["tid"]): e["args"]["name"] for e in tiny["traceEvents"] if e["name"] == "thread_name"}
    flows = defaultdict(dict)
    for e in tiny["traceEvents"]:
        if e["ph"] in ("s", "f"):
            flows[e["id"]][e["ph"]] = (e["cat"], tid_name[(e["pid"], e["tid"])], round(e["ts"] / 1e6, 9))
            if e["ph"] == "f":
                assert e["bp"] == "e"
    got = sorted((v["s"][0], v["s"][1:], v["f"][1:]) for v in flows.values())
    assert got == sorted([
        ("ac2g", ("host", 0.0), ("h2d", 0.1)), ("ac2g", ("host", 0.1), ("compute", 1.1)),
        ("ac2g", ("host", 1.6), ("h2d", 1.7)), ("ac2g", ("host", 1.7), ("compute", 2.7)),
        ("dependency", ("h2d", 0.1), ("compute", 1.1)), ("dependency", ("h2d", 1.7), ("compute", 2.7)),
        ("dependency", ("compute", 1.1), ("host", 0.2)), ("dependency", ("compute", 2.7), ("host", 1.8)),
    ])
    # Kineto convention: a launch and its GPU op share args.correlation, the ac2g flow id
    launch = {e["args"]["correlation"] for e in _x(tiny, cat="cuda_runtime")}
    gpu = {e["args"]["correlation"] for e in tiny["traceEvents"] if e["ph"] == "X" and e["pid"] == 1}
    assert launch == gpu == {1, 2, 3, 4}


def _check_structure(trace, n_steps):
    ev = trace["traceEvents"]
    xs = [e for e in ev if e["ph"] == "X"]
    assert all(e["dur"] > 0 for e in xs if e["pid"] == 0)
    # every flow has exactly one start and one end, each inside a slice of its thread
    by_thread = defaultdict(list)
    for e in xs:
        by_thread[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    ends = defaultdict(list)
    for e in ev:
        if e["ph"] in ("s", "f"):
            ends[e["id"]].append(e["ph"])
            assert any(a <= e["ts"] <= b for a, b in by_thread[(e["pid"], e["tid"])]), e
    assert ends and all(sorted(v) == ["f", "s"] for v in ends.values())
    # ProfilerStep#0..N-1 tile the main thread and hold every other slice on it
    steps = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in xs if e["name"].startswith("ProfilerStep#"))
    assert [s[2] for s in steps] == [f"ProfilerStep#{i}" for i in range(n_steps)]
    assert all(steps[i][1] == pytest.approx(steps[i + 1][0]) for i in range(n_steps - 1))
    main = sorted((e["ts"], e["ts"] + e["dur"]) for e in xs if e["pid"] == 0 and e["tid"] == 1
                  and not e["name"].startswith("ProfilerStep#"))
    assert main and all(steps[0][0] - 1e-3 <= a and b <= steps[-1][1] + 1e-3 for a, b in main)
    assert all(main[i][1] <= main[i + 1][0] + 1e-3 for i in range(len(main) - 1))  # no overlap on the thread


@pytest.mark.parametrize("name", ["gpt_184m_b16_offload_overlap", "dataloader_w0"])
def test_scenario_trace_structure(name):
    from simulator import load_scenario, run_scenario
    from tests.conftest import ROOT

    res = run_scenario(load_scenario(ROOT / f"scenarios/h200/{name}.yaml", ["run.steps=3"]))
    trace = json.loads(json.dumps(result_trace(res)))  # strict JSON round trip
    _check_structure(trace, 3)
    cats = {e.get("cat") for e in trace["traceEvents"] if e["ph"] == "s"}
    assert cats == {"ac2g", "dependency"}


def test_hta_reads_the_steps(tmp_path):
    """HolisticTraceAnalysis finds the ProfilerStep annotations (optional: needs HTA)."""
    hta = pytest.importorskip("hta.trace_analysis")
    from simulator import load_scenario, run_scenario
    from simulator.recording.writers import write_outputs
    from tests.conftest import ROOT

    res = run_scenario(load_scenario(ROOT / "scenarios/h200/gpt_184m_b8.yaml", ["run.steps=3"]))
    write_outputs(res, tmp_path / "run")
    (tmp_path / "hta").mkdir()
    (tmp_path / "run" / "trace.json").rename(tmp_path / "hta" / "rank0.trace.json")
    ta = hta.TraceAnalysis(trace_dir=str(tmp_path / "hta"))
    df = ta.get_temporal_breakdown(visualize=False)
    assert len(df) == 1 and df["compute_time(us)"].iloc[0] > 0
    # kernels get their step from the launch's correlation id (HTA 0.5 leaves out the last step)
    assert {0, 1} <= set(ta.t.get_trace(0)["iteration"].unique())
