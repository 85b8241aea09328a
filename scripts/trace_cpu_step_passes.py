"""Per pass of the H200 offload run's CPU step: the Kineto trace against the host roofline (a diagnosis, no fit).

Reads tests/data/h200/trace_gpt_184m_b16_offload_overlap.json.gz (2 profiled steps, main thread, ``cpu_op``
events recorded with shapes) and prices the same passes with hardware_models.host_kernels on the
h200-measured-host preset (16 threads, the launch overhead of the scenario per tensor per pass). Per pass,
milliseconds:

* ``raw``: the trace's op time (each ``aten::_foreach_*`` op inside ``Optimizer.step#AdamW.step``; the grad cast:
  the top-level ``aten::to`` ops before it; the param cast and the H2D upload issue: the top-level ``aten::copy_`` ops after it, two per tensor).
* ``robust``: per tensor size, the median per-tensor time x the count: the raw time less the sporadic stalls
  (single per-tensor ops 1-11 ms longer than the median for their size, tiny tensors included).
* ``model``: streaming + first-touch faults + dispatch of the same pass (``host_kernels.pass_parts``).
* per 16 MiB tensor (the 24 MLP weights, 4,194,304 elements) the median time, measured and modelled without faults.

Usage: python scripts/trace_cpu_step_passes.py [--trace PATH]
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "tests/data/h200/trace_gpt_184m_b16_offload_overlap.json.gz"
LAUNCH_S = 9.555295500000226e-06  # scenarios/h200/gpt_184m_b16_offload_overlap.yaml hardware.launch_overhead_s
THREADS = 16
MLP_ELEMENTS = 4194304


def _children(parent: dict, events: list[dict]) -> list[dict]:
    """Direct children of ``parent`` among ``events`` (same thread, nested in time), in time order."""
    end_p = parent["ts"] + parent["dur"]
    inside = sorted((e for e in events if e is not parent and parent["ts"] <= e["ts"] and e["ts"] + e["dur"] <= end_p),
                    key=lambda e: (e["ts"], -e["dur"]))
    out, end = [], -1.0
    for e in inside:
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def _numel(e: dict) -> int:
    dims = e.get("args", {}).get("Input Dims") or [[]]
    return math.prod(dims[0]) if dims[0] else 0


def _raw_robust(ops: list[dict]) -> tuple[float, float, float]:
    """``(raw_ms, robust_ms, median_ms of a 16 MiB tensor)`` of per-tensor ops."""
    by = defaultdict(list)
    for e in ops:
        by[_numel(e)].append(e["dur"] / 1e3)
    robust = sum(statistics.median(v) * len(v) for v in by.values())
    return sum(e["dur"] for e in ops) / 1e3, robust, statistics.median(by[MLP_ELEMENTS]) if by[MLP_ELEMENTS] else 0.0


def measured(trace: Path) -> list[dict[str, tuple[float, float, float]]]:
    """Per profiled step: pass name -> ``(raw, robust, 16 MiB median)`` ms, plus ``tail`` (Optimizer.step time after
    its last op)."""
    ev = [e for e in json.load(gzip.open(trace))["traceEvents"] if e.get("ph") == "X"]
    opts = [e for e in ev if e.get("name") == "Optimizer.step#AdamW.step"]
    tid = opts[0]["tid"]
    cpu = [e for e in ev if e.get("cat") == "cpu_op" and e["tid"] == tid]
    steps = [e for e in ev if e.get("name", "").startswith("ProfilerStep#") and e["tid"] == tid]
    out = []
    for step, opt in zip(steps, opts):
        res: dict[str, tuple[float, float, float]] = {}
        top = _children(step, cpu)
        res["grad cast"] = _raw_robust([e for e in top if e["name"] == "aten::to" and e["ts"] < opt["ts"]
                                        and 0 < _numel(e) < 1e8])
        kids = _children(opt, cpu)
        for i, f in enumerate(k for k in kids if k["name"].startswith("aten::_foreach") and k["dur"] > 1e3):
            res[f"{i}:{f['name'][len('aten::_foreach'):]}"] = _raw_robust(_children(f, cpu))
        last = max(e["ts"] + e["dur"] for e in kids)
        res["tail"] = ((opt["ts"] + opt["dur"] - last) / 1e3, 0.0, 0.0)
        res["param cast + upload"] = _raw_robust([e for e in top if e["name"] == "aten::copy_" and e["ts"] > opt["ts"]])
        out.append(res)
    return out


def modelled(sizes: list[int]) -> list[tuple[str, float, float, float]]:
    """Per pass ``(name, ms, fault ms, 16 MiB tensor ms without faults)`` of the host roofline for ``sizes``."""
    from hardware_models import presets
    from hardware_models.host_kernels import adamw_passes, faulting_elements, pass_parts
    from simulator.policies.offload_optimizer import GRAD_CAST, PARAM_CAST

    cpu, _ = presets.get("hosts", "h200-measured-host")
    rows = []
    for p in (GRAD_CAST, *adamw_passes("torch_foreach"), PARAM_CAST):
        fe = faulting_elements(sizes, p.fresh_bytes) if p.fresh_bytes else 0.0
        _, s, f = pass_parts(p, float(sum(sizes)), cpu, THREADS, 1, fe)
        _, s16, _ = pass_parts(p, float(MLP_ELEMENTS), cpu, THREADS, 1, 0.0)
        rows.append((p.name, (s + f + len(sizes) * LAUNCH_S) * 1e3, f * 1e3, (s16 + LAUNCH_S) * 1e3))
    return rows


def main(argv=None) -> int:
    """Print the table. Returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE))
    args = ap.parse_args(argv)
    steps = measured(Path(args.trace))
    ev = [e for e in json.load(gzip.open(args.trace))["traceEvents"] if e.get("ph") == "X"]
    opt = next(e for e in ev if e.get("name") == "Optimizer.step#AdamW.step")
    sizes = [_numel(e) for e in _children(next(f for f in _children(opt, [x for x in ev if x.get("cat") == "cpu_op"])
                                              if f["name"] == "aten::_foreach_sqrt"), ev)]
    model = modelled(sizes)
    names = [k for k in steps[0] if k != "tail"]
    order = [names[0], *names[1:-1], names[-1]]
    print(f"{len(sizes)} tensors, {sum(sizes) / 1e6:.2f}M elements; ms; error = model / measured - 1")
    print(f"{'pass':26s} {'raw s1/s2':>13s} {'robust s1/s2':>13s} {'model (faults)':>15s} {'vs raw':>7s} {'vs rob':>7s}"
          f" {'16MiB meas/model':>17s}")
    tot = [0.0, 0.0, 0.0]
    for key, (name, m, f, m16) in zip(order, model):
        raw = [s[key][0] for s in steps]
        rob = [s[key][1] for s in steps]
        r, b = statistics.mean(raw), statistics.mean(rob)
        tot[0] += r
        tot[1] += b
        tot[2] += m
        print(f"{key[:26]:26s} {raw[0]:6.1f}/{raw[1]:<6.1f} {rob[0]:6.1f}/{rob[1]:<6.1f} {m:7.1f} ({f:5.1f})"
              f" {m / r - 1:+7.0%} {m / b - 1:+7.0%} {statistics.mean(s[key][2] for s in steps):8.3f}/{m16:.3f}")
    tail = statistics.mean(s["tail"][0] for s in steps)
    print(f"{'Optimizer.step tail':26s} {tail:6.1f} (no op; model 0)")
    print(f"{'total':26s} raw {tot[0] + tail:.1f}  robust {tot[1]:.1f}  model {tot[2]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
