"""``simulate pareto SCENARIO --clocks 1980,1600,1200`` (or ``--power-caps 700,500,300``).

Prints step time, energy per step, average power and the Pareto flag per setting. Wire it into the
``simulate`` parser with ``add_parser(subparsers)``; ``run(args)`` returns the exit status (0 ok,
1 simulation failed, 2 bad input).
"""

from __future__ import annotations

import sys


def _floats(text: str, what: str, unit: str) -> list[float]:
    """Comma-separated positive finite numbers.

    Raises:
        ValueError: empty, not numbers, or a value that is zero, negative, NaN or infinite.
    """
    import math

    shown = text if len(text) <= 60 else text[:57] + "..."
    try:
        vals = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated numbers in {unit}, got {shown!r}") from None
    if not vals:
        raise ValueError(f"{what} is empty")
    bad = [v for v in vals if not (math.isfinite(v) and v > 0)]
    if bad:
        raise ValueError(f"{what}: every value must be a finite number > 0 {unit}, got {bad[0]:g}")
    return vals


def add_parser(subparsers):
    """Register the ``pareto`` verb on an ``argparse`` subparsers object."""
    p = subparsers.add_parser("pareto", help="energy-time Pareto sweep over locked clocks or power caps")
    p.add_argument("scenario", help="scenario YAML")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--clocks", help="locked SM clocks, MHz, comma-separated (default: a spread of supported clocks)")
    g.add_argument("--power-caps", help="power limits, W, comma-separated")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field (repeatable)")
    p.add_argument("--json", action="store_true", help="print the table as JSON records")
    p.add_argument("--out", help="also write the table to OUT/pareto.csv")
    p.set_defaults(fn=run)
    return p


def format_table(df) -> str:
    """The sweep as an aligned table (ms, J, W); Pareto points marked with '*', unsettled power caps (not ranked)
    with '?'."""
    unit = "MHz" if (len(df) and df.setting.iloc[0] == "locked_clocks_mhz") else "W"
    head = "clock MHz" if unit == "MHz" else "cap W"
    lines = [f"{head:>9}  {'step ms':>8}  {'J/step':>8}  {'avg W':>6}  {'mJ/token':>8}  {'avg MHz':>7}  pareto"]
    for r in df.itertuples():
        lines.append(f"{r.value:>9.0f}  {r.step_time_s * 1e3:>8.2f}  {r.energy_j_per_step:>8.2f}  {r.avg_power_w:>6.0f}  "
                     f"{r.energy_per_token_j * 1e3:>8.3f}  {r.avg_sm_clock_mhz:>7.0f}  {'*' if r.pareto else '' if r.settled else '?'}")
    return "\n".join(lines)


def run(args) -> int:
    """Run the verb; prints the table. Returns the exit status."""
    import warnings

    from hardware_models.presets import PresetError
    from hardware_models.units import UnitError
    from simulator.studies.pareto import energy_time_pareto
    from simulator.config.errors import ScenarioError, error_text
    from pydantic import ValidationError

    from simulator.api import SimulationError
    from simulator.cli import error_exit
    from simulator.config.errors import PolicyError
    from simulator.config.loader import format_validation_error, load_scenario
    from simulator.config.sections.dvfs import DvfsConfig

    try:
        if getattr(args, "out", None):
            from simulator.cli import check_out_dir

            check_out_dir(args.out)
        clocks = _floats(args.clocks, "--clocks", "MHz") if args.clocks is not None else None
        caps = _floats(args.power_caps, "--power-caps", "W") if args.power_caps is not None else None
        cfg = load_scenario(args.scenario, args.set)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            df = energy_time_pareto(cfg, clocks=clocks, power_caps=caps)
        for w in {str(w.message) for w in caught}:
            print(f"warning: {w}", file=sys.stderr)
    except ValidationError as exc:  # a setting the dvfs section refuses
        return error_exit(error_text(format_validation_error(exc, args.scenario, DvfsConfig)), args.json)
    except PolicyError as exc:  # a clock or cap outside the range of the scenario's GPU: the file that sets it
        return error_exit(f"error: {args.scenario}: {exc}", args.json)
    except (ScenarioError, PresetError, UnitError, ValueError) as exc:
        return error_exit(error_text(exc), args.json)
    except SimulationError as exc:
        return error_exit(f"error: simulation failed: {exc}", args.json, 1)
    if getattr(args, "out", None):
        from pathlib import Path

        from simulator.recording.writers import atomic_write_text

        atomic_write_text(Path(args.out) / "pareto.csv", df.to_csv(index=False))
    if args.json:
        print(df.to_json(orient="records"))
    else:
        unsettled = "; ? = power cap not settled in the measured steps, not ranked" if not df.settled.all() else ""
        print(f"scenario {cfg.name}: energy-time trade-off (GPU energy; * = Pareto-optimal{unsettled})")
        print(format_table(df))
    return 0
