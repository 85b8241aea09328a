"""``simulate replay`` and ``simulate calibrate``: the real-trace verbs."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _steps_arg(text: str):
    """``all`` or an integer step index (argparse type)."""
    import argparse

    if text == "all":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'all' or a step index, got {text!r}") from None


def _check_writable_file(path: str, what: str) -> str | None:
    """An error message if ``path`` cannot be written as a file, else None."""
    p = Path(path)
    if p.is_dir():
        return f"{what} {path}: is a folder, expected a file name"
    if not p.parent.exists():
        return f"{what} {path}: folder {p.parent} does not exist"
    return None


def add_parser(subparsers):
    """Register ``replay`` and ``calibrate``."""
    p = subparsers.add_parser("replay", help="replay a PyTorch-profiler (Kineto) trace and compare its step time")
    p.add_argument("trace")
    p.add_argument("--steps", default="all", type=_steps_arg, help="'all' or a step index (default all)")
    p.add_argument("--gpu", help="what-if: re-cost the kernels for this GPU preset")
    p.add_argument("--pcie-speedup", type=float, default=1.0, help="what-if: copies this many times faster")
    p.add_argument("--host-speedup", type=float, default=1.0, help="what-if: CPU side this many times faster")
    p.add_argument("--dataloader-workers", type=int, help="what-if: a single-process loader replaced by N workers")
    p.add_argument("--gpu-gaps", choices=["all", "boundary", "none"], default="all",
                   help="unexplained GPU idle kept as measured gap ops (all), only at boundaries, or none")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=run_replay)

    p = subparsers.add_parser("calibrate", help="fit an efficiency profile to traces of a scenario's run")
    p.add_argument("traces", nargs="+")
    p.add_argument("--scenario", action="append", required=True, help="scenario of the traced run (one, or one per trace)")
    p.add_argument("--out", required=True, help="profile YAML to write (reference it as hardware.profile)")
    p.add_argument("--report", help="folder for report.csv and report.png")
    p.set_defaults(fn=run_calibrate)
    return p


def run_replay(args) -> int:
    from simulator.calibration.replay import replay
    from simulator.graph.importers.kineto import TraceImportError

    if str(args.trace).endswith((".et", ".et.gz")) and (args.gpu or args.dataloader_workers or args.steps != "all"
                                                         or args.pcie_speedup != 1.0 or args.host_speedup != 1.0):
        print(f"error: {args.trace}: what-ifs and --steps apply to Kineto traces, not Chakra execution traces",
              file=sys.stderr)
        return 2
    try:
        out = replay(args.trace, args.steps, args.gpu, args.pcie_speedup, args.host_speedup, args.dataloader_workers,
                     args.gpu_gaps)
    except (TraceImportError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out))
    elif out["measured_step_time_s"] is None:
        print(f"trace               {out['trace']} (Chakra execution trace)")
        print(f"sum of node times   {out['serial_sum_s'] * 1e3:.3f} ms")
        print(f"simulated makespan  {out['simulated_step_time_s'] * 1e3:.3f} ms (dependencies and streams)")
        for w in out["warnings"]:
            print(f"warning             {w}")
    else:
        label = "predicted" if out["what_if"] else "simulated"
        steps = f"{out['steps']} step{'s' if out['steps'] != 1 else ''}"
        print(f"trace               {out['trace']} ({out['device'] or 'unknown GPU'}, {steps})")
        print(f"measured step       {out['measured_step_time_s'] * 1e3:.3f} ms (as traced, profiler overhead included)")
        print(f"{label} step      {out['simulated_step_time_s'] * 1e3:.3f} ms  ({out['error']:+.2%})")
        if out["what_if"]:
            print("what-if             " + ", ".join(f"{k}={v}" for k, v in out["what_if"].items() if v not in ("", None)))
    return 0


def run_calibrate(args) -> int:
    import yaml

    from simulator.calibration.fit import calibrate, plot_report
    from simulator.graph.importers.kineto import TraceImportError

    problems = [_check_writable_file(args.out, "--out")]
    if args.report and Path(args.report).exists() and not Path(args.report).is_dir():
        problems.append(f"--report {args.report}: is an existing file, expected a folder")
    problems += [f"{t}: calibrate takes Kineto traces, not Chakra execution traces"
                 for t in args.traces if str(t).endswith((".et", ".et.gz"))]
    problems = [p for p in problems if p]
    if problems:
        print(f"error: {problems[0]}", file=sys.stderr)
        return 2
    try:
        prof, report = calibrate(args.traces, args.scenario, Path(args.out).stem)
    except TraceImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    Path(args.out).write_text("# Written by simulate calibrate\n" + yaml.safe_dump(prof, sort_keys=False))
    shown = report.rename(columns=lambda c: c.replace("_s", "_ms"))
    for c in shown.columns:
        if c.endswith("_ms"):
            shown[c] = shown[c] * 1e3
    print(shown.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"class scales        {prof['provenance']['class_scales']}")
    rms = prof["provenance"]["rms_relative_class_error_fitted_classes"]
    print(f"rms class error     before {rms['before']:.1%}, after {rms['after']:.1%} (fitted classes)")
    print(f"wrote               {args.out}")
    if args.report:
        d = Path(args.report)
        d.mkdir(parents=True, exist_ok=True)
        report.to_csv(d / "report.csv", index=False)
        import matplotlib

        matplotlib.use("Agg")
        ax = plot_report(report)
        ax.figure.tight_layout()
        ax.figure.savefig(d / "report.png", dpi=120)
    return 0
