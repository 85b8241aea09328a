"""Build hook: copy the data the ``simulate`` verbs read into the package (``simulator/_bundled``).

The files stay where a checkout keeps them (``scenarios/``, ``tests/data/...``); a wheel gets a
copy under ``simulator/_bundled/`` with the same relative paths, which ``simulator.paths`` finds
through ``importlib.resources``. Everything else is configured in ``pyproject.toml``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
# What the verbs read, relative to the repository root (keep MANIFEST.in in step for sdists).
BUNDLED_GLOBS = (
    "scenarios/**/*.yaml",
    "scenarios/README.md",
    "tests/data/h200/measurements.json",   # simulate validate
    "tests/data/paper/paper_cases.yaml",   # simulate validate
)


def bundled_files(root: Path = HERE) -> list[Path]:
    """The files copied into the wheel, relative to ``root``."""
    return sorted({p.relative_to(root) for g in BUNDLED_GLOBS for p in root.glob(g) if p.is_file()})


class BuildPyWithData(build_py):
    """``build_py`` that also copies ``bundled_files()`` to ``simulator/_bundled/``."""

    def run(self):
        super().run()
        dest = Path(self.build_lib) / "simulator" / "_bundled"
        for rel in bundled_files():
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(HERE / rel, target)


setup(cmdclass={"build_py": BuildPyWithData})
