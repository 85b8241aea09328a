"""Execute every notebook in notebooks/ with nbclient (small scenarios; marked slow)."""

from __future__ import annotations

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
#: notebooks whose own code must not warn: no ``ScenarioWarning`` in their cells' stderr (the quickstart's loop over
#: GPUs warned once per point with ``hardware.profile=null``)
QUIET = {"01_what_if_quickstart.ipynb"}


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path):
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    if path.name in QUIET:
        warned = [o.text for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                  if o.output_type == "stream" and o.name == "stderr" and "ScenarioWarning" in o.text]
        assert not warned, warned


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_keeps_the_users_matplotlib_backend(path):
    """``matplotlib.use("Agg")`` in a notebook hides every figure from the user who opens it."""
    nb = nbformat.read(path, as_version=4)
    assert not [c for c in nb.cells if c.cell_type == "code" and "matplotlib.use(" in c.source]
