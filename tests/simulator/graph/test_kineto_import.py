"""Tests of the Kineto (PyTorch profiler) trace importer on real public traces.

The traces live in ``tests/data/traces`` (see ``SOURCES.md`` there) and ``tests/data/h200``.
Counts are checked against an independent pass over the raw JSON; replayability is checked with
a tiny reference list scheduler (below) that has the engine's semantics: an op starts when the
previous op of its stream and all its dependencies have finished, and takes
``fixed_duration_s``.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import random
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from simulator.graph.importers.kineto import (
    KinetoImport,
    TraceImportError,
    classify_kernel,
    load_kineto,
)
from simulator.graph.op_graph import OpGraph
from simulator.graph.ops import CostClass, OpKind, Phase

DATA = Path(__file__).resolve().parents[2] / "data"
TR = DATA / "traces"
HTA = TR / "HolisticTraceAnalysis" / "tests" / "data"

TRACES = {
    "alexnet": HTA / "critical_path/alexnet/benchmark_result_2869224_1695835535_trace.json.gz",
    "event_sync": HTA / "critical_path/cuda_event_sync/event_sync_trace.json.gz",
    "event_sync_multi": HTA / "critical_path/cuda_event_sync_multi_stream/event_sync_trace.json.gz",
    "simple_add": HTA / "execution_trace/benchmark_simple_add_trace.json.gz",
    "nccl_data": HTA / "nccl_parser_config/nccl_data.json.gz",
    "ns_resolution": HTA / "ns_resolution_trace/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz",
    "control_2022": HTA / "trace_diff/control/control.json.gz",
    "dlrm_rank0": TR / "param/et_replay/tests/inputs/dlrm_kineto/"
                       "worker0_step_12.1694128201545.pt.trace.json.gz",
    "resnet50_2021": TR / "kineto/tb_plugin/samples/resnet50_num_workers_0/"
                          "worker0.1623143089861.pt.trace.json.gz",
    "bert_h100": TR / "TraceLens/tests/traces/h100/gaunernst_bert-small-uncased__1016001.json.gz",
    "resnet_mi300": TR / "TraceLens/tests/traces/mi300/resnet_act_checkpoint.json.gz",
    "gpt_h200": DATA / "h200/trace_gpt_184m_b16.json.gz",
    "gpt_h200_offload": DATA / "h200/trace_gpt_184m_b16_offload_overlap.json.gz",
}
CPU_ONLY = HTA / "cpu_only/rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz"
ET_JSON = HTA / "execution_trace/benchmark_simple_add_et.json.gz"

GPU_CATS = {"kernel", "Kernel", "gpu_memcpy", "Memcpy", "gpu_memset", "Memset"}
RT_CATS = {"cuda_runtime", "Runtime", "cuda_driver"}
GPU_KINDS = {OpKind.COMPUTE, OpKind.MEMCPY_H2D, OpKind.MEMCPY_D2H, OpKind.MEMCPY_D2D,
             OpKind.COLLECTIVE}


# ---------------------------------------------------------------------------------------------
# helpers: cached imports, raw JSON, reference replayer
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def imp(key: str, gpu_gaps: str = "all", steps="all") -> KinetoImport:
    return load_kineto(TRACES[key], steps=steps, gpu_gaps=gpu_gaps)


@functools.lru_cache(maxsize=None)
def raw(key: str) -> list[dict]:
    with gzip.open(TRACES[key]) as f:
        return json.load(f)["traceEvents"]


def gpu_ops(g: OpGraph):
    return [op for op in g.ops if op.kind in GPU_KINDS and not op.meta.get("gap")]


def replay(g: OpGraph) -> tuple[list[float], list[float]]:
    """Reference list scheduler: start = max(end of previous op on the stream, ends of deps)."""
    start = [0.0] * len(g.ops)
    end = [0.0] * len(g.ops)
    free: dict[str, float] = {}
    for op in g.ops:
        s = max([free.get(op.stream, 0.0)] + [end[d] for d in op.deps])
        start[op.id] = s
        end[op.id] = s + (op.fixed_duration_s or 0.0)
        free[op.stream] = end[op.id]
    return start, end


def replayed_step_times(res: KinetoImport) -> list[float]:
    """Per step: replayed end of its last op minus replayed start of its step marker (s)."""
    start, end = replay(res.graph)
    begin: dict[int, float] = {}
    last: dict[int, float] = defaultdict(float)
    for op in res.graph.ops:
        k = op.meta.get("step")
        if op.meta.get("marker") == "step_begin":
            begin[k] = start[op.id]
        last[k] = max(last[k], end[op.id])
    return [last[k] - begin[k] for k in res.steps]


def step_errors(res: KinetoImport) -> list[float]:
    rep = replayed_step_times(res)
    return [abs(r - m) / m for r, m in zip(rep, res.step_times_s)]


# ---------------------------------------------------------------------------------------------
# parsing every era
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key, era", [
    ("resnet50_2021", "2021"),
    ("control_2022", "2022"),
    ("gpt_h200", "modern"),
    ("nccl_data", "modern"),
    ("resnet_mi300", "modern"),
    ("alexnet", "modern"),
])
def test_schema_era(key, era):
    assert imp(key).schema_era == era


def test_2021_string_tids_and_operator_steps():
    r = imp("resnet50_2021")
    assert r.step_source == "ProfilerStep"
    assert r.step_labels == [5, 6, 7, 8, 9, 10]
    streams = r.graph.streams()
    assert "gpu0.stream7" in streams  # tid "stream 7" (a string) normalised
    assert "cpu.25738" in streams and "cpu.25772" in streams  # string CPU tids normalised
    assert r.device_name == "Tesla V100-DGXS-32GB"
    # H2D input copies of the DataLoader batch, pageable
    h2d = [op for op in r.graph.ops if op.kind == OpKind.MEMCPY_H2D]
    assert h2d and all(not op.pinned and op.bytes_read > 0 for op in h2d)


def test_base_time_nanoseconds_is_recorded():
    for key in ("nccl_data", "gpt_h200"):
        g = imp(key).graph
        assert g.meta["base_time_ns"] and g.meta["base_time_ns"] > 1e18
    assert imp("dlrm_rank0").graph.meta["base_time_ns"] is None


def test_rocm_hip_runtime_is_linked():
    r = imp("resnet_mi300")
    assert r.device_name == "AMD Instinct MI300X"
    ops = gpu_ops(r.graph)
    launched = [op for op in ops if "launch" in op.meta]
    assert {op.meta["launch"] for op in launched} >= {"hipLaunchKernel", "hipExtModuleLaunchKernel"}
    colls = [op for op in ops if op.kind == OpKind.COLLECTIVE]
    # 17 ncclDevKernel_Generic (RCCL) kernels in the file, 12 of them inside the 3 steps
    assert len(colls) == 12
    assert all(op.stream == "gpu2.stream4" for op in colls)
    named = [op for op in colls if "launch" in op.meta]
    assert named and all(op.meta["collective"] in ("allreduce", "broadcast") for op in named)
    assert all(op.meta["group_size"] == 8 and op.meta["in_msg_nelems"] > 0 for op in named)


def test_device_sync_kinds_and_streams():
    g = imp("alexnet").graph
    assert {"gpu0.stream7", "gpu0.stream20"} <= set(g.streams())
    assert all(op.fixed_duration_s is not None and op.fixed_duration_s >= 0 for op in g.ops)


# ---------------------------------------------------------------------------------------------
# op counts against an independent pass over the raw JSON
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["alexnet", "event_sync_multi", "simple_add"])
def test_gpu_op_count_whole_trace(key):
    """Traces without step markers are one step: every GPU event becomes exactly one op."""
    ev = raw(key)
    n_raw = sum(1 for e in ev if e.get("ph") == "X" and e.get("cat") in GPU_CATS)
    r = imp(key)
    assert r.step_source == "none"
    ops = gpu_ops(r.graph)
    assert len(ops) == n_raw
    assert Counter(op.kind == OpKind.COMPUTE for op in ops)[True] == sum(
        1 for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset"))


def _raw_step_windows(ev):
    steps = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in ev
                   if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")
                   and e.get("cat") in ("cpu_op", "user_annotation", "Operator"))
    return steps


@pytest.mark.parametrize("key", ["dlrm_rank0", "bert_h100", "event_sync", "nccl_data",
                                 "resnet50_2021", "gpt_h200", "control_2022"])
def test_launched_gpu_op_count_per_step(key):
    """Each GPU event launched inside step k (by correlation) is one op of step k."""
    ev = raw(key)
    windows = _raw_step_windows(ev)
    assert windows
    launch_ts = {}
    for e in ev:
        if e.get("ph") == "X" and e.get("cat") in RT_CATS:
            c = (e.get("args") or {}).get("correlation")
            if c is not None:
                launch_ts.setdefault(c, float(e["ts"]))
    starts = [w[0] for w in windows]
    expected = Counter()
    for e in ev:
        if e.get("ph") == "X" and e.get("cat") in GPU_CATS:
            t = launch_ts.get((e.get("args") or {}).get("correlation"))
            if t is None:
                continue
            for k, s in enumerate(starts):
                hi = starts[k + 1] if k + 1 < len(starts) else windows[-1][1]
                if s <= t < hi or (k + 1 == len(starts) and t == hi):
                    expected[k] += 1
    r = imp(key)
    got = Counter(op.meta["step"] for op in gpu_ops(r.graph) if "launch" in op.meta)
    assert got == expected


def test_orphans_before_the_window_are_dropped():
    """The H200 trace starts with 550 kernels still queued from the previous step; they are
    not part of any step and show up as one carry-in gap."""
    r = imp("gpt_h200")
    assert r.graph.meta["orphan_gpu_ops"] == 550
    assert not [op for op in gpu_ops(r.graph) if op.meta.get("orphan")]
    carry = [op for op in r.graph.ops if op.meta.get("reason") == "carry_in"]
    assert len(carry) == 1 and carry[0].fixed_duration_s > 0.02
    # GPU-side step time agrees with the un-profiled measurement (~54.6 ms per step)
    assert all(abs(t - 0.0546) < 0.002 for t in r.gpu_step_times_s)


# ---------------------------------------------------------------------------------------------
# links and dependencies
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["event_sync", "dlrm_rank0", "bert_h100", "nccl_data",
                                 "resnet50_2021", "resnet_mi300", "gpt_h200"])
def test_correlation_links(key):
    g = imp(key).graph
    launched = [op for op in gpu_ops(g) if "launch" in op.meta]
    assert launched
    ok = 0
    for op in launched:
        hosts = [g.ops[d] for d in op.deps if g.ops[d].stream.startswith("cpu.")]
        if any(h.meta.get("correlation") == op.meta["correlation"] for h in hosts):
            ok += 1
    assert ok / len(launched) >= 0.99
    for op in launched:  # the launch op ends no later than the kernel starts (measured)
        for d in op.deps:
            h = g.ops[d]
            if h.meta.get("correlation") == op.meta["correlation"] and "ts_us" in h.meta:
                assert h.meta["ts_us"] <= op.meta["ts_us"] + 1.0


def test_cross_stream_edges_multi_stream_event_sync():
    """cudaEventRecord on stream 20 + cudaStreamWaitEvent on stream 24 ("Stream Wait Event",
    record corr 1385): the next op on stream 24 (memset, corr 1411) waits for the last op
    launched on stream 20 before the record (the sgemm, corr 27)."""
    g = imp("event_sync_multi").graph
    by_corr = {op.meta["correlation"]: op for op in gpu_ops(g)}
    dst, src = by_corr[1411], by_corr[27]
    assert dst.stream == "gpu0.stream24" and src.stream == "gpu0.stream20"
    assert src.id in dst.deps
    assert g.meta["cross_stream_edges"] == 1
    # cudaEventQuery ("Event Sync" records) does not block: no sync deps on it
    for op in g.ops:
        if op.meta.get("call") == "cudaEventQuery":
            assert op.kind == OpKind.HOST and not op.deps


def test_cross_stream_edges_from_cuda_sync_alexnet():
    g = imp("alexnet").graph
    assert g.meta["cross_stream_edges"] >= 5
    for op in gpu_ops(g):
        for d in op.deps:
            dep = g.ops[d]
            if dep.stream.startswith("gpu") and dep.stream != op.stream:
                assert dep.meta["ts_us"] + dep.meta["dur_us"] <= op.meta["ts_us"] + 1.0


def test_inferred_stream_waits_in_old_traces():
    """dlrm has cudaStreamWaitEvent but no cudaEventRecord: compute kernels that waited for
    NCCL are explained by an inferred edge instead of a ms-long GPU gap."""
    g = imp("dlrm_rank0").graph
    inferred = [op for op in gpu_ops(g) if op.meta.get("event_deps_inferred")]
    assert inferred
    assert any(g.ops[d].kind == OpKind.COLLECTIVE for op in inferred for d in op.deps)
    assert max(op.fixed_duration_s for op in g.ops if op.meta.get("gap") == "gpu") < 2e-4


def test_host_threads_are_coupled():
    """The autograd thread's idle gaps wait for the main thread, and the main thread's wait in
    backward() waits for the autograd thread's last call."""
    g = imp("nccl_data").graph
    assert g.meta["thread_edges"] > 0
    main = g.meta["main_stream"]
    waits = [op for op in g.ops if "waits_on_thread" in op.meta]
    assert {op.stream for op in waits} >= {main, "cpu.2919752"}
    for op in waits:
        others = [g.ops[d] for d in op.deps if g.ops[d].stream != op.stream]
        assert others and all(o.stream.startswith("cpu.") for o in others)
        assert op.fixed_duration_s <= op.meta["dur_us"] * 1e-6 + 1e-12


