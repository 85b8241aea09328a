#!/usr/bin/env python3
"""Time ``run_scenario`` on the bundled scenarios; print simulated ops/s (wall and CPU), raw SimPy and start-up.

    python benchmarks/bench_simulate.py [SCENARIO ...] [--steps 10] [--repeat 3] [--baseline DIR]
                                        [--startup-runs 5]

"ops" are op executions in the engine (graph ops x steps); each is at least one SimPy process
step plus resource/event work, the unit the issue's target (>= 100k ops/s end to end, issue 12)
is stated in. Each scenario gets one untimed ``run_scenario`` call, then ``--repeat`` timed ones (graph,
policies, engine, records, summary); "ops/s" is ops over the best wall time (``time.perf_counter``) of
those calls and "CPU ops/s" ops over the best CPU time of this process (``time.process_time``: user + system,
every thread) of the same calls, each best taken on its own. On a shared machine the wall figure moves with the
other jobs' load (+-30% here) and the CPU figure much less: compare CPU figures. The default scenarios are all of
``scenarios/h200`` and ``scenarios/cluster``.

``--baseline DIR`` names another checkout of this repository (``git worktree add DIR <commit>``):
each scenario is also timed there, in a subprocess, right after the in-process run (the "before"
columns, wall and CPU), so that both figures are taken under the same machine load.

Raw SimPy is measured in the same run, next to each scenario, in CPU time as the CPU column: ``raw
timeouts/s`` is one process yielding ``env.timeout``; the last column is the scenario's CPU ops/s over it. The
header line also gives ``process+resource ops/s`` (processes that each request a shared ``simpy.Resource``, hold
it for a timeout and release it; one op per cycle), in CPU time too.

Start-up is the median over ``--startup-runs`` fresh ``python -m simulator`` processes (``--version``,
``presets``, ``run`` on the first scenario), imports included, of the wall time and of the child's CPU time
(``resource.getrusage(RUSAGE_CHILDREN)``, user + system). The processes run with bytecode caching allowed, as an
installed ``simulate`` does: ``PYTHONDONTWRITEBYTECODE`` is removed from their environment (this environment sets
it, which makes every start-up compile every imported module again) and ``PYTHONPYCACHEPREFIX`` points at a
temporary folder of this run, so that neither checkout's tree gets ``__pycache__`` folders; one untimed warm-up
process per command fills that cache first. The header of the start-up rows says so.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import simpy

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = sorted(str(p.relative_to(ROOT)) for d in ("scenarios/h200", "scenarios/cluster")
                 for p in (ROOT / d).glob("*.yaml"))


def raw_timeouts_per_s(n: int = 200_000, repeat: int = 3, clock=time.perf_counter) -> float:
    """Best rate of ``env.timeout`` events processed by one SimPy process, per second of ``clock`` (wall time;
    ``time.process_time``: CPU time)."""

    def proc(env):
        for _ in range(n):
            yield env.timeout(1.0)

    best = float("inf")
    for _ in range(repeat):
        env = simpy.Environment()
        env.process(proc(env))
        t0 = clock()
        env.run()
        best = min(best, clock() - t0)
    return n / best


def raw_process_resource_ops_per_s(n_procs: int = 100, cycles: int = 500, repeat: int = 3,
                                   clock=time.perf_counter) -> float:
    """Best rate of request/hold/release cycles of ``n_procs`` processes on one 4-slot resource, per second of
    ``clock`` (as ``raw_timeouts_per_s``)."""

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
        t0 = clock()
        env.run()
        best = min(best, clock() - t0)
    return n_procs * cycles / best


def time_scenario(path: str, steps: int, repeat: int) -> tuple[int, float, float]:
    """``(ops, best wall s, best CPU s)`` of ``repeat`` end-to-end runs of one scenario (one untimed run first):
    the least ``time.perf_counter`` and the least ``time.process_time`` interval over the runs, each on its own."""
    import warnings

    from simulator import load_scenario, run_scenario

    cfg = load_scenario(ROOT / path, [f"run.steps={steps}", "run.warmup_steps=1"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = run_scenario(cfg)
        wall = cpu = float("inf")
        for _ in range(repeat):
            t0, c0 = time.perf_counter(), time.process_time()
            run_scenario(cfg)
            c1, t1 = time.process_time(), time.perf_counter()
            wall, cpu = min(wall, t1 - t0), min(cpu, c1 - c0)
    return r.summary["num_ops"] * steps, wall, cpu


def _env(code_dir: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(code_dir)}


def baseline_ops_per_s(code_dir: Path, path: str, steps: int, repeat: int) -> tuple[float, float]:
    """The same measurement with the code of ``code_dir`` (a subprocess): ``(ops/s over wall, ops/s over CPU)``."""
    code = ("import json, sys; sys.path.append(sys.argv[1]); from bench_simulate import time_scenario; "
            "import simulator; assert simulator.__file__.startswith(sys.argv[5]), simulator.__file__; "
            "print(json.dumps(time_scenario(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "benchmarks"), path, str(steps), str(repeat),
                          str(code_dir.resolve())], cwd=code_dir, env=_env(code_dir), capture_output=True, text=True,
                         check=True)
    ops, wall, cpu = json.loads(out.stdout.strip().splitlines()[-1])
    return ops / wall, ops / cpu


def _children_cpu_s() -> float:
    """User + system CPU time of this process's waited-for children so far, s."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def startup_s(code_dir: Path, argv: list[str], runs: int, pycache: Path) -> tuple[float, float]:
    """``(median wall s, median CPU s)`` of ``python -m simulator ARGV`` in ``runs`` fresh processes, after one
    untimed warm-up process; bytecode caching allowed (``PYTHONDONTWRITEBYTECODE`` removed from the environment,
    ``PYTHONPYCACHEPREFIX=pycache``: module docstring). The CPU time is the child's (``RUSAGE_CHILDREN``).

    Raises:
        RuntimeError: a process exited with another status than 0 or 1 (1: a scenario that does not fit, still a
            full run).
    """
    env = {k: v for k, v in _env(code_dir).items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(pycache)
    walls, cpus = [], []
    for i in range(runs + 1):  # run 0: the warm-up, which compiles into the cache
        t0, c0 = time.perf_counter(), _children_cpu_s()
        done = subprocess.run([sys.executable, "-m", "simulator", *argv], cwd=code_dir, env=env,
                              capture_output=True, text=True, check=False)
        wall, cpu = time.perf_counter() - t0, _children_cpu_s() - c0
        if done.returncode not in (0, 1):
            raise RuntimeError(f"simulate {' '.join(argv)} in {code_dir}: exit {done.returncode}: {done.stderr[-300:]}")
        if i:
            walls.append(wall)
            cpus.append(cpu)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenarios", nargs="*", default=DEFAULT)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--baseline", type=Path, help="another checkout to time as 'before'")
    ap.add_argument("--startup-runs", type=int, default=5)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    raw_pr = raw_process_resource_ops_per_s(clock=time.process_time)
    print(f"raw SimPy {simpy.__version__}: {raw_pr:,.0f} process+resource ops/s (CPU time); steps {args.steps}, "
          f"best of {args.repeat} (wall and CPU time each)")
    print(f"{'scenario':52s} {'ops':>6s} {'before ops/s':>12s} {'after ops/s':>11s} {'before CPU ops/s':>16s} "
          f"{'after CPU ops/s':>15s} {'raw timeouts/s':>14s} {'CPU/raw':>7s}")
    nan = float("nan")
    for s in args.scenarios:
        raw_to = raw_timeouts_per_s(n=100_000, clock=time.process_time)
        ops, wall, cpu = time_scenario(s, args.steps, args.repeat)
        before, before_cpu = (baseline_ops_per_s(args.baseline, s, args.steps, args.repeat) if args.baseline
                              else (nan, nan))
        print(f"{s:52s} {ops:6d} {before:12,.0f} {ops / wall:11,.0f} {before_cpu:16,.0f} {ops / cpu:15,.0f} "
              f"{raw_to:14,.0f} {ops / cpu / raw_to:7.3f}", flush=True)
    first = args.scenarios[0]
    print(f"start-up: median of {args.startup_runs} fresh processes after one warm-up, wall and CPU s; bytecode "
          "caching allowed (PYTHONDONTWRITEBYTECODE unset, PYTHONPYCACHEPREFIX a temporary folder)")
    with tempfile.TemporaryDirectory(prefix="bench_simulate_pycache_") as pycache:
        for argv in (["--version"], ["presets"], ["run", str(ROOT / first)]):
            after = startup_s(ROOT, argv, args.startup_runs, Path(pycache))
            before = startup_s(args.baseline, argv, args.startup_runs, Path(pycache)) if args.baseline else (nan, nan)
            print(f"start-up  simulate {' '.join(argv).replace(str(ROOT) + '/', ''):44s} before {before[0]:6.3f} s "
                  f"(CPU {before[1]:6.3f})  after {after[0]:6.3f} s (CPU {after[1]:6.3f})", flush=True)


if __name__ == "__main__":
    main()
