"""scripts/fit_host_cpu_model.py re-run on tests/data/h200/measurements.json reproduces the shipped host constants:
the measured H200 host preset's ``stream_bandwidth_bytes_per_s`` and ``page_fault_s`` (the lines it writes, byte for
byte) and ``hardware_models.host_kernels.DEFAULT_PAGE_FAULT_S`` (its copy, rounded to 3 digits)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from hardware_models import presets
from hardware_models.host_kernels import DEFAULT_PAGE_FAULT_S
from tests.conftest import ROOT

MEASUREMENTS = ROOT / "tests/data/h200/measurements.json"


def _script():
    spec = importlib.util.spec_from_file_location("fit_host_cpu_model", ROOT / "scripts/fit_host_cpu_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fit_reproduces_the_shipped_constants():
    """Two equations at 192M params (foreach 80 B/param; foreach=False 80 B + a fresh 4 B temporary faulting on 16
    threads), solved exactly: 98.11 GB/s and 6.177 us per page; both 192M points then fit to 0."""
    res = _script().fit(json.loads(MEASUREMENTS.read_text()))
    cpu, _ = presets.get("hosts", "h200-measured-host")
    assert round(res["stream_bandwidth_bytes_per_s"] / 1e9, 2) * 1e9 == pytest.approx(cpu.stream_bandwidth_bytes_per_s)
    assert float(f"{res['page_fault_s']:.4g}") == cpu.page_fault_s == 6.177e-6
    assert float(f"{res['page_fault_s']:.3g}") == DEFAULT_PAGE_FAULT_S
    assert res["residuals"]["192000000 foreach=True"] == pytest.approx(0, abs=1e-12)
    assert res["residuals"]["192000000 foreach=False"] == pytest.approx(0, abs=1e-12)


def test_rerun_writes_the_shipped_preset(tmp_path, monkeypatch):
    """Writing the fit into a copy of the preset leaves it unchanged: the shipped file is the script's output."""
    mod = _script()
    shipped = mod.PRESET.read_text()
    copy = tmp_path / "h200-measured-host.yaml"
    copy.write_text(shipped)
    monkeypatch.setattr(mod, "PRESET", copy)
    monkeypatch.setattr(mod, "ROOT", tmp_path)  # main() prints the path relative to ROOT
    assert mod.main(["--measurements", str(MEASUREMENTS)]) == 0
    assert copy.read_text() == shipped
