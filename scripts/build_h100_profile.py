#!/usr/bin/env python3
"""Fit the H100 SXM GEMM profile from Vidur's public H100 operator timings, holding half of them out.

Reads ``tests/data/vidur/llama2_7b_h100_gemm_median_ms.csv`` (microsoft/vidur, MIT licence; Agrawal et
al., MLSys 2024; see ``tests/data/vidur/README.md``): median times of the four GEMMs of a Llama-2-7B
layer for 1,024-4,096 tokens at tensor-parallel sizes 1, 2, 4 and 8 (shapes:
``simulator.studies.kernel_validation.gemm_shape``). Writes
``hardware_models/presets/profiles/h100-sxm-80gb.yaml``. Re-run:

    python scripts/build_h100_profile.py [--csv PATH] [--out PATH]

Fit / hold-out split: the GEMM parameters are fitted on the TP 1 and TP 2 rows only (``FIT_TP``, 1,048
points); the TP 4 and TP 8 rows (smaller N or K per rank, 1,048 points) are never seen by the fit and
are the held-out validation of ``tests/validation/test_vidur_gemms.py``.

What is fitted, and how (the method of ``scripts/build_h200_profile.py``): the wave/tile model of
``hardware_models.profile`` (tile 128 x 256, 132 SMs) with ``efficiency`` and ``wave_overhead_s``
free and ``fixed_s`` 0, by ``scipy.optimize.least_squares`` on log time; the model time includes the
profile's ``kernel_fixed_s``, as the cost model adds it to every kernel
(``simulator.cost.roofline.RooflineCostModel.duration_s``). Vidur times the model's half-precision
GEMMs; the H100's fp16 and bf16 tensor-core peaks are equal (989.4 TFLOP/s dense, NVIDIA H100
architecture whitepaper), so the fit is used for both, and fp32 GEMMs (66.9 TFLOP/s, no H100
measurement) keep the generic 70%.

Not measured on an H100 (no public microbenchmark of PyTorch's training kernels in the project):
the memory-bound classes, ``kernel_fixed_s`` and attention. They are the H200 microbenchmarks of
``h200-sxm-141gb-micro.yaml`` (same GH100 die and SM count, HBM3e 4.8 TB/s instead of HBM3 3.35 TB/s),
stored with ``reference_hbm_bandwidth_bytes_per_s: 4.8e12`` so that the cost model scales them by
3.35 / 4.8 (``RooflineCostModel``'s bandwidth scaling); the provenance block says so. Vidur's own
memory-bound operators are vLLM/Sarathi inference kernels (fused RMSNorm, SiLU-and-mul), not
PyTorch's, and are not used. Host copy rates are left to the scenario's PCIe link preset.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from scipy.optimize import least_squares

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simulator.studies.kernel_validation import DATA, OPS, gemm_shape  # noqa: E402

BF16_PEAK = 989.4e12  # hardware_models/presets/gpus/h100-sxm-80gb.yaml (dense)
SM_COUNT = 132  # hardware_models/presets/gpus/h100-sxm-80gb.yaml
TILE = (128, 256)  # as scripts/build_h200_profile.py
FIT_TP = (1, 2)  # fitted on these TP sizes; the others are held out
H200_MICRO = ROOT / "hardware_models/presets/profiles/h200-sxm-141gb-micro.yaml"


def points(csv: Path) -> pd.DataFrame:
    """One row per (op, tokens, tp) with ``m, n, k`` and the measured median ``t_s``."""
    rows = []
    for r in pd.read_csv(csv).itertuples(index=False):
        for op in OPS:
            m, n, k = gemm_shape(op, r.num_tokens, r.tp)
            rows.append({"op": op, "tokens": r.num_tokens, "tp": r.tp, "m": m, "n": n, "k": k,
                         "t_s": getattr(r, f"{op}_median_ms") * 1e-3})
    return pd.DataFrame(rows)


def gemm_model(p, d: pd.DataFrame, kernel_fixed_s: float) -> np.ndarray:
    """Modelled time, s: ``kernel_fixed_s + tiles / SMs * (wave_overhead_s + tile FLOPs / per-SM rate)``."""
    eff, wave_s = p
    # either tile orientation, whichever takes fewer tiles (RooflineCostModel.gemm_compute_s)
    tiles = np.minimum(np.ceil(d.m / TILE[0]) * np.ceil(d.n / TILE[1]), np.ceil(d.m / TILE[1]) * np.ceil(d.n / TILE[0]))
    return kernel_fixed_s + tiles / SM_COUNT * (wave_s + 2.0 * TILE[0] * TILE[1] * d.k / (BF16_PEAK / SM_COUNT * eff))


def fit(d: pd.DataFrame, kernel_fixed_s: float) -> tuple[dict, float, float]:
    """GEMM parameters fitted on ``FIT_TP``; returns them, the fit-set and the held-out RMS relative error."""
    f = d[d.tp.isin(FIT_TP)]
    res = least_squares(lambda p: np.log(gemm_model(p, f, kernel_fixed_s)) - np.log(f.t_s), [0.7, 1e-6],
                        bounds=([0.05, 0.0], [1.0, 1e-4]), x_scale=[1.0, 1e-6])
    err = gemm_model(res.x, d, kernel_fixed_s) / d.t_s - 1
    held = ~d.tp.isin(FIT_TP)
    gemm = {"efficiency": float(res.x[0]), "wave_overhead_s": float(res.x[1]), "fixed_s": 0.0,
            "tile_m": TILE[0], "tile_n": TILE[1]}
    return gemm, float(np.sqrt(np.mean(err[~held] ** 2))), float(np.sqrt(np.mean(err[held] ** 2)))


def build(csv: Path) -> dict:
    h200 = yaml.safe_load(H200_MICRO.read_text())
    gemm, rms_fit, rms_held = fit(points(csv), h200["kernel_fixed_s"])
    return {
        "name": "h100-sxm-80gb",
        "gpu": "h100-sxm-80gb",
        "gemm": {"bf16": gemm, "fp16": dict(gemm), "fp32": {"efficiency": 0.7}},
        "attention_efficiency": dict(h200["attention_efficiency"]),
        "memory_bandwidth_bytes_per_s": dict(h200["memory_bandwidth_bytes_per_s"]),
        "kernel_fixed_s": h200["kernel_fixed_s"],
        "reference_hbm_bandwidth_bytes_per_s": h200["reference_hbm_bandwidth_bytes_per_s"],
        "provenance": {
            "source": f"{DATA} (microsoft/vidur H100 operator profiles, Llama-2-7B GEMMs; MIT licence)",
            "script": "scripts/build_h100_profile.py",
            "generated": dt.date.today().isoformat(),
            "gemm_fit": f"bf16/fp16 efficiency and wave_overhead_s fitted on TP {', '.join(map(str, FIT_TP))} rows "
                        "only; TP 4 and 8 held out (tests/validation/test_vidur_gemms.py)",
            "borrowed_from": {"profile": "h200-sxm-141gb-micro",
                              "fields": ["memory_bandwidth_bytes_per_s", "kernel_fixed_s", "attention_efficiency"],
                              "why": "same GH100 die; memory bandwidths scaled by the HBM peak ratio 3.35 / 4.8; "
                                     "fp32 GEMMs assumed at 70% of peak"},
            "fit_rms_relative_error": {"gemm_fit_set": round(rms_fit, 4), "gemm_held_out": round(rms_held, 4)},
            "assumptions": {
                "gemm_fp32": "not measured on an H100: 70% of the fp32 peak (the generic profile's fraction)",
                "memory_bandwidth_bytes_per_s": "not measured on an H100: the H200 microbenchmarks "
                "(h200-sxm-141gb-micro.yaml; same GH100 die), scaled by the HBM peak ratio 3.35 / 4.8 through "
                "reference_hbm_bandwidth_bytes_per_s",
                "kernel_fixed_s": "not measured on an H100: the H200's CUDA-graph tiny-kernel time (same die)",
                "attention_efficiency": "not measured: as h200-sxm-141gb-micro.yaml (FlashAttention-2 range, "
                "Dao 2023)",
            },
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", type=Path, default=ROOT / DATA)
    ap.add_argument("--out", type=Path, default=ROOT / "hardware_models/presets/profiles/h100-sxm-80gb.yaml")
    args = ap.parse_args()
    prof = build(args.csv)
    header = f"# Generated by scripts/build_h100_profile.py from {args.csv.name}; do not edit by hand.\n"
    args.out.write_text(header + yaml.safe_dump(prof, sort_keys=False))
    print(f"wrote {args.out}")
    print(prof["provenance"]["fit_rms_relative_error"])


if __name__ == "__main__":
    main()
