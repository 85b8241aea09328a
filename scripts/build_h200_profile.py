#!/usr/bin/env python3
"""Fit the H200 efficiency profile from the maintainers' microbenchmarks.

Reads ``tests/data/h200/measurements.json`` (section ``micro``) and writes
``hardware_models/presets/profiles/h200-sxm-141gb-micro.yaml`` (microbenchmarks only) and
``h200-sxm-141gb.yaml`` (the same GPU-side numbers), and prints the host dispatch times per op
(eager tiny-op time and the per-phase fit from the CPU timeline of the batch-16 calibration trace
``tests/data/h200/trace_gpt_184m_b16.json.gz``, see ``simulator.calibration.host_overhead``) for
the host preset ``hardware_models/presets/hosts/h200-measured-host.yaml``: they are properties of
the host, not of the GPU. Re-run it after new measurements:

    python scripts/build_h200_profile.py [--measurements PATH] [--trace PATH] [--out-dir DIR]

What is fitted, and how:

* GEMM (bf16, fp32): the wave/tile model of ``hardware_models.profile`` by ``scipy.optimize.
  least_squares`` on log time, using only the shapes whose median time exceeds 100 us. Below
  that the benchmark loop is bound by the host's eager launch rate (256^3 and 1024^3 both take
  about 27 us), so those points measure the launch floor, not the kernel.
* Memory-bound kernels: achieved bandwidth (read + write) of the ``memory`` microbenchmarks:
  elementwise add -> ``elementwise``/``cast``/``reduction``/``optimizer``/``embedding``,
  device copy -> ``copy``/``memset``, LayerNorm -> ``norm``, softmax -> ``softmax``.
* ``kernel_fixed_s``: the per-kernel time of a tiny kernel replayed in a CUDA graph (no host
  launch cost). ``launch_overhead_s``: the per-op time of the same tiny kernel in eager mode.
* PCIe: ``t = latency + bytes / bandwidth`` fitted per direction and memory type on copies of
  64 KiB and up; duplex from the bidirectional 256 MiB test.
* CPU AdamW: the (params, params/s) points as measured.
* Attention: no microbenchmark exists; the fwd/bwd efficiencies are assumptions (see the
  ``provenance`` block) until ``simulate calibrate`` fits them from a trace.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path

import numpy as np
import yaml
from scipy.optimize import least_squares

ROOT = Path(__file__).resolve().parents[1]
GPU_PEAK = {"bf16": 989.4e12, "fp32": 66.9e12}  # hardware_models/presets/gpus/h200-sxm-141gb.yaml
SM_COUNT = 132
TILE = (128, 256)


def gemm_model(p, m, n, k, peak):
    eff, wave_s = p
    # either tile orientation, whichever takes fewer tiles (RooflineCostModel.gemm_compute_s)
    tiles = np.minimum(np.ceil(m / TILE[0]) * np.ceil(n / TILE[1]), np.ceil(m / TILE[1]) * np.ceil(n / TILE[0]))
    return tiles / SM_COUNT * (wave_s + 2.0 * TILE[0] * TILE[1] * k / (peak / SM_COUNT * eff))


def fit_gemm(points: list[dict], dtype: str) -> tuple[dict, float]:
    pts = [p for p in points if p["dtype"] == f"torch.{ {'bf16': 'bfloat16', 'fp32': 'float32'}[dtype] }"
           and p["median_s"] > 100e-6]
    m, n, k, t = (np.array([p[x] for p in pts], float) for x in ("m", "n", "k", "median_s"))
    peak = GPU_PEAK[dtype]
    res = least_squares(lambda p: np.log(gemm_model(p, m, n, k, peak)) - np.log(t), [0.7, 1e-6],
                        bounds=([0.05, 0.0], [1.0, 1e-4]))
    err = gemm_model(res.x, m, n, k, peak) / t - 1
    return ({"efficiency": float(res.x[0]), "wave_overhead_s": float(res.x[1]), "fixed_s": 0.0,
             "tile_m": TILE[0], "tile_n": TILE[1]}, float(np.sqrt(np.mean(err**2))))


def fit_copy(points: list[dict], pinned: bool, direction: str) -> tuple[float, float]:
    pts = [p for p in points if p["pinned"] == pinned and p["bytes"] >= 65536]
    b = np.array([p["bytes"] for p in pts], float)
    t = np.array([p[f"{direction}_s"] for p in pts], float)
    res = least_squares(lambda x: (x[0] + b / x[1]) / t - 1, [1e-5, 1e10], bounds=([0, 1e8], [1e-3, 1e12]),
                        x_scale=[1e-5, 1e10])
    return float(res.x[0]), float(res.x[1])


def build(meas_path: Path) -> dict:
    micro = json.loads(meas_path.read_text())["micro"]
    gemm_bf16, rms_bf16 = fit_gemm(micro["gemm"], "bf16")
    gemm_fp32, rms_fp32 = fit_gemm(micro["gemm"], "fp32")
    mem = micro["memory"]
    ew, cp = mem["elementwise_add_GBps_rw"] * 1e9, mem["d2d_copy_GBps_rw"] * 1e9
    lat_h2d, bw_h2d = fit_copy(micro["pcie"], True, "h2d")
    lat_d2h, bw_d2h = fit_copy(micro["pcie"], True, "d2h")
    _, bw_h2d_pg = fit_copy(micro["pcie"], False, "h2d")
    _, bw_d2h_pg = fit_copy(micro["pcie"], False, "d2h")
    adam = {"torch_foreach": [], "torch_single": []}
    for p in micro["cpu_adam"]:
        adam["torch_foreach" if p["foreach"] else "torch_single"].append([float(p["params"]), p["params_per_s"]])
    return {
        "name": "h200-sxm-141gb-micro",
        "gpu": "h200-sxm-141gb",
        "gemm": {"bf16": gemm_bf16, "fp32": gemm_fp32},
        "attention_efficiency": {"fwd": 0.35, "bwd": 0.30},
        "memory_bandwidth_bytes_per_s": {
            "elementwise": ew, "cast": ew, "reduction": ew, "optimizer": ew, "embedding": ew,
            "copy": cp, "memset": cp,
            "norm": mem["layernorm_bf16_GBps_rw"] * 1e9,
            "softmax": mem["softmax_bf16_GBps_rw"] * 1e9,
        },
        "kernel_fixed_s": mem["tiny_kernel_us_graph"] * 1e-6,
        "reference_hbm_bandwidth_bytes_per_s": 4.8e12,  # hardware_models/presets/gpus/h200-sxm-141gb.yaml
        "launch_overhead_s": mem["tiny_kernel_us_eager"] * 1e-6,
        "h2d_bytes_per_s": bw_h2d,
        "d2h_bytes_per_s": bw_d2h,
        "pageable_h2d_bytes_per_s": bw_h2d_pg,
        "pageable_d2h_bytes_per_s": bw_d2h_pg,
        "duplex_bytes_per_s": micro["pcie_bidirectional_256MiB"]["aggregate_GBps"] * 1e9,
        "copy_latency_s": (lat_h2d + lat_d2h) / 2,
        "copy_link": "pcie-gen5-x16-h200-measured",  # the links preset of the host these copies were measured on
        "host_memcpy_bytes_per_s": micro["host_memcpy_GBps_rw"] * 1e9,
        "cpu_adam_params_per_s": adam,
        "provenance": {
            "source": "tests/data/h200/measurements.json (micro), H200 SXM measured 2026-11-29",
            "script": "scripts/build_h200_profile.py",
            "generated": dt.date.today().isoformat(),
            "fit_rms_relative_error": {"gemm_bf16": round(rms_bf16, 4), "gemm_fp32": round(rms_fp32, 4)},
            "assumptions": {
                "attention_efficiency": "not measured: fwd 0.35 / bwd 0.30 of the bf16 peak assumed, "
                "the range FlashAttention-2 (Dao, 2023) reports for head dim 64 at 1k tokens; "
                "replace by a trace calibration (simulate calibrate)",
            },
        },
    }


def add_host_overhead(prof: dict, trace_path: Path) -> dict:
    """Micro profile + per-phase host dispatch time fitted from the calibration trace."""
    from simulator.calibration.host_overhead import fit_launch_overhead
    from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
    from simulator.graph.importers.kineto import read_trace_json

    # the traced configuration: gpt_184m, batch 16 (measurements.json train.gpt_184m_b16)
    graph = build_gpt_step(TransformerSpec(num_layers=12, hidden_size=1024, num_attention_heads=16, seq_length=1024,
                                           vocab_size=32768, ffn_hidden_size=4096, micro_batch_size=16))
    fit = fit_launch_overhead(read_trace_json(trace_path), graph, prof["launch_overhead_s"])
    out = dict(prof, name="h200-sxm-141gb", launch_overhead_by_phase_s=fit["launch_overhead_by_phase_s"],
               host_phase_fixed_s=fit["host_phase_fixed_s"])
    out["provenance"] = dict(prof["provenance"])
    out["provenance"]["host_overhead"] = {
        "trace": f"tests/data/h200/{trace_path.name} (gpt_184m batch 16, last ProfilerStep)",
        "profiler_inflation": round(fit["profiler_inflation"], 4),
        "host_phase_s_profiled": {k: round(v, 6) for k, v in fit["host_phase_s"].items()},
        "method": "simulator.calibration.host_overhead.fit_launch_overhead",
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measurements", type=Path, default=ROOT / "tests/data/h200/measurements.json")
    ap.add_argument("--trace", type=Path, default=ROOT / "tests/data/h200/trace_gpt_184m_b16.json.gz")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "hardware_models/presets/profiles")
    args = ap.parse_args()
    micro = build(args.measurements)
    full = add_host_overhead(micro, args.trace)
    # the host dispatch times belong to the host, not the GPU profile: they are kept in
    # hardware_models/presets/hosts/h200-measured-host.yaml (with sources); print them for it
    host = {"launch_overhead_s": micro["launch_overhead_s"],
            "launch_overhead_by_phase_s": full["launch_overhead_by_phase_s"],
            "host_phase_fixed_s": full["host_phase_fixed_s"],
            "host_overhead_fit": full["provenance"].pop("host_overhead")}
    print("host values for hardware_models/presets/hosts/h200-measured-host.yaml:")
    print(yaml.safe_dump(host, sort_keys=False))
    for prof in (micro, full):
        prof = {k: v for k, v in prof.items() if k not in ("launch_overhead_s", "launch_overhead_by_phase_s",
                                                              "host_phase_fixed_s")}
        out = args.out_dir / f"{prof['name']}.yaml"
        header = f"# Generated by scripts/build_h200_profile.py from {args.measurements.name}; do not edit by hand.\n"
        out.write_text(header + yaml.safe_dump(prof, sort_keys=False))
        print(f"wrote {out}")
    print(json.dumps(micro["provenance"]["fit_rms_relative_error"]))


if __name__ == "__main__":
    main()
