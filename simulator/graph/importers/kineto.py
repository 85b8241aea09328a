"""Import a PyTorch-profiler (Kineto) Chrome-trace JSON into a replayable ``OpGraph``.

The graph reproduces the measured timeline when replayed with CUDA-stream semantics (every op
runs on ``op.stream``; ops of one stream run one at a time in graph order; an op starts when the
previous op of its stream *and* all of ``op.deps`` have finished, then takes
``op.fixed_duration_s``).

What becomes an op
------------------
* **GPU work** (kernels, memcpy, memset) -> one op per event on stream
  ``f"gpu{device}.stream{stream_id}"``: ``COMPUTE`` (kernels, memsets), ``MEMCPY_H2D`` /
  ``MEMCPY_D2H`` / ``MEMCPY_D2D`` (direction from the event name, ``bytes_read`` from
  ``args.bytes``, ``pinned`` from "Pinned"/"Pageable" in the name) or ``COLLECTIVE`` (NCCL/RCCL
  kernels; ``meta`` carries the collective name, message element counts, group size and dtype
  when the trace has them). ``launch=False``: the launch is modelled explicitly by the host ops.
  ``fixed_duration_s`` is the measured ``dur``; only where a kernel overlaps the next kernel of
  its own stream (programmatic dependent launch, split-K epilogues, ns-rounding) is it clamped to
  end where the next one starts (``meta["clamped_us"]``).
* **Host threads.** Every CPU thread that issues CUDA/HIP runtime or driver calls becomes the
  stream ``f"cpu.{tid}"``. Its timeline from its first to its last runtime call is cut into
  contiguous ``HOST`` ops: the runtime calls themselves (``meta["segment"] == "call"``) and the
  gaps between them (``"gap"``; named after the innermost enclosing ``cpu_op``, e.g.
  ``aten::linear``). A launch call is split at ``min(call end, first GPU start of what it
  launched)``; the GPU op depends on the host op that ends there (correlation id link).
  Consequently, with an idle GPU the replayed kernel starts exactly where it was measured.
* **Host waits.** ``cudaDeviceSynchronize``, ``cudaStreamSynchronize``,
  ``cudaEventSynchronize`` (and the ``hip*`` / ``cu*`` equivalents) and blocking copies (a
  non-async ``cudaMemcpy``, or a D2H copy to pageable memory as ``.item()`` issues) become
  ``SYNC`` ops that depend on the GPU ops they waited for (exactly, from ``cuda_sync`` events
  when the trace has them; otherwise inferred). Their ``fixed_duration_s`` is only the part of the
  call *after* the awaited GPU work finished, so a replay in which the GPU runs longer makes the
  host wait longer.
* **Cross-stream edges** come from ``cuda_sync`` "Stream Wait Event" events (exact), or are
  inferred from ``cudaEventRecord`` + ``cudaStreamWaitEvent`` call pairs in older traces (the
  recorded stream and the waiting stream are the streams the same thread launched on just
  before the record and just after the wait). Older traces often lack the record calls; there a
  GPU op that starts late is tied to an op of another stream of its device that ended at most
  5 us before it (``meta["event_deps_inferred"]``; ``infer_stream_waits=False`` disables it).
* **Host threads are coupled.** An idle gap (>= 50 us) of a secondary thread (autograd, comm
  threads) waits for the main thread's last op before it ended (the thread was woken), and an
  idle gap of the main thread waits for the last call of another thread's burst of work that
  ended inside it (``backward()`` returning); such gaps keep as fixed time only the part after
  that event (``meta["waits_on_thread"]``).
* **GPU gaps.** The idle time of a GPU stream is not an op: it follows from the dependencies.
  What the dependencies cannot explain (kernels whose launch was not captured, GPU work still
  queued from before the selected steps, and the ~1-3 us front-end gap between back-to-back
  kernels) becomes a ``gpu_gap`` op (kind ``SYNC``, ``meta["gap"] == "gpu"``) placed just before
  the op on its stream, carrying the same dependencies, so it acts as a fixed delay after the
  op's true release time. ``gpu_gaps="boundary"`` keeps only the gaps of orphan kernels and of
  the first op of each stream; ``"none"`` drops them all.
* **Step markers.** Each selected step starts with a zero-length ``HOST`` op on the main thread
  (``meta["marker"] == "step_begin"``) at the step's start time.

Every op carries ``meta["step"]`` (index of its step among *all* steps detected in the file),
``meta["step_label"]`` (the ``ProfilerStep#N`` number, when known) and, for trace events,
``meta["ts_us"]`` / ``meta["dur_us"]`` (the original values from the file, microseconds).

Units: the file's ``ts``/``dur`` are microseconds (always, whatever ``displayTimeUnit`` says);
everything on ``Op`` is in seconds. An event longer than a day, or a trace whose events span more
than a day, is refused (``TraceImportError``): such numbers are not profiler timestamps, and
replaying them would run the engine at times where float resolution is lost.

Steps
-----
Iterations come from ``ProfilerStep#N`` (``cpu_op``, ``user_annotation`` or 2021 ``Operator``),
else from ``Optimizer.step#...`` annotations (a step ends with its optimizer step), else from
``enumerate(DataLoader)#...`` annotations (a step starts with its batch fetch), else the whole
trace is one step (with a warning). CPU ops are attributed to the step in whose
``[start_k, start_{k+1})`` window they start; GPU ops to the step of the host call that
launched them. An orphan GPU op (launch not captured) takes a step between those of the launched
ops around it on its stream, by its GPU start time; orphans ahead of the first launched op of
their stream were queued before the trace window and belong to no step (they become one
``carry_in`` gap). Gap ops that would straddle a step start are split there, so every op of a
step starts inside the step.

``KinetoImport.step_times_s[k]`` is measured from the step's start (the ``ProfilerStep`` span
start) to the last end of any op (CPU or GPU) attributed to the step - i.e. it includes the GPU
tail of the step and any GPU backlog it had to wait for. ``step_spans_s`` holds the CPU-side span
durations and ``gpu_step_times_s`` the first-to-last GPU activity of the step's GPU ops.

Memory
------
The file is decompressed into memory in one piece (capped at ``max_bytes``, default 2 GiB, so a
gzip bomb raises ``TraceImportError`` instead of exhausting memory) and parsed with ``json``.
Events that are never used (``python_function``, instant events such as ``[memory]``, ``ac2g``
flows, ``Call stack`` strings) are discarded inside the parser's ``object_hook`` as they are
decoded, and the raw bytes are freed right after parsing. Peak memory is therefore about
``2 x decompressed size`` (bytes plus decoder working set) plus roughly 1 KB per *kept* event:
measured 260 MB peak RSS (process total) for a 35 MB trace (HTA ``control.json``, 55k ops,
~4 s). The garbage collector is paused during the import.
"""

from __future__ import annotations

import bisect
import functools
import gc
import gzip
import heapq
import json
import math
import os
import re
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

from simulator.graph.op_graph import GraphBuilder, OpGraph
from simulator.graph.ops import CostClass, OpKind, Phase

__all__ = [
    "DEFAULT_MAX_BYTES",
    "KinetoImport",
    "TraceImportError",
    "annotation_events",
    "classify_kernel",
    "load_kineto",
    "read_trace_bytes",
    "read_trace_json",
]

DEFAULT_MAX_BYTES = 2 * 1024**3
"""Default cap on the decompressed size of a trace file, bytes (2 GiB)."""

_DEP_TOL_US = 1.0  # a dependency may end at most this long after the dependent op starts (us)
_EPS_US = 1e-6  # segments shorter than this are dropped (us)
_CHUNK = 16 * 1024 * 1024
_WAIT_MIN_GAP_US = 2.0  # an unexplained GPU start delay at least this long may be a stream wait
_WAIT_WINDOW_US = 5.0  # ... on an op of another stream that ended at most this long before
_WAKE_IDLE_US = 50.0  # a host thread idle this long between runtime calls is taken to be waiting
_MAX_SPAN_US = 86_400e6  # a trace window (and any event) longer than a day is refused: not a profile

GpuGapMode = Literal["all", "boundary", "none"]


class TraceImportError(ValueError):
    """The trace file cannot be imported (one-line message naming the file and the problem)."""


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------


def _read_capped(f, max_bytes: int, name: str) -> bytes:
    """Read a whole stream, refusing more than ``max_bytes`` bytes."""
    parts: list[bytes] = []
    total = 0
    while True:
        chunk = f.read(_CHUNK)
        if not chunk:
            break
        total += len(chunk)
        if total > max_bytes:
            raise TraceImportError(
                f"{name}: too large after decompression (more than {max_bytes} bytes; raise max_bytes)"
            )
        parts.append(chunk)
    return b"".join(parts)