def test_synchronize_calls_wait_for_the_gpu():
    g = imp("event_sync").graph
    gpu = {op.meta["correlation"]: op for op in gpu_ops(g)}
    calls = {op.meta["call"]: op for op in g.ops if op.meta.get("segment") == "call"
             and op.kind == OpKind.SYNC}
    assert {"cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
            "cudaMemcpyAsync"} <= set(calls)
    assert gpu[1511].id in calls["cudaStreamSynchronize"].deps  # D2H copy from .item()
    assert gpu[1511].kind == OpKind.MEMCPY_D2H and not gpu[1511].pinned
    assert gpu[1526].id in calls["cudaEventSynchronize"].deps  # spin kernel before the record
    # a sync op's duration is only the part after the awaited GPU work finished
    for op in calls.values():
        assert op.fixed_duration_s <= op.meta["dur_us"] * 1e-6 + 1e-12


def test_sync_makes_host_wait_when_gpu_is_slower():
    """Stretch every GPU op x3: the host ops after cudaEventSynchronize (which waits for a 36 us
    spin kernel) must be pushed back by about the extra GPU time."""
    g = imp("event_sync").graph
    _, end = replay(g)
    stretched = g.with_changes(ops=tuple(
        dataclasses.replace(op, fixed_duration_s=op.fixed_duration_s * 3) if op.kind in GPU_KINDS
        else op for op in g.ops))
    _, end3 = replay(stretched)
    last_host = max(op.id for op in g.ops if op.stream.startswith("cpu."))
    spin = next(op for op in gpu_ops(g) if "spin_kernel" in op.meta["kernel"])
    extra = 2 * spin.fixed_duration_s
    assert end3[last_host] - end[last_host] == pytest.approx(extra, rel=0.2)


