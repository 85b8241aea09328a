"""Quantities with units, parsed once at the config boundary with pint.

YAML may say ``"4.8 TB/s"``, ``"141 GB"``, ``"700 W"``, ``"1980 MHz"``, ``"2 us"``; inside the
simulator everything is SI floats (bytes, seconds, bytes/s, FLOP/s, W, J, MHz for clocks).
Decimal and binary prefixes are respected: ``"1 GB" == 1e9`` bytes, ``"1 GiB" == 2**30`` bytes.
"""

from __future__ import annotations

import math
import re
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pint


@lru_cache(maxsize=1)
def _registry() -> "pint.UnitRegistry":
    """The pint registry, built on the first quantity string (pint's import and its definitions file
    take about 0.3 s: commands that parse no quantity do not pay it)."""
    import pint

    ureg = pint.UnitRegistry()
    ureg.define("FLOP = [flop] = flop = flops")
    return ureg

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


#: Longest quantity string accepted (``"989.4 TFLOP/s"`` has 13 characters).
MAX_QUANTITY_CHARS = 64

_NUMBER = r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]{1,3})?"
_UNIT = r"[A-Za-zµμΩ_%]+(?:\s*(?:\^|\*\*)\s*[-+]?[1-9])?"
#: ``<number> <unit expression>``: units joined by ``*``, ``/`` or a space, each with an optional
#: one-digit exponent (``m^2``, ``s**-1``). Checked before pint sees the text, so pint never
#: evaluates an arbitrary expression (``"9**9**9 s"`` would run for hours).
_QUANTITY = re.compile(rf"^\s*({_NUMBER})\s*({_UNIT}(?:\s*[*/]\s*{_UNIT}|\s+{_UNIT})*)?\s*$")


