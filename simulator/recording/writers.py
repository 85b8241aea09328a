"""Write a ``SimulationResult`` to a folder: the only place results touch files.

Files: ``config.resolved.yaml`` (a header comment records the scenario file and the ``--set``
overrides; the values below it already include them, so the file loads as a scenario),
``summary.json``, ``spans.csv``, ``steps.csv``, ``counters.csv``, ``trace.json`` (Perfetto / HTA),
the figures ``breakdown.png`` (where a step's time goes), ``memory.png`` (memory over time) and,
when the run has power counters, ``power.png`` (power and SM clock over time), and, written last, ``manifest.json`` (the file list, the source scenario and the overrides).

A folder is either the old run or the new one, never a mix: everything is written into a hidden
temporary sibling (``.NAME.tmp-*``), which then replaces the folder by rename (the old folder is
renamed aside first and deleted after; an interruption between the two renames leaves the old run
as ``.NAME.old-*`` beside a missing folder, never a mixed one). So that no user file is deleted
with an old run, an existing folder is replaced only if it is empty or holds a previous run's
files (``RUN_FILES``) and nothing else; otherwise the write is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import yaml

from simulator.config.errors import ScenarioError
from simulator.recording.chrome_trace import result_trace

MANIFEST = "manifest.json"
PLOT_FILES = ("breakdown.png", "memory.png", "power.png")
RUN_FILES = ("config.resolved.yaml", "summary.json", "spans.csv", "steps.csv", "counters.csv", "trace.json",
             *PLOT_FILES, MANIFEST)


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file and a rename (whole file or the old one)."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)
    return p


def atomic_write_text(path: str | Path, text: str) -> Path:
    """``atomic_write_bytes`` for text (UTF-8)."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def _figures(result) -> list[tuple[str, object]]:
    """``(file name, make bytes)`` of the run's PNGs; the breakdown comes from the result itself
    (``result.breakdown()``: recording does not import analysis)."""
    from simulator.recording import plots

    figs = [("breakdown.png", lambda: plots.render_png(plots.breakdown_bars, result.breakdown(),
                                                      title="step time breakdown", figsize=(8.0, 3.5)))]
    if (result.counters.metric.astype(str).str.startswith("memory_bytes")).any():
        figs.append(("memory.png", lambda: plots.render_png(plots.memory_over_time, result.counters)))
    if plots.has_power(result.counters):
        figs.append(("power.png", lambda: plots.render_png(plots.power_and_clock, result.counters)))
    return figs


def _config_text(config: dict, scenario: str | None, overrides: list[str]) -> str:
    head = [f"# resolved scenario{f' from {scenario}' if scenario else ''}"]
    if overrides:
        head += ["# with overrides (already applied to the values below):"] + [f"#   --set {o}" for o in overrides]
    return "\n".join(head) + "\n" + yaml.safe_dump(config, sort_keys=False)


def check_replaceable(out: str | Path) -> None:
    """Check that ``out`` may become a run folder: absent, empty, or a previous run's files only.

    Raises:
        ScenarioError: ``out`` is a file or holds other files.
    """
    out = Path(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise ScenarioError(f"--out {out}: is an existing file, expected a folder")
    present = {p.name for p in out.iterdir()}
    if not present:
        return
    foreign = sorted(present - set(RUN_FILES))
    if foreign:
        raise ScenarioError(f"--out {out}: holds files that are not this simulator's outputs ({', '.join(foreign[:5])}"
                            f"{', ...' if len(foreign) > 5 else ''}); give an empty or new folder")


def write_outputs(result, out_dir: str | Path, overrides: list[str] | None = None,
                  scenario: str | Path | None = None, plots: bool = True) -> list[Path]:
    """Write all outputs of ``result`` as the folder ``out_dir``, replacing a previous run there.

    Args:
        result: A ``SimulationResult``.
        out_dir: The run's folder (created; its parents too).
        overrides: The ``--set KEY=VALUE`` strings the run was made with (recorded, not applied).
        scenario: The scenario file the run came from (recorded).
        plots: Also write the PNGs (``PLOT_FILES``; sweeps leave them out of every point folder).

    Returns:
        The paths written, inside ``out_dir``.

    Raises:
        ScenarioError: ``out_dir`` is a file, cannot be written, or holds files that are not a
            previous run's (see the module docstring).
    """
    out = Path(out_dir)
    overrides = [str(o) for o in overrides or []]
    check_replaceable(out)
    items = [
        ("config.resolved.yaml", lambda: _config_text(result.config, str(scenario) if scenario else None, overrides)),
        ("summary.json", lambda: json.dumps(result.summary, indent=2, default=float)),
        ("spans.csv", lambda: result.spans.to_csv(index=False)),
        ("steps.csv", lambda: result.steps.to_csv(index=False)),
        ("counters.csv", lambda: result.counters.to_csv(index=False)),
        ("trace.json", lambda: json.dumps(result_trace(result))),
    ]
    if plots:
        items += _figures(result)
    names = [name for name, _ in items] + [MANIFEST]
    items.append((MANIFEST, lambda: json.dumps({"files": names, "scenario": str(scenario) if scenario else None,
                                                "overrides": overrides}, indent=2)))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
        os.chmod(tmp, out.stat().st_mode & 0o7777 if out.is_dir() else 0o777 & ~_umask())
    except OSError as exc:
        raise ScenarioError(f"--out {out}: cannot create the folder ({exc.strerror})") from None
    try:
        for name, make in items:
            data = make()
            (tmp / name).write_bytes(data) if isinstance(data, bytes) else (tmp / name).write_text(data)
        _swap_into_place(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return [out / name for name, _ in items]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _swap_into_place(tmp: Path, out: Path) -> None:
    if not out.exists():
        os.rename(tmp, out)
        return
    old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
    os.rmdir(old)  # a free name for the old run
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)  # put the old run back
        raise
    shutil.rmtree(old, ignore_errors=True)