# ---------------------------------------------------------------------------------------------
# graph structure, phases, classes, collectives, copies
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(TRACES))
def test_graph_is_valid_and_stream_order_is_time_order(key):
    g = imp(key).graph
    assert isinstance(g, OpGraph) and len(g) > 0
    last: dict[str, float] = {}
    for op in gpu_ops(g):
        t = op.meta["ts_us"]
        assert t >= last.get(op.stream, -float("inf"))
        last[op.stream] = t
        assert op.launch is False
        assert op.fixed_duration_s == pytest.approx(
            (op.meta["dur_us"] - op.meta.get("clamped_us", 0.0)) * 1e-6, abs=1e-12)
        assert op.stream.startswith("gpu")
    for op in g.ops:
        assert op.stream.startswith(("gpu", "cpu."))
        assert op.meta.get("step") in imp(key).steps


def test_phases_h200():
    g = imp("gpt_h200").graph
    ops = gpu_ops(g)
    phases = Counter(op.phase for op in ops)
    assert phases[Phase.FWD] > 300 and phases[Phase.BWD] > 800
    adam = [op for op in ops if "FusedAdamMathFunctor" in op.meta["kernel"]]
    assert adam and all(op.phase == Phase.OPT and op.cost_class == CostClass.OPTIMIZER for op in adam)
    attn_bwd = [op for op in ops if "flash_bprop" in op.meta["kernel"]]
    assert attn_bwd and all(op.cost_class == CostClass.ATTENTION_BWD and op.phase == Phase.BWD
                            for op in attn_bwd)


