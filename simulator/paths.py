"""Where the bundled scenarios are, wherever a notebook or script runs from."""

from __future__ import annotations

from pathlib import Path


def repo_root() -> Path:
    """The checkout holding ``scenarios/``: the package's parent in an editable install, else the
    first parent of the working directory that has one.

    Raises:
        FileNotFoundError: no ``scenarios/`` folder found.
    """
    candidates = [Path(__file__).resolve().parents[1], *Path.cwd().resolve().parents, Path.cwd().resolve()]
    for c in candidates:
        if (c / "scenarios").is_dir():
            return c
    raise FileNotFoundError("no scenarios/ folder found next to the package or above the working directory")


def scenario(relative: str) -> Path:
    """Path of a bundled scenario, e.g. ``scenario("h200/gpt_184m_b8.yaml")``."""
    return repo_root() / "scenarios" / relative
