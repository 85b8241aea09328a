"""Write a ``SimulationResult`` to a folder: the only place results touch files.

Files: ``config.resolved.yaml``, ``summary.json``, ``spans.csv``, ``steps.csv``, ``counters.csv``
and ``trace.json`` (Perfetto). Each file is written to a temporary name and renamed, so a failed
run never leaves a half-written file, and files already in the folder are only replaced whole.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from simulator.recording.chrome_trace import result_trace


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_outputs(result, out_dir: str | Path) -> list[Path]:
    """Write all outputs of ``result`` into ``out_dir`` (created if needed); returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    items = [
        ("config.resolved.yaml", lambda: yaml.safe_dump(result.config, sort_keys=False)),
        ("summary.json", lambda: json.dumps(result.summary, indent=2, default=float)),
        ("spans.csv", lambda: result.spans.to_csv(index=False)),
        ("steps.csv", lambda: result.steps.to_csv(index=False)),
        ("counters.csv", lambda: result.counters.to_csv(index=False)),
        ("trace.json", lambda: json.dumps(result_trace(result))),
    ]
    for name, make in items:
        p = out / name
        _atomic_write(p, make())
        written.append(p)
    return written