def test_phases_data_and_annotations_dlrm():
    g = imp("dlrm_rank0").graph
    phases = Counter(op.phase for op in gpu_ops(g))
    assert phases[Phase.DATA] > 0 and phases[Phase.FWD] > 0 and phases[Phase.BWD] > 0
    assert phases[Phase.OPT] > 0


@pytest.mark.parametrize("name, cls", [
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", CostClass.GEMM),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", CostClass.GEMM),
    ("void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_64x64_32x6_tn_align4>(X::Params)", CostClass.GEMM),
    ("Kernel2", CostClass.GEMM),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>(Flash_fwd_params)",
     CostClass.ATTENTION_FWD),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", CostClass.ATTENTION_BWD),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>(int)",
     CostClass.NORM),
    ("void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, true>(float*)",
     CostClass.SOFTMAX),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<float>, "
     "at::detail::Array<char*, 3> >(int, at::native::AddFunctor<float>)", CostClass.ELEMENTWISE),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda("
     "at::TensorIteratorBase&)::{lambda()#3}>(int)", CostClass.CAST),
    ("void at::native::reduce_kernel<128, 4, at::native::ReduceOp<float>>(X)", CostClass.REDUCTION),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedOptimizerTensorList"
     "Metadata<4>, FusedAdamMathFunctor<float, 4>>(X)", CostClass.OPTIMIZER),
    ("void tensorrt_llm::kernels::quantize_with_block_size<2, __nv_bfloat16>(int, "
     "flashinfer::QuantizationSFLayout)", CostClass.OTHER),
])
def test_classify_kernel(name, cls):
    assert classify_kernel(name) == cls


