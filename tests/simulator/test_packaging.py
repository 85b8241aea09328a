"""The data the verbs read ships in the wheel and is found through importlib.resources.

Builds the package the way a wheel is built (``setup.py build_py``: the same build step and
package-data rules a wheel uses) into a temporary folder, then imports it from a working
directory outside the checkout, so no repository layout can be found.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT

PROBE = r"""
import json, sys
from pathlib import Path
import simulator
from simulator import paths
from simulator.studies.validation import all_cases, H200, PAPER
from hardware_models import presets
pkg = Path(simulator.__file__).parent
files = [paths.scenario("h200/gpt_184m_b8.yaml"), paths.data_file(H200), paths.data_file(PAPER)]
files += [paths.data_file(s) for c in all_cases() for s in c.scenarios]
print(json.dumps({"pkg": str(pkg), "bundle": str(paths.bundle_root()),
                  "files": [str(f) for f in files], "presets": str(presets.list_presets())}))
"""


def test_verbs_data_is_package_data(tmp_path):
    lib = tmp_path / "lib"
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path),
                    "build_py", "--build-lib", str(lib)], cwd=ROOT, check=True,
                   capture_output=True)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(lib)}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=work, env=env, check=True, capture_output=True, text=True)
    got = json.loads(out.stdout)
    assert got["pkg"] == str(lib / "simulator")  # the built copy, not the checkout
    assert got["bundle"] == str(lib / "simulator" / "_bundled")
    assert all(f.startswith(got["bundle"]) for f in got["files"])
    assert "h200" in got["presets"]
    # and the verb itself runs from there
    run = subprocess.run([sys.executable, "-m", "simulator", "validate", "dataloader_w0.data_wait", "--json"],
                         cwd=work, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)[0]["case_id"] == "dataloader_w0.data_wait"


def test_checkout_falls_back_to_the_repository():
    from simulator import paths

    assert paths.bundle_root() is None  # running from the checkout: nothing bundled in the source tree
    assert paths.scenario("h200/gpt_184m_b8.yaml") == ROOT / "scenarios" / "h200" / "gpt_184m_b8.yaml"
