#!/usr/bin/env python3
"""CPU time of the power-limit watch in one ``run_scenario``: the watch process itself and, inside it, the power
levels it and the switch to per-op metering compute from the spans.

    python benchmarks/bench_power_watch.py [--scenario PATH] [--set KEY=VALUE ...] [--code DIR]

Default: the GPT-3 175B step (``scenarios/scale/gpt3_175b_tp8_pp8_dp16.yaml``) at ``run.fidelity: kernel``, whose
eight stage graphs are large enough to be watched (``policies.dvfs.WATCH_MIN_OPS``) and switch to per-op metering
late in the step (``PowerLimitFirmware.watch``). ``watch`` is the process CPU time (``time.process_time``) spent
in each resumption of every rank's ``PowerLimitFirmware.watch`` generator (the switch, ``go_online``, runs inside
it); ``levels`` is the part of the whole run spent in ``PowerMeter.levels`` (mostly the switch's levels of every
span so far). ``--code DIR`` times another checkout's simulator (its ``PYTHONPATH``; the names wrapped exist in
main before the watch priced spans by key), so two checkouts can be compared under the same load by alternating
runs. Raw SimPy's rate is measured in the same process after the run; the step time and energy are printed so that
two checkouts can be seen to agree.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = "scenarios/scale/gpt3_175b_tp8_pp8_dp16.yaml"


def _resume(g, value):
    """``g.send(value)``: the event the generator yields next, or None once it has returned."""
    try:
        return g.send(value)
    except StopIteration:
        return None


def _timed_generator(owner, name: str, acc: dict, label: str) -> None:
    """Wrap generator function ``owner.name`` so that the CPU time of each of its resumptions adds to ``acc[label]``."""
    f = getattr(owner, name)

    def timed(*args, **kwargs):
        g = f(*args, **kwargs)
        sent = None
        while True:  # each resumption timed; the watch yields SimPy events only (never None)
            t = time.process_time()
            ev = _resume(g, sent)
            acc[label] += time.process_time() - t
            if ev is None:
                return
            sent = yield ev

    setattr(owner, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--code", type=Path, default=None, help="time this checkout's simulator instead")
    ap.add_argument("--scenario", default=DEFAULT)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a scenario override (default: run.fidelity=kernel)")
    args = ap.parse_args()
    if args.code is not None:  # rerun this script under the other checkout's code
        cmd = [sys.executable, __file__, "--scenario", str(ROOT / args.scenario),
               *(a for o in args.overrides for a in ("--set", o))]
        sys.exit(subprocess.call(cmd, env={**os.environ, "PYTHONPATH": str(args.code.resolve())}))
    sys.path.insert(0, os.environ.get("PYTHONPATH") or str(ROOT))
    from simulator import load_scenario, run_scenario
    from simulator.policies.power_firmware import PowerLimitFirmware
    from simulator.policies.power_meter import PowerMeter

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_simulate import raw_timeouts_per_s
    from split_scale import _timed

    acc: dict[str, float] = defaultdict(float)
    _timed_generator(PowerLimitFirmware, "watch", acc, "watch")
    _timed(PowerMeter, "levels", "levels", acc, defaultdict(int))
    cfg = load_scenario(ROOT / args.scenario if not Path(args.scenario).is_absolute() else Path(args.scenario),
                        args.overrides or ["run.fidelity=kernel"])
    warnings.simplefilter("ignore")  # the run's own warnings are not what is measured
    t = time.process_time()
    r = run_scenario(cfg)
    total = time.process_time() - t
    import simulator

    print(f"{Path(simulator.__file__).parents[1]}: run_scenario {total:.2f} CPU s, watch {acc['watch']:.3f} CPU s "
          f"(levels {acc['levels']:.3f}); step {r.summary['step_time_s']!r} s, energy "
          f"{r.summary.get('energy_j_per_step')!r} J; raw SimPy {raw_timeouts_per_s(n=100_000):,.0f} timeouts/s")


if __name__ == "__main__":
    main()
