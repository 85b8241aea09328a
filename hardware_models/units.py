"""Quantities with units, parsed once at the config boundary with pint.

YAML may say ``"4.8 TB/s"``, ``"141 GB"``, ``"700 W"``, ``"1980 MHz"``, ``"2 us"``; inside the
simulator everything is SI floats (bytes, seconds, bytes/s, FLOP/s, W, J, MHz for clocks).
Decimal and binary prefixes are respected: ``"1 GB" == 1e9`` bytes, ``"1 GiB" == 2**30`` bytes.
"""

from __future__ import annotations

from functools import lru_cache

import pint

_UREG = pint.UnitRegistry()
_UREG.define("FLOP = [flop] = flop = flops")

#: Canonical SI unit for each dimension name used in field names.
DIMENSIONS: dict[str, str] = {
    "bytes": "byte",
    "bytes_per_s": "byte / second",
    "s": "second",
    "w": "watt",
    "j": "joule",
    "mhz": "megahertz",
    "flops": "FLOP",
    "flops_per_s": "FLOP / second",
}

#: Examples of accepted input per dimension, for error messages.
EXAMPLES: dict[str, str] = {
    "bytes": '"141 GB", "80 GiB"',
    "bytes_per_s": '"4.8 TB/s", "64 GB/s"',
    "s": '"2 us", "1.5 ms"',
    "w": '"700 W"',
    "j": '"10 J"',
    "mhz": '"1980 MHz", "1.98 GHz"',
    "flops": '"1 TFLOP"',
    "flops_per_s": '"989 TFLOP/s"',
}


class UnitError(ValueError):
    """A quantity string could not be parsed or has the wrong dimension."""


@lru_cache(maxsize=4096)
def parse_quantity(value: str | float | int, dimension: str) -> float:
    """Parse a quantity and return it in the SI unit of ``dimension``.

    Args:
        value: A number (taken as already in SI units) or a string with a unit (``"4.8 TB/s"``).
        dimension: One of ``DIMENSIONS`` (``"bytes_per_s"``...).

    Returns:
        The magnitude in the canonical unit (bytes, seconds, bytes/s, W, J, MHz, FLOP, FLOP/s).

    Raises:
        UnitError: unparsable text, a string without a unit, or a unit of another dimension
            (``"4.8 TB"`` for a bandwidth).
    """
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise UnitError(f"expected a quantity like {EXAMPLES[dimension]}, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    text = value.strip()
    try:
        q = _UREG.Quantity(text)
    except Exception as exc:  # pint raises several unrelated exception types
        raise UnitError(f"cannot parse {value!r} as a quantity (expected e.g. {EXAMPLES[dimension]})") from exc
    if not isinstance(q, _UREG.Quantity) or q.unitless:
        raise UnitError(f"{value!r} has no unit (expected e.g. {EXAMPLES[dimension]})")
    target = _UREG.Unit(DIMENSIONS[dimension])
    # pint treats byte as dimensionless, so the byte exponent is checked by hand.
    if _byte_power(q.units) != _byte_power(target) or (q.unitless and not target.dimensionless):
        raise UnitError(_wrong_dimension(value, dimension))
    try:
        return float(q.to(target).magnitude)
    except pint.DimensionalityError as exc:
        raise UnitError(_wrong_dimension(value, dimension)) from exc


def _byte_power(unit: "pint.Unit") -> int:
    """Exponent of byte-like units (byte, GB, GiB, bit) in ``unit``."""
    return int(sum(exp for name, exp in unit._units.items() if name.endswith(("byte", "bit"))))


_WORDS = {"bytes": "size in bytes", "bytes_per_s": "bandwidth in bytes/s", "s": "time", "w": "power",
          "j": "energy", "mhz": "frequency", "flops": "FLOP count", "flops_per_s": "FLOP rate"}


def _wrong_dimension(value: object, dimension: str) -> str:
    return f"{value!r} is not a {_WORDS[dimension]} (expected e.g. {EXAMPLES[dimension]})"
