"""Chrome / Perfetto trace JSON of a run (opens in ui.perfetto.dev, chrome://tracing and HTA).

Layout (Chrome trace event format, the Kineto conventions HolisticTraceAnalysis reads):

* process 0 ``host``: one thread per host stream. The main training thread (``host``) holds
  ``ProfilerStep#N`` slices (``cat: user_annotation``; from the host's start of step N to its start
  of step N+1, as ``torch.profiler`` marks them), the launch of every GPU kernel or copy
  (``cudaLaunchKernel`` / ``cudaMemcpyAsync``, ``cat: cuda_runtime``, lasting the modelled launch
  time), host ops, and ``wait: <op>`` slices where the thread is blocked on a dependency.
* process 1 ``gpu0``: one thread per stream (``args.stream`` > 0); kernels are ``cat: kernel``,
  copies ``cat: gpu_memcpy``; step and phase extents are async slices (``ph: b/e``), since steps
  and phases may overlap.
* flows (``ph: s`` then ``ph: f`` with ``bp: e``): launch -> kernel (``cat: ac2g``, ``id`` =
  ``args.correlation`` of both ends, as Kineto writes them) and every dependency between ops on
  different streams (``cat: dependency``; H2D -> compute, compute -> D2H, device -> host waits).
* counters (memory, clock, power) are ``ph: C`` events.

Zero-length spans (e.g. a ``SYNC`` that found its dependencies done) become instant events
(``ph: i``), so every slice has a positive duration. Times convert from seconds to microseconds
here and only here.
"""

from __future__ import annotations


import pandas as pd

from simulator.recording.recorder import RANK_COLUMNS, rank_column

HOST_PID, GPU_PID = 0, 1
MAIN_THREAD = "host"
_GPU_CAT = {"compute": "kernel", "collective": "kernel", "memcpy_h2d": "gpu_memcpy", "memcpy_d2h": "gpu_memcpy",
            "memcpy_d2d": "gpu_memcpy"}
_LAUNCH_NAME = {"compute": "cudaLaunchKernel", "collective": "cudaLaunchKernel"}  # copies: cudaMemcpyAsync
_US = 1e6


def _pid(stream: str) -> int:
    return HOST_PID if stream.startswith(("host", "cpu", "dataloader", "worker")) else GPU_PID


