"""The common units ``parse_quantity`` converts without pint give pint's value bit for bit, and a
bundled scenario's load and run do not import pint at all."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hardware_models.units import _FACTORS, UnitError, _parse_text, _parse_with_pint, parse_quantity
from tests.conftest import ROOT


@pytest.mark.parametrize("unit,dimension", sorted(_FACTORS))
def test_factor_is_pints(unit, dimension):
    """Each table factor is what pint converts ``1 <unit>`` to (e.g. ``TiB -> 1099511627776.0``)."""
    assert _FACTORS[unit, dimension] == _parse_with_pint(f"1 {unit}", 1.0, unit, dimension)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(_FACTORS)),
       st.floats(min_value=-1e12, max_value=1e12, allow_nan=False, allow_infinity=False)
       | st.integers(0, 10**6).map(float) | st.decimals(0, 10**4, places=3).map(float))
def test_fast_path_equals_pint(key, number):
    """``"<number> <unit>"`` parses to exactly pint's float (same single multiplication)."""
    unit, dimension = key
    text = f"{number!r} {unit}"
    assert _parse_text(text, dimension) == _parse_with_pint(text, number, unit, dimension)


def test_examples_and_errors_unchanged():
    assert parse_quantity("4.8 TB/s", "bytes_per_s") == 4.8e12
    assert parse_quantity("80 GiB", "bytes") == 80 * 2**30
    assert parse_quantity("1.98 GHz", "mhz") == 1980.0
    assert parse_quantity("2 us", "s") == 2e-6
    with pytest.raises(UnitError, match="overflows"):
        parse_quantity("1e300 PB", "bytes")
    with pytest.raises(UnitError, match="is not a bandwidth"):  # the wrong dimension goes to pint's checks
        parse_quantity("4.8 TB", "bytes_per_s")
    assert parse_quantity("4.8 TB / s", "bytes_per_s") == 4.8e12  # other spellings: pint
    assert math.isclose(parse_quantity("1 kWh", "j"), 3.6e6)


def test_bundled_run_imports_neither_pint_nor_networkx():
    """Start-up: a single-GPU bundled scenario loads and runs without importing pint or networkx."""
    code = ("import sys; from simulator import load_scenario, run_scenario; "
            f"run_scenario(load_scenario({str(ROOT / 'scenarios/h200/gpt_184m_b16.yaml')!r})); "
            "print(sorted(m for m in ('pint', 'networkx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
