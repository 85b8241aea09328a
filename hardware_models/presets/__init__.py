"""Preset registry: one YAML data file per product, found by family and name.

Families: ``gpus`` (``GpuSpec``), ``links`` (``LinkSpec``), ``hosts`` (``HostCpuSpec`` plus a
``memory`` block for ``HostMemorySpec``), ``profiles`` (``EfficiencyProfile``). A value in a preset
file may be a number (SI units), a string with a unit (``"4.8 TB/s"``), or ``{value: ..., source:
...}``; the unit dimension comes from the field-name suffix (``_bytes``, ``_bytes_per_s``, ``_s``,
``_w``, ``_mhz``, ``_flops_per_s``).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from hardware_models.fabrics import LinkSpec
from hardware_models.gpu import GpuSpec
from hardware_models.host import HostCpuSpec, HostMemorySpec
from hardware_models.profile import EfficiencyProfile
from hardware_models.units import UnitError, parse_quantity

FAMILIES = ("gpus", "links", "hosts", "profiles", "storage", "power")
_SUFFIXES = (
    ("_flops_per_s", "flops_per_s"),
    ("_bytes_per_s", "bytes_per_s"),
    ("_params_per_s", None),
    ("_bytes", "bytes"),
    ("_mhz", "mhz"),
    ("_w", "w"),
    ("_j", "j"),
    ("_s", "s"),
)


class PresetError(ValueError):
    """An unknown preset name or an invalid preset file."""


def dimension_of(field_name: str) -> str | None:
    """Unit dimension implied by a field name's suffix, or None for plain numbers."""
    for suffix, dim in _SUFFIXES:
        if field_name.endswith(suffix):
            return dim
    return None


def _root() -> Path:
    return Path(str(resources.files("hardware_models") / "presets"))


def list_presets(family: str | None = None) -> dict[str, list[str]]:
    """Names of the shipped presets, by family."""
    fams = FAMILIES if family is None else (family,)
    return {f: sorted(p.stem for p in (_root() / f).glob("*.yaml")) for f in fams}


def strip_sources(d: Any, sources: dict[str, str] | None = None, prefix: str = "") -> Any:
    """Replace ``{value, source}`` leaves by their value, collecting sources by dotted key."""
    if isinstance(d, dict):
        if "value" in d and set(d) <= {"value", "source", "note"}:
            if sources is not None and "source" in d:
                sources[prefix] = str(d["source"])
            return d["value"]
        return {k: strip_sources(v, sources, f"{prefix}.{k}" if prefix else str(k)) for k, v in d.items()}
    if isinstance(d, list):
        return [strip_sources(v, sources, prefix) for v in d]
    return d


#: Smallest plausible value of a bare number (no unit) per dimension; below it the user most
#: likely meant a unit ("4.8" for "4.8 TB/s"), which would otherwise make runs absurdly slow.
_BARE_MINIMUM = {"bytes_per_s": 1e6, "bytes": 1e3, "flops_per_s": 1e9}


def _check_bare(value: Any, dim: str, path: str) -> None:
    low = _BARE_MINIMUM.get(dim)
    if low is not None and isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < low:
        unit = {"bytes_per_s": "bytes/s", "bytes": "bytes", "flops_per_s": "FLOP/s"}[dim]
        raise PresetError(f"{path}: a bare number is taken in {unit}: {value!r} is implausibly small; "
                          f"give a unit, e.g. \"{value} TB/s\"" if dim == "bytes_per_s" else
                          f"{path}: a bare number is taken in {unit}: {value!r} is implausibly small; give a unit")


