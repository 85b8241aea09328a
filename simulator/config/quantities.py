"""Pydantic field types for quantities with units (parsed by ``hardware_models.units``)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator

from hardware_models.units import parse_quantity


def _q(dim: str):
    def parse(v):
        return parse_quantity(v, dim)

    return BeforeValidator(parse)


Bytes = Annotated[float, _q("bytes")]
BytesPerS = Annotated[float, _q("bytes_per_s")]
Seconds = Annotated[float, _q("s")]
Watts = Annotated[float, _q("w")]
MHz = Annotated[float, _q("mhz")]