def test_collective_meta():
    g = imp("nccl_data").graph
    colls = [op for op in gpu_ops(g) if op.kind == OpKind.COLLECTIVE]
    assert len(colls) == 21 and {op.stream for op in colls} == {"gpu0.stream40"}
    for op in colls:
        assert op.meta["collective"] in ("allreduce", "broadcast")
        assert op.meta["in_msg_nelems"] > 0 and op.meta["group_size"] == 2
        assert op.meta["dtype"] in ("fp32", "int64")
    old = [op for op in gpu_ops(imp("dlrm_rank0").graph) if op.kind == OpKind.COLLECTIVE]
    assert len(old) == 8
    assert Counter(op.meta["collective"] for op in old) == {"SendRecv": 5, "AllReduce": 3}
    # message size derived from record_param_comms "Input Dims" in the older schema
    assert any(op.meta.get("in_msg_nelems", 0) > 0 for op in old)


def test_memcpy_ops():
    g = imp("dlrm_rank0").graph
    cps = [op for op in gpu_ops(g) if op.kind.value.startswith("memcpy")]
    ev = raw("dlrm_rank0")
    n_raw = Counter(e["name"] for e in ev if e.get("cat") == "gpu_memcpy")
    assert len(cps) == sum(n_raw.values())
    for op in cps:
        name = op.meta["kernel"]
        assert op.bytes_read > 0 and op.cost_class == CostClass.COPY
        assert op.pinned == ("Pageable" not in name)
        want = {"HtoD": OpKind.MEMCPY_H2D, "DtoH": OpKind.MEMCPY_D2H, "DtoD": OpKind.MEMCPY_D2D}
        assert op.kind == next(v for k, v in want.items() if k in name)


