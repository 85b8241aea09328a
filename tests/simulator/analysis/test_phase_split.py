"""Phase split (data wait / forward / backward / optimizer) on tiny graphs worked out by hand."""

from __future__ import annotations

import pandas as pd
import pytest

from simulator.analysis.metrics import phase_split
from simulator.cli import _busy_line, format_summary
from simulator.api import simulate_graph
from simulator.graph.op_graph import GraphBuilder
from simulator.graph.ops import OpKind, Phase
from tests.conftest import ROOT, make_hw

MS = 1e-3
F, B, O, D = Phase.FWD, Phase.BWD, Phase.OPT, Phase.DATA


def two_micro_batches(data_s: float = 0.0):
    """Two micro-batches and an optimizer, launches free, the PCIe link at 1 GB/s (make_hw).

    Host: [next() mb0] [next() mb1] while the GPU runs; every GPU op's duration is fixed:

        h2d   : in0 copy 1 ms (1 MB)            in1 copy 1 ms (after next() for mb1)
        compute:      f0 3 ms | b0 5 ms | f1 3 ms | b1 5 ms | opt 1 ms
    """
    b = GraphBuilder()
    prev = []
    for mb in range(2):
        nxt = b.add(f"mb{mb}.next", OpKind.HOST, "host", phase=D, host_s=data_s) if data_s else None
        h2d = b.add(f"mb{mb}.in", OpKind.MEMCPY_H2D, "h2d", deps=[nxt] if nxt is not None else [], phase=F,
                    bytes_read=1e6, pinned=True)
        f = b.add(f"mb{mb}.f", OpKind.COMPUTE, "compute", deps=[h2d, *prev], phase=F, fixed_duration_s=3 * MS)
        bw = b.add(f"mb{mb}.b", OpKind.COMPUTE, "compute", deps=[f], phase=B, fixed_duration_s=5 * MS)
        prev = [bw]
    b.add("opt", OpKind.COMPUTE, "compute", deps=prev, phase=O, fixed_duration_s=1 * MS)
    return b.build()


def test_gradient_accumulation_sums_the_micro_batches():
    """t: in0 0-1, f0 1-4, in1 1-2 (prefetched), b0 4-9, f1 9-12, b1 12-17, opt 17-18 ms.

    Forward = in0 + f0 + f1 = 1 + 3 + 3 = 7 ms, backward 5 + 5 = 10, optimizer 1: the phases add
    up to the 18 ms step (the old rule, phase boundary at the last op, gave forward 12 / backward 5).
    """
    r = simulate_graph(two_micro_batches(), make_hw(), steps=1)
    assert r.summary["step_time_s"] == pytest.approx(18 * MS)
    ph = r.summary["phase_s"]
    assert ph["fwd_s"] == pytest.approx(7 * MS)
    assert ph["bwd_s"] == pytest.approx(10 * MS)
    assert ph["opt_s"] == pytest.approx(1 * MS)
    assert ph["data_s"] == 0.0


def test_data_wait_is_its_own_phase_and_not_forward():
    """next() takes 2 ms on the host: mb0's next 0-2 (GPU idle), in0 2-3, f0 3-6; mb1's next 2-4
    while the GPU copies and computes (hidden), in1 4-5, b0 6-11, f1 11-14, b1 14-19, opt 19-20.

    Data wait 2 ms (only the part with the GPU idle), forward 1 + 3 + 3 = 7, backward 10, opt 1.
    """
    r = simulate_graph(two_micro_batches(data_s=2 * MS), make_hw(), steps=1)
    assert r.summary["step_time_s"] == pytest.approx(20 * MS)
    ph = r.summary["phase_s"]
    assert ph["data_s"] == pytest.approx(2 * MS)
    assert ph["fwd_s"] == pytest.approx(7 * MS)
    assert ph["bwd_s"] == pytest.approx(10 * MS)
    assert ph["opt_s"] == pytest.approx(1 * MS)


def _spans(rows):
    return pd.DataFrame(rows, columns=["step", "kind", "phase", "start_s", "end_s"])


