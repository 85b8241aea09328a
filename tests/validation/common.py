"""Helpers shared by the predicted-vs-measured tests: a cached scenario run and one error check."""

from __future__ import annotations

from functools import lru_cache

from simulator import load_scenario, run_scenario
from tests.conftest import ROOT


@lru_cache(maxsize=None)
def scenario_summary(relative_path: str) -> dict:
    """Summary of a bundled scenario (``"h200/gpt_184m_b8.yaml"``), simulated once per test session."""
    return run_scenario(load_scenario(ROOT / "scenarios" / relative_path)).summary


def check_rel(what: str, predicted: float, measured: float, tol: float, unit: str = "") -> float:
    """Assert ``|predicted / measured - 1| <= tol``; the message states measured, predicted and error.

    Returns:
        The relative error.
    """
    err = predicted / measured - 1
    assert abs(err) <= tol, (f"{what}: measured {measured:.6g}{unit}, predicted {predicted:.6g}{unit}, "
                             f"error {err:+.1%} (tolerance {tol:.0%})")
    return err


def known_gap_xfail(case_id: str, metric: str):
    """The strict xfail of a known miss, with its reason from ``simulator.studies.validation.KNOWN_GAPS``
    (the one copy; ``simulate validate`` prints the same text).

    Raises:
        KeyError: the case is not a known gap (a stale mark).
    """
    import pytest

    from simulator.studies.validation import KNOWN_GAPS

    return pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[(case_id, metric)])


def gap_marks(case_id: str, metric: str) -> list:
    """``[known_gap_xfail(...)]`` for a known gap, else ``[]`` (for ``pytest.param(..., marks=...)``)."""
    from simulator.studies.validation import KNOWN_GAPS

    return [known_gap_xfail(case_id, metric)] if (case_id, metric) in KNOWN_GAPS else []
