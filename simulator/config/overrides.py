"""``--set a.b.c=value`` overrides applied to the scenario dict before validation."""

from __future__ import annotations

import copy
from typing import Any

import yaml

from simulator.config.errors import ScenarioError


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``"a.b=value"`` into a key path and a YAML-typed value (``8`` -> int, ``"8 GB"`` -> str).

    Raises:
        ScenarioError: no ``=`` or an empty key.
    """
    if "=" not in text:
        raise ScenarioError(f"--set {text!r}: expected dotted.key=value")
    key, _, raw = text.partition("=")
    parts = [p for p in key.strip().split(".")]
    if not all(parts):
        raise ScenarioError(f"--set {text!r}: empty key component")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Return a copy of ``data`` with each ``dotted.key=value`` set (creating mappings as needed).

    Raises:
        ScenarioError: a path goes through a non-mapping value.
    """
    out = copy.deepcopy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for i, p in enumerate(parts[:-1]):
            nxt = node.get(p) if isinstance(node, dict) else None
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                if isinstance(nxt, str):  # a preset given by name: expand to {preset: name}
                    nxt = node[p] = {"preset": nxt}
                else:
                    raise ScenarioError(f"--set {text!r}: {'.'.join(parts[: i + 1])} is not a mapping")
            node = nxt
        node[parts[-1]] = value
    return out
