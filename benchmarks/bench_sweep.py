#!/usr/bin/env python3
"""Time a 10,000-point single-node sweep on 2 local worker processes and on a Dask LocalCluster of 2 workers.

    python benchmarks/bench_sweep.py [--points N] [--workers 2] [--skip-dask] [--scenario PATH]

The grid (issue 12: "a 10,000-point single-node sweep ... in <= 10 minutes on the 2 local cores, and the same
points on a Dask LocalCluster with 2 workers at the same throughput") is ``training.micro_batch_size`` 1..10 x
``training.recompute_granularity`` selective|full x ``dataloader.num_workers`` 1..10 x ``dvfs.locked_clocks_mhz`` 50
clocks of the H200 (1980 down to 1245 MHz, 15 MHz apart) = 10,000 points over ``scenarios/h200/dataloader_w2.yaml``
with ``model.num_layers=4``, ``run.steps=3``, ``run.warmup_steps=1`` (a reduced model, so that a point costs
tens of ms). ``--points N`` runs N points spread evenly over the grid (every 10,000 / N-th) and extrapolates
the wall time of all 10,000 from the measured points per second: the table labels those rows
``extrapolated``. Each mode runs through ``simulator.studies.sweep.run_sweep`` (the code ``simulate sweep``
runs), so the times include scenario loading and result collection, and the pool's start-up (its processes are
forked by ``run_sweep`` and import the simulation in their first batch); a LocalCluster is started before the
sweep (``start s``: its worker processes are spawned and import the simulation, ``SWEEP_DASK_CONFIG``'s preload),
so its ``wall s`` and ``points/s`` are those of a running cluster, and ``CPU ms/point`` includes the start-up.
Raw SimPy timeouts/s is measured in this process before the sweeps (``bench_simulate.raw_timeouts_per_s``).
``CPU ms/point`` is the CPU time of this process and of its finished child processes (the pool's workers; the
LocalCluster's worker processes, joined when it closes) per point: what a point costs whatever else loads the machine
(the header gives the load average, since other jobs on the 2 cores lower points/s but not CPU ms/point); ``parent``
and ``workers`` split it between this process (the sweep's bookkeeping and table, the pool's queue thread; with Dask
also the scheduler, the nannies and the client, which a LocalCluster runs here) and the worker processes. The
LocalCluster is ``simulator.studies.sweep_dask.local_cluster`` (2 processes of one thread, no dashboard,
``SWEEP_DASK_CONFIG``); ``--dask-defaults`` starts it with Dask's default settings instead, to see what those cost.
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = "scenarios/h200/dataloader_w2.yaml"
BASE = ["model.num_layers=4", "run.steps=3", "run.warmup_steps=1", "dvfs.kind=locked_clock"]
FACTORS = {
    "training.micro_batch_size": list(range(1, 11)),
    "training.recompute_granularity": ["selective", "full"],
    "dataloader.num_workers": list(range(1, 11)),
    "dvfs.locked_clocks_mhz": [1980 - 15 * i for i in range(50)],
}
GRID = 10_000


def grid_points(n: int) -> list[dict]:
    """``n`` points spread evenly over the full grid (all of it when ``n`` >= its size)."""
    keys = list(FACTORS)
    every = [dict(zip(keys, combo)) for combo in itertools.product(*(FACTORS[k] for k in keys))]
    assert len(every) == GRID
    if n >= len(every):
        return every
    step = len(every) / n
    return [every[int(i * step)] for i in range(n)]


def children_cpu_s() -> float:
    """CPU seconds (user + system) of the finished, waited-for child processes of this process."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def time_mode(scenario: str, points: list[dict], workers: int, client=None) -> tuple[float, float, int]:
    """``(wall s, CPU s of this process, failed points)`` of one ``run_sweep`` over ``points``."""
    from simulator.studies.sweep import run_sweep

    t0, c0 = time.perf_counter(), time.process_time()
    df = run_sweep(ROOT / scenario, FACTORS, BASE, workers=workers, progress=False, client=client, points=points,
                   log=lambda msg: None)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    failed = int(df["error"].notna().sum()) if "error" in df else 0
    return wall, cpu, failed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=int, default=GRID, help="points to run (spread over the 10,000-point grid)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--skip-dask", action="store_true")
    ap.add_argument("--scenario", default=SCENARIO)
    ap.add_argument("--dask-defaults", action="store_true",
                    help="start the LocalCluster with Dask's default settings, not sweep_dask.SWEEP_DASK_CONFIG")
    args = ap.parse_args()
    if not args.skip_dask:
        try:
            import dask.distributed  # noqa: F401
        except ImportError:
            print("bench_sweep.py: the Dask mode needs dask.distributed: pip install -e '.[dask]', or pass --skip-dask",
                  file=sys.stderr)
            sys.exit(2)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_simulate import raw_timeouts_per_s

    raw = raw_timeouts_per_s(n=100_000)
    points = grid_points(args.points)
    label = "measured" if len(points) >= GRID else "extrapolated"
    dims = " x ".join(f"{k.rsplit('.', 1)[-1]} {len(v)}" for k, v in FACTORS.items())
    print(f"sweep grid {GRID:,} points ({dims}) on "
          f"{args.scenario} with {' '.join(BASE)}; raw SimPy {raw:,.0f} timeouts/s; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'mode':28s} {'points':>7s} {'failed':>6s} {'start s':>7s} {'wall s':>8s} {'points/s':>9s} "
          f"{'ms/point':>9s} "
          f"{'CPU ms/point':>12s} {'parent':>7s} {'workers':>8s} {'10k wall s':>11s} {'':12s}")
    modes = [(f"local pool, {args.workers} workers", None)]
    if not args.skip_dask:
        modes.append((f"dask LocalCluster, {args.workers} w" + (" (defaults)" if args.dask_defaults else ""), "dask"))
    for name, kind in modes:
        client = cluster = None
        cpu0, ch0, t0 = time.process_time(), children_cpu_s(), time.perf_counter()
        if kind == "dask":
            from simulator.studies.sweep_dask import local_cluster

            if args.dask_defaults:
                from dask.distributed import Client, LocalCluster

                cluster = LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                                       dashboard_address=None)
                client = Client(cluster)
            else:
                cluster, client = local_cluster(args.workers)
        start = time.perf_counter() - t0
        try:
            wall, _, failed = time_mode(args.scenario, points, args.workers, client)
        finally:
            if client is not None:
                client.close()
                cluster.close()
        parent_ms = 1e3 * (time.process_time() - cpu0) / len(points)
        workers_ms = 1e3 * (children_cpu_s() - ch0) / len(points)
        rate = len(points) / wall
        print(f"{name:28s} {len(points):7d} {failed:6d} {start:7.1f} {wall:8.1f} {rate:9.2f} {1e3 / rate:9.1f} "
              f"{parent_ms + workers_ms:12.1f} {parent_ms:7.1f} {workers_ms:8.1f} {GRID / rate:11.0f} {label:12s}  "
              f"(load average now {os.getloadavg()[0]:.1f})", flush=True)

if __name__ == "__main__":
    main()
