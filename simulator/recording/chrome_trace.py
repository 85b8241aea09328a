"""Chrome / Perfetto trace JSON of a run (opens in ui.perfetto.dev and chrome://tracing).

Each stream becomes a thread (``tid``) of one process per device; spans are ``"X"`` events and
counters (memory, clock, power) ``"C"`` events. Times convert from seconds to microseconds here
and only here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd


def _pid(stream: str) -> tuple[int, str]:
    if stream.startswith(("host", "cpu", "dataloader", "worker")):
        return 0, "host"
    return 1, "gpu0"


def to_chrome_trace(spans: pd.DataFrame, counters: pd.DataFrame | None = None) -> dict:
    """Build the trace dict (``{"traceEvents": [...], "displayTimeUnit": "ms"}``)."""
    events: list[dict] = []
    tids: dict[str, int] = {}
    for stream in spans.stream.unique() if len(spans) else []:
        pid, pname = _pid(stream)
        tids[stream] = len(tids) + 1
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tids[stream], "args": {"name": stream}})
    for pid, pname in ((0, "host"), (1, "gpu0")):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": pname}})
    for r in spans.itertuples(index=False):
        events.append({
            "ph": "X", "name": r.name, "cat": r.kind, "pid": _pid(r.stream)[0], "tid": tids[r.stream],
            "ts": r.start_s * 1e6, "dur": max(r.end_s - r.start_s, 0.0) * 1e6,
            "args": {"step": int(r.step), "phase": r.phase, "op_id": int(r.op_id), "class": r.cost_class,
                     "flops": float(r.flops), "bytes": float(r.bytes)},
        })
    if counters is not None and len(counters):
        for r in counters.itertuples(index=False):
            pid = 0 if str(r.scope).startswith("host") else 1
            events.append({"ph": "C", "name": f"{r.scope}.{r.metric}", "pid": pid, "ts": r.t_s * 1e6,
                           "args": {r.metric: float(r.value)}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(spans: pd.DataFrame, counters: pd.DataFrame | None, path: str | Path) -> Path:
    """Write the trace JSON to ``path``; returns the path."""
    p = Path(path)
    p.write_text(json.dumps(to_chrome_trace(spans, counters)))
    return p