def test_overlapping_steps_start_at_the_previous_steps_end():
    """Step 1 is launched at 2 but its first kernel waits for step 0's optimizer (ends 10): the wait
    belongs to step 0, so step 1's forward is 10-11 (1), not 2-11 (9)."""
    spans = _spans([(0, "compute", "fwd", 0, 1), (0, "compute", "bwd", 1, 2), (0, "host", "opt", 2, 10),
                    (1, "compute", "fwd", 10, 11), (1, "compute", "bwd", 11, 12), (1, "host", "opt", 12, 20)])
    steps = pd.DataFrame({"step": [0, 1], "start_s": [0.0, 2.0], "warmup": [True, False]})
    assert phase_split(spans, steps) == {"data_s": 0.0, "fwd_s": 1.0, "bwd_s": 1.0, "opt_s": 8.0}


def test_trailing_copies_extend_the_last_segment_of_their_phase():
    """Backward kernels end at 5, their gradient copy at 7: backward 2-7, optimizer 7-8."""
    spans = _spans([(0, "compute", "fwd", 0, 2), (0, "compute", "bwd", 2, 5), (0, "memcpy_d2h", "bwd", 4, 7),
                    (0, "compute", "opt", 7, 8), (0, "host", "other", 8, 8)])
    steps = pd.DataFrame({"step": [0], "start_s": [0.0], "warmup": [False]})
    assert phase_split(spans, steps) == {"data_s": 0.0, "fwd_s": 2.0, "bwd_s": 5.0, "opt_s": 1.0}


def test_training_thread_wait_after_a_backward_is_backward():
    """Micro-batch 0's backward kernels end at 5, then the training thread blocks on a host op (a synchronous
    gradient copy and CPU add, stream host) until 9; micro-batch 1's forward runs 9-11, its backward 11-14, the
    optimizer 14-15. The thread records micro-batch 1's forward event only after the wait: backward
    3 + 4 + 3 = 10, forward 2 + 2 = 4 (the rule for other ops put the wait in micro-batch 1's backward segment,
    so its forward ran 5-11: forward 8, backward 6). A copy on another stream stays with the next segment."""
    rows = [(0, "compute", "fwd", 0, 2, "compute"), (0, "compute", "bwd", 2, 5, "compute"),
            (0, "host", "bwd", 5, 9, "host"), (0, "compute", "fwd", 9, 11, "compute"),
            (0, "compute", "bwd", 11, 14, "compute"), (0, "compute", "opt", 14, 15, "compute")]
    steps = pd.DataFrame({"step": [0], "start_s": [0.0], "warmup": [False]})
    spans = pd.DataFrame(rows, columns=["step", "kind", "phase", "start_s", "end_s", "stream"])
    assert phase_split(spans, steps) == {"data_s": 0.0, "fwd_s": 4.0, "bwd_s": 10.0, "opt_s": 1.0}
    rows[2] = (0, "memcpy_h2d", "fwd", 5, 9, "h2d")  # the next forward's input copy: forward 2 + 6 = 8
    spans = pd.DataFrame(rows, columns=["step", "kind", "phase", "start_s", "end_s", "stream"])
    assert phase_split(spans, steps) == {"data_s": 0.0, "fwd_s": 8.0, "bwd_s": 6.0, "opt_s": 1.0}


def test_fsdp2_cpu_offload_accumulation_wait_is_not_forward():
    """FSDP2 CPUOffloadPolicy, 1 layer, 3 micro-batches (fresh-user trial): from the second micro-batch on each
    backward ends with synchronous gradient copies and CPU adds on the training thread (``offload_fsdp``), the
    root's 33.5 MB shard faulting in (52 ms). Worked from the spans: the forwards take 25.86 ms together, the third
    8.72 ms from the end of micro-batch 1's last CPU add to its loss, as the lone micro-batch's 8.73 ms; the waits
    went to the third forward (fwd 80.8 ms, bwd 97.2 ms). (8.98, 8.68 and 8.99 ms, 8.99 alone, while FSDP2 with
    bf16 parameters was priced as autocast: fp32 residual stream and norms, casts before the GEMMs.)"""
    from simulator import load_scenario, run_scenario

    path = ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_fsdp2_offload.yaml"
    base = ["model.num_layers=1", "run.steps=2", "run.warmup_steps=1"]
    one = run_scenario(load_scenario(path, base + ["training.global_batch_size=64"])).summary
    three = run_scenario(load_scenario(path, base + ["training.global_batch_size=192"])).summary
    assert one["phase_s"]["fwd_s"] == pytest.approx(8.733e-3, abs=2e-6)
    ph = three["phase_s"]
    assert ph["fwd_s"] == pytest.approx(25.860e-3, rel=1e-3)
    assert ph["fwd_s"] + ph["bwd_s"] + ph["opt_s"] == pytest.approx(three["step_time_s"], rel=1e-3)


