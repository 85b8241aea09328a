"""Preset registry: one YAML data file per product, found by family and name.

Families: ``gpus`` (``GpuSpec``), ``links`` (``LinkSpec``), ``hosts`` (``HostCpuSpec`` plus a
``memory`` block for ``HostMemorySpec``, an optional ``nvme`` block, ``hardware_models.nvme.host_nvme``, and an
optional ``pcie_switches`` list, ``hardware_models.pcie_switches.host_pcie_switches``), ``profiles``
(``EfficiencyProfile``). A value in a preset file may be a number (SI units), a string with a unit
(``"4.8 TB/s"``), or ``{value: ..., source: ...}``; the unit dimension comes from the field-name suffix
(``_bytes``, ``_bytes_per_s``, ``_s``, ``_w``, ``_mhz``, ``_flops_per_s``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import typing
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from hardware_models.fabrics import LinkSpec
from hardware_models.gpu import GpuSpec
from hardware_models.host import HostCpuSpec, HostMemorySpec
from hardware_models.profile import EfficiencyProfile
from hardware_models import safe_yaml
from hardware_models.units import UnitError, parse_quantity, short_repr

#: Preset families, one folder each. This module builds the first four; the others are built by their
#: own modules from ``read(family, name)``: storage (``hardware_models.dataloader.load_storage_preset``),
#: power (``hardware_models.power.load_power_model``), clusters and networks
#: (``hardware_models.topology``), collectives (``hardware_models.collectives``).
FAMILIES = ("gpus", "links", "hosts", "profiles", "storage", "power", "clusters", "networks", "collectives")
_BUILT_HERE = ("gpus", "links", "hosts", "profiles")
#: One preset of each family, in words (for messages).
_ONE = {"gpus": "gpu", "links": "link", "hosts": "host", "profiles": "profile", "storage": "storage",
        "power": "power", "clusters": "cluster", "networks": "network", "collectives": "collective"}
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


#: A preset name: letters, digits, ``.``, ``_``, ``+`` and ``-``, at most 100 characters, not
#: starting with a dot (so never a path: no ``/``, no ``..``).
_NAME = re.compile(r"^[A-Za-z0-9_+-][A-Za-z0-9._+-]{0,99}$")

#: Prefixes that make a string a file path rather than a preset name (``hardware.profile``,
#: ``dvfs.power_model``). Anything else is a name, looked up in the preset folders only.
FILE_PREFIXES = ("./", "../", "/")


def is_file_reference(text: str) -> bool:
    """Whether ``text`` names a file (starts with ``./``, ``../`` or ``/``) rather than a preset."""
    return isinstance(text, str) and text.startswith(FILE_PREFIXES)


def check_name(family: str, name: object) -> str:
    """Check that ``name`` is a shipped preset of ``family`` (a name, never a path).

    Raises:
        PresetError: not a string, not a valid name (e.g. ``../x``, too long) or not shipped; the
            message lists the known names, then the closest ones (``did you mean``, difflib's
            ``get_close_matches`` at its default cutoff 0.6) when a valid name is near some.
    """
    known = list_presets(family)[family]
    if not isinstance(name, str) or not _NAME.match(name) or name not in known:
        shown = short_repr(name)
        if isinstance(name, str) and "/" in name:
            why = (" (a preset name, not a path; files are accepted only where the schema says so, "
                   f"as paths starting with {', '.join(FILE_PREFIXES)})")
        elif not isinstance(name, str) or not _NAME.match(name):
            why = " (a preset name is letters, digits, '.', '_', '+' and '-', at most 100 characters)"
        else:
            why = ""
        raise PresetError(f"unknown {_ONE.get(family, family)} preset {shown}{why}; known: {', '.join(known)}"
                          f"{_did_you_mean(name, known)}")
    return name


#: closest names shown after an unknown preset name (difflib)
MAX_CLOSE = 3


def _did_you_mean(name: object, known: list[str]) -> str:
    """``"; did you mean 'a' or 'b'?"`` for the known names nearest ``name`` (a valid name only), else ``""``."""
    import difflib

    if not isinstance(name, str) or not _NAME.match(name):
        return ""
    close = difflib.get_close_matches(name, known, n=MAX_CLOSE)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


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


def _type_word(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if type(None) in args:  # Optional[X]: described as X
        tp = next(a for a in args if a is not type(None))
        origin = typing.get_origin(tp)
    if origin is dict:
        return "a mapping"
    if origin is tuple or origin is list:
        return "a list"
    return {float: "a number", int: "an integer", str: "a string", bool: "true or false"}.get(tp, "a mapping")


def _kind(value: Any) -> str:
    """A value's type in words ("a list"), for errors that must not quote the value."""
    if isinstance(value, bool):
        return "true/false"
    return {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a mapping",
            type(None): "null"}.get(type(value), f"a {type(value).__name__}")


