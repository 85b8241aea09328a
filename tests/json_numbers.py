"""Walk a JSON value for its numbers: what the fuzz tests check is finite (and non-negative)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def json_numbers(value: Any, key: str = "") -> Iterator[tuple[str, float]]:
    """``(key, number)`` for every number in a JSON value; ``key`` is the innermost mapping key
    (list items keep their list's key). Booleans, strings and nulls are not numbers."""
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield key, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from json_numbers(v, k)
    elif isinstance(value, list):
        for v in value:
            yield from json_numbers(v, key)