def test_measured_duration_dataframe():
    r = imp("alexnet")
    df = r.measured_durations()
    assert list(df.columns) == ["op_id", "name", "kind", "cost_class", "stream", "dur_s", "bytes",
                                "step"]
    ev = raw("alexnet")
    raw_total = sum(float(e["dur"]) for e in ev if e.get("ph") == "X" and e.get("cat") in GPU_CATS)
    assert df["dur_s"].sum() == pytest.approx(raw_total * 1e-6, rel=1e-9)
    assert "gemm" in set(df["cost_class"])
    summ = r.class_summary()
    assert summ["share"].sum() == pytest.approx(1.0)
    host = r.measured_durations(include_host=True)
    assert len(host) > len(df) and "cudaLaunchKernel" in set(host["name"])


# ---------------------------------------------------------------------------------------------
# steps
# ---------------------------------------------------------------------------------------------


def test_step_selection():
    full = imp("gpt_h200")
    assert full.step_labels == [1, 2]
    one = imp("gpt_h200", steps=1)
    assert one.step_labels == [2] and one.steps == [1]
    assert {op.meta["step"] for op in one.graph.ops} == {1}
    assert one.step_times_s[0] == pytest.approx(full.step_times_s[1], rel=1e-9)
    assert max(step_errors(one)) < 1e-6
    assert imp("gpt_h200", steps=(-1,)).step_labels == [2]
    with pytest.raises(TraceImportError, match="out of range"):
        load_kineto(TRACES["gpt_h200"], steps=5)
    with pytest.raises(TraceImportError):
        load_kineto(TRACES["gpt_h200"], steps="first")  # type: ignore[arg-type]


def _without_markers(key: str, tmp_path: Path, prefixes=("ProfilerStep",)) -> Path:
    with gzip.open(TRACES[key]) as f:
        data = json.load(f)
    data["traceEvents"] = [e for e in data["traceEvents"]
                           if not str(e.get("name", "")).startswith(prefixes)]
    out = tmp_path / f"{key}_nosteps.json"
    out.write_text(json.dumps(data))
    return out


def test_steps_from_optimizer_step(tmp_path):
    r = load_kineto(_without_markers("gpt_h200", tmp_path))
    assert r.step_source == "Optimizer.step" and len(r.steps) == 2
    assert any("Optimizer.step" in w for w in r.warnings)
    assert max(step_errors(r)) < 0.02


def test_steps_from_dataloader(tmp_path):
    r = load_kineto(_without_markers("dlrm_rank0", tmp_path, ("ProfilerStep", "Optimizer.step")))
    assert r.step_source == "DataLoader" and len(r.steps) == 1
    assert any("DataLoader" in w for w in r.warnings)
    assert max(step_errors(r)) < 0.02


def test_no_step_markers_warns():
    r = imp("event_sync_multi")
    assert r.step_source == "none" and len(r.steps) == 1
    assert any("no step markers" in w for w in r.warnings)


# ---------------------------------------------------------------------------------------------
# replay fidelity
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(TRACES))
def test_replay_reproduces_measured_step_times(key):
    r = imp(key)
    assert r.step_times_s and all(t > 0 for t in r.step_times_s)
    assert max(step_errors(r)) < 0.02


