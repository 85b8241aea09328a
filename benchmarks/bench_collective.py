#!/usr/bin/env python3
"""Time ``simulate collective`` pricing and the flow-level collective primitive at 64 ranks.

    python benchmarks/bench_collective.py [--repeat 3]

Rows: pricing one all-reduce (closed form, cached routes) on 64 ranks of 8 DGX H100; one 64-rank
flow-level all-reduce (SimPy rendezvous + max-min fair flows over the topology); 8 concurrent
8-rank all-reduces (one per node) plus one 64-rank all-reduce sharing the NVLink ports; a whole
64-rank data-parallel training scenario (scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml on 8 nodes,
3 steps, ranks folded); and raw SimPy timeouts/s measured in the same run for reference.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import simpy

from hardware_models.collective_flows import CollectiveFlows
from hardware_models.collectives import CollectiveModel, load_collective_profile
from hardware_models.topology import build_topology


def best(fn, repeat: int) -> float:
    t = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    t0 = time.perf_counter()
    topo = build_topology("dgx-h100", nodes=8)
    build_s = time.perf_counter() - t0
    prof = load_collective_profile("dgx-h100")
    ranks = list(range(64))

    def price_cold():
        CollectiveModel(topo, prof).price("all_reduce", ranks, 2**28)

    model = CollectiveModel(topo, prof)
    model.price("all_reduce", ranks, 2**28)

    def price_warm():
        for s in range(100):
            model.price("all_reduce", ranks, 2**20 + s)

    def flows_one():
        env = simpy.Environment()
        f = CollectiveFlows(env, model)
        rv = f.collective("all_reduce", ranks, 2**28)
        for r in ranks:
            rv.arrive(r)
        env.run()

    def flows_concurrent():
        env = simpy.Environment()
        f = CollectiveFlows(env, model)
        rvs = [f.collective("all_reduce", list(range(8 * k, 8 * k + 8)), 2**28) for k in range(8)]
        rvs.append(f.collective("all_reduce", ranks, 2**28))
        for rv in rvs:
            for r in rv.ranks:
                rv.arrive(r)
        env.run()

    def simpy_timeouts(n=100_000):
        env = simpy.Environment()

        def p():
            for _ in range(n):
                yield env.timeout(1)

        env.process(p())
        env.run()

    def dp64_scenario():
        from simulator.api import load_scenario, run_scenario

        root = Path(__file__).resolve().parents[1]
        cfg = load_scenario(root / "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml",
                            ["hardware.cluster.nodes=8", "run.steps=3", "run.warmup_steps=1"])
        return run_scenario(cfg).summary

    rows = [("build topology, 8 x dgx-h100 (64 GPUs)", build_s, 1),
            ("price all_reduce, 64 ranks, cold model", best(price_cold, args.repeat), 1),
            ("price all_reduce, 64 ranks, cached routes", best(price_warm, args.repeat) / 100, 1),
            ("flow all_reduce, 64 ranks (120 flows)", best(flows_one, args.repeat), 1),
            ("flows: 8 x 8-rank + 1 x 64-rank concurrent", best(flows_concurrent, args.repeat), 1),
            ("DP64 training scenario, 3 steps (whole run)", best(dp64_scenario, args.repeat), 1)]
    ts = best(simpy_timeouts, args.repeat)
    print(f"{'case':48s} {'wall ms':>10s}")
    for name, t, _ in rows:
        print(f"{name:48s} {t * 1e3:>10.3f}")
    print(f"{'raw SimPy timeouts/s (reference)':48s} {100_000 / ts:>10.0f}")


if __name__ == "__main__":
    main()
