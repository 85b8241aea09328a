"""Fit the free parameters of the host CPU roofline (hardware_models.host_kernels) on the measured H200 host.

Reads ``micro.cpu_adam`` of tests/data/h200/measurements.json (``torch.optim.AdamW.step`` on ONE
fp32 CPU tensor, 16 threads, foreach=True and foreach=False, 16M / 64M / 192M parameters) and
``micro.host_memcpy_GBps_rw``. Per element the two implementations stream the same 80 bytes
(hardware_models.host_kernels.adamw_passes) but foreach=False writes one more fresh fp32
temporary (``exp_avg_sq.sqrt() / bc`` makes two new tensors, foreach's ``_foreach_div_`` is in
place), each of 768 MB at 192M, hence mmap-ed and faulting every step. At the largest size (far
above the last-level cache) the two measurements give two equations in two unknowns::

    t / P = 80 B / bw + fresh_bytes / 4096 B x page_fault_s / threads

solved exactly for ``stream_bandwidth_bytes_per_s`` (bw) and ``page_fault_s``. Cross-check:
``host_memcpy_GBps_rw`` counts read + write bytes of a copy whose stores also read the
destination line first (write-allocate), i.e. 1.5x the counted traffic: 67.05 x 1.5 = 100.6 GB/s
against the fitted bw. The smaller sizes are printed as residuals (they run partly from the LLC).
Writes both values with their provenance into hardware_models/presets/hosts/h200-measured-host.yaml
(``--dry-run``: print only).

Usage: python scripts/fit_host_cpu_model.py [--measurements PATH] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "hardware_models/presets/hosts/h200-measured-host.yaml"
THREADS = 16  # env.txt lscpu: 16 vCPUs, 1 thread per core; torch default threads = 16


def fit(meas: dict) -> dict:
    """Return ``stream_bandwidth_bytes_per_s``, ``page_fault_s`` and the residuals per point."""
    from hardware_models.host_kernels import PAGE_BYTES, adamw_passes

    pts = {(r["params"], r["foreach"]): r["median_s"] for r in meas["micro"]["cpu_adam"]}
    P = max(p for p, _ in pts)
    rows, rhs = [], []
    for foreach in (True, False):
        passes = adamw_passes("torch_foreach" if foreach else "torch_single")
        rows.append([sum(p.bytes for p in passes), sum(p.fresh_bytes for p in passes) / PAGE_BYTES / THREADS])
        rhs.append(pts[(P, foreach)] / P)
    inv_bw, pf = np.linalg.solve(np.array(rows), np.array(rhs))
    out = {"stream_bandwidth_bytes_per_s": 1.0 / inv_bw, "page_fault_s": pf, "params": P,
           "memcpy_cross_check_bytes_per_s": 1.5 * meas["micro"]["host_memcpy_GBps_rw"] * 1e9, "residuals": {}}
    for (n, foreach), t in sorted(pts.items()):
        a, b = rows[0] if foreach else rows[1]
        out["residuals"][f"{n} foreach={foreach}"] = (a * inv_bw + b * pf) * n / t - 1
    return out


def write(res: dict) -> None:
    """Replace or add the two fitted fields in the measured host preset."""
    text = PRESET.read_text()
    src = {
        "stream_bandwidth_bytes_per_s": (
            f"\"{res['stream_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s\"",
            "fitted: scripts/fit_host_cpu_model.py on measurements.json micro.cpu_adam at "
            f"{res['params'] / 1e6:.0f}M params (foreach=true 80 B/param, foreach=false 80 B/param with one more fresh "
            "fp32 temporary; 2 equations, 2 unknowns); cross-check: host_memcpy_GBps_rw x 1.5 (write-allocate) = "
            f"{res['memcpy_cross_check_bytes_per_s'] / 1e9:.1f} GB/s"),
        "page_fault_s": (
            f"{res['page_fault_s']:.4g}",
            "fitted: scripts/fit_host_cpu_model.py (same fit): one thread's time per first-touched 4 KiB page of an "
            "mmap-ed fresh allocation, 16 threads (KVM guest)"),
    }
    for key, (val, source) in src.items():
        line = f"{key}: {{value: {val}, source: \"{source.replace(chr(34), chr(39))}\"}}"
        if re.search(rf"^{key}:", text, re.M):
            text = re.sub(rf"^{key}:.*$", lambda _m, x=line: x, text, flags=re.M)
        else:
            text = text.replace("\nmemory:\n", f"\n{line}\nmemory:\n", 1)
    PRESET.write_text(text)


def main(argv=None) -> int:
    """Fit, print, write (unless ``--dry-run``). Returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measurements", default=str(ROOT / "tests/data/h200/measurements.json"))
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    res = fit(json.loads(Path(args.measurements).read_text()))
    print(f"stream bandwidth {res['stream_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s "
          f"(memcpy x 1.5: {res['memcpy_cross_check_bytes_per_s'] / 1e9:.2f} GB/s); "
          f"page fault {res['page_fault_s'] * 1e6:.3f} us per 4 KiB page per thread")
    for k, v in res["residuals"].items():
        print(f"  {k}: model / measured - 1 = {v:+.1%}")
    if not args.dry_run:
        write(res)
        print(f"wrote {PRESET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
