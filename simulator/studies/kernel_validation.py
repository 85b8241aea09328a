"""Predicted vs measured GEMM times of a Llama-2-7B layer on an H100 (Vidur's operator profiles).

The four GEMMs of one layer, with ``T`` tokens on one of ``t`` tensor-parallel ranks (Megatron-LM
splits, Llama-2-7B: ``h`` 4096, ``f`` 11008, 32 heads and 32 K/V heads of 128):

* ``attn_pre_proj`` (QKV, column parallel): ``[T, h] x [h, 3 h / t]``;
* ``attn_post_proj`` (output projection, row parallel): ``[T, h / t] x [h / t, h]``;
* ``mlp_up_proj`` (gate and up fused, column parallel): ``[T, h] x [h, 2 f / t]``;
* ``mlp_down_proj`` (row parallel): ``[T, f / t] x [f / t, h]``;

priced by ``simulate kernel``'s cost model (``simulator.studies.kernels.price_kernel``) on the
``h100-sxm-80gb`` preset with its shipped profile, against the measured medians in
``tests/data/vidur/llama2_7b_h100_gemm_median_ms.csv`` (microsoft/vidur, MLSys 2024). That profile's GEMM
parameters are fitted on the TP 1 and TP 2 rows of the same file (``scripts/build_h100_profile.py``); the TP 4
and TP 8 rows are held out (``tests/validation/test_vidur_gemms.py``).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

#: The measured medians, relative to the checkout (not bundled into wheels)
DATA = "tests/data/vidur/llama2_7b_h100_gemm_median_ms.csv"
HIDDEN, FFN, HEADS, KV_HEADS = 4096, 11008, 32, 32  # Llama-2-7B (its config.json)
OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")


def gemm_shape(op: str, tokens: int, tp: int) -> tuple[int, int, int]:
    """``(M, N, K)`` of one of ``OPS`` for ``tokens`` tokens on one of ``tp`` ranks (module docstring)."""
    d = HIDDEN // HEADS
    return {"attn_pre_proj": (tokens, (HEADS + 2 * KV_HEADS) * d // tp, HIDDEN),
            "attn_post_proj": (tokens, HIDDEN, HIDDEN // tp),
            "mlp_up_proj": (tokens, 2 * FFN // tp, HIDDEN),
            "mlp_down_proj": (tokens, HIDDEN, FFN // tp)}[op]


def vidur_gemm_errors(path: Path | None = None, gpu: str = "h100-sxm-80gb") -> pd.DataFrame:
    """One row per (operator, tokens, tp): ``measured_s``, ``predicted_s``, ``error`` (predicted / measured - 1).

    Args:
        path: The measured CSV (default ``DATA`` in the checkout).
        gpu: GPU preset to price on.

    Raises:
        FileNotFoundError: no checkout with the CSV.
    """
    from simulator.studies.kernels import price_kernel
    from simulator.paths import repo_root

    rows = []
    for r in pd.read_csv(path or repo_root() / DATA).itertuples(index=False):
        for op in OPS:
            m, n, k = gemm_shape(op, r.num_tokens, r.tp)
            measured = getattr(r, f"{op}_median_ms") * 1e-3
            predicted = price_kernel(gpu, "gemm", [m, n, k])["time_s"]
            rows.append({"op": op, "tokens": r.num_tokens, "tp": r.tp, "measured_s": measured,
                         "predicted_s": predicted, "error": predicted / measured - 1})
    return pd.DataFrame(rows)


def summary_table(errors: pd.DataFrame) -> pd.DataFrame:
    """Median error and median |error| per operator and TP size, and per operator over all sizes (``tp`` "all")."""
    e = errors.assign(abs_error=errors.error.abs())
    by_tp = e.groupby(["op", "tp"]).agg(points=("error", "size"), median_error=("error", "median"),
                                        median_abs_error=("abs_error", "median")).reset_index()
    pooled = e.groupby("op").agg(points=("error", "size"), median_error=("error", "median"),
                                 median_abs_error=("abs_error", "median")).reset_index().assign(tp="all")
    return pd.concat([by_tp.astype({"tp": str}), pooled], ignore_index=True)