def parse_quantity(value: object, dimension: str) -> float:
    """Parse a quantity and return it in the SI unit of ``dimension``.

    Args:
        value: A number (taken as already in SI units) or a string ``"<number> <unit expression>"``
            (``"4.8 TB/s"``) of at most ``MAX_QUANTITY_CHARS`` characters.
        dimension: One of ``DIMENSIONS`` (``"bytes_per_s"``...).

    Returns:
        The magnitude in the canonical unit (bytes, seconds, bytes/s, W, J, MHz, FLOP, FLOP/s), a
        finite float.

    Raises:
        UnitError: a value that is not a number or a string (booleans, lists, mappings, dates),
            a non-finite number (NaN, infinity, or an overflow such as ``"1e400 TB/s"``),
            unparsable text, a string without a unit, or a unit of another dimension
            (``"4.8 TB"`` for a bandwidth).
    """
    if dimension not in DIMENSIONS:
        raise UnitError(f"unknown dimension {dimension!r}; known: {', '.join(DIMENSIONS)}")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise UnitError(f"expected a quantity like {EXAMPLES[dimension]}, got {short_repr(value)}")
    if isinstance(value, int):
        if abs(value) >= 2**63:
            raise UnitError(f"{short_repr(value)} is out of range (at most 2**63)")
        return float(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise UnitError(f"{value!r} is not a finite number (expected e.g. {EXAMPLES[dimension]})")
        return value
    return _parse_text(value, dimension)


@lru_cache(maxsize=4096)
def _parse_text(value: str, dimension: str) -> float:
    """``parse_quantity`` for strings (cached: keys are strings only, so ``True`` never hits ``1``)."""
    if len(value) > MAX_QUANTITY_CHARS:
        raise UnitError(f"quantity text of {len(value)} characters is too long (at most "
                        f"{MAX_QUANTITY_CHARS}; expected e.g. {EXAMPLES[dimension]})")
    m = _QUANTITY.match(value)
    if m is None:
        raise UnitError(f"cannot parse {value!r} as a quantity (expected a number and a unit, e.g. "
                        f"{EXAMPLES[dimension]})")
    number, unit = float(m.group(1)), (m.group(2) or "").strip()
    if not unit:
        raise UnitError(f"{value!r} has no unit (expected e.g. {EXAMPLES[dimension]})")
    if not math.isfinite(number):
        raise UnitError(f"{value!r} is not a finite number (expected e.g. {EXAMPLES[dimension]})")
    factor = _FACTORS.get((unit, dimension))
    if factor is not None:  # what pint returns for these units, without importing pint (start-up)
        out = number * factor
        if not math.isfinite(out):
            raise UnitError(f"{value!r} overflows: not a finite {_WORDS[dimension]}")
        return out
    return _parse_with_pint(value, number, unit, dimension)


def _parse_with_pint(value: str, number: float, unit: str, dimension: str) -> float:
    """``number`` ``unit`` (the parts of ``value``) in the SI unit of ``dimension``, by pint."""
    import pint

    ureg = _registry()
    try:
        q = ureg.Quantity(number, ureg.parse_units(unit))
    except Exception as exc:  # pint raises several unrelated exception types
        raise UnitError(f"cannot parse {value!r} as a quantity (expected e.g. {EXAMPLES[dimension]})") from exc
    if q.unitless:
        raise UnitError(f"{value!r} has no unit (expected e.g. {EXAMPLES[dimension]})")
    target = ureg.Unit(DIMENSIONS[dimension])
    # pint treats byte as dimensionless, so the byte exponent is checked by hand.
    if _byte_power(q.units) != _byte_power(target):
        raise UnitError(_wrong_dimension(value, dimension))
    try:
        out = float(q.to(target).magnitude)
    except pint.DimensionalityError as exc:
        raise UnitError(_wrong_dimension(value, dimension)) from exc
    except (OverflowError, ArithmeticError):
        out = math.inf
    if not math.isfinite(out):
        raise UnitError(f"{value!r} overflows: not a finite {_WORDS[dimension]}")
    return out


def _common_factors() -> dict[tuple[str, str], float]:
    """``(unit text, dimension) -> factor`` to the dimension's SI unit for the units presets and
    scenarios use most (SI and IEC prefixes of B, B/s, FLOP, FLOP/s; s, ms, us, ns; W, J, MHz, GHz).

    pint converts a plain quantity by one multiplication, ``number * factor``; for these units the
    factor is written here so that parsing them does not import pint (about 0.3 s of start-up).
    ``tests/hardware_models/test_units_fast_path.py`` checks every entry against pint, bit for bit.
    Any other unit text (spacing, other units, wrong dimensions and their errors) goes to pint.
    """
    si = {"": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
    iec = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50}
    out: dict[tuple[str, str], float] = {}
    for p, v in (si | iec).items():
        out[f"{p}B", "bytes"] = v
        out[f"{p}B/s", "bytes_per_s"] = v
    for p, v in si.items():
        out[f"{p}FLOP", "flops"] = v
        out[f"{p}FLOP/s", "flops_per_s"] = v
        out[f"{p}W", "w"] = v
        out[f"{p}J", "j"] = v
    out |= {("s", "s"): 1.0, ("ms", "s"): 1e-3, ("us", "s"): 1e-6, ("\u00b5s", "s"): 1e-6, ("ns", "s"): 1e-9,
            ("MHz", "mhz"): 1.0, ("GHz", "mhz"): 1e3}
    return out


_FACTORS = _common_factors()


def short_repr(value: object) -> str:
    """``repr`` of a value cut to 60 characters (errors never quote a whole input)."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _byte_power(unit: "pint.Unit") -> int:
    """Exponent of byte-like units (byte, GB, GiB, bit) in ``unit``."""
    return int(sum(exp for name, exp in unit._units.items() if name.endswith(("byte", "bit"))))


_WORDS = {"bytes": "size in bytes", "bytes_per_s": "bandwidth in bytes/s", "s": "time", "w": "power",
          "j": "energy", "mhz": "frequency", "flops": "FLOP count", "flops_per_s": "FLOP rate"}


def _wrong_dimension(value: object, dimension: str) -> str:
    return f"{value!r} is not a {_WORDS[dimension]} (expected e.g. {EXAMPLES[dimension]})"
