"""scripts/count_half_convert.py: the counted instructions and mispredicts per element of DeepSpeed 0.3's scalar
(__half) copy-back equal the constants of hardware_models.host_kernels (skipped without gcc and valgrind)."""

from __future__ import annotations

import importlib.util
import shutil

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(not (shutil.which("gcc") and shutil.which("valgrind")),
                                reason="needs gcc and valgrind (not guaranteed on CI)")


def _script():
    spec = importlib.util.spec_from_file_location("count_half_convert", ROOT / "scripts/count_half_convert.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_counts_equal_the_constants():
    """2^20 N(0, 0.02^2) weights: 22.52 instructions and 0.503 mispredicts per element, as HALF_CONVERT_* are
    written, and the cycles by the module's formula (instructions / 4 + mispredicts x 15)."""
    from hardware_models.host_kernels import HALF_CONVERT_CYCLES

    r = _script().count()
    assert _script().matches(r), r
    assert r["cycles"] == pytest.approx(HALF_CONVERT_CYCLES, abs=0.01)


def test_bad_element_count_is_refused():
    with pytest.raises(ValueError, match="positive multiple of 4"):
        _script().count(elements=6)
