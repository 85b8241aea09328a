#!/usr/bin/env python3
"""Check that two checkouts give bit-identical results on the bundled scenarios.

    python benchmarks/compare_results.py OTHER_CHECKOUT [--set KEY=VALUE ...] [SCENARIO ...]

Each scenario (default: ``scenarios/h200/*.yaml`` and ``scenarios/cluster/*.yaml``) is run by
``run_scenario`` under this checkout and under ``OTHER_CHECKOUT`` (each in a subprocess with its own
``PYTHONPATH``); the summaries are compared by ``repr`` (floats to the last bit), and the spans,
counters, steps, launches and deps frames by dtype and value (``DataFrame.equals`` plus column
order), and the resolved configs key by key. ``--set`` overrides a scenario key in both runs
(``--set run.fidelity=layer``). Exit status 1 and one line per difference when anything differs, or ``FAIL`` with the
failing checkout's last error line when one checkout cannot run a scenario (a key it does not know). Config keys
only one checkout has (a new key at its default) are listed as a note, not counted as a difference.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FRAMES = ("spans", "counters", "steps", "launches", "deps")
_DUMP = r"""
import pickle, sys, warnings
warnings.simplefilter("ignore")
import simulator
assert simulator.__file__.startswith(sys.argv[3]), simulator.__file__
from simulator import load_scenario, run_scenario
r = run_scenario(load_scenario(sys.argv[1], sys.argv[4:]))
with open(sys.argv[2], "wb") as f:
    pickle.dump({"summary": r.summary, "config": r.config, **{k: getattr(r, k) for k in %r}}, f)
""" % (FRAMES,)


def dump(code_dir: Path, scenario: Path, out: Path, overrides: list[str] = ()) -> dict:
    """The results of ``scenario`` (with ``overrides``, ``KEY=VALUE``) under the code of ``code_dir``."""
    """Raises RunFailed (its last stderr line) when that checkout refuses or fails the scenario."""
    done = subprocess.run([sys.executable, "-c", _DUMP, str(scenario), str(out), str(code_dir.resolve()), *overrides],
                          cwd=code_dir, env={**os.environ, "PYTHONPATH": str(code_dir)}, capture_output=True, text=True)
    if done.returncode:
        lines = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
        raise RunFailed(f"{code_dir}: {lines[-1][:300]}")
    with open(out, "rb") as f:
        return pickle.load(f)


#: the note for config keys only one checkout has (a new key's default): shown, not counted as a difference
_ONE_SIDE = "config keys in one checkout only"


class RunFailed(Exception):
    """One checkout could not run the scenario (message: the checkout and its last error line)."""


def _flat(d, prefix: str = "") -> dict:
    """A nested config mapping as ``{"a.b": value}``."""
    if not isinstance(d, dict):
        return {prefix: d}
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _config_differences(a, b) -> list[str]:
    """The resolved configs' differences: keys only one checkout has (new keys, usually harmless) apart from values
    that differ."""
    fa, fb = _flat(a), _flat(b)
    only = sorted(set(fa) ^ set(fb))
    changed = sorted(k for k in set(fa) & set(fb) if repr(fa[k]) != repr(fb[k]))
    out = [f"config {k}: {fa[k]!r} != {fb[k]!r}" for k in changed]
    if only:
        out.append(f"{_ONE_SIDE} ({len(only)}): {', '.join(only[:6])}{' ...' if len(only) > 6 else ''}")
    return out


def differences(a: dict, b: dict) -> list[str]:
    """What differs between two dumps (empty: bit-identical)."""
    out = []
    if repr(a["summary"]) != repr(b["summary"]):
        keys = sorted(set(a["summary"]) | set(b["summary"]))
        out += [f"summary[{k!r}]: {a['summary'].get(k)!r} != {b['summary'].get(k)!r}" for k in keys
                if repr(a["summary"].get(k)) != repr(b["summary"].get(k))] or ["summary key order"]
    if repr(a["config"]) != repr(b["config"]):
        out += _config_differences(a["config"], b["config"]) or ["config differs (key order)"]
    for k in FRAMES:
        x, y = a[k], b[k]
        if x is None or y is None:
            if (x is None) != (y is None):
                out.append(f"{k}: None in one run only")
            continue
        if list(x.columns) != list(y.columns) or list(x.dtypes.astype(str)) != list(y.dtypes.astype(str)):
            out.append(f"{k}: columns/dtypes {dict(x.dtypes.astype(str))} != {dict(y.dtypes.astype(str))}")
        elif not x.equals(y) or not x.index.equals(y.index):
            out.append(f"{k}: values differ")
    return out


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Check that two checkouts give bit-identical results on the bundled "
                                 "scenarios (exit 1 and one line per difference when anything differs).")
    ap.add_argument("other", type=Path, help="the other checkout's root")
    ap.add_argument("scenarios", nargs="*", type=Path,
                    help="scenario files (default: scenarios/h200/*.yaml and scenarios/cluster/*.yaml)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a scenario override applied in both runs (repeatable)")
    args = ap.parse_args(argv)
    if not (args.other / "simulator").is_dir():
        ap.error(f"{args.other}: not a checkout of this project (no simulator/ folder)")
    other, overrides = args.other, args.overrides
    scenarios = args.scenarios or sorted(p for d in ("scenarios/h200", "scenarios/cluster")
                                         for p in (ROOT / d).glob("*.yaml"))
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for sc in scenarios:
            sc = sc.resolve()
            try:
                a = dump(ROOT, sc, Path(tmp) / "a.pkl", overrides)
                b = dump(other, sc, Path(tmp) / "b.pkl", overrides)
            except RunFailed as exc:
                bad += 1
                print(f"FAIL {sc.relative_to(ROOT) if sc.is_relative_to(ROOT) else sc}\n    {exc}")
                continue
            diff = differences(a, b)
            real = [d for d in diff if not d.startswith(_ONE_SIDE)]  # a new key's default alone changes no result
            bad += bool(real)
            print(f"{'DIFF' if real else 'same'} {sc.relative_to(ROOT) if sc.is_relative_to(ROOT) else sc}")
            for d in diff:
                print(f"    {d}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