def to_chrome_trace(spans: pd.DataFrame, counters: pd.DataFrame | None = None, steps: pd.DataFrame | None = None,
                    launches: pd.DataFrame | None = None, deps: pd.DataFrame | None = None) -> dict:
    """Build the trace dict (``{"traceEvents": [...], "displayTimeUnit": "ms", ...}``).

    Args:
        spans: Op executions (``SimulationResult.spans``; seconds).
        counters: Level samples (``SimulationResult.counters``).
        steps: ``step, start_s, end_s`` per step: ProfilerStep and step slices (none without it).
        launches: ``step, op_id, start_s, end_s`` host launch intervals (``recorder.launches_frame``).
        deps: ``op_id, dep_id, step_lag`` dependency edges (``recorder.dependencies_frame``).
    """
    events: list[dict] = []
    streams = list(spans.stream.unique()) if len(spans) else []
    if MAIN_THREAD not in streams and (launches is not None and len(launches) or steps is not None and len(steps)):
        streams.insert(0, MAIN_THREAD)
    tids = {s: i + 1 for i, s in enumerate(sorted(streams, key=lambda s: (s != MAIN_THREAD, s)))}
    for pid, pname in ((HOST_PID, "host"), (GPU_PID, "gpu0")):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": pname}})
    for stream, tid in tids.items():
        events.append({"ph": "M", "name": "thread_name", "pid": _pid(stream), "tid": tid, "args": {"name": stream}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": _pid(stream), "tid": tid, "args": {"sort_index": tid}})

    # -- launches: correlation ids tie a host launch to its GPU op ------------------------------
    corr: dict[tuple[int, int], int] = {}
    launch_at: dict[tuple[int, int], float] = {}
    # an op's first span (a layer-fidelity block's folded TP collectives follow it under the block's id)
    kind_of = dict(zip(spans.op_id[::-1], spans.kind[::-1])) if len(spans) else {}
    if launches is not None and len(launches):
        for r in launches.itertuples(index=False):
            key = (int(r.step), int(r.op_id))
            corr[key] = len(corr) + 1
            if r.end_s > r.start_s:
                launch_at[key] = r.start_s
                events.append({"ph": "X", "name": _LAUNCH_NAME.get(kind_of.get(r.op_id), "cudaMemcpyAsync"),
                               "cat": "cuda_runtime", "pid": HOST_PID, "tid": tids[MAIN_THREAD],
                               "ts": r.start_s * _US, "dur": (r.end_s - r.start_s) * _US,
                               "args": {"correlation": corr[key], "step": key[0], "op_id": key[1]}})

    # -- op spans; where each (step, op) can be bound by a flow ---------------------------------
    slice_of: dict[tuple[int, int], tuple[int, int, float]] = {}  # (step, op) -> (pid, tid, ts in a slice)
    zero: set[tuple[int, int]] = set()
    # busy intervals of the main thread: (start, end, (step, op) of a host op or None for a launch, name)
    host_activity: list[tuple[float, float, tuple[int, int] | None, str]] = []
    if launches is not None and len(launches):
        host_activity += [(a, b, None, "") for a, b in zip(launches.start_s, launches.end_s)]
    for r in spans.itertuples(index=False):
        key = (int(r.step), int(r.op_id))
        pid, tid, dur = _pid(r.stream), tids[r.stream], max(r.end_s - r.start_s, 0.0)
        args = {"step": key[0], "phase": r.phase, "op_id": key[1], "class": r.cost_class,
                "flops": float(r.flops), "bytes": float(r.bytes)}
        if pid == GPU_PID:
            args.update(stream=tid, device=0)
        if key in corr:
            args["correlation"] = corr[key]
        ev = {"name": r.name, "cat": _GPU_CAT.get(r.kind, r.kind) if pid == GPU_PID else r.kind,
              "pid": pid, "tid": tid, "ts": r.start_s * _US, "args": args}
        if dur > 0:
            events.append({"ph": "X", **ev, "dur": dur * _US})
            slice_of.setdefault(key, (pid, tid, r.start_s))
        else:
            events.append({"ph": "i", "s": "t", **ev})
            zero.add(key)
        if r.stream == MAIN_THREAD:
            host_activity.append((r.start_s, r.end_s, key, r.name))

    # -- waits: a gap on the main thread before a host op is the thread blocked on its deps ----
    prev_end = float(steps.start_s.min()) if steps is not None and len(steps) else 0.0
    for start, end, key, name in sorted(host_activity, key=lambda a: (a[0], a[1])):
        if key is not None and start - prev_end > 1e-12 * max(1.0, start):
            events.append({"ph": "X", "name": f"wait: {name}", "cat": "host_wait", "pid": HOST_PID,
                           "tid": tids[MAIN_THREAD], "ts": prev_end * _US, "dur": (start - prev_end) * _US,
                           "args": {"step": key[0], "op_id": key[1]}})
            if key in zero:
                slice_of[key] = (HOST_PID, tids[MAIN_THREAD], prev_end)
        prev_end = max(prev_end, end)

    # -- flows ----------------------------------------------------------------------------------
    flow_id = 0

    def flow(cat: str, src: tuple[int, int, float], dst: tuple[int, int, float], fid: int) -> None:
        events.append({"ph": "s", "name": cat, "cat": cat, "id": fid, "pid": src[0], "tid": src[1], "ts": src[2] * _US})
        events.append({"ph": "f", "bp": "e", "name": cat, "cat": cat, "id": fid, "pid": dst[0], "tid": dst[1],
                       "ts": dst[2] * _US})

    for key, t in launch_at.items():
        if key in slice_of and slice_of[key][0] == GPU_PID:
            flow("ac2g", (HOST_PID, tids[MAIN_THREAD], t), slice_of[key], corr[key])
    flow_id = len(corr)
    if deps is not None and len(deps) and len(spans):
        stream_of = dict(zip(spans.op_id[::-1], spans.stream[::-1]))
        by_op: dict[int, list[tuple[int, int]]] = {}
        for op, dep, lag in deps.itertuples(index=False):
            by_op.setdefault(int(op), []).append((int(dep), int(lag)))

        def sources(step: int, op: int, seen: set) -> list[tuple[int, int]]:
            """Positive-length spans an op stands for: itself, or (zero-length) its own deps."""
            if (step, op) in slice_of and (step, op) not in zero:
                return [(step, op)]
            out = []
            for d, lag in by_op.get(op, ()):
                if step - lag >= 0 and (step - lag, d) not in seen:
                    seen.add((step - lag, d))
                    out += sources(step - lag, d, seen)
            return out

        n_steps = int(spans.step.max()) + 1
        for op, edges in by_op.items():
            for step in range(n_steps):
                dst = slice_of.get((step, op))
                if dst is None:
                    continue
                for d, lag in edges:
                    if step - lag < 0:
                        continue
                    for src_key in dict.fromkeys(sources(step - lag, d, {(step - lag, d)})):
                        if stream_of.get(src_key[1]) == stream_of.get(op) or src_key == (step, op):
                            continue  # same stream: order is implicit
                        flow_id += 1
                        flow("dependency", slice_of[src_key], dst, flow_id)

    # -- steps and phases -----------------------------------------------------------------------
    if steps is not None and len(steps):
        st = steps.sort_values("step")
        starts, ends_s = list(st.start_s), list(st.end_s)
        for i, n in enumerate(st.step):
            host_end = starts[i + 1] if i + 1 < len(starts) else max([ends_s[i], *(a[1] for a in host_activity)])
            events.append({"ph": "X", "name": f"ProfilerStep#{int(n)}", "cat": "user_annotation", "pid": HOST_PID,
                           "tid": tids[MAIN_THREAD], "ts": starts[i] * _US, "dur": max(host_end - starts[i], 0) * _US,
                           "args": {"step": int(n)}})
            events.append({"ph": "b", "name": f"step {int(n)}", "cat": "step", "id": f"step{int(n)}",
                           "pid": GPU_PID, "ts": starts[i] * _US, "args": {"step": int(n)}})
            events.append({"ph": "e", "name": f"step {int(n)}", "cat": "step", "id": f"step{int(n)}",
                           "pid": GPU_PID, "ts": ends_s[i] * _US})
        if len(spans):
            ext = spans.groupby(["step", "phase"]).agg(start_s=("start_s", "min"), end_s=("end_s", "max"))
            for (n, ph), r in ext.iterrows():
                if r.end_s > r.start_s:
                    eid = f"phase{int(n)}.{ph}"
                    events.append({"ph": "b", "name": ph, "cat": "phase", "id": eid, "pid": GPU_PID,
                                   "ts": float(r.start_s) * _US, "args": {"step": int(n)}})
                    events.append({"ph": "e", "name": ph, "cat": "phase", "id": eid, "pid": GPU_PID,
                                   "ts": float(r.end_s) * _US})

    if counters is not None and len(counters):
        for r in counters.itertuples(index=False):
            pid = HOST_PID if str(r.scope).startswith("host") else GPU_PID
            events.append({"ph": "C", "name": f"{r.scope}.{r.metric}", "pid": pid, "ts": r.t_s * _US,
                           "args": {r.metric: float(r.value)}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "distributedInfo": {"rank": 0, "world_size": 1}}


def result_trace(result) -> dict:
    """The trace of a ``SimulationResult`` (spans, counters, steps, launches, dependencies).

    A result of several ranks (frames with a ``pp_rank`` or ``rank_class`` column) gets one ``host`` and
    one ``gpu`` process per rank (pids ``2 r`` and ``2 r + 1``, named ``pp<r>.host`` / ``pp<r>.gpu`` or
    ``class<r>...``), each built as one GPU's trace; flow ids are made unique per rank, pipeline
    sends point to their receives and a collective met by several simulated ranks points from its first
    member to each other one (``_collective_flows``)."""
    parts = (result.spans, result.counters, getattr(result, "launches", None), getattr(result, "deps", None))
    col = rank_column(result.spans)
    if col is None:
        return to_chrome_trace(result.spans, result.counters, result.steps, parts[2], parts[3])
    extra = [c for c in RANK_COLUMNS if c in result.spans]
    first = result.spans.drop_duplicates(col).set_index(col)
    events: list[dict] = []
    for r in sorted(int(x) for x in result.spans[col].unique()):
        row = first.loc[r]
        tag = ".".join(t for t in (f"pp{int(row.pp_rank)}" if "pp_rank" in first else "",
                                   f"class{int(row.dp_class)}" if "dp_class" in first else "") if t) or f"pp{r}"
        sel = [None if df is None else df[df[col] == r].drop(columns=extra) for df in parts]
        one = to_chrome_trace(sel[0], sel[1], result.steps, sel[2], sel[3])["traceEvents"]
        for ev in one:
            ev["pid"] = 2 * r + ev.get("pid", 0)
            if ev.get("name") == "process_name":
                ev["args"] = {"name": f"{tag}.{ev['args']['name']}".replace(".gpu0", ".gpu")}
            if "id" in ev:
                ev["id"] = f"r{r}.{ev['id']}"
            events.append(ev)
    if "pp_rank" in result.spans:
        events += _p2p_flows(result.spans, col)
    events += _collective_flows(result.spans, col)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "distributedInfo": {"rank": 0, "world_size": int(result.summary.get("world_size", 1))}}


def _p2p_flows(spans: pd.DataFrame, col: str) -> list[dict]:
    """Flow arrows (``cat: p2p``) from each pipeline send (``...pp.send_<what>.k<boundary>.mb<i>``) to the
    receive of the same transfer on the other stage, in the same data-parallel class (the transfer runs
    between the two ends); ``col`` numbers the simulated ranks (their pids are ``2 col + 1``)."""
    m = spans.name.str.extract(r"pp\.(send|recv)_(\w+\.k\d+\.mb\d+)$")
    p2p = spans.assign(way=m[0], key=m[1]).dropna(subset=["key"])
    if p2p.empty:
        return []
    cls = p2p.dp_class if "dp_class" in p2p else 0
    p2p = p2p.assign(cls=cls)
    tid = _thread_ids(spans, col)  # the thread ids to_chrome_trace gives each rank's streams
    recv = {(r.step, r.key, r.cls): r for r in p2p[p2p.way == "recv"].itertuples()}
    out = []
    for n, s in enumerate(p2p[p2p.way == "send"].itertuples()):
        d = recv.get((s.step, s.key, s.cls))
        if d is None:
            continue
        fid = f"p2p.{n}"
        a, b = int(getattr(s, col)), int(getattr(d, col))
        out.append({"ph": "s", "name": "p2p", "cat": "p2p", "id": fid, "pid": 2 * a + GPU_PID,
                    "tid": tid[a, s.stream], "ts": s.start_s * _US})
        out.append({"ph": "f", "bp": "e", "name": "p2p", "cat": "p2p", "id": fid, "pid": 2 * b + GPU_PID,
                    "tid": tid[b, d.stream], "ts": d.end_s * _US})
    return out


#: Streams of the data-parallel collectives that rank classes of one stage meet at (``api._meet_across_classes``)
_DP_STREAMS = frozenset({"comm.dp", "comm.dp_shard", "comm.dp_replicate", "comm.dp_post_forward", "comm.ep", "comm.tp_ep", "comm.edp"})


def _thread_ids(spans: pd.DataFrame, col: str) -> dict:
    """``(rank, stream) -> tid`` as ``to_chrome_trace`` numbers each rank's streams."""
    tid = {}
    for r, d in spans.groupby(col):
        names = sorted({*d.stream.unique(), MAIN_THREAD}, key=lambda x: (x != MAIN_THREAD, x))
        tid.update({(r, name): i + 1 for i, name in enumerate(names)})
    return tid


def _collective_flows(spans: pd.DataFrame, col: str) -> list[dict]:
    """Flow arrows (``cat: collective``) between the members of each collective that several simulated ranks
    meet at (a rendezvous, ``engine.rendezvous``): from the lowest-numbered member's span to each other
    member's, ``members - 1`` arrows per call. Who meets, as the engine has them: a cross-stage all-reduce
    (stream ``comm.pp``, not a send/recv) joins the stages of one data-parallel class; a data-parallel
    collective (``_DP_STREAMS``) joins the data-parallel classes of one stage. ``col`` numbers the simulated
    ranks (their GPU pids are ``2 col + 1``)."""
    coll = spans[(spans.kind == "collective") & ~spans.name.str.contains(r"pp\.(?:send|recv)_", regex=True)]
    if coll.empty:
        return []
    has_pp, has_dp = "pp_rank" in coll, "dp_class" in coll
    pp_rows = coll[coll.stream == "comm.pp"] if has_pp else coll.iloc[:0]
    dp_rows = coll[coll.stream.isin(_DP_STREAMS)] if has_dp else coll.iloc[:0]
    meets = []
    if not pp_rows.empty:
        keys = ["step", "name"] + (["dp_class"] if has_dp else [])
        meets += [g for _, g in pp_rows.groupby(keys, sort=True)]
    if not dp_rows.empty:
        keys = ["step", "name"] + (["pp_rank"] if has_pp else [])
        meets += [g for _, g in dp_rows.groupby(keys, sort=True)]
    tid = _thread_ids(spans, col)
    out = []
    n = 0
    for g in meets:
        if len(g) < 2:
            continue
        g = g.sort_values(col)
        first = next(g.itertuples())
        a = int(getattr(first, col))
        for m in g.iloc[1:].itertuples():
            b = int(getattr(m, col))
            fid = f"coll.{n}"
            n += 1
            out.append({"ph": "s", "name": "collective", "cat": "collective", "id": fid, "pid": 2 * a + GPU_PID,
                        "tid": tid[a, first.stream], "ts": first.start_s * _US})
            out.append({"ph": "f", "bp": "e", "name": "collective", "cat": "collective", "id": fid,
                        "pid": 2 * b + GPU_PID, "tid": tid[b, m.stream], "ts": m.start_s * _US})
    return out
