"""``simulate search SCENARIO --space KEY=V1,V2,... [...]``: the fastest parallel layouts of a scenario and
what bounds each (``simulator.studies.search``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


#: ``simulator.studies.search.OBJECTIVES`` (kept here so that building the parser imports nothing heavy)
OBJECTIVE_CHOICES = ("tokens_per_s", "step_time_s", "mfu")


def add_parser(subparsers):
    """Register ``search``."""
    p = subparsers.add_parser("search", help="rank parallel layouts (TP/PP/micro-batch/ZeRO): refuse, prune by "
                              "memory, simulate the rest")
    p.add_argument("scenario", help="scenario YAML")
    p.add_argument("--space", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="a dimension of the space (repeatable), e.g. parallelism.tensor_model_parallel_size=1,2,4,8")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field on every point "
                   "(repeatable)")
    p.add_argument("--objective", default="tokens_per_s", choices=OBJECTIVE_CHOICES,
                   help="ranking metric (default tokens_per_s)")
    p.add_argument("--top", type=int, default=10, help="layouts shown (default 10)")
    p.add_argument("--workers", type=int, default=1, help="processes (default 1)")
    p.add_argument("--dask-scheduler", metavar="ADDRESS", help="simulate the points on a dask.distributed cluster")
    p.add_argument("--out", help="one output folder per simulated point, results.csv, search.csv (every point with "
                   "its status); re-running the same command skips the points already simulated")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(fn=cmd_search)


def cmd_search(args) -> int:
    from simulator.cli import check_out_dir, dask_client
    from simulator.config.errors import ScenarioError
    from simulator.studies.search import format_search, parse_space, run_search, search_json
    from simulator.studies.sweep import SweepInterrupted, check_sweep_folder

    if args.workers < 1:
        raise ScenarioError(f"--workers must be >= 1, got {args.workers}")
    if args.top < 1:
        raise ScenarioError(f"--top must be >= 1, got {args.top}")
    space = parse_space(args.space)
    check_out_dir(args.out)
    if args.out:
        check_sweep_folder(args.out)
    client = dask_client(args.dask_scheduler) if args.dask_scheduler else None
    try:
        result = run_search(args.scenario, space, base_overrides=args.set, objective=args.objective,
                            workers=args.workers, out_dir=args.out, client=client, progress=not args.json)
    except SweepInterrupted as stop:
        where = f"; the same command resumes from {Path(args.out)}" if args.out else ""
        print(f"interrupted: {len(stop.table)} of {stop.total} simulations finished{where}", file=sys.stderr)
        return 130
    finally:
        if client is not None:
            client.close()
    if args.json:
        print(json.dumps(search_json(result, args.top), default=str))
    else:
        print(format_search(result, args.top))
        if args.out:
            print(f"table: {Path(args.out) / 'search.csv'}", file=sys.stderr)
    failed = result.counts["error"]
    if failed:
        print(f"error: {failed} simulated point(s) failed (see the reason column)", file=sys.stderr)
    return 1 if failed else 0
