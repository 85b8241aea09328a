"""Fit the H200 host's first-touch write bandwidth from the measured ZeRO-Offload run's Kineto trace.

Reads tests/data/h200/trace_gpt_184m_b16_offload_overlap.json.gz (two profiled steps of the run
``offload.gpt_184m_b16_offload_overlap`` of tests/data/h200/measurements.json), finds the CPU
passes of the offloaded optimizer step on the training thread of each ``ProfilerStep``:

* the grad cast: the top-level ``aten::to`` calls after the forward's ``aten::cross_entropy_loss``
  and before ``Optimizer.step`` (148 bf16 -> fp32 casts into fresh tensors; checked against the
  model's 185,759,744 parameters in 148 tensors from their ``Input Dims``),
* AdamW: the ``aten::_foreach_*`` children of ``Optimizer.step#AdamW.step`` (element counts from
  their per-tensor children's ``Input Dims``),
* the param cast: the top-level ``aten::copy_`` calls after ``Optimizer.step`` with a bf16
  destination and an fp32 source (into preallocated pinned buffers),

prints a table of every pass (bytes read, bytes written in place, bytes written into fresh
allocations, time, achieved GB/s), fits

    ft_bw = sum(fresh bytes) / sum(t_pass - read bytes / host_bw - n_tensors * launch_overhead_s)

over the passes that write into fresh allocations (the grad cast and ``_foreach_sqrt``, both
steps), the same per-pass model simulator/policies/offload_optimizer.py charges, and writes it
into hardware_models/presets/hosts/h200-measured-host.yaml as ``first_touch_bytes_per_s:
{value, source}`` (``--dry-run``: print only).

Usage: python scripts/fit_host_first_touch.py [--trace PATH] [--dry-run]
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simulator.graph.importers.kineto import read_trace_json  # noqa: E402

TRACE = "tests/data/h200/trace_gpt_184m_b16_offload_overlap.json.gz"
PRESET = "hardware_models/presets/hosts/h200-measured-host.yaml"
HOST = "h200-measured-host"
PROFILE = "h200-sxm-141gb-micro"  # the overlap scenario's profile: its launch_overhead_s
PARAMS = 185_759_744  # measurements.json offload.gpt_184m_b16_offload_overlap.params
TENSORS = 148

#: AdamW passes in the order _multi_tensor_adamw issues them (op name, role, bytes/param read,
#: written in place, written into a fresh allocation).
ADAM_PASSES = [
    ("aten::_foreach_add_", "step += 1", 0, 0, 0),
    ("aten::_foreach_mul_", "param *= 1 - lr*wd", 4, 4, 0),
    ("aten::_foreach_lerp_", "exp_avg.lerp_(g)", 8, 4, 0),
    ("aten::_foreach_mul_", "exp_avg_sq *= b2", 4, 4, 0),
    ("aten::_foreach_addcmul_", "exp_avg_sq += g*g", 8, 4, 0),
    ("aten::_foreach_sqrt", "sqrt(exp_avg_sq) [new]", 4, 0, 4),
    ("aten::_foreach_div_", "tmp /= bc2_sqrt", 4, 4, 0),
    ("aten::_foreach_add_", "tmp += eps", 4, 4, 0),
    ("aten::_foreach_addcdiv_", "param += -ss*m/tmp", 12, 4, 0),
]


def _numel(e) -> int:
    dims = (e.get("args") or {}).get("Input Dims") or []
    return math.prod(dims[0]) if dims and dims[0] else 0


def _types(e) -> list:
    return (e.get("args") or {}).get("Input type") or []


def passes(trace_path: Path) -> list[dict]:
    """The CPU passes of the optimizer region of each profiled step (see the module docstring)."""
    doc = read_trace_json(trace_path)
    ev = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    opt_steps = [e for e in ev if e["name"].startswith("Optimizer.step")]
    if not opt_steps:
        raise SystemExit(f"{trace_path}: no Optimizer.step annotation")
    tid = opt_steps[0]["tid"]
    ev = sorted((e for e in ev if e["tid"] == tid), key=lambda e: (e["ts"], -e["dur"]))
    steps = [e for e in ev if e["name"].startswith("ProfilerStep")]
    rows = []
    for s in steps:
        t0, t1 = s["ts"], s["ts"] + s["dur"]
        inside = [e for e in ev if t0 <= e["ts"] < t1 and e is not s]
        opt = next(e for e in inside if e["name"].startswith("Optimizer.step"))
        o0, o1 = opt["ts"], opt["ts"] + opt["dur"]
        # nesting: parent of each event (events sorted by start, longest first)
        stack, parent = [], {}
        for e in inside:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            parent[id(e)] = stack[-1] if stack else None
            stack.append(e)
        top = [e for e in inside if parent[id(e)] is None]
        loss = [e for e in top if e["name"] == "aten::cross_entropy_loss" and e["ts"] < o0]
        after = loss[-1]["ts"] if loss else t0
        casts = [e for e in top if e["name"] == "aten::to" and after < e["ts"] < o0
                 and _types(e)[:1] == ["c10::BFloat16"]]
        n = sum(_numel(e) for e in casts)
        if len(casts) != TENSORS or n != PARAMS:
            raise SystemExit(f"{s['name']}: found {len(casts)} grad casts of {n} elements, "
                             f"expected {TENSORS} of {PARAMS}")
        step = s["name"]
        rows.append(dict(step=step, op="aten::to x148", role="grad bf16->fp32 [new]", tensors=len(casts), numel=n,
                         read=2 * n, inplace=0, fresh=4 * n, t=sum(e["dur"] for e in casts) * 1e-6))
        kids = [e for e in inside if parent[id(e)] is opt and e["name"].startswith("aten::_foreach_")]
        names = [k["name"] for k in kids]
        if names != [p[0] for p in ADAM_PASSES]:
            raise SystemExit(f"{step}: unexpected AdamW op sequence {names}")
        for k, (name, role, r, w, f) in zip(kids, ADAM_PASSES):
            sub = [e for e in inside if parent[id(e)] is k and not e["name"].startswith("aten::empty")]
            numel = sum(_numel(e) for e in sub) if role != "step += 1" else 0
            if role != "step += 1" and numel != PARAMS:
                raise SystemExit(f"{step}: {name} ({role}) covers {numel} elements, expected {PARAMS}")
            rows.append(dict(step=step, op=name, role=role, tensors=len(sub), numel=numel, read=r * numel,
                             inplace=w * numel, fresh=f * numel, t=k["dur"] * 1e-6))
        pc = [e for e in top if e["name"] == "aten::copy_" and e["ts"] >= o1
              and _types(e)[:2] == ["c10::BFloat16", "float"]]
        n = sum(_numel(e) for e in pc)
        if len(pc) != TENSORS or n != PARAMS:
            raise SystemExit(f"{step}: found {len(pc)} param casts of {n} elements, expected {TENSORS} of {PARAMS}")
        rows.append(dict(step=step, op="aten::copy_ x148", role="param fp32->bf16 pinned", tensors=len(pc), numel=n,
                         read=4 * n, inplace=2 * n, fresh=0, t=sum(e["dur"] for e in pc) * 1e-6))
    return rows


def fit(rows: list[dict], host_bw: float, launch_s: float) -> float:
    """``sum(fresh) / sum(t - read / host_bw - tensors * launch)`` over the fresh-output passes."""
    used = [r for r in rows if r["fresh"]]
    return sum(r["fresh"] for r in used) / sum(r["t"] - r["read"] / host_bw - r["tensors"] * launch_s for r in used)


def write_preset(path: Path, value: float, source: str) -> None:
    text = path.read_text()
    line = f'first_touch_bytes_per_s: {{value: "{value / 1e9:.2f} GB/s", source: "{source}"}}\n'
    if re.search(r"^first_touch_bytes_per_s:.*\n", text, flags=re.M):
        text = re.sub(r"^first_touch_bytes_per_s:.*\n", lambda _: line, text, flags=re.M)
    else:
        text = re.sub(r"^(memory_bandwidth_bytes_per_s:.*\n)", lambda m: m.group(1) + line, text, count=1, flags=re.M)
    path.write_text(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(ROOT / TRACE))
    ap.add_argument("--dry-run", action="store_true", help="print the table and the fit, write nothing")
    args = ap.parse_args(argv)
    from hardware_models import presets

    host_bw = presets.get("hosts", HOST)[0].memory_bandwidth_bytes_per_s
    launch = presets.get("hosts", HOST)[0].launch_overhead_s  # the eager per-op time (moved from the profile)
    rows = passes(Path(args.trace))
    print(f"host_bw {host_bw / 1e9:.2f} GB/s (read + write), launch {launch * 1e6:.2f} us/tensor op")
    print(f"{'step':14s} {'op':24s} {'role':26s} {'n':>4s} {'read MB':>8s} {'inpl MB':>8s} {'new MB':>8s} "
          f"{'t ms':>7s} {'GB/s':>6s} {'ft GB/s':>8s}")
    for r in rows:
        moved = r["read"] + r["inplace"] + r["fresh"]
        gbs = moved / r["t"] / 1e9 if moved else 0.0
        ft = ""
        if r["fresh"]:
            ft = f"{r['fresh'] / (r['t'] - r['read'] / host_bw - r['tensors'] * launch) / 1e9:8.2f}"
        print(f"{r['step']:14s} {r['op']:24s} {r['role']:26s} {r['tensors']:4d} {r['read'] / 1e6:8.1f} "
              f"{r['inplace'] / 1e6:8.1f} {r['fresh'] / 1e6:8.1f} {r['t'] * 1e3:7.2f} {gbs:6.1f} {ft:>8s}")
    value = fit(rows, host_bw, launch)
    used = [r for r in rows if r["fresh"]]
    print(f"fitted first_touch_bytes_per_s = {value / 1e9:.3f} GB/s from {len(used)} passes "
          f"({sum(r['fresh'] for r in used) / 1e9:.3f} GB fresh in {sum(r['t'] for r in used) * 1e3:.1f} ms)")
    if args.dry_run:
        return 0
    steps = sorted({r["step"] for r in used})
    source = (f"fitted: scripts/fit_host_first_touch.py on {TRACE} (the measured run "
              f"offload.gpt_184m_b16_offload_overlap, {' and '.join(steps)}): the fresh-output passes "
              f"grad cast (148 top-level aten::to bf16->fp32 before Optimizer.step, 4 B/param new) and "
              f"aten::_foreach_sqrt in Optimizer.step#AdamW.step (4 B/param new); "
              f"sum(new bytes) / sum(t - read bytes / memory_bandwidth - 148 x launch_overhead_s of {PROFILE}). "
              f"In-sample for tests/validation/test_offload.py overlap case")
    write_preset(ROOT / PRESET, value, source)
    print(f"wrote {PRESET}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
