#!/usr/bin/env python3
"""Time ``run_scenario`` on the bundled scenarios; print simulated ops/s, raw SimPy and start-up.

    python benchmarks/bench_simulate.py [SCENARIO ...] [--steps 10] [--repeat 3] [--baseline DIR]

"ops" are op executions in the engine (graph ops x steps); each is at least one SimPy process
step plus resource/event work, the unit the issue's target (>= 100k ops/s end to end, issue 12)
is stated in. "ops/s" is over the best of ``--repeat`` end-to-end ``run_scenario`` calls (graph,
policies, engine, records, summary). The default scenarios are all of ``scenarios/h200`` and
``scenarios/cluster``.

``--baseline DIR`` names another checkout of this repository (``git worktree add DIR <commit>``):
each scenario is also timed there, in a subprocess, right after the in-process run (the "before"
column), so that both figures are taken under the same machine load.

Raw SimPy is measured in the same run, next to each scenario: ``timeouts/s`` is one process yielding
``env.timeout``; the last column is the scenario's ops/s over it. The header line also gives
``proc+res ops/s`` (processes that each request a shared ``simpy.Resource``, hold it for a timeout
and release it; one op per cycle). Start-up is the median wall time of ``--startup-runs`` fresh
``python -m simulator`` processes (``--version``; ``run`` on the first scenario), imports included.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import simpy

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = sorted(str(p.relative_to(ROOT)) for d in ("scenarios/h200", "scenarios/cluster")
                 for p in (ROOT / d).glob("*.yaml"))


def raw_timeouts_per_s(n: int = 200_000, repeat: int = 3) -> float:
    """Best rate of ``env.timeout`` events processed by one SimPy process, per second."""

    def proc(env):
        for _ in range(n):
            yield env.timeout(1.0)

    best = float("inf")
    for _ in range(repeat):
        env = simpy.Environment()
        env.process(proc(env))
        t0 = time.perf_counter()
        env.run()
        best = min(best, time.perf_counter() - t0)
    return n / best


def raw_process_resource_ops_per_s(n_procs: int = 100, cycles: int = 500, repeat: int = 3) -> float:
    """Best rate of request/hold/release cycles of ``n_procs`` processes on one 4-slot resource, per second."""

    def proc(env, res):
        for _ in range(cycles):
            with res.request() as req:
                yield req
                yield env.timeout(1.0)

    best = float("inf")
    for _ in range(repeat):
        env = simpy.Environment()
        res = simpy.Resource(env, capacity=4)
        for _ in range(n_procs):
            env.process(proc(env, res))
        t0 = time.perf_counter()
        env.run()
        best = min(best, time.perf_counter() - t0)
    return n_procs * cycles / best


def time_scenario(path: str, steps: int, repeat: int) -> tuple[int, float]:
    """``(ops, best wall s)`` of ``repeat`` end-to-end runs of one scenario (one untimed run first)."""
    import warnings

    from simulator import load_scenario, run_scenario

    cfg = load_scenario(ROOT / path, [f"run.steps={steps}", "run.warmup_steps=1"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = run_scenario(cfg)
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            run_scenario(cfg)
            best = min(best, time.perf_counter() - t0)
    return r.summary["num_ops"] * steps, best


def _env(code_dir: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(code_dir)}


def baseline_ops_per_s(code_dir: Path, path: str, steps: int, repeat: int) -> float:
    """The same measurement with the code of ``code_dir`` (a subprocess), ops/s."""
    code = ("import json, sys; sys.path.append(sys.argv[1]); from bench_simulate import time_scenario; "
            "import simulator; assert simulator.__file__.startswith(sys.argv[5]), simulator.__file__; "
            "print(json.dumps(time_scenario(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "benchmarks"), path, str(steps), str(repeat),
                          str(code_dir.resolve())], cwd=code_dir, env=_env(code_dir), capture_output=True, text=True,
                         check=True)
    ops, wall = json.loads(out.stdout.strip().splitlines()[-1])
    return ops / wall


def startup_s(code_dir: Path, argv: list[str], runs: int) -> float:
    """Median wall time of ``python -m simulator ARGV`` in fresh processes, s."""
    walls = []
    for _ in range(runs):
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "simulator", *argv], cwd=code_dir, env=_env(code_dir),
                              capture_output=True, text=True, check=False)
        walls.append(time.perf_counter() - t0)
        if done.returncode not in (0, 1):  # 1: a scenario that does not fit (still a full run)
            raise RuntimeError(f"simulate {' '.join(argv)} in {code_dir}: exit {done.returncode}: {done.stderr[-300:]}")
    return statistics.median(walls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenarios", nargs="*", default=DEFAULT)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--baseline", type=Path, help="another checkout to time as 'before'")
    ap.add_argument("--startup-runs", type=int, default=5)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    raw_pr = raw_process_resource_ops_per_s()
    print(f"raw SimPy {simpy.__version__}: {raw_pr:,.0f} process+resource ops/s; steps {args.steps}, "
          f"best of {args.repeat}")
    print(f"{'scenario':52s} {'ops':>6s} {'before ops/s':>12s} {'after ops/s':>11s} {'raw timeouts/s':>14s} "
          f"{'after/raw':>9s}")
    for s in args.scenarios:
        raw_to = raw_timeouts_per_s(n=100_000)
        ops, wall = time_scenario(s, args.steps, args.repeat)
        before = baseline_ops_per_s(args.baseline, s, args.steps, args.repeat) if args.baseline else float("nan")
        print(f"{s:52s} {ops:6d} {before:12,.0f} {ops / wall:11,.0f} {raw_to:14,.0f} {ops / wall / raw_to:9.3f}",
              flush=True)
    first = args.scenarios[0]
    for argv in (["--version"], ["presets"], ["run", str(ROOT / first)]):
        after = startup_s(ROOT, argv, args.startup_runs)
        before = startup_s(args.baseline, argv, args.startup_runs) if args.baseline else float("nan")
        print(f"start-up  simulate {' '.join(argv).replace(str(ROOT) + '/', ''):44s} before {before:6.3f} s  after {after:6.3f} s")


if __name__ == "__main__":
    main()