@pytest.mark.parametrize("key", sorted(TRACES))
def test_no_op_starts_before_its_step(key):
    """First start to last end of a step's ops equals the marker-based step time (the
    definition ``calibration.replay.simulated_step_times`` uses)."""
    r = imp(key)
    start, end = replay(r.graph)
    first: dict[int, float] = defaultdict(lambda: float("inf"))
    last: dict[int, float] = defaultdict(float)
    for op in r.graph.ops:
        k = op.meta["step"]
        first[k] = min(first[k], start[op.id])
        last[k] = max(last[k], end[op.id])
    for k, meas in zip(r.steps, r.step_times_s):
        assert last[k] - first[k] == pytest.approx(meas, rel=0.02)


def _boundary_only(res: KinetoImport) -> KinetoImport:
    """The same import as if made with ``gpu_gaps="boundary"``: per-kernel GPU gaps (launch
    latency, front-end gaps between queued kernels) become zero-length pass-throughs."""
    ops = tuple(dataclasses.replace(op, fixed_duration_s=0.0)
                if op.meta.get("gap") == "gpu" and op.meta["reason"] in ("queue", "launch_latency")
                else op for op in res.graph.ops)
    return dataclasses.replace(res, graph=res.graph.with_changes(ops=ops))


def test_boundary_shortcut_matches_import_option():
    a = _boundary_only(imp("dlrm_rank0"))
    b = imp("dlrm_rank0", gpu_gaps="boundary")
    assert replayed_step_times(a) == pytest.approx(replayed_step_times(b), rel=1e-9)


def test_replay_error_table():
    """Every bundled trace replays within 2% per step (``gpu_gaps="all"``); nothing is printed."""
    for key in sorted(TRACES):
        r = imp(key)
        assert max(step_errors(r)) < 0.02, key


# ---------------------------------------------------------------------------------------------
# broken input: always TraceImportError (or a warning), never another exception
# ---------------------------------------------------------------------------------------------


def test_cpu_only_trace():
    with pytest.raises(TraceImportError, match="no GPU events"):
        load_kineto(CPU_ONLY)


def test_execution_trace_is_not_kineto():
    with pytest.raises(TraceImportError, match="not a Kineto trace"):
        load_kineto(ET_JSON)


def test_truncated_gzip(tmp_path):
    data = TRACES["dlrm_rank0"].read_bytes()
    p = tmp_path / "trunc.json.gz"
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceImportError, match="trunc.json.gz: truncated gzip"):
        load_kineto(p)


def test_corrupt_gzip(tmp_path):
    data = bytearray(TRACES["event_sync"].read_bytes())
    for i in range(100, 140):
        data[i] ^= 0xFF
    p = tmp_path / "corrupt.gz"
    p.write_bytes(bytes(data))
    with pytest.raises(TraceImportError, match="corrupt.gz"):
        load_kineto(p)


