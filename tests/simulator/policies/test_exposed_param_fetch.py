"""``exposed_param_fetch_s``: one definition (the time the compute stream waits on a parameter fetch: a fetch in
flight, compute idle, no collective running) for ZeRO-3 ``offload_param`` and FSDP ``cpu_offload``."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd

from simulator.policies import offload_fsdp
from simulator.policies.offload_fsdp import FsdpOffloadSummary
from simulator.policies.offload_optimizer import OffloadSummary
from simulator.policies.offload_param import OffloadParamSummary


def _spans(fetch_name: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """One warm-up step (ignored) and one measured step over [0, 10] s: layer 0's forward compute over [0, 2],
    layer 1's fetch over [3, 5] (issued late: compute idles from 2 s), its all-gather over [5, 6], layer 1's
    forward compute over [6, 10]."""
    rows = []
    for step in (0, 1):
        rows += [
            dict(step=step, name="L0.fwd.qkv.gemm", stream="compute", kind="compute", layer=0, phase="fwd",
                 start_s=0.0, end_s=2.0),
            dict(step=step, name=f"L1.fwd.{fetch_name}", stream="h2d", kind="memcpy_h2d", layer=1, phase="fwd",
                 start_s=3.0, end_s=5.0),
            dict(step=step, name="L1.fwd.param_all_gather", stream="comm.dp", kind="collective", layer=1,
                 phase="fwd", start_s=5.0, end_s=6.0),
            dict(step=step, name="L1.fwd.qkv.gemm", stream="compute", kind="compute", layer=1, phase="fwd",
                 start_s=6.0, end_s=10.0),
        ]
    steps = pd.DataFrame([dict(step=0, warmup=True, start_s=0.0), dict(step=1, warmup=False, start_s=0.0)])
    return pd.DataFrame(rows), steps


def test_both_offload_paths_expose_the_same_fetch_wait_by_hand(monkeypatch):
    """ZeRO-3 ``offload_param`` and FSDP ``cpu_offload`` on the same spans: compute idles over [2, 6]; the fetch is
    in flight over [3, 5] of it and the all-gather over [5, 6] is exposed communication: 2 s exposed, 2 s busy, on
    both paths. (ZeRO-3's old per-block rule counted from the end of the previous compute op, [2, 5]: 3 s, the idle
    second before the fetch started included.)"""
    spans, steps = _spans("offload_param.fetch")
    zero3 = OffloadParamSummary(None, None, None, None).summarize(spans, steps, None, {})
    monkeypatch.setattr(OffloadSummary, "summarize", lambda self, *a: {})
    monkeypatch.setattr(offload_fsdp, "offload_ranks", lambda hw: 1)
    summ = object.__new__(FsdpOffloadSummary)
    summ.cfg = SimpleNamespace(fsdp=SimpleNamespace(cpu_adam_impl=lambda impl: "torch_fused", offload_policy=None),
                               training=SimpleNamespace(optimizer=SimpleNamespace(impl="fused")))
    summ.hw = None
    spans, steps = _spans("fsdp_offload.fetch")
    fsdp = summ.summarize(spans, steps, None, {})
    assert zero3 == {"offload_param_fetch_s": 2.0, "exposed_param_fetch_s": 2.0}
    assert (fsdp["offload_param_fetch_s"], fsdp["exposed_param_fetch_s"]) == (2.0, 2.0)
