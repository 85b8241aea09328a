#!/usr/bin/env python3
"""What each ``run.rank_folding`` mode costs: CPU time against the rank classes simulated, at several DP sizes.

    python benchmarks/bench_folding.py [--scenario PATH] [--dp 4,8,16,32] [--fidelity layer]
                                       [--modes symmetric,slow,none] [--slow-dp-rank 3]

Modes (issue 12, "full-rank mode: time linear in the number of rank classes; one slow GPU adds one class per
affected stage, not a full-rank run"):

* ``symmetric``: ``run.rank_folding: symmetric``, one representative per pipeline stage (PP classes);
* ``slow``: ``run.rank_folding: classes`` with one slow GPU, ``rank_overrides: [{dp_rank: 3, slowdown: 1.2}]``
  (its replica is its own class in every stage: 2 x PP classes at any DP);
* ``none``: ``run.rank_folding: none``, every data-parallel replica of every stage (DP x PP classes).

The data-parallel size grows with the nodes (nodes = DP x TP x PP / GPUs per node) and the micro-batches per
pipeline stay the scenario's (global batch = micro-batches x micro_batch_size x DP), so a class's work is the same
at every DP. Each point is one end-to-end ``run_scenario`` in a fresh process (``bench_scale.point``: graph
build, policies, engine, records, summary; scenario loading and imports excluded), with raw SimPy timeouts/s
measured in that process right after the run. ``CPU s`` is the figure to compare on a shared machine. The last
lines fit ``CPU s = a + b x classes`` by least squares over the DP sizes of each mode (``R^2`` near 1: linear)
and give each mode's CPU time over symmetric's at each DP. The replicas of a stage that share its hardware share
its built graph (``api.run_scenario``), so a ``none`` class costs its engine run only, while a slow replica's
classes (another hardware) are each built and priced too.

The default scenario is ``scenarios/cluster/gpt_16x2048_pp4_dp2_dgx_h100.yaml`` (GPT 1.0B, PP4, 16 micro-batches
per pipeline) at layer fidelity: a point costs about 0.2-7 CPU s. ``--scenario scenarios/scale/gpt3_175b_tp8_pp8_dp16.yaml
--dp 16 --modes symmetric,slow`` runs the 175B step (``none`` there is 128 classes of the 175B pipeline).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_scale import run_point  # noqa: E402

DEFAULT = "scenarios/cluster/gpt_16x2048_pp4_dp2_dgx_h100.yaml"
MODES = {"symmetric": ["run.rank_folding=symmetric"],
         "slow": ["run.rank_folding=classes"],  # + the dp_rank override (--slow-dp-rank)
         "none": ["run.rank_folding=none"]}


def shape(path: str) -> tuple[int, int, int, int, int]:
    """``(TP, PP, micro_batch_size, micro-batches per pipeline, GPUs per node)`` of the scenario."""
    sys.path.insert(0, str(ROOT))
    from hardware_models.topology import load_cluster
    from simulator import load_scenario

    cfg = load_scenario(ROOT / path)
    p, t = cfg.parallelism, cfg.training
    dp = p.data_parallel_size or 1
    gpn = load_cluster(cfg.hardware.cluster.preset).gpus_per_node
    return (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, t.micro_batch_size,
            t.global_batch_size // (t.micro_batch_size * dp), gpn)


def fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least-squares ``y = a + b x``: ``(a, b, R^2)``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    ss = sum((y - my) ** 2 for y in ys)
    return a, b, 1 - sum((y - a - b * x) ** 2 for x, y in zip(xs, ys)) / ss if ss else 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default=DEFAULT)
    ap.add_argument("--dp", default="4,8,16,32", help="data-parallel sizes")
    ap.add_argument("--fidelity", default="layer", choices=("layer", "kernel"))
    ap.add_argument("--modes", default="symmetric,slow,none")
    ap.add_argument("--slow-dp-rank", type=int, default=3, help="the slow replica (the last one where DP is smaller)")
    args = ap.parse_args()
    tp, pp, mbs, m, gpn = shape(args.scenario)
    print(f"{args.scenario} at {args.fidelity} fidelity: TP{tp} x PP{pp}, {m} micro-batches of {mbs} per pipeline; "
          f"slow = rank_overrides [{{dp_rank: {args.slow_dp_rank}, slowdown: 1.2}}]")
    print(f"{'mode':10s} {'DP':>4s} {'GPUs':>6s} {'classes':>7s} {'wall s':>7s} {'CPU s':>7s} {'CPU ms/class':>12s} "
          f"{'ops':>9s} {'raw timeouts/s':>14s} {'step s':>9s} {'peak RSS GB':>11s}")
    xs, ys, rows = [], [], []
    for dp in [int(d) for d in args.dp.split(",") if d]:
        gpus = dp * tp * pp
        base = [f"hardware.cluster.nodes={-(-gpus // gpn)}", f"training.global_batch_size={m * mbs * dp}"]
        for mode in args.modes.split(","):
            extra = list(MODES[mode])
            if mode == "slow":
                extra.append(f"rank_overrides=[{{dp_rank: {min(args.slow_dp_rank, dp - 1)}, slowdown: 1.2}}]")
            p = run_point(args.scenario, args.fidelity, base + extra)
            k = p["rank_classes"]
            xs.append(k)
            ys.append(p["cpu_s"])
            rows.append((mode, dp, k, p["cpu_s"]))
            print(f"{mode:10s} {dp:4d} {gpus:6,d} {k:7d} {p['wall_s']:7.2f} {p['cpu_s']:7.2f} "
                  f"{1e3 * p['cpu_s'] / k:12.1f} {p['ops']:9,d} {p['raw_timeouts_per_s']:14,.0f} "
                  f"{p['step_time_s']:9.4f} {p['peak_rss_bytes'] / 1e9:11.2f}", flush=True)
    for mode in dict.fromkeys(r[0] for r in rows):
        pts = [(k, c) for m, _, k, c in rows if m == mode]
        if len({k for k, _ in pts}) > 1:
            a, b, r2 = fit([k for k, _ in pts], [c for _, c in pts])
            print(f"{mode}: CPU s = {a:.3f} + {1e3 * b:.1f} ms x classes over the DP sizes, R^2 {r2:.4f}")
    by = {(m, dp): c for m, dp, _, c in rows}
    for dp in dict.fromkeys(r[1] for r in rows):
        if ("symmetric", dp) in by:
            print(f"DP {dp}: " + ", ".join(f"{m} {by[m, dp] / by['symmetric', dp]:.2f}x" for m in MODES
                                           if (m, dp) in by and m != "symmetric") + " the CPU s of symmetric")

if __name__ == "__main__":
    main()