def test_gpt_gradient_accumulation_matches_the_compute_spans():
    """The issue's reproducer: gpt_184m_b16 at global batch 64 (4 micro-batches).

    Forward and backward equal the step's compute-stream time of each phase plus the input copy
    of the first micro-batch (the compute stream is never idle in this step), and four times the
    single-micro-batch figures within the first copy's time.
    """
    from simulator import load_scenario, run_scenario

    path = ROOT / "scenarios/h200/gpt_184m_b16.yaml"
    one = run_scenario(load_scenario(path)).summary["phase_s"]
    r = run_scenario(load_scenario(path, ["training.global_batch_size=64"]))
    ph = r.summary["phase_s"]
    sp = r.spans[(r.spans.step == 1) & (r.spans.kind == "compute")]
    busy = (sp.end_s - sp.start_s).groupby(sp.phase).sum()
    assert ph["bwd_s"] == pytest.approx(busy["bwd"], rel=1e-3)
    assert ph["fwd_s"] == pytest.approx(busy["fwd"], rel=1e-3)
    assert ph["fwd_s"] == pytest.approx(4 * one["fwd_s"], rel=0.01)
    assert ph["bwd_s"] == pytest.approx(4 * one["bwd_s"], rel=0.01)
    assert ph["opt_s"] == pytest.approx(one["opt_s"], rel=1e-6)
    total = ph["data_s"] + ph["fwd_s"] + ph["bwd_s"] + ph["opt_s"]
    assert total == pytest.approx(r.summary["step_time_s"], rel=0.01)


def _summary(busy: float, step_s: float, data_s: float) -> dict:
    return {"utilisation": {"compute": busy}, "step_time_s": step_s,
            "phase_s": {"data_s": data_s, "fwd_s": 0.0, "bwd_s": 0.0, "opt_s": 0.0}}


@pytest.mark.parametrize(("busy", "data_s", "cause"), [
    (0.38, 48e-3, "data-bound"),   # 62 ms idle of 100, 48 of them waiting for data
    (0.38, 20e-3, "host-bound"),   # 62 ms idle, 20 of them for data: mostly launches
    (0.38, 0.0, "host-bound"),
    (0.90, 5e-3, None),            # busy enough: no flag
])
def test_busy_line_names_the_cause(busy, data_s, cause):
    line = _busy_line(_summary(busy, 0.1, data_s))[0]
    if cause is None:
        assert "bound" not in line
    else:
        assert cause in line and ({"data-bound", "host-bound"} - {cause}).pop() not in line


def test_dataloader_w0_summary_reports_the_data_wait_apart_from_forward():
    """dataloader_w0: forward equals gpt_184m_b8's forward (same GPU work), the stall is data."""
    from simulator import load_scenario, run_scenario

    w0 = run_scenario(load_scenario(ROOT / "scenarios/h200/dataloader_w0.yaml")).summary
    b8 = run_scenario(load_scenario(ROOT / "scenarios/h200/gpt_184m_b8.yaml")).summary
    assert w0["phase_s"]["fwd_s"] == pytest.approx(b8["phase_s"]["fwd_s"], rel=1e-3)
    assert w0["phase_s"]["data_s"] == pytest.approx(w0["data_stall_s"], rel=0.01)
    text = format_summary(w0, "dataloader_w0")
    assert "data-bound" in text and "host-bound" not in text
    assert f"data wait {w0['phase_s']['data_s'] * 1e3:.2f} / forward" in text


def test_bubble_and_exposed_comm_together_are_not_called_host_bound():
    """6.7B PP2 x DP8 on 2 DGX H100 (fresh-user trial): 138 ms idle of 511 ms, 61 ms bubble and 55 ms exposed
    communication, neither half of the idle time alone: the line names both, not the host."""
    s = {"utilisation": {"compute": 1 - 0.138 / 0.511}, "step_time_s": 0.511, "pipeline_bubble_s": 0.061,
         "exposed_comm_s": 0.055, "phase_s": {"data_s": 0.0}}
    line = _busy_line(s)[0]
    assert "host-bound" not in line and "pipeline bubble 61.00 ms and exposed communication 55.00 ms" in line