@lru_cache(maxsize=None)
def _type_hints(cls) -> dict:
    """``typing.get_type_hints(cls)``, once per class (it evaluates every string annotation anew on each
    call: about a tenth of a small sweep point's time when every preset build asked)."""
    return typing.get_type_hints(cls)


#: ``_check_type``'s ``quantity`` for a bandwidth (``*_bytes_per_s``) that must be > 0, and for one whose field
#: defaults to 0, which then means "not given" (the field's documented fallback: pageable = pinned rate,
#: no PCIe switch, no NVLink with ``intra: pcie``, unknown host bandwidth)
RATE, RATE_OR_UNSET = "rate", "rate_or_unset"


def _quantity(cls: type, name: str) -> bool | str:
    """``_check_type``'s ``quantity`` for field ``name`` of spec dataclass ``cls``: ``RATE`` /
    ``RATE_OR_UNSET`` for a bandwidth, True for another quantity with a unit suffix, else False."""
    dim = dimension_of(name)
    if dim != "bytes_per_s":
        return dim is not None
    f = next((f for f in dataclasses.fields(cls) if f.name == name), None) if dataclasses.is_dataclass(cls) else None
    return RATE_OR_UNSET if f is not None and f.default == 0 else RATE


def _check_type(value: Any, tp: Any, path: str, quantity: bool | str = False) -> None:
    """Check a converted preset value against its dataclass field type.

    Numbers must be finite, >= 0 for quantities with a unit suffix, and > 0 for bandwidths (``quantity``
    ``RATE``: a zero bandwidth would make a transfer infinitely long; ``RATE_OR_UNSET``: or exactly 0, the
    field's default, "not given"); integers fit in 64 bits.

    Raises:
        PresetError: naming ``path`` and the type expected.
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or (origin is not None and type(None) in args):
        if value is None and type(None) in args:
            return
        tp = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is float or tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PresetError(f"{path}: expected {_type_word(tp)}, got {_kind(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise PresetError(f"{path}: expected a finite number, got {value!r}")
        if tp is int and (isinstance(value, float) and not value.is_integer() or abs(value) >= 2**63):
            raise PresetError(f"{path}: expected an integer below 2**63")
        if quantity == RATE and value <= 0:
            raise PresetError(f"{path}: must be > 0 (a bandwidth; 0 would make a transfer infinitely long), "
                              f"got {value!r}")
        if quantity == RATE_OR_UNSET and value < 0:
            raise PresetError(f"{path}: must be > 0 (a bandwidth), or 0 for not given (the field's default), "
                              f"got {value!r}")
        if quantity and value < 0:
            raise PresetError(f"{path}: must be >= 0, got {value!r}")
        return
    if tp is str or tp is bool:
        if not isinstance(value, tp):
            raise PresetError(f"{path}: expected {_type_word(tp)}, got {_kind(value)}")
        return
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise PresetError(f"{path}: expected a mapping, got {_kind(value)}")
        if args:
            for k, v in value.items():
                if not isinstance(k, str):
                    raise PresetError(f"{path}: keys must be strings, got {_kind(k)}")
                _check_type(v, args[1], f"{path}.{k}", quantity)
        return
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise PresetError(f"{path}: expected a list, got {_kind(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            for i, v in enumerate(value):
                _check_type(v, args[0], f"{path}[{i}]", quantity)
        elif len(value) != len(args):
            raise PresetError(f"{path}: expected a list of {len(args)} values, got {len(value)}")
        else:
            for i, (v, a) in enumerate(zip(value, args)):
                _check_type(v, a, f"{path}[{i}]", quantity)
        return
    if dataclasses.is_dataclass(tp) and not isinstance(value, tp):
        if not isinstance(value, dict):
            raise PresetError(f"{path}: expected a mapping of keys ({', '.join(sorted(_type_hints(tp)))}), got "
                              f"{_kind(value)}")
        hints = _type_hints(tp)
        unknown = sorted(str(k) for k in value if k not in hints)
        if unknown:
            raise PresetError(f"{path}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(hints))})")
        for k, v in value.items():
            _check_type(v, hints[k], f"{path}.{k}", _quantity(tp, k))


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
        raise PresetError(f"{where}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(names))})")
    hints = _type_hints(cls)
    for k, v in clean.items():  # containers first, so a mapping is never read as a per-dtype table
        if isinstance(v, (dict, list)) and _type_word(hints[k]) not in ("a mapping", "a list"):
            raise PresetError(f"{where}.{k}: expected {_type_word(hints[k])}"
                              f"{' (a quantity with a unit)' if dimension_of(k) else ''}, got {_kind(v)}")
        if _type_word(hints[k]) == "a mapping" and v is not None and not isinstance(v, dict):
            raise PresetError(f"{where}.{k}: expected a mapping, got {_kind(v)}")
    clean = convert_units(clean, where)
    for k, v in clean.items():
        _check_type(v, hints[k], f"{where}.{k}", _quantity(cls, k))
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


def read(family: str, name: str) -> dict:
    """The mapping in shipped preset ``name`` of ``family``, sources kept: the one preset reader.

    The name is checked first (a name, never a path); the file is read with ``hardware_models.safe_yaml``.

    Raises:
        PresetError: unknown family or name (the message lists the known names), or a bad file.
    """
    if family not in FAMILIES:
        raise PresetError(f"unknown preset family {family!r}; known: {', '.join(FAMILIES)}")
    return copy.deepcopy(_load(family, name))  # callers may change what they get; the cache must not


@lru_cache(maxsize=None)
def _load(family: str, name: str) -> dict:
    check_name(family, name)
    try:
        return safe_yaml.load_mapping(_root() / family / f"{name}.yaml", f"a mapping of {_ONE.get(family, family)} fields")
    except safe_yaml.YamlInputError as exc:
        raise PresetError(f"preset {family}/{name}: {exc}") from None


def load_profile_file(path: str | Path) -> EfficiencyProfile:
    """Load an efficiency profile from a YAML file (e.g. written by ``simulate calibrate``).

    Raises:
        PresetError: a missing file or invalid content (see ``hardware_models.safe_yaml``); the
            message names the file and a key, never the file's values.
    """
    p = Path(path)
    try:
        data = safe_yaml.load_mapping(p, "a mapping of profile fields")
    except safe_yaml.YamlInputError as exc:
        msg = "does not exist" if str(exc) == "file not found" else str(exc)
        raise PresetError(f"profile file {str(p)!r}: {msg}") from None
    return build_spec(EfficiencyProfile, data, f"profile file {str(p)!r}")


def get(family: str, name: str) -> Any:
    """Return the spec for preset ``name`` of one of the families built here.

    Returns:
        ``GpuSpec`` (gpus) / ``LinkSpec`` (links) / ``(HostCpuSpec, HostMemorySpec)`` (hosts) /
        ``EfficiencyProfile`` (profiles).

    Raises:
        PresetError: a family built elsewhere (see ``FAMILIES``), an unknown name (the message lists
            the known names), or a bad file.
    """
    if family not in _BUILT_HERE:
        raise PresetError(f"preset family {family!r} is not built by hardware_models.presets.get "
                          f"(allowed: {', '.join(_BUILT_HERE)}; see FAMILIES for the others' loaders)")
    return _built(family, name)


@lru_cache(maxsize=None)
def _built(family: str, name: str) -> Any:
    """``get``'s spec, built once per process (the specs are frozen; ``_load`` caches the file the same way)."""
    data = read(family, name)  # checks the name first
    where = f"preset {family}/{name}"
    if family == "gpus":
        return build_spec(GpuSpec, data, where)
    if family == "links":
        return build_spec(LinkSpec, data, where)
    if family == "hosts":
        data.pop("nvme", None)  # the host's NVMe drives: hardware_models.nvme.host_nvme
        data.pop("pcie_switches", None)  # its PCIe switches: hardware_models.pcie_switches.host_pcie_switches
        mem = data.pop("memory", {})
        return build_spec(HostCpuSpec, data, where), build_spec(HostMemorySpec, mem, where + ".memory")
    return build_spec(EfficiencyProfile, data, where)


def raw(family: str, name: str) -> dict:
    """The preset file's content with sources stripped (for ``simulate presets show``)."""
    return strip_sources(read(family, name))
