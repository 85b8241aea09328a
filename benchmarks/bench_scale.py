#!/usr/bin/env python3
"""Time the GPT-3 175B pipeline step at layer and kernel fidelity, and its weak scaling; print a table, save a plot.

    python benchmarks/bench_scale.py [--scenario PATH] [--gpus 128,1024,4096,16384] [--weak-fidelity layer]
                                     [--plot bench_scale.png] [--skip-kernel]

Each point is one end-to-end ``run_scenario`` (graph build of every pipeline stage, policies, engine, records,
summary) in a fresh Python process, so that its peak memory (``resource.getrusage`` max RSS, imports
included) is its own; a process runs on one core. Columns:

* ``wall s``: the ``run_scenario`` call (scenario loading and imports excluded); ``CPU s``: its process CPU
  time (the figure to compare on a shared machine);
* ``ops``: op executions the engine simulated (rows of the spans, all stages, less the spans of TP collectives
  folded into layer-fidelity blocks); ``ops/s`` = ops / wall;
* ``raw timeouts/s``: raw SimPy in the same process right after the run (one process yielding
  ``env.timeout``), and ``ops/s / raw``;
* ``peak RSS``: the process's peak resident memory (``rank_classes`` in the JSON of a point: the rank classes
  simulated, ``simulator.api.rank_classes``);
* ``wall@1M``: wall x raw timeouts/s / 1e6, the wall time scaled to a machine where raw SimPy does 1M
  timeouts/s (a rough correction for the load of a shared machine; the plot shows both).

Weak scaling holds 96 micro-batches per pipeline fixed (global batch = 96 x DP, micro-batch 1) and grows the
data-parallel size with the nodes (TP8 x PP8 on DGX H100 nodes of 8 GPUs: GPUs = 64 x DP).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = "scenarios/scale/gpt3_175b_tp8_pp8_dp16.yaml"
MICRO_BATCHES = 96
GPUS_PER_NODE = 8
GPUS_PER_REPLICA = 64  # TP8 x PP8


def point(path: str, fidelity: str, overrides: list[str]) -> dict:
    """One measurement in this process (see the module docstring)."""
    import warnings

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_simulate import raw_timeouts_per_s

    from simulator import load_scenario, run_scenario
    from simulator.api import rank_classes
    from simulator.config.loader import resolve_hardware

    cfg = load_scenario(ROOT / path, [f"run.fidelity={fidelity}", *overrides])
    n_classes = len(rank_classes(cfg, resolve_hardware(cfg)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0, c0 = time.perf_counter(), time.process_time()
        r = run_scenario(cfg)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    raw = raw_timeouts_per_s(n=100_000)
    s = r.summary
    sp = r.spans  # a layer-fidelity block reports its folded TP collectives as spans of its own op id: not ops run
    ops = len(sp) - int(sp.duplicated([c for c in ("step", "op_id", "rank_class", "pp_rank") if c in sp]).sum())
    return {"wall_s": wall, "cpu_s": cpu, "ops": ops, "raw_timeouts_per_s": raw, "step_time_s": s["step_time_s"],
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "peak_memory_bytes": s["peak_memory_bytes"], "rank_classes": n_classes}


def run_point(path: str, fidelity: str, overrides: list[str]) -> dict:
    """``point`` in a fresh process."""
    out = subprocess.run([sys.executable, __file__, "--point", path, fidelity, *overrides], cwd=ROOT,
                         capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"{path} {fidelity} {overrides}: exit {out.returncode}: {out.stderr[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def weak_overrides(gpus: int) -> list[str]:
    dp = gpus // GPUS_PER_REPLICA
    return [f"hardware.cluster.nodes={gpus // GPUS_PER_NODE}", f"training.global_batch_size={MICRO_BATCHES * dp}"]


def row(label: str, p: dict) -> str:
    rate = p["ops"] / p["wall_s"]
    return (f"{label:34s} {p['wall_s']:8.2f} {p['cpu_s']:7.2f} {p['ops']:9,d} {rate:9,.0f} {p['raw_timeouts_per_s']:14,.0f} "
            f"{rate / p['raw_timeouts_per_s']:7.3f} {p['peak_rss_bytes'] / 2**30:9.2f} {p['step_time_s']:9.3f} "
            f"{p['wall_s'] * p['raw_timeouts_per_s'] / 1e6:8.2f}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--point":
        print(json.dumps(point(sys.argv[2], sys.argv[3], sys.argv[4:])))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default=DEFAULT)
    ap.add_argument("--gpus", default="128,1024,4096,16384", help="weak-scaling points (multiples of 64)")
    ap.add_argument("--weak-fidelity", default="layer", choices=("layer", "kernel"))
    ap.add_argument("--skip-kernel", action="store_true", help="no kernel-fidelity point for the scenario itself")
    ap.add_argument("--plot", default="bench_scale.png", help="PNG of wall time vs GPUs ('' for none)")
    args = ap.parse_args()
    print(f"{'point':34s} {'wall s':>8s} {'CPU s':>7s} {'ops':>9s} {'ops/s':>9s} {'raw timeouts/s':>14s} {'/raw':>7s} "
          f"{'peak RSS':>9s} {'step s':>9s} {'wall@1M':>8s}")
    for fid in ("layer",) if args.skip_kernel else ("layer", "kernel"):
        print(row(f"{Path(args.scenario).stem} {fid}", run_point(args.scenario, fid, [])), flush=True)
    gpus = [int(g) for g in args.gpus.split(",") if g]
    walls, scaled, cpus = [], [], []
    for g in gpus:
        p = run_point(args.scenario, args.weak_fidelity, weak_overrides(g))
        walls.append(p["wall_s"])
        cpus.append(p["cpu_s"])
        scaled.append(p["wall_s"] * p["raw_timeouts_per_s"] / 1e6)
        print(row(f"weak {g:,} GPUs (DP {g // GPUS_PER_REPLICA}) {args.weak_fidelity}", p), flush=True)
    if walls:
        print(f"weak scaling: wall {min(walls):.2f}-{max(walls):.2f} s, max/min {max(walls) / min(walls):.2f}")
        # CPU s: the figure that other jobs on a shared machine do not stretch (a point runs on one core)
        mean = sum(cpus) / len(cpus)
        print(f"weak scaling: CPU {min(cpus):.2f}-{max(cpus):.2f} s, max/min {max(cpus) / min(cpus):.2f}, "
              f"{100 * (min(cpus) / mean - 1):+.0f}% to {100 * (max(cpus) / mean - 1):+.0f}% of their mean")
    if args.plot and walls:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot(gpus, walls, "o-", label=f"{args.weak_fidelity} fidelity, wall")
        ax.plot(gpus, scaled, "s--", label="scaled to 1M raw SimPy timeouts/s")
        ax.set_xscale("log")
        ax.set_xlabel("GPUs (TP8 x PP8 x DP, 96 micro-batches per pipeline)")
        ax.set_ylabel("wall time per step, s")
        ax.set_ylim(0, max(walls + scaled) * 1.2)
        ax.set_title("GPT-3 175B step: simulator wall time (weak scaling)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
