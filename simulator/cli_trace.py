"""``simulate replay`` and ``simulate calibrate``: the real-trace verbs."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def add_parser(subparsers):
    """Register ``replay`` and ``calibrate``."""
    p = subparsers.add_parser("replay", help="replay a PyTorch-profiler (Kineto) trace and compare its step time")
    p.add_argument("trace")
    p.add_argument("--steps", default="all", help="'all' or a step index (default all)")
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

    steps = args.steps if args.steps == "all" else int(args.steps)
    try:
        out = replay(args.trace, steps, args.gpu, args.pcie_speedup, args.host_speedup, args.dataloader_workers,
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
    else:
        label = "predicted" if out["what_if"] else "simulated"
        print(f"trace               {out['trace']} ({out['device']}, {out['steps']} steps)")
        print(f"measured step       {out['measured_step_time_s'] * 1e3:.3f} ms")
        print(f"{label} step      {out['simulated_step_time_s'] * 1e3:.3f} ms  ({out['error']:+.2%})")
        if out["what_if"]:
            print(f"what-if             {out['what_if']}")
    return 0


def run_calibrate(args) -> int:
    import yaml

    from simulator.calibration.fit import calibrate, plot_report
    from simulator.graph.importers.kineto import TraceImportError

    try:
        prof, report = calibrate(args.traces, args.scenario, Path(args.out).stem)
    except TraceImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    Path(args.out).write_text("# Written by simulate calibrate\n" + yaml.safe_dump(prof, sort_keys=False))
    print(report.to_string(index=False, float_format=lambda v: f"{v * 1e3:.3f}" if abs(v) < 10 else f"{v:.3g}"))
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
