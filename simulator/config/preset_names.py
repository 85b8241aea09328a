"""The preset names a scenario's ``hardware`` section writes, checked against the shipped catalogue
(``hardware_models/presets``) without building any spec: the names ``loader.resolve_hardware`` would refuse.

``loader.scenario_errors`` runs this once pydantic refused a file, so that an unknown preset name is reported in
the same run as the file's other problems instead of after they are fixed (``resolve_hardware`` only runs on a
valid scenario). A valid scenario never runs it: its names are checked by ``resolve_hardware`` as they are
loaded, with the same lines (``presets.check_name``'s message, ``pcie_link_problem``).
"""

from __future__ import annotations

from typing import Any

from hardware_models import presets
from hardware_models.presets import PresetError

#: (key path, preset family) of every preset name in ``hardware``; ``gpu``, ``pcie`` and ``host`` are a name or a
#: mapping ``{preset: NAME, ...}`` (then checked at ``KEY.preset``); ``profile`` may be a file (not checked here)
PRESET_KEYS = ((("hardware", "gpu"), "gpus"), (("hardware", "pcie"), "links"), (("hardware", "host"), "hosts"),
               (("hardware", "profile"), "profiles"), (("hardware", "cluster", "preset"), "clusters"),
               (("hardware", "cluster", "network"), "networks"),
               (("hardware", "cluster", "collective_profile"), "collectives"))
#: names whose preset the schema's own checks load (``schema.world_size_of``: the cluster's GPUs): unknown, what
#: those checks read of it (the world size, the data-parallel size derived from it) is unknown
READ_BY_CHECKS = frozenset({("hardware", "cluster", "preset")})
#: keys whose value may be ``{preset: NAME, overrides: ...}`` (``schema.PresetRef`` / ``HostRef``)
_REF_KEYS = frozenset({("hardware", "gpu"), ("hardware", "pcie"), ("hardware", "host")})


def pcie_link_problem(name: str) -> str | None:
    """Why the links preset ``name`` is not a host link for ``hardware.pcie`` (the links family also holds NVLink,
    InfiniBand and Ethernet presets), or None for a ``pcie-*`` name."""
    if name.startswith("pcie-"):
        return None
    return (f"{name!r} is not a PCIe link (the GPU's host link); allowed: the pcie-* presets (simulate presets "
            "--family links); a network goes in hardware.cluster")


def _at(data: Any, path: tuple) -> Any:
    """The value at key path ``path`` of the mapping ``data`` (None where a key is absent or not a mapping)."""
    for p in path:
        if not isinstance(data, dict):
            return None
        data = data.get(p)
    return data


def preset_name_problems(data: Any, bad: set[tuple] = frozenset()) -> list[tuple[tuple, str]]:
    """``(key path, problem)`` of each preset name of ``data``'s ``hardware`` that is not a shipped preset of its
    family (``presets.check_name``: the known names and the closest ones), and of a ``hardware.pcie`` that is not a
    PCIe link; in ``PRESET_KEYS`` order.

    Args:
        data: A scenario mapping (as read, after ``--set``).
        bad: Key paths pydantic already refused (``loader.errors_by_key``): a name at or below one is not checked
            again (its line is there); ``()``, the scenario's own checks, holds none.

    Returns:
        ``[]`` when every name written is known; non-string values are left to the schema (its type error).
    """
    out = []
    for path, family in PRESET_KEYS:
        value = _at(data, path)
        if path in _REF_KEYS and isinstance(value, dict):
            path, value = (*path, "preset"), value.get("preset")
        if not isinstance(value, str) or any(b and path[:len(b)] == b for b in bad):  # (): a scenario-wide check
            continue
        if family == "profiles" and presets.is_file_reference(value):  # a calibration file: resolve_hardware
            continue
        try:
            presets.check_name(family, value)
        except PresetError as exc:
            out.append((path, str(exc)))
            continue
        if family == "links" and (why := pcie_link_problem(value)) is not None:
            out.append((path, why))
    return out
