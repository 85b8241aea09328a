#!/usr/bin/env python3
"""Time ``run_scenario`` on the bundled H200 scenarios and print simulated ops per second.

    python benchmarks/bench_simulate.py [--steps 10] [--repeat 3]

"ops" are op executions in the engine (graph ops x steps); each is at least one SimPy process
step plus resource/event work, the unit the issue's target (>= 100k ops/s end to end, issue 12)
is stated in. "wall s" is the best of ``--repeat`` end-to-end ``run_scenario`` calls (graph,
policies, engine, records, summary).

Raw SimPy is measured in the same run, so that figures taken on a loaded machine compare:
``timeouts/s`` (one process yielding ``env.timeout``) and ``proc+res ops/s`` (processes that each
request a shared ``simpy.Resource``, hold it for a timeout and release it; one op per cycle). The
last column is the scenario's ops/s over the raw timeouts/s.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from pathlib import Path

import simpy

from simulator import load_scenario, run_scenario

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ["scenarios/h200/gpt_184m_b4.yaml", "scenarios/h200/gpt_184m_b16.yaml",
           "scenarios/h200/gpt_184m_b16_ckpt.yaml", "scenarios/h200/gpt_1p3b_b8.yaml"]


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenarios", nargs="*", default=DEFAULT)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    raw_to, raw_pr = raw_timeouts_per_s(), raw_process_resource_ops_per_s()
    print(f"raw SimPy {simpy.__version__}: {raw_to:,.0f} timeouts/s, {raw_pr:,.0f} process+resource ops/s")
    print(f"{'scenario':45s} {'ops/step':>8s} {'steps':>5s} {'wall s':>8s} {'ops/s':>10s} {'peak MiB':>9s} "
          f"{'ops/timeout':>11s}")
    for s in args.scenarios:
        cfg = load_scenario(ROOT / s, [f"run.steps={args.steps}", "run.warmup_steps=1"])
        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            r = run_scenario(cfg)
            best = min(best, time.perf_counter() - t0)
        tracemalloc.start()
        run_scenario(cfg)
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        n = r.summary["num_ops"] * args.steps
        print(f"{s:45s} {r.summary['num_ops']:8d} {args.steps:5d} {best:8.3f} {n / best:10.0f} {peak:9.1f} "
              f"{n / best / raw_to:11.3f}")


if __name__ == "__main__":
    main()