def convert_units(d: dict, where: str = "") -> dict:
    """Convert unit strings by field-name suffix (recursing into dicts keyed by dtype etc.).

    Raises:
        PresetError: a quantity with the wrong unit, naming the key path.
    """
    out = {}
    for k, v in d.items():
        path = f"{where}.{k}" if where else k
        dim = dimension_of(k)
        try:
            if dim and isinstance(v, dict):
                for kk, vv in v.items():
                    _check_bare(vv, dim, f"{path}.{kk}")
                out[k] = {kk: parse_quantity(vv, dim) for kk, vv in v.items()}
            elif dim and isinstance(v, list):
                out[k] = [parse_quantity(vv, dim) for vv in v]
            elif dim and v is not None:
                _check_bare(v, dim, path)
                out[k] = parse_quantity(v, dim)
            else:
                out[k] = v
        except UnitError as exc:
            raise PresetError(f"{path}: {exc}") from None
    return out


def build_spec(cls: type, data: dict, where: str) -> Any:
    """Instantiate a frozen spec dataclass from a preset dict (units converted, sources kept).

    Raises:
        PresetError: unknown or missing fields, bad units, or a failed invariant.
    """
    sources: dict[str, str] = {}
    clean = strip_sources(data, sources)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(clean) - names)
    if unknown:
        raise PresetError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(names)}")
    clean = convert_units(clean, where)
    if "sources" in names:
        clean["sources"] = {**sources, **(clean.get("sources") or {})}
    for f in dataclasses.fields(cls):
        if f.type in ("tuple[float, ...]",) and f.name in clean:
            clean[f.name] = tuple(clean[f.name])
    try:
        if cls is EfficiencyProfile:
            return EfficiencyProfile.from_dict(clean)
        return cls(**clean)
    except TypeError as exc:
        import re

        missing = re.findall(r"'(\w+)'", str(exc)) if "missing" in str(exc) else []
        msg = f"missing required key(s): {', '.join(missing)}" if missing else str(exc)
        raise PresetError(f"{where}: {msg}") from None
    except ValueError as exc:
        raise PresetError(f"{where}: {exc}") from None


@lru_cache(maxsize=None)
def _load(family: str, name: str) -> dict:
    path = _root() / family / f"{name}.yaml"
    if not path.exists():
        known = ", ".join(list_presets(family)[family])
        raise PresetError(f"unknown {family[:-1]} preset {name!r}; known: {known}")
    with open(path) as fh:
        return yaml.safe_load(fh) or {}


def load_profile_file(path: str | Path) -> EfficiencyProfile:
    """Load an efficiency profile from a YAML file (e.g. written by ``simulate calibrate``).

    Raises:
        PresetError: a missing file or invalid content.
    """
    p = Path(path)
    if not p.is_file():
        raise PresetError(f"profile file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise PresetError(f"profile file {str(p)!r}: YAML syntax error{where}") from None
    if not isinstance(data, dict):
        raise PresetError(f"profile file {str(p)!r}: expected a mapping of profile fields")
    return build_spec(EfficiencyProfile, data, str(p))


def get(family: str, name: str) -> Any:
    """Return the spec for preset ``name`` of ``family``.

    Returns:
        ``GpuSpec`` / ``LinkSpec`` / ``(HostCpuSpec, HostMemorySpec)`` / ``EfficiencyProfile`` /
        ``StorageSpec`` / ``GpuPowerModel``.

    Raises:
        PresetError: unknown family or name (the message lists the known names), or a bad file.
    """
    if family not in FAMILIES:
        raise PresetError(f"unknown preset family {family!r}; known: {FAMILIES}")
    data = dict(_load(family, name))
    where = f"preset {family}/{name}"
    if family == "gpus":
        return build_spec(GpuSpec, data, where)
    if family == "links":
        return build_spec(LinkSpec, data, where)
    if family == "hosts":
        mem = data.pop("memory", {})
        return build_spec(HostCpuSpec, data, where), build_spec(HostMemorySpec, mem, where + ".memory")
    if family == "storage":
        from hardware_models.dataloader import load_storage_preset

        return load_storage_preset(name)
    if family == "power":
        from hardware_models.power import load_power_model

        return load_power_model(name)
    return build_spec(EfficiencyProfile, data, where)


def raw(family: str, name: str) -> dict:
    """The preset file's content with sources stripped (for ``simulate presets show``)."""
    return strip_sources(dict(_load(family, name)))
