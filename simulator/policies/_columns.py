"""Per-distinct-value tests on string columns of a run's frames (op names, streams): each distinct value is tested
once, then the answers are spread over the rows by their codes (``pandas.factorize``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd


def value_masks(values, tests: Sequence[Callable[[str], bool]]) -> list[np.ndarray]:
    """One boolean array per test (``str -> bool``): which entries of ``values`` (a column or 1-D array of strings)
    pass it; each distinct value is tested once. A value that is not a string (a missing name) passes no test.

    Returns:
        ``len(tests)`` boolean arrays of ``len(values)`` entries each.
    """
    codes, uniques = pd.factorize(np.asarray(values, dtype=object), use_na_sentinel=False)
    uniq = list(uniques)
    return [np.array([isinstance(v, str) and bool(t(v)) for v in uniq], dtype=bool)[codes] if len(codes)
            else np.zeros(0, dtype=bool) for t in tests]
