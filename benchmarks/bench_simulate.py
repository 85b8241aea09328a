#!/usr/bin/env python3
"""Time ``run_scenario`` on the bundled H200 scenarios and print simulated ops per second.

    python benchmarks/bench_simulate.py [--steps 10] [--repeat 3]

"ops" are op executions in the engine (graph ops x steps); each is at least one SimPy process
step plus resource/event work, the unit the issue's 50k ops/s target is stated in.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from pathlib import Path

from simulator import load_scenario, run_scenario

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ["scenarios/h200/gpt_184m_b4.yaml", "scenarios/h200/gpt_184m_b16.yaml",
           "scenarios/h200/gpt_184m_b16_ckpt.yaml", "scenarios/h200/gpt_1p3b_b8.yaml"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenarios", nargs="*", default=DEFAULT)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"{'scenario':45s} {'ops/step':>8s} {'steps':>5s} {'wall s':>8s} {'ops/s':>10s} {'peak MiB':>9s}")
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
        print(f"{s:45s} {r.summary['num_ops']:8d} {args.steps:5d} {best:8.3f} {n / best:10.0f} {peak:9.1f}")


if __name__ == "__main__":
    main()
