"""``simulate dataloader-workers SCENARIO``: the smallest ``num_workers`` without a steady data stall.

Each value is simulated until its stall settles (``simulator.studies.whatif_dataloader``), up to
``--max-steps`` steps; a value that does not settle is marked and never answers. Wire it into
the ``simulate`` parser with ``add_parser(subparsers)``; ``run(args)`` returns the exit status
(0 answered, 1 no value up to ``--max-workers`` removes the stall in steady state, 2 bad input).
``--json`` prints one object: ``scenario``, ``answer`` (or null), ``steady`` (every row tried
settled), ``tolerance``, ``max_steps`` and ``rows`` (the table's columns, SI units).
"""

from __future__ import annotations

import json
import math


def add_parser(subparsers):
    """Register the ``dataloader-workers`` verb on an ``argparse`` subparsers object."""
    p = subparsers.add_parser("dataloader-workers",
                              help="smallest DataLoader num_workers that removes the data stall")
    p.add_argument("scenario", help="scenario YAML with a dataloader section")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field (repeatable)")
    p.add_argument("--max-workers", type=int, default=16, help="largest num_workers tried (default 16)")
    p.add_argument("--tolerance", type=float, default=0.01,
                   help="stall allowed, as a fraction of the step time (default 0.01)")
    p.add_argument("--all", action="store_true", help="try every value up to --max-workers (full table)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="longest run per value while waiting for the stall to settle (default 1024)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(fn=run)
    return p


def format_table(df) -> str:
    """The sweep as a small aligned table (ms, %)."""
    lines = [f"{'workers':>7}  {'step ms':>8}  {'stall ms':>8}  {'stall %':>7}  {'worker util':>11}  {'steps':>5}"]
    for r in df.itertuples():
        flag = "  (more threads than cores)" if r.oversubscribed else ""
        if not r.steady:
            flag += "  (not steady)"
        lines.append(f"{r.num_workers:>7d}  {r.step_time_s * 1e3:>8.2f}  {r.data_stall_s * 1e3:>8.2f}  "
                     f"{r.stall_fraction * 100:>6.1f}%  {r.worker_utilisation * 100:>10.0f}%  {r.steps_simulated:>5d}{flag}")
    return "\n".join(lines)


def run(args) -> int:
    """Run the verb; prints the table and the answer. Returns the exit status."""
    from hardware_models.presets import PresetError
    from hardware_models.units import UnitError
    from simulator.studies.whatif_dataloader import min_workers_without_stall, workers_sweep
    from simulator.config.errors import ScenarioError, error_text
    from simulator.config.loader import load_scenario
    from simulator.api import SimulationError
    from simulator.cli import error_exit

    from simulator.studies.whatif_dataloader import MAX_STEPS

    max_steps = MAX_STEPS if args.max_steps is None else args.max_steps
    try:
        if args.max_workers < 0:
            raise ScenarioError(f"--max-workers must be >= 0, got {args.max_workers}")
        if not (math.isfinite(args.tolerance) and 0 <= args.tolerance < 1):
            raise ScenarioError(f"--tolerance must be a fraction in [0, 1), got {args.tolerance}")
        if max_steps < 1:
            raise ScenarioError(f"--max-steps must be >= 1, got {max_steps}")
        cfg = load_scenario(args.scenario, args.set)
        answer, df = min_workers_without_stall(cfg, args.max_workers, args.tolerance, max_steps)
        if args.all and len(df) < args.max_workers + 1:
            df = workers_sweep(cfg, range(args.max_workers + 1), max_steps)
    except (ScenarioError, PresetError, UnitError) as exc:
        return error_exit(error_text(exc), args.json)
    except SimulationError as exc:
        return error_exit(f"error: simulation failed: {exc}", args.json, 1)
    unsteady = [int(n) for n in df.num_workers[~df.steady]]
    below = [n for n in unsteady if answer is None or n < answer]
    if args.json:
        print(json.dumps({"scenario": cfg.name, "answer": answer, "steady": not unsteady,
                          "not_steady_workers": unsteady, "tolerance": args.tolerance, "max_steps": max_steps,
                          "rows": json.loads(df.to_json(orient="records"))}))
        return 0 if answer is not None else 1
    print(f"scenario {cfg.name}: DataLoader batch_size {cfg.training.micro_batch_size}")
    print(format_table(df))
    if below:
        print(f"not steady within {max_steps} steps: num_workers {', '.join(map(str, below))} "
              "(the stall still changes; try a larger --max-steps)")
    if answer is None:
        print(f"no num_workers up to {args.max_workers} keeps the steady-state stall within {args.tolerance:.0%} "
              "of the step")
        return 1
    print(f"smallest num_workers without a data stall in steady state (<= {args.tolerance:.0%} of the step): "
          f"{answer}{' (a smaller value that did not settle might do)' if below else ''}")
    return 0
