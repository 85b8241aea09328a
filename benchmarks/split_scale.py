#!/usr/bin/env python3
"""Where one ``run_scenario`` of a scenario spends its CPU time, phase by phase (build, stamping, the stamped-block
check, coarsening, folding the side TP collectives, the engine run, the records' frames, the summary).

    python benchmarks/split_scale.py [--scenario PATH] [--set KEY=VALUE ...]

Default: the GPT-3 175B step (``scenarios/scale/gpt3_175b_tp8_pp8_dp16.yaml``) at ``run.fidelity: layer``, the
point ``bench_scale.py`` times. Each phase is the process CPU time (``time.process_time``) spent inside the named
function, summed over its calls; nested phases are indented under the one holding them (``stamper`` and
``check`` inside ``build``; ``coarsen`` (without a collective model) and ``coarsen + fold TP`` (with one:
``side_blocks.coarsen_folded``, its plan, coarsened ops and fold below it) inside ``policies``; ``env.run`` and
the frames inside ``engine``). ``engine`` counts ``run_ranks`` once (a run that restarts itself with exact power
metering before simulating anything is counted by its outer call only). The step time and peak memory are printed so that two
checkouts can be compared (they must agree to the last bit where a change is meant to keep results).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = "scenarios/scale/gpt3_175b_tp8_pp8_dp16.yaml"

#: the functions timed: ``label | indent | module[:class] | attribute``, one a line, in print order
_TABLE = """
build               | 0 | simulator.api                          | build_graph
stamper (passes)    | 1 | simulator.graph.builders.stamp:Stamper | run
stamp_blocks.check  | 1 | simulator.graph.builders.stamp_blocks  | check
policies            | 0 | simulator.api                          | apply_graph_policies
coarsen             | 1 | simulator.policies.fidelity            | coarsen
coarsen + fold TP   | 1 | simulator.policies.fidelity            | coarsen_folded
coarsen plan        | 2 | simulator.graph.side_blocks            | coarse_plan
coarsen ops         | 2 | simulator.graph.side_blocks            | coarse_ops
fold side TP        | 2 | simulator.graph.side_blocks            | _folded
engine              | 0 | simulator.engine.run                   | run_ranks
executor setup      | 1 | simulator.engine.executor:Executor     | __init__
env.run             | 1 | simpy:Environment                      | run
spans frame         | 1 | simulator.recording.recorder:Recorder  | spans_frame
memory counters     | 1 | simulator.engine.system:System         | memory_counters
summarize           | 0 | simulator.api                          | summarize
stage idle split    | 0 | simulator.analysis.pipeline            | stage_idle_split
"""
#: ``(module[:class], attribute, label, indent)`` per row of ``_TABLE``
PHASES = tuple((where, name, label, int(indent)) for label, indent, where, name in
               (tuple(c.strip() for c in row.split("|")) for row in _TABLE.strip().splitlines()))


def _timed(owner, name: str, label: str, acc: dict, depth: dict) -> None:
    """Wrap ``owner.name`` so that its outermost calls add their CPU time to ``acc[label]``."""
    f = getattr(owner, name)

    def timed(*args, **kwargs):
        depth[label] += 1
        t = time.process_time()
        try:
            return f(*args, **kwargs)
        finally:
            depth[label] -= 1
            if not depth[label]:
                acc[label] += time.process_time() - t

    setattr(owner, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default=DEFAULT)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a scenario override (default: run.fidelity=layer)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import importlib

    from simulator import load_scenario, run_scenario

    acc: dict[str, float] = defaultdict(float)
    depth: dict[str, int] = defaultdict(int)
    for where, name, label, _ in PHASES:
        mod, _, cls = where.partition(":")
        owner = importlib.import_module(mod)
        _timed(getattr(owner, cls) if cls else owner, name, label, acc, depth)
    cfg = load_scenario(ROOT / args.scenario, args.overrides or ["run.fidelity=layer"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = time.process_time()
        r = run_scenario(cfg)
        total = time.process_time() - t
    print(f"{'run_scenario':24s} {total:7.2f} CPU s   step {r.summary['step_time_s']!r} s, "
          f"peak memory {r.summary['peak_memory_bytes']} B")
    for _, _, label, indent in PHASES:
        print(f"{'  ' * (indent + 1)}{label:{22 - 2 * indent}s} {acc.get(label, 0.0):7.2f}")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_simulate import raw_timeouts_per_s

    print(f"raw SimPy in the same process: {raw_timeouts_per_s(n=100_000):,.0f} timeouts/s")


if __name__ == "__main__":
    main()
