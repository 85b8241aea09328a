"""Where the bundled scenarios and validation data are, wherever a notebook or script runs from.

An installed wheel carries them under ``simulator/_bundled/`` (``setup.py`` copies them there, with
the same relative paths as in the repository), found through ``importlib.resources``; a checkout
(editable install or ``PYTHONPATH``) reads them from the repository itself.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

BUNDLE = "_bundled"


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


def bundle_root() -> Path | None:
    """The installed package's data folder (``simulator/_bundled``), or None in a checkout."""
    p = resources.files("simulator") / BUNDLE
    return Path(str(p)) if p.is_dir() else None


def data_root() -> Path:
    """The folder that ``data_file`` paths are relative to: the installed bundle, else the checkout.

    Raises:
        FileNotFoundError: neither an installed bundle nor a checkout is found.
    """
    return bundle_root() or repo_root()


def data_file(relative: str) -> Path:
    """A bundled file by its path in the repository, e.g. ``data_file("tests/data/h200/measurements.json")``.

    Raises:
        FileNotFoundError: the file is not bundled (see ``BUNDLED_GLOBS`` in setup.py).
    """
    p = data_root() / relative
    if not p.is_file():
        raise FileNotFoundError(f"{relative}: not found under {data_root()} (not a bundled file?)")
    return p


def scenario(relative: str) -> Path:
    """Path of a bundled scenario, e.g. ``scenario("h200/gpt_184m_b8.yaml")``.

    Raises:
        FileNotFoundError: no such bundled scenario.
    """
    return data_file(f"scenarios/{relative}")