def test_truncated_json(tmp_path):
    with gzip.open(TRACES["event_sync"]) as f:
        text = f.read()
    p = tmp_path / "trunc.json"
    p.write_bytes(text[: len(text) // 3])  # plain (not gzip): detected by magic bytes
    with pytest.raises(TraceImportError, match="truncated or corrupt JSON"):
        load_kineto(p)


def test_gzip_bomb_is_capped(tmp_path):
    p = tmp_path / "bomb.json.gz"
    with gzip.open(p, "wb") as f:
        f.write(b'{"traceEvents": [' + b" " * (8 * 1024 * 1024) + b"]}")
    assert p.stat().st_size < 64 * 1024
    with pytest.raises(TraceImportError, match="too large after decompression"):
        load_kineto(p, max_bytes=1024 * 1024)
    with pytest.raises(TraceImportError, match="too large"):
        load_kineto(TRACES["event_sync"], max_bytes=1000)


@pytest.mark.parametrize("content", [
    b"", b"   ", b"\x00\x01\x02garbage", b"[1, 2, 3]", b'"just a string"', b"{}",
    b'{"traceEvents": 5}', b'{"traceEvents": []}',
    b'{"traceEvents": [{"ph": "X", "cat": "kernel", "ts": "abc", "dur": 1}]}',
    b'{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 1, "dur": 1}]}',
])
def test_small_broken_files(tmp_path, content):
    p = tmp_path / "broken.json"
    p.write_bytes(content)
    with pytest.raises(TraceImportError, match="broken.json"):
        load_kineto(p)


def test_missing_file(tmp_path):
    with pytest.raises(TraceImportError, match="file not found"):
        load_kineto(tmp_path / "nope.json.gz")


def test_minimal_kernel_only_trace(tmp_path):
    """Kernels without any CPU side: imported as orphans on their stream, with a warning."""
    ev = [{"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 10 + 5 * i,
           "dur": 3, "args": {"device": 0, "stream": 7}} for i in range(4)]
    p = tmp_path / "k.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    r = load_kineto(p)
    assert len(gpu_ops(r.graph)) == 4
    assert r.step_times_s[0] == pytest.approx(18e-6)
    assert max(step_errors(r)) < 1e-9
    assert any("no launch event" in w for w in r.warnings)


def test_fuzzed_events_never_crash(tmp_path):
    """Randomly damaged events (missing keys, wrong types): imported or TraceImportError."""
    base = raw("event_sync")
    rng = random.Random(1234)
    junk = [None, "x", -1, 1e300, [], {}, "stream 7", float("nan")]
    n_ok = 0
    for trial in range(40):
        ev = json.loads(json.dumps(base))
        for e in rng.sample(ev, k=min(len(ev), 12)):
            key = rng.choice(["ts", "dur", "pid", "tid", "name", "cat", "args", "ph"])
            if rng.random() < 0.5:
                e.pop(key, None)
            else:
                e[key] = rng.choice(junk)
            if isinstance(e.get("args"), dict) and rng.random() < 0.5:
                e["args"][rng.choice(["correlation", "stream", "device", "bytes"])] = rng.choice(junk)
        p = tmp_path / f"fuzz{trial}.json"
        p.write_text(json.dumps({"traceEvents": ev}, allow_nan=True))
        try:
            r = load_kineto(p)
            n_ok += 1
            assert isinstance(r.graph, OpGraph)
        except TraceImportError:
            pass
    assert n_ok > 0


# ---------------------------------------------------------------------------------------------
# Chakra protobuf execution trace
# ---------------------------------------------------------------------------------------------

CHAKRA_ET = TR / "chakra/tests/data/chakra.0.et.gz"


def test_chakra_et_import():
    from simulator.graph.importers.chakra import load_chakra, read_chakra_et

    meta, nodes = read_chakra_et(CHAKRA_ET)
    assert meta["schema"] == "1.0.1" and meta["pid"] == 114598
    assert len(nodes) == 3664
    assert Counter(n.type_name for n in nodes) == {"COMP_NODE": 3643, "COMM_COLL_NODE": 21}
    r = load_chakra(CHAKRA_ET)
    g = r.graph
    assert len(g) == 3664
    colls = [op for op in g.ops if op.kind == OpKind.COLLECTIVE]
    assert len(colls) == 7 and all(op.stream == "gpu0.stream14" for op in colls)
    assert {op.meta["collective"] for op in colls} == {"broadcast", "all_reduce"}
    assert all(op.meta["comm_size"] > 0 for op in colls)
    assert {"cpu.1", "cpu.2", "gpu0.stream7"} <= set(g.streams())
    # durations are the node durations; a replay can overlap streams but not exceed their sum
    start, end = replay(g)
    assert 0 < max(end) <= r.total_duration_s + 1e-9
    assert sum(op.fixed_duration_s for op in g.ops) == pytest.approx(r.total_duration_s)


def test_chakra_broken_inputs(tmp_path):
    from simulator.graph.importers.chakra import load_chakra

    with gzip.open(CHAKRA_ET) as f:
        data = f.read()
    p = tmp_path / "trunc.et"
    p.write_bytes(data[: len(data) // 2 + 7])
    with pytest.raises(TraceImportError, match="trunc.et"):
        load_chakra(p)
    with pytest.raises(TraceImportError, match="not a Chakra"):
        load_chakra(TRACES["event_sync"])
    p2 = tmp_path / "junk.et"
    p2.write_bytes(b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01")
    with pytest.raises(TraceImportError):
        load_chakra(p2)
