"""Predicted vs published per-layer times: Korthikanti et al., *Reducing Activation Recomputation in Large
Transformer Models* (MLSys 2023, arXiv 2205.05198), Table 4: forward and backward time of one transformer
layer of the 22B GPT (TP8 on a DGX A100 80GB, batch 4, seq 2048) for five recompute / sequence-parallel
settings. Predicted: layer 10 of the last step of the bundled Table 5 scenarios (its first kernel's start to
its last kernel's end in each phase; the backward includes the recompute), with the overrides of each row.

Tolerance 5% on each combined (forward + backward) time, the tolerance the issue sets on the Table 5 ratio.
At the time of writing (generic A100 profile): 19.69 / 18.74 / 27.32 / 20.72 / 19.77 ms against 19.6 / 19.0 /
27.2 / 20.9 / 20.3 (+0.5%, -1.4%, +0.4%, -0.9%, -2.6%); before Megatron's asynchronous column-parallel
backward was modelled (``parallelism.async_tensor_model_parallel_allreduce``) full recompute was 28.70 ms
(+5.5%).

What is left of Table 5 lies outside the layers: the predicted step has 77 ms outside the 48 layers (the optimizer
64.6 ms: unscale + inf check 13.6, fused Adam 51.0; embedding, LM head and loss 12.4) where Table 5 minus 48 x
Table 4 leaves 114 ms (full recompute, 1.42 s) and 126 ms (SP + selective, 1.10 s), so the steps are -2.2% and
-6.7% and their ratio +4.8% (1.353 vs 1.291). Candidates, not modelled: Megatron's fp16 optimizer kernels the
graph lacks (zeroing the gradient buffer, clip_grad_norm's L2 norm and its host sync, the copy of the main
parameters back to the fp16 model parameters as its own kernel)."""

from __future__ import annotations

import pytest

from simulator import load_scenario, run_scenario
from simulator.studies.validation import KORTH
from tests.conftest import ROOT
from tests.validation.common import check_rel

pytestmark = pytest.mark.validation
#: Table 4 rows: (recompute, sequence parallel) -> (forward ms, backward ms); overheads over the no-recompute
#: baseline -3% / 39% / 7% / 4%, the abstract's "reducing execution time overhead from activation recomputation by
#: over 90%" (39% -> 4%). Not in tests/data/paper/paper_cases.yaml (which has Table 5). Every forward, backward,
#: combined and overhead figure checked against the paper's text (section 6.2: Table 4 and its discussion, which
#: gives the backward overheads as 1.3 ms, 11% of 11.9, for selective and 7.6 ms, 64%, for full recompute; Table 3:
#: 22B, 64 heads, hidden 6144, 48 layers, TP8, global and micro-batch 4; section 6: s 2048, v 51200) in a markdown
#: conversion of arXiv 2205.05198, and against two other transcriptions of the table: all five rows agree
TABLE4 = {("none", False): (7.7, 11.9), ("none", True): (7.2, 11.8), ("full", False): (7.7, 19.5),
          ("selective", False): (7.7, 13.2), ("selective", True): (7.2, 13.1)}
LAYER = 10


def _layer_ms(recompute: str, sp: bool) -> tuple[float, float]:
    path = ROOT / "scenarios/validation" / f"{KORTH}-full_recompute.yaml"
    sets = [f"training.recompute_granularity={'null' if recompute == 'none' else recompute}",
            f"parallelism.sequence_parallel={'true' if sp else 'false'}"]
    spans = run_scenario(load_scenario(path, sets)).spans
    sp_ = spans[(spans["step"] == spans["step"].max()) & (spans["layer"] == LAYER)]
    out = []
    for ph in ("fwd", "bwd"):
        p = sp_[sp_["phase"] == ph]
        out.append(1e3 * (p["end_s"].max() - p["start_s"].min()))
    return out[0], out[1]


@pytest.mark.parametrize("row", list(TABLE4), ids=[f"{r}-{'sp' if s else 'nosp'}" for r, s in TABLE4])
def test_table4_layer_time(row):
    fwd, bwd = _layer_ms(*row)
    mf, mb = TABLE4[row]
    check_rel(f"Korthikanti Table 4 {row} forward + backward of one 22B layer", fwd + bwd, mf + mb, 0.05, " ms")
