"""``simulate replay`` and ``simulate calibrate``: the real-trace verbs."""

from __future__ import annotations

import json
from pathlib import Path


def _steps_arg(text: str):
    """``all`` or an integer step index (argparse type; a negative index is refused in ``run_replay``)."""
    import argparse

    if text == "all":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'all' or a step index, got {text!r}") from None


def _strict_json(obj) -> str:
    """JSON with every non-finite float (NaN, inf) written as ``null``: the output is strict JSON."""
    import math

    def clean(v):
        if isinstance(v, float):
            return v if math.isfinite(v) else None
        if isinstance(v, dict):
            return {str(k): clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    return json.dumps(clean(obj), allow_nan=False)


def _speedup_problem(flag: str, x: float) -> str | None:
    import math

    return None if math.isfinite(x) and x > 0 else f"{flag} {x}: must be a finite number > 0"


#: First line of every profile ``simulate calibrate`` writes: only such a file may be replaced.
CALIBRATED_HEADER = "# Written by simulate calibrate"


def _check_writable_file(path: str, what: str) -> str | None:
    """An error message if ``path`` cannot be written as a profile YAML, else None.

    The name must end in ``.yaml``/``.yml`` (it is referenced as ``hardware.profile``); an existing
    file is replaced only if an earlier ``simulate calibrate`` wrote it.
    """
    p = Path(path)
    if p.is_dir():
        return f"{what} {path}: is a folder, expected a file name"
    if not p.parent.exists():
        return f"{what} {path}: folder {p.parent} does not exist"
    if p.suffix not in (".yaml", ".yml"):
        return f"{what} {path}: expected a profile file name ending in .yaml or .yml"
    if p.exists():
        try:
            with open(p, encoding="utf-8", errors="replace") as fh:
                first = fh.readline().rstrip("\n")
        except OSError:
            first = ""
        if first != CALIBRATED_HEADER:
            return f"{what} {path}: exists and was not written by simulate calibrate; choose another file name"
    return None


def add_parser(subparsers):
    """Register ``replay`` and ``calibrate``."""
    p = subparsers.add_parser("replay", help="replay a PyTorch-profiler (Kineto) trace and compare its step time")
    p.add_argument("trace", help="PyTorch profiler (Kineto) JSON trace")
    p.add_argument("--steps", default="all", type=_steps_arg, help="'all' or a step index >= 0 (default all)")
    p.add_argument("--gpu", help="what-if: re-cost the kernels for this GPU preset")
    p.add_argument("--pcie-speedup", type=float, default=1.0, help="what-if: copies this many times faster")
    p.add_argument("--host-speedup", type=float, default=1.0, help="what-if: CPU side this many times faster")
    p.add_argument("--dataloader-workers", type=int, help="what-if: a single-process loader replaced by N workers")
    p.add_argument("--gpu-gaps", choices=["all", "boundary", "none"], default="all",
                   help="unexplained GPU idle kept as measured gap ops (all), only at boundaries, or none")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", help="folder to write replay.json into (created)")
    p.set_defaults(fn=run_replay)

    p = subparsers.add_parser("calibrate", help="fit an efficiency profile to traces of a scenario's run")
    p.add_argument("traces", nargs="+", help="PyTorch profiler (Kineto) JSON traces of the scenario's run")
    p.add_argument("--scenario", action="append", required=True, help="scenario of the traced run (one, or one per trace)")
    p.add_argument("--out", required=True, help="profile YAML to write (reference it as hardware.profile)")
    p.add_argument("--report", help="folder for report.csv and report.png")
    p.add_argument("--json", action="store_true", help="print one JSON object (fit summary and report rows)")
    p.set_defaults(fn=run_calibrate)
    return p


def _folder_problem(flag: str, path: str) -> str | None:
    p = Path(path)
    if p.exists() and not p.is_dir():
        return f"{flag} {path}: is an existing file, expected a folder"
    return None


def run_replay(args) -> int:
    from simulator.calibration.replay import replay
    from simulator.graph.importers.kineto import TraceImportError

    steps = args.steps
    problems = [None if steps == "all" or steps >= 0 else f"--steps {steps}: expected 'all' or a step index >= 0 "
                "(negative indices are not accepted)",
                _speedup_problem("--pcie-speedup", args.pcie_speedup),
                _speedup_problem("--host-speedup", args.host_speedup),
                None if args.dataloader_workers is None or args.dataloader_workers >= 1
                else f"--dataloader-workers {args.dataloader_workers}: must be >= 1",
                _folder_problem("--out", args.out) if args.out else None]
    if str(args.trace).endswith((".et", ".et.gz")) and (args.gpu or args.dataloader_workers or args.steps != "all"
                                                         or args.pcie_speedup != 1.0 or args.host_speedup != 1.0):
        problems.append(f"{args.trace}: what-ifs and --steps apply to Kineto traces, not Chakra execution traces")
    problems = [p for p in problems if p]
    if problems:
        from simulator.cli import error_exit

        return error_exit(f"error: {problems[0]}", args.json)
    try:
        out = replay(args.trace, steps, args.gpu, args.pcie_speedup, args.host_speedup, args.dataloader_workers,
                     args.gpu_gaps)
    except (TraceImportError, ValueError, OSError) as exc:
        from simulator.cli import error_exit
        from simulator.config.errors import error_text

        return error_exit(error_text(exc), args.json)
    text = _strict_json(out)
    if args.out:
        d = Path(args.out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "replay.json").write_text(text + "\n")
    if args.json:
        print(text)
    elif out["measured_step_time_s"] is None:
        print(f"trace               {out['trace']} (Chakra execution trace)")
        print(f"sum of node times   {out['serial_sum_s'] * 1e3:.3f} ms")
        print(f"simulated makespan  {out['simulated_step_time_s'] * 1e3:.3f} ms (dependencies and streams)")
        for w in out["warnings"]:
            print(f"warning             {w}")
    else:
        label = "predicted" if out["what_if"] else "simulated"
        steps_txt = f"{out['steps']} step{'s' if out['steps'] != 1 else ''}"
        print(f"trace               {out['trace']} ({out['device'] or 'unknown GPU'}, {steps_txt}; "
              f"preset {out['gpu_preset'] or 'none'})")
        if out["step_time_basis"] == "period":
            warm = ", ".join(f"#{w}" for w in out["warmup_steps"])
            print(f"measured step       {out['measured_step_time_s'] * 1e3:.3f} ms (steady period: median distance "
                  f"between step ends; warm-up dropped: step {warm})")
        else:
            print(f"measured step       {out['measured_step_time_s'] * 1e3:.3f} ms (latency of the only step: "
                  "no period measurable)")
        print(f"{label} step      {out['simulated_step_time_s'] * 1e3:.3f} ms  ({out['error']:+.2%})")
        print(f"step latency        measured {out['measured_step_latency_s'] * 1e3:.3f} ms, {label} "
              f"{out['simulated_step_latency_s'] * 1e3:.3f} ms (step start to its last GPU/CPU end)")
        busy = out["gpu_busy"]
        if busy["measured"] is not None and busy["simulated"] is not None:
            print(f"GPU busy            measured {busy['measured']:.1%}, {label} {busy['simulated']:.1%} "
                  "(inserted gap ops not counted)")
        if out["what_if"]:
            print("what-if             " + ", ".join(f"{k}={v}" for k, v in out["what_if"].items() if v not in ("", None)))
        if args.out:
            print(f"wrote               {Path(args.out) / 'replay.json'}")
    return 0


def _same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one file (resolved paths, or the same inode when both exist)."""
    import os

    pa, pb = Path(a), Path(b)
    try:
        if pa.exists() and pb.exists():
            return os.path.samefile(pa, pb)
    except OSError:
        pass
    return pa.resolve() == pb.resolve()


def run_calibrate(args) -> int:
    import yaml

    from simulator.calibration.fit import calibrate, plot_report
    from simulator.graph.importers.kineto import TraceImportError

    problems = [f"--out {args.out}: is one of the inputs ({f}); choose another file name"
                for f in [*args.traces, *args.scenario] if _same_file(args.out, f)]
    problems.append(_check_writable_file(args.out, "--out"))
    if args.report and Path(args.report).exists() and not Path(args.report).is_dir():
        problems.append(f"--report {args.report}: is an existing file, expected a folder")
    problems += [f"{t}: calibrate takes Kineto traces, not Chakra execution traces"
                 for t in args.traces if str(t).endswith((".et", ".et.gz"))]
    problems = [p for p in problems if p]
    if problems:
        from simulator.cli import error_exit

        return error_exit(f"error: {problems[0]}", args.json)
    try:
        prof, report = calibrate(args.traces, args.scenario, Path(args.out).stem)
    except (TraceImportError, ValueError) as exc:
        from simulator.cli import error_exit
        from simulator.config.errors import error_text

        return error_exit(error_text(exc), args.json)
    Path(args.out).write_text(CALIBRATED_HEADER + "\n" + yaml.safe_dump(prof, sort_keys=False))
    if args.json:
        print(_strict_json({"profile": str(args.out), "provenance": prof["provenance"],
                            "report": report.to_dict(orient="records")}))
    shown = report.rename(columns=lambda c: c.replace("_s", "_ms"))
    for c in shown.columns:
        if c.endswith("_ms"):
            shown[c] = shown[c] * 1e3
    if not args.json:
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