def read_trace_bytes(path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """Read a whole file, decompressing it if it is gzip (detected by its magic bytes).

    Args:
        path: File to read.
        max_bytes: Largest accepted (decompressed) size, bytes.

    Returns:
        The (decompressed) content.

    Raises:
        TraceImportError: missing or unreadable file, corrupt or truncated gzip, or more than
            ``max_bytes`` after decompression.
    """
    p = os.fspath(path)
    name = p  # as typed (the folder too), as ``run`` names its scenario
    try:
        with open(p, "rb") as f:
            head = f.read(2)
            f.seek(0)
            if head == b"\x1f\x8b":
                with gzip.GzipFile(fileobj=f, mode="rb") as gz:
                    return _read_capped(gz, max_bytes, name)
            return _read_capped(f, max_bytes, name)
    except TraceImportError:
        raise
    except FileNotFoundError:
        raise TraceImportError(f"{name}: file not found") from None
    except EOFError as e:
        raise TraceImportError(f"{name}: truncated gzip stream ({e})") from None
    except (gzip.BadGzipFile, zlib.error) as e:
        raise TraceImportError(f"{name}: corrupt gzip data ({e})") from None
    except OSError as e:
        raise TraceImportError(f"{name}: cannot read file ({e})") from None


def read_trace_json(path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES, *,
                    object_hook=None) -> Any:
    """Read a plain or gzip JSON file (gzip detected by its magic bytes).

    Args:
        path: File to read.
        max_bytes: Largest accepted decompressed size, bytes.
        object_hook: Passed to ``json.loads`` (used to drop unneeded events while decoding).

    Returns:
        The decoded JSON value.

    Raises:
        TraceImportError: missing file, corrupt or truncated gzip, too large after
            decompression, or invalid / truncated JSON.
    """
    p = os.fspath(path)
    name = p  # as typed (the folder too), as ``run`` names its scenario
    raw = read_trace_bytes(p, max_bytes)
    if not raw.strip():
        raise TraceImportError(f"{name}: empty file")
    try:
        return json.loads(raw, object_hook=object_hook)
    except json.JSONDecodeError as e:
        raise TraceImportError(
            f"{name}: truncated or corrupt JSON ({e.msg} at line {e.lineno} column {e.colno})"
        ) from None
    except UnicodeDecodeError as e:
        raise TraceImportError(f"{name}: not UTF-8 JSON ({e.reason})") from None
    except RecursionError:
        raise TraceImportError(f"{name}: JSON nested too deeply") from None
    finally:
        del raw


def annotation_events(events: Any) -> list[dict]:
    """CPU annotation events of a raw ``traceEvents`` list, validated as the importer keeps them.

    For callers holding a trace dict rather than a ``KinetoImport`` (synthetic traces in tests,
    scripts): the same record as ``KinetoImport.cpu_annotations``. Events that are not objects,
    not ``ph == "X"``, not of an annotation category, or without a finite ``ts`` are skipped; a
    missing, negative or non-finite ``dur`` becomes 0; ``name`` becomes a string.
    """
    out: list[dict] = []
    if not isinstance(events, list):
        return out
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X" or e.get("cat") not in _ANNOT_CATS:
            continue
        ts, dur = _num(e.get("ts")), _num(e.get("dur"))
        if ts is None:
            continue
        name = e.get("name")
        out.append({"ts": ts, "dur": dur if dur is not None and dur >= 0 else 0.0,
                    "name": name if isinstance(name, str) else str(name), "tid": _ident(e.get("tid")),
                    "cat": e.get("cat")})
    return out


# ----------------------------------------------------------------------------------------------
# Kernel classification
# ----------------------------------------------------------------------------------------------

_CLASS_RULES: list[tuple[CostClass | str, re.Pattern]] = [
    (CostClass.COPY, re.compile(r"reshape_and_cache")),
    ("attention", re.compile(r"flash|fmha|sdpa|attention|\battn|_attn|attn_|mha_|mla_")),
    (CostClass.OPTIMIZER, re.compile(r"adam|multi_tensor_apply|optimizer|_sgd|sgd_|\blamb\b|lamb_|"
                                     r"adagrad|rmsprop")),
    (CostClass.NORM, re.compile(r"layer_?norm|rms_?norm|batch_?norm|group_?norm|bn_fw|bn_bw|"
                                r"gammabetabackward|instance_?norm")),
    (CostClass.GEMM, re.compile(
        r"^kernel2$|nvjet|xmma|cutlass|gemm|gemv|splitkreduce|cijk_|scudnn|^volta_|^turing_|"
        r"^ampere_|^hopper_|^sm\d+_|^bmm_|conv|wgrad|dgrad|fprop|implicit_|triton_tem|"
        r"winograd|miopen")),
    (CostClass.SOFTMAX, re.compile(r"softmax")),
    (CostClass.ELEMENTWISE, re.compile(r"rotary")),
    (CostClass.EMBEDDING, re.compile(r"embedding|index_?select|gather_kernel|embedding_bag|\btbe\b")),
    (CostClass.CAST, re.compile(r"direct_copy|copy_kernel|_to_copy|\bcast|convert_")),
    (CostClass.COPY, re.compile(r"catarray|\bcat_|copy|transpose|permute")),
    (CostClass.REDUCTION, re.compile(r"reduce|triton_red|triton_per|\bsum|mean|argmax|argmin|"
                                     r"nll_loss|cross_entropy|norm_kernel|radix_sort|scan|cub::")),
    (CostClass.ELEMENTWISE, re.compile(r"elementwise|triton_poi|pointwise|fill|gelu|relu|silu|"
                                       r"activation|dropout|threshold|add|mul|where|clamp|sigmoid|"
                                       r"tanh|exp|div|sub")),
    (CostClass.MEMSET, re.compile(r"memset")),
]
_BWD_ATTN = re.compile(r"bwd|backward|bprop|cutlassb|dq_dk|dkdv|dq_")
_COLL_HEAD = re.compile(r"^(?:void )?[rn]ccl|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all")
_EW_WRAPPER = re.compile(r"elementwise_kernel")
_class_cache: dict[str, CostClass] = {}


@functools.lru_cache(maxsize=65536)
def _signature(name: str) -> tuple[str, str]:
    """(head, signature) of a kernel name, lower-case: the function name without template
    arguments, and the name with templates but without the parameter list."""
    low = name.lower().replace("(anonymous namespace)::", "")
    if low.startswith("void "):
        low = low[5:]
    depth = 0
    cut = len(low)
    for i, ch in enumerate(low):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(0, depth - 1)
        elif ch == "(" and depth == 0:
            cut = i
            break
    sig = low[:cut]
    head = sig.split("<", 1)[0]
    return head, sig


def classify_kernel(name: str) -> CostClass:
    """Kernel family of a GPU kernel, from its (demangled) name.

    The kernel's own name (without template arguments) is matched first, then the name with
    its template arguments (where PyTorch puts the functor: ``AddFunctor``,
    ``direct_copy_kernel_cuda``...); the parameter list is ignored.

    Args:
        name: Kernel name as in the trace (``nvjet_sm90_...``, ``void at::native::...``).

    Returns:
        The ``CostClass`` (``OTHER`` when no rule matches). Collective kernels return
        ``OTHER``: they are recognised by their op kind (``COLLECTIVE``); there is no collective
        cost class.
    """
    c = _class_cache.get(name)
    if c is not None:
        return c
    head, sig = _signature(name)
    res = CostClass.OTHER
    if not _COLL_HEAD.search(head):
        # PyTorch's generic elementwise wrappers: the functor in the template decides
        texts = (sig,) if _EW_WRAPPER.search(head) else (head, sig)
        for text in texts:
            for cls, rx in _CLASS_RULES:
                if rx.search(text):
                    if cls == "attention":
                        res = CostClass.ATTENTION_BWD if _BWD_ATTN.search(sig) else CostClass.ATTENTION_FWD
                    else:
                        res = cls  # type: ignore[assignment]
                    break
            if res != CostClass.OTHER:
                break
        if res == CostClass.OTHER and texts == (sig,):
            res = CostClass.ELEMENTWISE
    if len(_class_cache) < 100_000:
        _class_cache[name] = res
    return res


def _is_collective(name: str) -> bool:
    return bool(_COLL_HEAD.search(_signature(name)[0]))


_COLL_FROM_NAME = re.compile(r"nccl(?:Dev)?Kernel_([A-Za-z]+)")
_NCCL_DTYPE = {
    "float": "fp32", "f32": "fp32", "half": "fp16", "f16": "fp16", "bfloat16": "bf16",
    "bf16": "bf16", "double": "fp64", "f64": "fp64", "int8_t": "int8", "i8": "int8",
    "uint8_t": "uint8", "u8": "uint8", "int32_t": "int32", "i32": "int32", "int64_t": "int64",
    "i64": "int64", "c10::bfloat16": "bf16", "c10::half": "fp16", "long": "int64", "int": "int32",
}


def _norm_dtype(s: Any) -> str | None:
    if not isinstance(s, str) or not s:
        return None
    return _NCCL_DTYPE.get(s.lower(), s)


# ----------------------------------------------------------------------------------------------
# Result
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KinetoImport:
    """Result of importing one Kineto trace.

    Attributes:
        graph: Replayable graph of the selected steps (see the module docstring).
        step_times_s: Measured wall time of each selected step, seconds: from the step's start
            (``ProfilerStep`` span start, or the fallback boundary) to the last end of any CPU or
            GPU op attributed to the step.
        device_name: GPU name from ``deviceProperties`` (``None`` if absent).
        schema_era: ``"2021"`` (``Operator``/``Runtime``/``Kernel`` categories), ``"2022"``
            (``async_cpu_to_gpu`` flows) or ``"modern"``.
        warnings: Non-fatal problems found while importing.
        steps: Indices (among all steps detected in the file) of the selected steps.
        step_labels: ``ProfilerStep`` numbers (or fallback ordinals) of the selected steps.
        step_source: ``"ProfilerStep"``, ``"Optimizer.step"``, ``"DataLoader"`` or ``"none"``.
        step_spans_s: CPU-side span of each selected step, seconds.
        gpu_step_times_s: First GPU start to last GPU end of each step's GPU ops, seconds
            (0.0 for a step without GPU ops).
        path: The imported file.
        step_starts_s: Start of each selected step (its ``ProfilerStep`` span start, or the
            fallback boundary), seconds from the start of the first selected step.
        step_ends_s: Last end of any op attributed to each selected step, same origin, seconds
            (``step_ends_s[k] - step_starts_s[k] == step_times_s[k]``).
        gpu_step_starts_s: First start of each selected step's GPU ops (gap ops excluded), same
            origin, seconds (``None`` for a step without GPU ops).
        uses_worker_processes: The trace shows DataLoader worker processes (a multi-process
            ``DataLoader``: ``_MultiProcessingDataLoaderIter`` annotations, or a
            ``pt_data_worker`` / ``pt_data_pin`` thread).
        dataloader_intervals_us: ``(start, end)`` of the ``enumerate(DataLoader)...__next__``
            annotations, the file's own microsecond timestamps (as ``op.meta["ts_us"]``), sorted.
        cpu_annotations: Every CPU annotation event (``cpu_op``, ``user_annotation``, 2021
            ``Operator``) as ``{"ts", "dur", "name", "tid", "cat"}``: ``ts``/``dur`` finite
            microseconds (file timestamps; ``dur >= 0``), ``name`` a string. Consumers of the
            CPU timeline (``calibration.host_overhead``) read these instead of parsing the file.
    """

    graph: OpGraph
    step_times_s: list[float]
    device_name: str | None
    schema_era: str
    warnings: list[str]
    steps: list[int] = field(default_factory=list)
    step_labels: list[int] = field(default_factory=list)
    step_source: str = "ProfilerStep"
    step_spans_s: list[float] = field(default_factory=list)
    gpu_step_times_s: list[float] = field(default_factory=list)
    path: str = ""
    step_starts_s: list[float] = field(default_factory=list)
    step_ends_s: list[float] = field(default_factory=list)
    gpu_step_starts_s: list[float | None] = field(default_factory=list)
    uses_worker_processes: bool = False
    dataloader_intervals_us: list[tuple[float, float]] = field(default_factory=list)
    cpu_annotations: list[dict] = field(default_factory=list, repr=False)

    _GPU_KINDS = (OpKind.COMPUTE, OpKind.MEMCPY_H2D, OpKind.MEMCPY_D2H, OpKind.MEMCPY_D2D,
                  OpKind.COLLECTIVE)

    def measured_durations(self, include_host: bool = False):
        """Measured duration of every traced op, for calibrating cost models.

        Args:
            include_host: Also list the host runtime-call ops (not the gaps between them).

        Returns:
            ``pandas.DataFrame`` with columns ``op_id``, ``name``, ``kind``, ``cost_class``
            (the ``CostClass`` value, or ``"collective"`` for collectives), ``stream``,
            ``dur_s`` (measured, seconds, before any overlap clamping), ``bytes`` (bytes moved
            by copies/memsets, else 0) and ``step``. Inserted gap and marker ops are excluded.
        """
        import pandas as pd

        rows = []
        for op in self.graph.ops:
            m = op.meta
            if m.get("gap") or m.get("marker"):
                continue
            if op.kind in self._GPU_KINDS:
                pass
            elif not (include_host and m.get("segment") == "call"):
                continue
            rows.append({
                "op_id": op.id,
                "name": m.get("kernel", op.name),
                "kind": op.kind.value,
                "cost_class": "collective" if op.kind == OpKind.COLLECTIVE else op.cost_class.value,
                "stream": op.stream,
                "dur_s": float(m.get("dur_us", (op.fixed_duration_s or 0.0) * 1e6)) * 1e-6,
                "bytes": float(op.bytes_read + op.bytes_written),
                "step": m.get("step", -1),
            })
        cols = ["op_id", "name", "kind", "cost_class", "stream", "dur_s", "bytes", "step"]
        return pd.DataFrame(rows, columns=cols)

    def class_summary(self):
        """Per-cost-class totals of GPU op time.

        Returns:
            ``pandas.DataFrame`` indexed by ``cost_class`` with ``count``, ``total_s``,
            ``mean_s``, ``median_s`` and ``share`` (of total GPU op time).
        """
        df = self.measured_durations()
        g = df.groupby("cost_class")["dur_s"]
        out = g.agg(count="count", total_s="sum", mean_s="mean", median_s="median")
        tot = out["total_s"].sum()
        out["share"] = out["total_s"] / tot if tot > 0 else 0.0
        return out.sort_values("total_s", ascending=False)


# ----------------------------------------------------------------------------------------------
# Parsed-event records
# ----------------------------------------------------------------------------------------------


class _Call:
    __slots__ = ("ts", "end", "name", "corr", "thread", "raw_ts", "raw_dur", "gpu", "group")

    def __init__(self, ts, end, name, corr, thread, raw_ts, raw_dur):
        self.ts, self.end, self.name, self.corr, self.thread = ts, end, name, corr, thread
        self.raw_ts, self.raw_dur = raw_ts, raw_dur
        self.gpu: list[_Node] = []
        self.group: _Group | None = None


class _Group:
    """Runtime calls of one thread that overlap in time (normally a single call)."""

    __slots__ = ("ts", "end", "calls", "cut", "launch_seg", "last_seg", "first_seg")

    def __init__(self, call: _Call):
        self.ts, self.end, self.calls = call.ts, call.end, [call]
        self.cut: float | None = None
        self.launch_seg: _Node | None = None
        self.last_seg: _Node | None = None
        self.first_seg: _Node | None = None


class _Annot:
    __slots__ = ("ts", "end", "name", "label", "args")

    def __init__(self, ts, end, name, label, args):
        self.ts, self.end, self.name, self.label, self.args = ts, end, name, label, args


class _Node:
    """An op under construction. ``s``/``e``: measured start/end, us relative to the origin."""

    __slots__ = ("name", "kind", "stream", "s", "e", "deps", "phase", "cost_class", "step",
                 "meta", "bytes_read", "bytes_written", "pinned", "dtype", "is_gpu", "sub",
                 "seq", "shrink", "launch_t", "thread", "call", "a")

    _counter = 0

    def __init__(self, name, kind, stream, s, e, *, is_gpu=False, sub=1):
        self.name, self.kind, self.stream, self.s, self.e = name, kind, stream, s, e
        self.a = s  # original start (for host ops whose start moves with their deps)
        self.deps: list[_Node] = []
        self.phase = Phase.OTHER
        self.cost_class = CostClass.OTHER
        self.step: int | None = None
        self.meta: dict = {}
        self.bytes_read = 0.0
        self.bytes_written = 0.0
        self.pinned = True
        self.dtype: str | None = None
        self.is_gpu = is_gpu
        self.sub = sub
        _Node._counter += 1
        self.seq = _Node._counter
        self.shrink = False  # host op whose start waits for its deps (sync)
        self.launch_t: float | None = None
        self.thread = None
        self.call: _Call | None = None


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _num(v) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        f = float(v)
    elif isinstance(v, str):
        try:
            f = float(v)
        except ValueError:
            return None
    else:
        return None
    return f if math.isfinite(f) else None


def _ident(v):
    """Normalise a pid/tid: ints stay ints, numeric strings and "stream 7" become ints."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        s = v.strip()
        if s.lower().startswith("stream"):
            s = s[6:].strip()
        try:
            return int(s)
        except ValueError:
            return v.strip()
    return v


def _int(v) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            return None
    return None


_SYNC_CALL = re.compile(r"^(cuda|hip|cu)(Device|Ctx|Stream|Event)Synchronize")
_MEMCPY_CALL = re.compile(r"^(cuda|hip|cu)Memcpy")
_EVENT_RECORD = re.compile(r"^(cuda|hip|cu)EventRecord")
_STREAM_WAIT = re.compile(r"^(cuda|hip|cu)StreamWaitEvent")
_STEP_RX = re.compile(r"^ProfilerStep#(\d+)")
# a multi-process DataLoader: PyTorch's iterator class name, or its worker / pin-memory threads
_WORKER_ANNOT = re.compile(r"_MultiProcessingDataLoaderIter")
_WORKER_THREAD = re.compile(r"pt_data_worker|pt_data_pin")


def _phase_label(name: str) -> Phase | None:
    """Phase implied by an annotation / cpu_op name, or ``None``."""
    if name.startswith("ProfilerStep"):
        return None
    low = name.lower()
    if "dataloader" in low or "wait_for_batch" in low or "copy_batch_to_gpu" in low:
        return Phase.DATA
    if (name.startswith("Optimizer.") or "## optimizer" in low or "_fused_adam" in low
            or "fused_sgd" in low or low.startswith("optimizer")):
        return Phase.OPT
    if (name.startswith("autograd::engine::evaluate_function") or "## backward" in low
            or "backward" in low or name.startswith("torch::autograd::")):
        return Phase.BWD
    if "## forward" in low or name.endswith(".forward") or name.startswith("nn.Module:"):
        return Phase.FWD
    return None


def _memcpy_kind(name: str) -> OpKind:
    n = name.replace(" ", "")
    if "HtoD" in n or "HostToDevice" in n or "H2D" in n:
        return OpKind.MEMCPY_H2D
    if "DtoH" in n or "DeviceToHost" in n or "D2H" in n:
        return OpKind.MEMCPY_D2H
    return OpKind.MEMCPY_D2D  # DtoD, PtoP, DtoA ...


# ----------------------------------------------------------------------------------------------
# The importer
# ----------------------------------------------------------------------------------------------

_DROP_X = {"python_function", "cpu_instant_event", "Trace", "overhead", "cuda_profiler_range",
           "Python"}
_ANNOT_CATS = {"cpu_op", "user_annotation", "Operator", "operator"}
_RUNTIME_CATS = {"cuda_runtime", "Runtime", "cuda_driver", "runtime", "hip_runtime"}
_KERNEL_CATS = {"kernel", "Kernel"}
_MEMCPY_CATS = {"gpu_memcpy", "Memcpy"}
_MEMSET_CATS = {"gpu_memset", "Memset"}
_KEEP_ANNOT_ARGS = ("record_param_comms", "nccl:", "c10d::")


class _Importer:
    def __init__(self, path, max_bytes, gpu_gaps: GpuGapMode, gpu_gap_min_us: float,
                 infer_waits: bool = True):
        self.path = os.fspath(path)
        self.fname = os.path.basename(self.path) or self.path
        self.max_bytes = max_bytes
        if gpu_gaps not in ("all", "boundary", "none"):
            raise ValueError(f"gpu_gaps must be 'all', 'boundary' or 'none', not {gpu_gaps!r}")
        self.gpu_gaps = gpu_gaps
        self.gpu_gap_min_us = float(gpu_gap_min_us)
        self.infer_waits = infer_waits
        self.n_inferred = 0
        self.n_thread_edges = 0
        self.exact_waits = False
        self.warnings: list[str] = []
        self.cat_counts: Counter = Counter()

    # -- parsing ---------------------------------------------------------------------------

    def _hook(self, d: dict):
        ph = d.get("ph")
        if ph is None:
            if "Call stack" in d:
                del d["Call stack"]
            return d
        cat = d.get("cat")
        self.cat_counts[cat] += 1
        if ph == "X":
            return None if cat in _DROP_X else d
        if ph == "M":
            return d
        if ph in ("s", "f") and cat == "fwdbwd":
            return d
        return None

    def load(self):
        data = read_trace_json(self.path, self.max_bytes, object_hook=self._hook)
        if isinstance(data, dict):
            if "traceEvents" not in data:
                hint = " (looks like a PyTorch execution trace)" if "nodes" in data else ""
                raise TraceImportError(f"{self.path}: not a Kineto trace (no traceEvents){hint}")
            events = data.pop("traceEvents")
            self.top = data
        elif isinstance(data, list):
            events, self.top = data, {}
        else:
            raise TraceImportError(f"{self.path}: not a Kineto trace (top level is not an object)")
        if not isinstance(events, list):
            raise TraceImportError(f"{self.path}: not a Kineto trace (traceEvents is not a list)")
        self._normalise(events)

    def _normalise(self, events: list):
        cc = self.cat_counts
        if cc.get("Kernel") or cc.get("Runtime") or cc.get("Operator") or cc.get("Memcpy"):
            self.era = "2021"
        elif cc.get("async_cpu_to_gpu"):
            self.era = "2022"
        else:
            self.era = "modern"
        base_ns = _num(self.top.get("baseTimeNanoseconds")) if isinstance(self.top, dict) else None
        self.base_time_ns = base_ns

        calls: list[_Call] = []
        gpu_raw: list[tuple] = []
        annots: dict[Any, list] = defaultdict(list)
        gpu_annots: list[tuple] = []
        syncs: list[dict] = []
        fwd_src: set = set()
        thread_names: dict = {}
        bad = 0
        t_min, t_max = math.inf, -math.inf
        kept: list[tuple] = []
        cpu_annots: list[dict] = []
        for e in events:
            if not isinstance(e, dict):
                continue
            ph = e.get("ph")
            if ph == "M":
                if e.get("name") == "thread_name":
                    a = e.get("args") or {}
                    thread_names[(_ident(e.get("pid")), _ident(e.get("tid")))] = str(a.get("name", ""))
                continue
            if ph in ("s", "f"):
                if ph == "s":
                    ts = _num(e.get("ts"))
                    if ts is not None:
                        fwd_src.add((_ident(e.get("tid")), ts))
                continue
            if ph != "X":
                continue
            ts = _num(e.get("ts"))
            dur = _num(e.get("dur"))
            if ts is None:
                bad += 1
                continue
            if dur is None or dur < 0:
                dur = 0.0
            name = e.get("name")
            if not isinstance(name, str):
                name = str(name)
            if dur > _MAX_SPAN_US:
                raise TraceImportError(f"{self.path}: event {name[:60]!r} has dur {dur:g} us, more than a day "
                                       f"({_MAX_SPAN_US:g} us): not a profiler duration")
            kept.append((e.get("cat"), name, ts, dur, e))
            if ts < t_min:
                t_min = ts
            if ts + dur > t_max:
                t_max = ts + dur
        events.clear()
        if t_max - t_min > _MAX_SPAN_US:
            raise TraceImportError(f"{self.path}: events span {t_max - t_min:g} us, more than a day "
                                   f"({_MAX_SPAN_US:g} us): a ts is not a profiler timestamp")
        if bad:
            self.warnings.append(f"skipped {bad} events without a numeric ts")
        if not kept:
            raise TraceImportError(f"{self.path}: not a Kineto trace (no complete events)")
        self.t0_abs = t_min
        t0 = t_min
        n_gpu = 0
        for cat, name, ts, dur, e in kept:
            rel = ts - t0
            args = e.get("args")
            if not isinstance(args, dict):
                args = {}
            if cat in _KERNEL_CATS or cat in _MEMCPY_CATS or cat in _MEMSET_CATS:
                n_gpu += 1
                gpu_raw.append((cat, name, rel, dur, ts, e, args))
            elif cat in _RUNTIME_CATS:
                thread = (_ident(e.get("pid")), _ident(e.get("tid")))
                calls.append(_Call(rel, rel + dur, name, _int(args.get("correlation")), thread, ts, dur))
            elif cat in _ANNOT_CATS:
                thread = (_ident(e.get("pid")), _ident(e.get("tid")))
                cpu_annots.append({"ts": ts, "dur": dur, "name": name, "tid": thread[1], "cat": cat})
                keep_args = args if name.startswith(_KEEP_ANNOT_ARGS) else None
                lab = _phase_label(name)
                if lab is None and (thread[1], ts) in fwd_src:
                    lab = Phase.FWD
                annots[thread].append(_Annot(rel, rel + dur, name, lab, keep_args))
            elif cat == "cuda_sync":
                d = dict(args)
                d["_ts"] = rel
                d["_pid"] = _ident(e.get("pid"))
                syncs.append(d)
            elif cat == "gpu_user_annotation":
                gpu_annots.append((rel, rel + dur, name, _ident(e.get("pid")), _ident(e.get("tid"))))
        kept.clear()
        if n_gpu == 0:
            raise TraceImportError(f"{self.path}: no GPU events (kernels, memcpy or memset)")
        self.calls = calls
        self.gpu_raw = gpu_raw
        self.annots = annots
        self.cpu_annotations = cpu_annots
        self.dataloader_intervals_us = sorted(
            (a["ts"], a["ts"] + a["dur"]) for a in cpu_annots
            if "DataLoader" in a["name"] and "__next__" in a["name"])
        self.uses_workers = (any(_WORKER_ANNOT.search(a["name"]) for a in cpu_annots)
                             or any(_WORKER_THREAD.search(n) for n in thread_names.values()))
        self.gpu_annots = gpu_annots
        self.syncs = syncs
        self.thread_names = thread_names

    # -- graph construction ---------------------------------------------------------------

    def build(self, steps) -> KinetoImport:
        self._build_gpu_nodes()
        self._detect_steps()
        self._build_host()
        self._link_launches()
        self._index_streams()
        self._sync_deps()
        self._thread_wake_deps()
        self._cross_stream_deps()
        if self.infer_waits and not self.exact_waits:
            self._infer_stream_waits()
        self._assign_steps_and_phases()
        sel = self._select(steps)
        return self._finish(sel)

    def _build_gpu_nodes(self):
        devices = Counter()
        nodes: list[_Node] = []
        by_corr: dict[int, list[_Node]] = defaultdict(list)
        for cat, name, rel, dur, ts, e, args in self.gpu_raw:
            dev = _int(args.get("device"))
            if dev is None:
                dev = _ident(e.get("pid"))
            sid = _int(args.get("stream"))
            if sid is None:
                sid = _ident(e.get("tid"))
            devices[dev] += 1
            stream = f"gpu{dev}.stream{sid}"
            if cat in _MEMCPY_CATS:
                kind = _memcpy_kind(name)
                cc = CostClass.COPY
            elif cat in _MEMSET_CATS:
                kind, cc = OpKind.COMPUTE, CostClass.MEMSET
            elif _is_collective(name):
                kind, cc = OpKind.COLLECTIVE, CostClass.OTHER
            else:
                kind, cc = OpKind.COMPUTE, classify_kernel(name)
            n = _Node(name if len(name) <= 200 else name[:197] + "...", kind, stream, rel, rel + dur,
                      is_gpu=True)
            n.cost_class = cc
            corr = _int(args.get("correlation"))
            n.meta = {"kernel": name, "ts_us": ts, "dur_us": dur, "device": dev, "stream_id": sid}
            if corr is not None:
                n.meta["correlation"] = corr
                by_corr[corr].append(n)
            nbytes = _num(args.get("bytes")) or 0.0
            if cat in _MEMCPY_CATS:
                n.bytes_read = nbytes
                n.bytes_written = nbytes
                n.meta["bytes"] = nbytes
                if "Pageable" in name:
                    n.pinned = False
            elif cat in _MEMSET_CATS:
                n.bytes_written = nbytes
                n.meta["bytes"] = nbytes
            if kind == OpKind.COLLECTIVE:
                self._collective_meta(n, name, args)
            nodes.append(n)
        self.gpu_raw = []
        self.gpu_nodes = nodes
        self.gpu_by_corr = by_corr
        self.devices = devices
        # overlap clamping on each stream
        per: dict[str, list[_Node]] = defaultdict(list)
        for n in nodes:
            per[n.stream].append(n)
        n_clamp, max_clamp = 0, 0.0
        for lst in per.values():
            lst.sort(key=lambda n: (n.s, n.e, n.seq))
            for a, b in zip(lst, lst[1:]):
                if b.s < a.e:
                    new_e = max(a.s, b.s)
                    ov = a.e - new_e
                    if ov > 1e-9:
                        a.meta["clamped_us"] = ov
                        n_clamp += 1
                        max_clamp = max(max_clamp, ov)
                    a.e = new_e
        self.gpu_streams = per
        if n_clamp:
            self.warnings.append(
                f"clamped {n_clamp} same-stream GPU overlaps (largest {max_clamp:.3f} us)")

    def _collective_meta(self, n: _Node, name: str, args: dict):
        m = n.meta
        coll = args.get("Collective name")
        if not coll:
            mm = _COLL_FROM_NAME.search(name)
            if mm and mm.group(1) != "Generic":
                coll = mm.group(1)
        if coll:
            m["collective"] = str(coll)
        for k_src, k_dst in (("In msg nelems", "in_msg_nelems"), ("Out msg nelems", "out_msg_nelems"),
                             ("Group size", "group_size")):
            v = _int(args.get(k_src))
            if v is not None:
                m[k_dst] = v
        dt = _norm_dtype(args.get("dtype"))
        if dt is None:
            mm = re.search(r"_([A-Za-z0-9]+_?t?)\(", name)
            if mm:
                dt = _NCCL_DTYPE.get(mm.group(1).lower())
        if dt:
            m["dtype"] = dt
            n.dtype = dt
        for k_src, k_dst in (("Process Group Name", "pg_name"), ("Process Group Ranks", "pg_ranks")):
            if k_src in args:
                m[k_dst] = args[k_src]

    def _detect_steps(self):
        """Find step windows: list of (label, start, end) in relative us, and the main thread."""
        prof: dict[int, tuple] = {}
        opt_ends: list[tuple] = []
        dl_starts: list[tuple] = []
        for thread, lst in self.annots.items():
            for a in lst:
                m = _STEP_RX.match(a.name)
                if m:
                    lab = int(m.group(1))
                    old = prof.get(lab)
                    if old is None or (a.end - a.ts) > (old[2] - old[1]):
                        prof[lab] = (lab, a.ts, a.end, thread)
                elif a.name.startswith("Optimizer.step#"):
                    opt_ends.append((a.end, a.ts, thread))
                elif a.name.startswith("enumerate(DataLoader)"):
                    dl_starts.append((a.ts, thread))
        t_first = min([c.ts for c in self.calls] + [n.s for n in self.gpu_nodes])
        t_last = max([c.end for c in self.calls] + [n.e for n in self.gpu_nodes])
        steps: list[tuple] = []
        main = None
        if prof:
            self.step_source = "ProfilerStep"
            items = sorted(prof.values(), key=lambda x: x[1])
            steps = [(lab, s, e) for lab, s, e, _ in items]
            main = Counter(x[3] for x in items).most_common(1)[0][0]
        elif opt_ends:
            self.step_source = "Optimizer.step"
            opt_ends.sort()
            prev = t_first
            for i, (end, ts, thread) in enumerate(opt_ends):
                if end <= prev:
                    continue
                steps.append((i, prev, end))
                prev = end
            main = Counter(x[2] for x in opt_ends).most_common(1)[0][0]
            self.warnings.append("no ProfilerStep markers; steps delimited by Optimizer.step annotations")
        elif dl_starts:
            self.step_source = "DataLoader"
            dl_starts.sort()
            for i, (ts, thread) in enumerate(dl_starts):
                end = dl_starts[i + 1][0] if i + 1 < len(dl_starts) else t_last
                if end > ts:
                    steps.append((i, ts, end))
            main = Counter(x[1] for x in dl_starts).most_common(1)[0][0]
            self.warnings.append("no ProfilerStep markers; steps delimited by DataLoader annotations")
        if not steps:
            self.step_source = "none"
            steps = [(0, t_first, t_last)]
            self.warnings.append("no step markers (ProfilerStep, Optimizer.step or DataLoader); "
                                 "the whole trace is one step")
        if main is None:
            cnt = Counter(c.thread for c in self.calls)
            main = cnt.most_common(1)[0][0] if cnt else ("main", "main")
        self.steps = steps
        self.main_thread = main
        starts = [s for _, s, _ in steps]
        self.step_starts = starts
        # attribution windows [start_k, start_{k+1}); the last one ends at its own end
        bounds = starts[1:] + [max(steps[-1][2], starts[-1])]
        self.step_bounds = bounds

    def _step_of(self, t: float) -> int | None:
        i = bisect.bisect_right(self.step_starts, t) - 1
        if i < 0:
            return None
        if i == len(self.step_starts) - 1 and t > self.step_bounds[-1]:
            return None
        return i

    def _build_host(self):
        """Cut each CPU thread's timeline into host ops."""
        by_thread: dict[Any, list[_Call]] = defaultdict(list)
        for c in self.calls:
            by_thread[c.thread].append(c)
        # stream names: cpu.{tid}, disambiguated by pid if needed
        tids = Counter(t[1] for t in by_thread)
        names = {}
        for t in list(by_thread) + [self.main_thread]:
            names[t] = f"cpu.{t[1]}" if tids[t[1]] <= 1 else f"cpu.{t[0]}.{t[1]}"
        self._stream_names = names
        # link calls to their GPU ops
        corr_call: dict[int, _Call] = {}
        for c in self.calls:
            if c.corr is not None:
                corr_call.setdefault(c.corr, c)
                g = self.gpu_by_corr.get(c.corr)
                if g:
                    c.gpu = g
        self.corr_call = corr_call
        bounds = sorted(set(self.step_starts + [self.step_bounds[-1]]))
        self.host_nodes: dict[Any, list[_Node]] = {}
        self.groups_by_thread: dict[Any, list[_Group]] = {}
        self.seg_ends: dict[Any, list[float]] = {}
        for thread, lst in by_thread.items():
            lst.sort(key=lambda c: (c.ts, -c.end))
            groups: list[_Group] = []
            for c in lst:
                if groups and c.ts < groups[-1].end - _EPS_US:
                    g = groups[-1]
                    g.calls.append(c)
                    g.end = max(g.end, c.end)
                else:
                    g = _Group(c)
                    groups.append(g)
                c.group = g
            cuts = set()
            for g in groups:
                cuts.add(g.ts)
                cuts.add(g.end)
                gstarts = [n.s for c in g.calls for n in c.gpu]
                if gstarts:
                    cut = min(max(min(gstarts), g.ts), g.end)
                    g.cut = cut
                    cuts.add(cut)
            lo, hi = groups[0].ts, groups[-1].end
            for b in bounds:
                if lo < b < hi:
                    cuts.add(b)
            cl = sorted(cuts)
            stream = names[thread]
            annots = sorted(self.annots.get(thread, ()), key=lambda a: (a.ts, -a.end))
            segs: list[_Node] = []
            gi = 0
            ai = 0
            stack: list[_Annot] = []
            for a, b in zip(cl, cl[1:]):
                if b - a <= _EPS_US:
                    continue
                while gi < len(groups) and groups[gi].end <= a:
                    gi += 1
                g = groups[gi] if gi < len(groups) and groups[gi].ts <= a < groups[gi].end else None
                # annotation stack at time a
                while ai < len(annots) and annots[ai].ts <= a:
                    an = annots[ai]
                    ai += 1
                    while stack and stack[-1].end <= an.ts:
                        stack.pop()
                    stack.append(an)
                while stack and stack[-1].end <= a:
                    stack.pop()
                active = [x for x in stack if x.end > a]
                inner = active[-1].name if active else None
                if g is not None:
                    call = next((c for c in g.calls if c.ts <= a < c.end), g.calls[0])
                    n = _Node(call.name, OpKind.HOST, stream, a, b)
                    n.meta = {"segment": "call", "call": call.name, "ts_us": call.raw_ts,
                              "dur_us": call.raw_dur}
                    if call.corr is not None:
                        n.meta["correlation"] = call.corr
                    if a > g.ts:
                        n.meta["part"] = 2
                    n.call = call
                    if g.first_seg is None:
                        g.first_seg = n
                    g.last_seg = n
                    if g.cut is not None and abs(b - g.cut) <= _EPS_US:
                        g.launch_seg = n
                else:
                    n = _Node(inner or "cpu_gap", OpKind.HOST, stream, a, b)
                    n.meta = {"segment": "gap", "ts_us": a + self.t0_abs, "dur_us": b - a}
                if inner is not None:
                    n.meta["cpu_op"] = inner
                n.thread = thread
                n.meta["_stack"] = active
                segs.append(n)
            self.host_nodes[thread] = segs
            self.groups_by_thread[thread] = groups
            self.seg_ends[thread] = [s.e for s in segs]

    def _link_launches(self):
        n_orphan = 0
        for thread, groups in self.groups_by_thread.items():
            for g in groups:
                if g.cut is None:
                    continue
                seg = g.launch_seg
                if seg is None:  # cut at the very start of the thread's first call
                    ends = self.seg_ends[thread]
                    i = bisect.bisect_left(ends, g.cut - _EPS_US)
                    segs = self.host_nodes[thread]
                    if i < len(ends) and abs(ends[i] - g.cut) <= _EPS_US:
                        seg = segs[i]
                for c in g.calls:
                    for n in c.gpu:
                        n.launch_t = c.ts
                        n.thread = thread
                        n.call = c
                        n.meta["launch"] = c.name
                        if seg is not None and seg.e <= n.s + _DEP_TOL_US:
                            n.deps.append(seg)
        for n in self.gpu_nodes:
            if n.launch_t is None:
                n.meta["orphan"] = True
                n_orphan += 1
        self.n_orphan = n_orphan
        if n_orphan:
            self.warnings.append(
                f"{n_orphan} of {len(self.gpu_nodes)} GPU ops have no launch event in the trace "
                "(attached by stream order only)")

    def _index_streams(self):
        """Per GPU stream: ops in stream order and their fill-forward launch times."""
        self.stream_L: dict[str, list[float]] = {}
        self.stream_pos: dict[int, int] = {}
        for s, lst in self.gpu_streams.items():
            for i, n in enumerate(lst):
                self.stream_pos[id(n)] = i
            L = []
            cur = -math.inf
            for n in lst:
                if n.launch_t is not None and n.launch_t > cur:
                    cur = n.launch_t
                L.append(cur)
            self.stream_L[s] = L
        # per-thread launches in time order
        tl: dict[Any, list[tuple[float, _Node]]] = defaultdict(list)
        for n in self.gpu_nodes:
            if n.launch_t is not None:
                tl[n.thread].append((n.launch_t, n.seq, n))
        for v in tl.values():
            v.sort()
        self.thread_launches = tl
        self.thread_launch_t = {k: [x[0] for x in v] for k, v in tl.items()}
        self.dev_streams: dict[Any, list[str]] = defaultdict(list)
        for s, lst in self.gpu_streams.items():
            self.dev_streams[lst[0].meta["device"]].append(s)

    def _last_before(self, stream: str, t: float) -> _Node | None:
        L = self.stream_L.get(stream)
        if not L:
            return None
        i = bisect.bisect_right(L, t) - 1
        return self.gpu_streams[stream][i] if i >= 0 else None

    def _first_after(self, stream: str, t: float) -> _Node | None:
        L = self.stream_L.get(stream)
        if not L:
            return None
        i = bisect.bisect_right(L, t)
        return self.gpu_streams[stream][i] if i < len(L) else None

    def _thread_stream_near(self, thread, t: float, after: bool) -> str | None:
        ts = self.thread_launch_t.get(thread)
        if not ts:
            return None
        if after:
            i = bisect.bisect_right(ts, t)
            return self.thread_launches[thread][i][2].stream if i < len(ts) else None
        i = bisect.bisect_left(ts, t) - 1
        return self.thread_launches[thread][i][2].stream if i >= 0 else None

    def _gpu_stream_name(self, dev, sid) -> str:
        return f"gpu{dev}.stream{sid}"

    def _sync_deps(self):
        sync_by_corr: dict[int, dict] = {}
        for d in self.syncs:
            c = _int(d.get("correlation"))
            if c is not None:
                sync_by_corr.setdefault(c, d)
        self.sync_by_corr = sync_by_corr
        all_streams = list(self.gpu_streams)
        n_sync = 0
        # most recent event record per thread (for the fallback)
        for thread, groups in self.groups_by_thread.items():
            records: list[_Call] = []
            for g in groups:
                for c in g.calls:
                    if _EVENT_RECORD.match(c.name):
                        records.append(c)
                        continue
                    cand: list[_Node] = []
                    if _SYNC_CALL.match(c.name):
                        cand = self._sync_targets(c, all_streams, records)
                    elif _MEMCPY_CALL.match(c.name) and c.gpu:
                        self._blocking_copy(c)
                        continue
                    else:
                        continue
                    seg = g.last_seg
                    if seg is None:
                        continue
                    ok = [n for n in cand if n is not None and n.e <= seg.e + _DEP_TOL_US]
                    if ok:
                        seg.deps.extend(ok)
                        seg.shrink = True
                        seg.kind = OpKind.SYNC
                        seg.meta["waits_on"] = len(ok)
                        n_sync += 1
        self.n_sync = n_sync

    def _thread_wake_deps(self):
        """Couple the main thread and the other host threads (autograd, comm threads).

        Without these edges every host thread would replay on its own fixed timeline. A thread
        that was idle for at least ``_WAKE_IDLE_US`` (a gap between runtime calls) is taken to
        have been woken by the main thread: its idle gap waits for the last main-thread op
        that ended during the gap. Conversely, an idle gap of the main thread during which
        another thread finished a burst of work (its last call before going idle) waits for
        that burst. The gap op then only keeps, as fixed time, the part after that event.
        """
        main = self.host_nodes.get(self.main_thread)
        if not main:
            return
        main_ends = self.seg_ends[self.main_thread]
        n = 0
        burst_ends: list[_Node] = []
        for thread, segs in self.host_nodes.items():
            if thread == self.main_thread:
                continue
            for i, g in enumerate(segs):
                if g.meta.get("segment") != "gap" or g.e - g.s < _WAKE_IDLE_US:
                    continue
                if i > 0 and segs[i - 1].meta.get("segment") == "call":
                    burst_ends.append(segs[i - 1])
                j = bisect.bisect_right(main_ends, g.e + _EPS_US) - 1
                if j >= 0 and main[j].e > g.s + _EPS_US:
                    g.deps.append(main[j])
                    g.shrink = True
                    g.meta["waits_on_thread"] = self._stream_names[self.main_thread]
                    n += 1
            if segs and segs[-1].meta.get("segment") == "call":
                burst_ends.append(segs[-1])
        burst_ends.sort(key=lambda x: x.e)
        keys = [x.e for x in burst_ends]
        for g in main:
            if g.meta.get("segment") != "gap" or g.e - g.s < _WAKE_IDLE_US:
                continue
            j = bisect.bisect_right(keys, g.e + _EPS_US) - 1
            if j >= 0 and burst_ends[j].e > g.s + _EPS_US:
                g.deps.append(burst_ends[j])
                g.shrink = True
                g.meta["waits_on_thread"] = burst_ends[j].stream
                n += 1
        self.n_thread_edges = n

    def _sync_targets(self, c: _Call, all_streams, records) -> list[_Node]:
        d = self.sync_by_corr.get(c.corr) if c.corr is not None else None
        name = c.name
        if d is not None:
            kind = str(d.get("cuda_sync_kind") or "")
            dev = _int(d.get("device"))
            if dev is None:
                dev = d.get("_pid")
            if kind == "Context Sync":
                return [self._last_before(s, c.ts) for s in self.dev_streams.get(dev, all_streams)]
            if kind == "Stream Sync":
                sid = _int(d.get("stream"))
                return [self._last_before(self._gpu_stream_name(dev, sid), c.ts)]
            if kind == "Event Sync":
                if "EventSynchronize" not in name:
                    return []  # cudaEventQuery: does not block
                rec = self.corr_call.get(_int(d.get("wait_on_cuda_event_record_corr_id")) or -1)
                ws = _int(d.get("wait_on_stream"))
                if rec is not None and ws is not None and ws >= 0:
                    return [self._last_before(self._gpu_stream_name(dev, ws), rec.ts)]
        if ("DeviceSynchronize" in name or "CtxSynchronize" in name
                or (d and d.get("cuda_sync_kind") == "Context Sync")):
            return [self._last_before(s, c.ts) for s in all_streams]
        if "EventSynchronize" in name and records:
            rec = records[-1]
            rs = self._thread_stream_near(c.thread, rec.ts, after=False)
            if rs is not None:
                return [self._last_before(rs, rec.ts)]
        # stream sync (or unknown event): the latest-finishing candidate that finished in time
        best = None
        for s in all_streams:
            n = self._last_before(s, c.ts)
            if n is not None and n.e <= c.end + _DEP_TOL_US and (best is None or n.e > best.e):
                best = n
        return [best] if best is not None else []

    def _blocking_copy(self, c: _Call):
        """A synchronous copy: the tail of the call waits for the copy (and, before it, the
        launch part waits for the copy's stream predecessor)."""
        g = c.group
        for n in c.gpu:
            if n.kind not in (OpKind.MEMCPY_D2H, OpKind.MEMCPY_D2D, OpKind.MEMCPY_H2D):
                continue
            blocking = ("Async" not in c.name) or (n.kind == OpKind.MEMCPY_D2H and not n.pinned)
            if not blocking or g.last_seg is None or g.launch_seg is None or g.last_seg is g.launch_seg:
                continue
            if n.e > g.last_seg.e + _DEP_TOL_US:
                continue
            tail = g.last_seg
            tail.deps.append(n)
            tail.shrink = True
            tail.kind = OpKind.SYNC
            tail.meta["waits_on"] = 1
            i = self.stream_pos[id(n)]
            if i > 0:
                p = self.gpu_streams[n.stream][i - 1]
                head = g.launch_seg
                if p.e <= head.e + _DEP_TOL_US and p.e > head.s:
                    head.deps.append(p)
                    head.shrink = True

    def _cross_stream_deps(self):
        n_edges = 0
        waits = [d for d in self.syncs if d.get("cuda_sync_kind") == "Stream Wait Event"]
        self.exact_waits = bool(waits)
        if waits:
            for d in waits:
                dev = _int(d.get("device"))
                if dev is None:
                    dev = d.get("_pid")
                s_wait = self._gpu_stream_name(dev, _int(d.get("stream")))
                ws = _int(d.get("wait_on_stream"))
                rec = self.corr_call.get(_int(d.get("wait_on_cuda_event_record_corr_id")) or -1)
                wcall = self.corr_call.get(_int(d.get("correlation")) or -1)
                if ws is None or ws < 0 or rec is None:
                    continue
                t_wait = wcall.ts if wcall is not None else d["_ts"]
                src = self._last_before(self._gpu_stream_name(dev, ws), rec.ts)
                dst = self._first_after(s_wait, t_wait)
                if self._add_gpu_edge(src, dst, exact=True):
                    n_edges += 1
        else:
            for thread, groups in self.groups_by_thread.items():
                last_rec: tuple[float, str] | None = None
                for g in groups:
                    for c in g.calls:
                        if _EVENT_RECORD.match(c.name):
                            rs = self._thread_stream_near(thread, c.ts, after=False)
                            last_rec = (c.ts, rs) if rs is not None else None
                        elif _STREAM_WAIT.match(c.name) and last_rec is not None:
                            t_rec, rs = last_rec
                            ws = self._thread_stream_near(thread, c.ts, after=True)
                            if ws is None or ws == rs:
                                continue
                            src = self._last_before(rs, t_rec)
                            dst = self._first_after(ws, c.ts)
                            if self._add_gpu_edge(src, dst, exact=False):
                                n_edges += 1
        self.n_cross = n_edges

    def _infer_stream_waits(self):
        """Explain a GPU op's late start by an op of another stream that ended just before.

        Used when the trace has no ``cuda_sync`` "Stream Wait Event" records (older traces often
        lack the ``cudaEventRecord`` calls too): if an op starts more than ``_WAIT_MIN_GAP_US``
        after both its stream predecessor and its other dependencies, and an op of another
        stream of the same device ended within ``_WAIT_WINDOW_US`` before it, the op is taken to
        have waited for that op (an event wait), and an edge is added.
        """
        ends: dict[Any, list[tuple[float, int, _Node]]] = defaultdict(list)
        for lst in self.gpu_streams.values():
            for n in lst:
                ends[n.meta["device"]].append((n.e, n.seq, n))
        for v in ends.values():
            v.sort(key=lambda x: (x[0], x[1]))
        keys = {d: [x[0] for x in v] for d, v in ends.items()}
        n_inf = 0
        for stream, lst in self.gpu_streams.items():
            prev_e = -math.inf
            for n in lst:
                dep_e = max((d.e for d in n.deps), default=-math.inf)
                explained = max(prev_e, dep_e)
                prev_e = n.e
                if n.s - explained < _WAIT_MIN_GAP_US:
                    continue
                dev = n.meta["device"]
                ev, ek = ends[dev], keys[dev]
                i = bisect.bisect_right(ek, n.s + _DEP_TOL_US) - 1
                while i >= 0 and ek[i] >= n.s - _WAIT_WINDOW_US:
                    src = ev[i][2]
                    if src.stream != stream and src.e > explained:
                        if self._add_gpu_edge(src, n, exact=False):
                            n_inf += 1
                        break
                    i -= 1
        self.n_inferred = n_inf

    def _add_gpu_edge(self, src: _Node | None, dst: _Node | None, exact: bool) -> bool:
        if src is None or dst is None or src is dst or src.stream == dst.stream:
            return False
        if src.e > dst.s + _DEP_TOL_US:
            return False
        if src in dst.deps:
            return False
        dst.deps.append(src)
        dst.meta.setdefault("event_deps", 0)
        dst.meta["event_deps"] += 1
        if not exact:
            dst.meta["event_deps_inferred"] = True
        return True

    def _assign_steps_and_phases(self):
        # step of each host segment and GPU op
        for thread, segs in self.host_nodes.items():
            for n in segs:
                n.step = self._step_of(n.s)
        # GPU ops: the step of their launch call. An orphan (launch not captured) was launched
        # between its launched neighbours on the stream, so it takes a step in
        # [step(prev launched), step(next launched)] chosen by its GPU start time; orphans ahead
        # of the first launched op of their stream were launched before the trace window (GPU
        # backlog) and belong to no step (their time becomes a carry-in gap). Streams without
        # any captured launch fall back to the GPU start time.
        for n in self.gpu_nodes:
            if n.launch_t is not None:
                n.step = self._step_of(n.launch_t)
        for lst in self.gpu_streams.values():
            launched = [i for i, n in enumerate(lst) if n.launch_t is not None]
            if not launched:
                for n in lst:
                    n.step = self._step_of(n.s)
                continue
            nxt = [None] * len(lst)
            j = None
            for i in range(len(lst) - 1, -1, -1):
                if lst[i].launch_t is not None:
                    j = i
                nxt[i] = j
            prev = None
            for i, n in enumerate(lst):
                if n.launch_t is not None:
                    prev = n
                    continue
                if prev is None:
                    n.step = None
                    n.meta["pre_window"] = True
                    continue
                lo = prev.step
                hi = lst[nxt[i]].step if nxt[i] is not None else None
                k = self._step_of(n.s)
                if k is None or lo is None:
                    k = lo
                else:
                    k = max(k, lo)
                    if hi is not None:
                        k = min(k, hi)
                n.step = k
        # backward window per step (from BWD-labelled annotations on any thread)
        K = len(self.steps)
        bwd_lo = [math.inf] * K
        bwd_hi = [-math.inf] * K
        for thread, lst in self.annots.items():
            for a in lst:
                if a.label == Phase.BWD:
                    k = self._step_of(a.ts)
                    if k is not None:
                        bwd_lo[k] = min(bwd_lo[k], a.ts)
                        bwd_hi[k] = max(bwd_hi[k], a.end)
        autograd_threads = set()
        for thread, lst in self.annots.items():
            if thread != self.main_thread and any(
                    a.name.startswith("autograd::engine::evaluate_function") for a in lst):
                autograd_threads.add(thread)
        for t, nm in self.thread_names.items():
            if "autograd" in nm.lower():
                autograd_threads.add(t)
        for thread, segs in self.host_nodes.items():
            for n in segs:
                stack = n.meta.pop("_stack", ())
                ph = None
                for a in reversed(stack):
                    if a.label is not None:
                        ph = a.label
                        break
                if ph is None:
                    if thread in autograd_threads:
                        ph = Phase.BWD
                    elif thread == self.main_thread and n.step is not None and bwd_lo[n.step] < math.inf:
                        k = n.step
                        if n.s < bwd_lo[k]:
                            ph = Phase.FWD
                        else:
                            ph = Phase.BWD if n.s <= bwd_hi[k] else Phase.OTHER
                    else:
                        ph = Phase.OTHER
                n.phase = ph
                # collective info from enclosing annotations (for the kernels it launches)
                if stack and n.call is not None and n.call.gpu:
                    for a in reversed(stack):
                        if a.name.startswith("nccl:") or a.args is not None:
                            for g in n.call.gpu:
                                if g.kind == OpKind.COLLECTIVE:
                                    self._coll_from_annot(g, a)
        # GPU phases: from the launching call's first segment; orphans from GPU annotations
        gl = [(ts, end, nm, _phase_label(nm)) for ts, end, nm, _, _ in self.gpu_annots]
        gl = [x for x in gl if x[3] is not None]
        for thread, groups in self.groups_by_thread.items():
            for g in groups:
                if g.first_seg is None:
                    continue
                for c in g.calls:
                    for n in c.gpu:
                        n.phase = g.first_seg.phase
                        if "cpu_op" in g.first_seg.meta:
                            n.meta["cpu_op"] = g.first_seg.meta["cpu_op"]
        for n in self.gpu_nodes:
            if n.launch_t is None and gl:
                best = None
                for ts, end, nm, lab in gl:
                    if ts <= n.s < end and (best is None or ts >= best[0]):
                        best = (ts, lab)
                if best is not None:
                    n.phase = best[1]
        # collectives without a name: the GPU-side "nccl:<coll>" annotation around them
        coll_ann = [x for x in self.gpu_annots if x[2].startswith("nccl:")]
        if coll_ann:
            for n in self.gpu_nodes:
                if n.kind == OpKind.COLLECTIVE and "collective" not in n.meta:
                    for ts, end, nm, pid, tid in coll_ann:
                        if ts <= n.s < end and tid == n.meta["stream_id"]:
                            n.meta["collective"] = nm[5:]
                            break
        # attention direction from phase when the name does not say
        for n in self.gpu_nodes:
            if n.cost_class == CostClass.ATTENTION_FWD and n.phase == Phase.BWD:
                n.cost_class = CostClass.ATTENTION_BWD

    def _coll_from_annot(self, g: _Node, a: _Annot):
        m = g.meta
        if a.name.startswith("nccl:") and "collective" not in m:
            m["collective"] = a.name[5:]
        args = a.args
        if not args:
            return
        if "collective" not in m and args.get("Collective name"):
            m["collective"] = str(args["Collective name"])
        for k_src, k_dst in (("In msg nelems", "in_msg_nelems"), ("Out msg nelems", "out_msg_nelems"),
                             ("Group size", "group_size")):
            v = _int(args.get(k_src))
            if v is not None and k_dst not in m:
                m[k_dst] = v
        if "in_msg_nelems" not in m:
            dims = args.get("Input Dims")
            if isinstance(dims, list) and dims and isinstance(dims[0], list) and dims[0]:
                d0 = dims[0]
                while d0 and isinstance(d0[0], list):  # TensorList: [[n]]
                    d0 = d0[0]
                if all(isinstance(x, int) for x in d0):
                    m["in_msg_nelems"] = int(math.prod(d0))
        if "dtype" not in m:
            dt = _norm_dtype(args.get("dtype"))
            if dt is None:
                it = args.get("Input type")
                if (isinstance(it, list) and it and isinstance(it[0], str)
                        and it[0] not in ("", "Scalar", "TensorList")):
                    dt = _norm_dtype(it[0])
            if dt:
                m["dtype"] = dt
                g.dtype = dt

    def _select(self, steps) -> list[int]:
        K = len(self.steps)
        if steps == "all" or steps is None:
            return list(range(K))
        if isinstance(steps, bool):
            raise TraceImportError(f"{self.path}: steps must be 'all', an int or a list of ints")
        if isinstance(steps, int):
            steps = [steps]
        if not isinstance(steps, (list, tuple, range)):
            raise TraceImportError(f"{self.path}: steps must be 'all', an int or a list of ints")
        out = []
        for s in steps:
            if not isinstance(s, int) or isinstance(s, bool):
                raise TraceImportError(f"{self.path}: step index {s!r} is not an int")
            if not -K <= s < K:
                raise TraceImportError(f"{self.path}: step index {s} out of range (trace has {K} steps)")
            out.append(s % K)
        out = sorted(set(out))
        if not out:
            raise TraceImportError(f"{self.path}: no steps selected")
        return out

    def _finish(self, sel: list[int]) -> KinetoImport:
        selset = set(sel)
        nodes: list[_Node] = []
        for segs in self.host_nodes.values():
            nodes.extend(n for n in segs if n.step in selset)
        nodes.extend(n for n in self.gpu_nodes if n.step in selset)
        main_stream = self._stream_names[self.main_thread]
        markers = {}
        for k in sel:
            lab, s, e = self.steps[k]
            m = _Node(f"step_begin#{lab}", OpKind.HOST, main_stream, s, s, sub=0)
            m.step = k
            m.meta = {"marker": "step_begin", "step_label": lab}
            markers[k] = m
            nodes.append(m)
        inset = set(map(id, nodes))
        # prune deps to selected ops; host ops waiting on deps start when they are done
        for n in nodes:
            if n.deps:
                n.deps = [d for d in dict.fromkeys(n.deps) if id(d) in inset]
            if n.shrink:
                if "waits_on" in n.meta:
                    n.meta["waits_on"] = sum(1 for d in n.deps if d.is_gpu)
                if "waits_on_thread" in n.meta and not any(
                        not d.is_gpu and d.stream != n.stream for d in n.deps):
                    del n.meta["waits_on_thread"]
                dmax = max((d.e for d in n.deps), default=-math.inf)
                n.s = min(max(n.a, dmax), n.e)
        t_origin = self.steps[sel[0]][1]
        # per-stream order and gap filling
        per: dict[str, list[_Node]] = defaultdict(list)
        for n in nodes:
            per[n.stream].append(n)
        gaps: list[_Node] = []
        gap_stats = Counter()
        gap_time = Counter()
        for stream, lst in per.items():
            lst.sort(key=lambda n: (n.a, n.sub, n.seq))
            prev_e = t_origin
            first = True
            for n in lst:
                dep_e = max((d.e for d in n.deps), default=-math.inf)
                explained = max(prev_e, dep_e)
                gap = n.s - explained
                if n.is_gpu:
                    reason = None
                    if n.launch_t is None:
                        reason = "orphan"
                    elif first:
                        reason = "carry_in"
                    elif dep_e >= prev_e:
                        reason = "launch_latency"
                    else:
                        reason = "queue"
                    want = self.gpu_gaps == "all" or (
                        self.gpu_gaps == "boundary" and reason in ("orphan", "carry_in"))
                    if want and gap > max(self.gpu_gap_min_us, _EPS_US):
                        gaps.extend(self._gap_nodes("gpu_gap", OpKind.SYNC, explained, n, selset,
                                                    {"gap": "gpu", "reason": reason}))
                        gap_stats[reason] += 1
                        gap_time[reason] += gap
                elif gap > _EPS_US:
                    gaps.extend(self._gap_nodes("cpu_gap", OpKind.HOST, explained, n, selset,
                                                {"gap": "cpu"}))
                prev_e = n.e
                first = False
        nodes.extend(gaps)
        order = self._topo_order(nodes)
        # build the graph
        b = GraphBuilder()
        new_id: dict[int, int] = {}
        lab_of = {k: self.steps[k][0] for k in range(len(self.steps))}
        for n in order:
            deps = [new_id[id(d)] for d in n.deps if id(d) in new_id]
            dur_s = max(0.0, n.e - n.s) * 1e-6
            meta = n.meta
            meta["step"] = n.step
            meta["step_label"] = lab_of.get(n.step)
            fields: dict[str, Any] = dict(
                phase=n.phase, cost_class=n.cost_class, fixed_duration_s=dur_s, meta=meta,
            )
            if n.is_gpu and n.kind != OpKind.SYNC:
                fields.update(launch=False, bytes_read=n.bytes_read, bytes_written=n.bytes_written,
                              pinned=n.pinned)
                if n.dtype:
                    fields["dtype"] = n.dtype
            elif n.is_gpu:
                fields["launch"] = False
            else:
                fields["host_s"] = dur_s if n.kind == OpKind.HOST else 0.0
                fields["launch"] = False
            new_id[id(n)] = b.add(n.name, n.kind, n.stream, deps=deps, **fields)
        # measured step times on the constructed timeline
        step_end: dict[int, float] = defaultdict(lambda: -math.inf)
        gpu_lo: dict[int, float] = defaultdict(lambda: math.inf)
        gpu_hi: dict[int, float] = defaultdict(lambda: -math.inf)
        for n in nodes:
            if n.step is None:
                continue
            step_end[n.step] = max(step_end[n.step], n.e)
            if n.is_gpu and not n.meta.get("gap"):
                gpu_lo[n.step] = min(gpu_lo[n.step], n.s)
                gpu_hi[n.step] = max(gpu_hi[n.step], n.e)
        step_times = [max(0.0, step_end[k] - self.steps[k][1]) * 1e-6 for k in sel]
        gpu_times = [max(0.0, gpu_hi[k] - gpu_lo[k]) * 1e-6 if gpu_hi[k] > -math.inf else 0.0
                     for k in sel]
        spans = [max(0.0, self.steps[k][2] - self.steps[k][1]) * 1e-6 for k in sel]
        starts_s = [(self.steps[k][1] - t_origin) * 1e-6 for k in sel]
        ends_s = [st + t for st, t in zip(starts_s, step_times)]
        gpu_starts = [(gpu_lo[k] - t_origin) * 1e-6 if gpu_lo[k] < math.inf else None for k in sel]
        dev = self.devices.most_common(1)[0][0] if self.devices else None
        graph = b.build(
            source=f"kineto:{self.fname}",
            meta={
                "path": self.path,
                "schema_era": self.era,
                "device": dev,
                "device_name": self._device_name(dev),
                "steps": list(sel),
                "step_labels": [self.steps[k][0] for k in sel],
                "step_source": self.step_source,
                "time_origin_ts_us": t_origin + self.t0_abs,
                "base_time_ns": self.base_time_ns,
                "gpu_gaps": self.gpu_gaps,
                "gpu_gap_count": dict(gap_stats),
                "gpu_gap_us": {k: float(v) for k, v in gap_time.items()},
                "orphan_gpu_ops": self.n_orphan,
                "cross_stream_edges": self.n_cross,
                "inferred_stream_edges": self.n_inferred,
                "thread_edges": self.n_thread_edges,
                "sync_ops": self.n_sync,
                "main_stream": main_stream,
            },
        )
        return KinetoImport(
            graph=graph,
            step_times_s=step_times,
            device_name=self._device_name(dev),
            schema_era=self.era,
            warnings=list(self.warnings),
            steps=list(sel),
            step_labels=[self.steps[k][0] for k in sel],
            step_source=self.step_source,
            step_spans_s=spans,
            gpu_step_times_s=gpu_times,
            path=self.path,
            step_starts_s=starts_s,
            step_ends_s=ends_s,
            gpu_step_starts_s=gpu_starts,
            uses_worker_processes=self.uses_workers,
            dataloader_intervals_us=list(self.dataloader_intervals_us),
            cpu_annotations=self.cpu_annotations,
        )

    def _gap_nodes(self, name: str, kind: OpKind, start: float, n: _Node, selset: set,
                   meta: dict) -> list[_Node]:
        """Gap op(s) filling ``[start, n.s]`` before ``n`` on its stream, carrying ``n``'s deps.

        A gap that crosses the start of ``n``'s step is split there, so that every op of a step
        starts inside the step (the first part goes to the step it starts in).
        """
        k0 = self.steps[n.step][1] if n.step is not None else None
        if k0 is not None and start < k0 - _EPS_US and n.s > k0 + _EPS_US:
            st0 = self._step_of(start)
            pieces = [(start, k0, st0 if st0 in selset else n.step), (k0, n.s, n.step)]
        else:
            pieces = [(start, n.s, n.step)]
        out = []
        for a, b, st in pieces:
            gn = _Node(name, kind, n.stream, a, b, is_gpu=n.is_gpu)
            gn.deps = list(n.deps) if n.is_gpu else []
            gn.step = st
            gn.phase = n.phase
            gn.meta = dict(meta, dur_us=b - a)
            out.append(gn)
        return out

    def _device_name(self, dev) -> str | None:
        props = self.top.get("deviceProperties") if isinstance(self.top, dict) else None
        if not isinstance(props, list) or not props:
            return None
        for p in props:
            if isinstance(p, dict) and p.get("id") == dev and p.get("name"):
                return str(p["name"])
        if isinstance(dev, int) and 0 <= dev < len(props) and isinstance(props[dev], dict):
            nm = props[dev].get("name")
            return str(nm) if nm else None
        p = props[0]
        return str(p.get("name")) if isinstance(p, dict) and p.get("name") else None

    def _topo_order(self, nodes: list[_Node]) -> list[_Node]:
        """Topological order (deps and stream order), as close to start-time order as possible.

        Dependencies are consistent with the measured times, so cycles can only come from
        ties within the tolerances; one is broken by dropping the (non-stream) dependencies of
        the earliest op that waits on an unplaced op.
        """
        idx = {id(n): i for i, n in enumerate(nodes)}
        succ: list[list[int]] = [[] for _ in nodes]
        indeg = [0] * len(nodes)
        stream_pred = [-1] * len(nodes)
        per: dict[str, list[int]] = defaultdict(list)
        for i, n in enumerate(nodes):
            per[n.stream].append(i)
        for stream, lst in per.items():
            lst.sort(key=lambda i: (nodes[i].a, nodes[i].sub, nodes[i].seq))
            for a, b in zip(lst, lst[1:]):
                succ[a].append(b)
                indeg[b] += 1
                stream_pred[b] = a
        for i, n in enumerate(nodes):
            for d in n.deps:
                j = idx[id(d)]
                succ[j].append(i)
                indeg[i] += 1

        def key(i):
            n = nodes[i]
            return (n.s, n.sub, n.seq, i)

        heap = [key(i) for i in range(len(nodes)) if indeg[i] == 0]
        heapq.heapify(heap)
        pending = [key(i) for i in range(len(nodes))]
        heapq.heapify(pending)
        out: list[_Node] = []
        placed = [False] * len(nodes)
        broken = 0
        while len(out) < len(nodes):
            if not heap:
                while placed[pending[0][-1]]:
                    heapq.heappop(pending)
                i = pending[0][-1]
                while stream_pred[i] >= 0 and not placed[stream_pred[i]]:
                    i = stream_pred[i]
                n = nodes[i]
                drop = [d for d in n.deps if not placed[idx[id(d)]]]
                for d in drop:
                    succ[idx[id(d)]].remove(i)
                    indeg[i] -= 1
                n.deps = [d for d in n.deps if placed[idx[id(d)]]]
                broken += len(drop)
                if indeg[i] == 0:
                    heapq.heappush(heap, key(i))
                continue
            *_, i = heapq.heappop(heap)
            placed[i] = True
            out.append(nodes[i])
            for j in succ[i]:
                indeg[j] -= 1
                if indeg[j] == 0:
                    heapq.heappush(heap, key(j))
        if broken:
            self.warnings.append(f"dropped {broken} dependencies that formed cycles")
        return out


def load_kineto(
    path: str | os.PathLike,
    steps: Literal["all"] | int | Sequence[int] = "all",
    max_bytes: int = DEFAULT_MAX_BYTES,
    *,
    gpu_gaps: GpuGapMode = "all",
    gpu_gap_min_us: float = 0.0,
    infer_stream_waits: bool = True,
) -> KinetoImport:
    """Import a PyTorch-profiler / Kineto trace into a replayable ``OpGraph``.

    Args:
        path: Trace file (``.json`` or gzip, detected by magic bytes).
        steps: ``"all"``, or the index / list of indices (0-based, negative counts from the end)
            of the steps to import among the steps detected in the file.
        max_bytes: Largest accepted decompressed size, bytes (defends against gzip bombs).
        gpu_gaps: Which unexplained GPU idle intervals become ``gpu_gap`` ops: ``"all"``,
            ``"boundary"`` (orphan GPU ops and the first op of each stream only) or ``"none"``.
        gpu_gap_min_us: Unexplained gaps up to this long (microseconds) are not materialised.
        infer_stream_waits: In traces without ``cuda_sync`` wait records, explain a GPU op that
            starts late by an op of another stream that ended just before it (an inferred
            event wait; ``meta["event_deps_inferred"]``).

    Returns:
        A ``KinetoImport``.

    Raises:
        TraceImportError: unreadable, truncated or corrupt file; too large after
            decompression; not a Kineto trace; no GPU events; bad ``steps``.
    """
    imp = _Importer(path, max_bytes, gpu_gaps, gpu_gap_min_us, infer_stream_waits)
    gc_was_enabled = gc.isenabled()
    gc.disable()  # the parse creates millions of acyclic objects; GC passes would dominate
    try:
        imp.load()
        return imp.build(steps)
    except TraceImportError:
        raise
    except MemoryError:
        raise TraceImportError(f"{imp.path}: out of memory while importing") from None
    except Exception as e:  # malformed content we did not anticipate: keep the one-line contract
        raise TraceImportError(
            f"{imp.path}: malformed trace ({type(e).__name__}: {e})"
        ) from e
    finally:
        if gc_was_enabled:
            gc.enable()
