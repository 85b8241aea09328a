"""``--set a.b.c=value`` overrides applied to the scenario dict before validation."""

from __future__ import annotations

import copy
import typing
from typing import Any

from hardware_models import safe_yaml
from simulator.config.errors import ScenarioError

#: Longest ``--set`` text accepted, characters.
MAX_OVERRIDE_CHARS = 100_000


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``"a.b=value"`` into a key path and a YAML-typed value (``8`` -> int, ``"8 GB"`` -> str).

    The value is read with ``hardware_models.safe_yaml`` (YAML 1.2 scalars, bounded nesting and
    size); text that is not valid YAML is taken as a plain string.

    Raises:
        ScenarioError: no ``=``, an empty key, a text over ``MAX_OVERRIDE_CHARS``, or a value that
            safe_yaml refuses (too deep, duplicate key, unsupported tag, integer out of range).
    """
    if len(text) > MAX_OVERRIDE_CHARS:
        raise ScenarioError(f"--set: a value of {len(text):,} characters; at most {MAX_OVERRIDE_CHARS:,}")
    shown = text if len(text) <= 80 else text[:77] + "..."
    if "=" not in text:
        raise ScenarioError(f"--set {shown!r}: expected dotted.key=value")
    key, _, raw = text.partition("=")
    parts = [p for p in key.strip().split(".")]
    if not all(parts):
        raise ScenarioError(f"--set {shown!r}: empty key component")
    try:
        value = safe_yaml.loads(raw) if raw.strip() else ""
    except safe_yaml.YamlInputError as exc:
        if str(exc).startswith("YAML syntax error"):
            value = raw
        else:
            raise ScenarioError(f"--set {key.strip()}: {str(exc).removeprefix('line 1: ')}") from None  # one line
    return parts, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Return a copy of ``data`` with each ``dotted.key=value`` set (creating mappings as needed).

    ``KEY=null`` (or ``~``) for a key of the schema removes it, as if it were not written: the schema's default
    applies, and no section is created for it (a required key is then reported missing by the loader); where
    null is itself a value other than the default (``fsdp.backward_prefetch: null``, no prefetch) it is set, and
    a key the schema does not have is set too, for the loader to name (``null_override``).

    ``model.from_hf=PATH`` replaces the scenario's model section by the file (keys an earlier
    ``--set model.KEY`` gave are kept, later ones apply after): merged into the scenario's own model
    keys it would quietly build a hybrid (a GPT-2 scenario's 12 layers with Llama's widths), since
    a scenario's explicit keys override the file's.

    Raises:
        ScenarioError: a path goes through a non-mapping value.
    """
    out = copy.deepcopy(data)
    set_model_keys: dict[str, Any] = {}
    for text in overrides:
        parts, value = parse_override(text)
        if value is None and null_override(parts) == "remove":
            _remove(out, parts)
            if len(parts) >= 2 and parts[0] == "model":
                set_model_keys.pop(parts[1], None)
            continue
        if parts == ["model", "from_hf"]:
            out["model"] = {**set_model_keys, "from_hf": value}
            continue
        node = out
        for i, p in enumerate(parts[:-1]):
            nxt = node.get(p) if isinstance(node, dict) else None
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                if isinstance(nxt, str):  # a preset given by name: expand to {preset: name}
                    nxt = node[p] = {"preset": nxt}
                else:
                    raise ScenarioError(f"--set {'.'.join(parts)}: {'.'.join(parts[: i + 1])} is not a mapping")
            node = nxt
        node[parts[-1]] = value
        if len(parts) >= 2 and parts[0] == "model" and isinstance(out.get("model"), dict):
            set_model_keys[parts[1]] = copy.deepcopy(out["model"].get(parts[1]))
    return out


def _remove(data: dict, parts: list[str]) -> None:
    """Delete the key at ``parts`` from ``data`` in place (nothing when a mapping on the way is absent; a preset
    given by name has no keys below it to remove)."""
    node: Any = data
    for p in parts[:-1]:
        node = node.get(p) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(parts[-1], None)


def null_override(parts: list[str]) -> str:
    """What ``--set KEY=null`` does to the key at ``parts``: ``"remove"`` (a key of the scenario schema whose
    default is not a null value of its own), ``"set"`` (null is one of its values, other than the default:
    ``fsdp.backward_prefetch``; or a key the schema does not have, which the loader reports)."""
    import typing

    from pydantic import BaseModel

    from simulator.config.schema import ScenarioConfig

    model: Any = ScenarioConfig
    for i, p in enumerate(parts):
        field = getattr(model, "model_fields", {}).get(p)
        if field is None:
            return "set"
        if i == len(parts) - 1:
            admits_null = type(None) in typing.get_args(field.annotation)
            default = None if field.is_required() else field.get_default(call_default_factory=True)
            return "set" if admits_null and default is not None else "remove"
        subs = [a for a in (field.annotation, *typing.get_args(field.annotation))
                if isinstance(a, type) and issubclass(a, BaseModel)]
        model = subs[0] if len(subs) == 1 else None
    return "set"


#: Sections the validators fill in from another key when they are not written: dotted key -> (that key, what its
#: value filled in, the ``--set`` that turns that off, what the key's null means). ``fsdp.offload_policy`` from
#: torchtitan's ``training.enable_cpu_offload: true`` (``ScenarioConfig._torchtitan_cpu_offload``: CPUOffloadPolicy(),
#: pytorch/torchtitan@81c12433 torchtitan/models/llama3/infra/parallelize.py apply_fsdp; unset, fully_shard's
#: OffloadPolicy(): no offload).
DERIVED_FROM = {"fsdp.offload_policy": ("training.enable_cpu_offload", "torchtitan's CPUOffloadPolicy()",
                                        "training.enable_cpu_offload=false turns the offload off",
                                        "no offload (OffloadPolicy)")}


#: what an optional top-level section (default None) left out means for the run: ``--set SECTION=null``'s note
ABSENT_SECTION = {
    "activation_checkpoint": lambda cfg: "no torchtitan activation checkpointing: training.recompute_granularity "
                                         f"decides the recompute ({cfg.training.recompute_granularity or 'none'})",
    "dataloader": lambda cfg: "no DataLoader workers are simulated: each batch is ready on the host",
    "dvfs": lambda cfg: "no DVFS policy: the GPUs run at their default clocks and power limit",
    "fsdp": lambda cfg: "no FSDP: data parallelism is DDP, or DeepSpeed's per zero_optimization",
}


def _absent_section_note(cfg: Any, key: str, field: Any) -> str | None:
    """For an optional section (a model, default None) that ``--set KEY=null`` left out: what the section became
    (left out, its default) and what that means for the run (``ABSENT_SECTION``); None for another key."""
    from pydantic import BaseModel

    kinds = [a for a in typing.get_args(field.annotation) if a is not type(None)] if field is not None else []
    if not (len(kinds) == 1 and isinstance(kinds[0], type) and issubclass(kinds[0], BaseModel)):
        return None
    meaning = ABSENT_SECTION.get(key)
    return (f"the {key} section is left out (its default, none)" + (f": {meaning(cfg)}" if meaning else ""))


def _derived_note(cfg: Any, key: str, node: Any) -> str | None:
    """For a key of ``DERIVED_FROM`` removed by ``--set KEY=null``: what it became and why, naming the key it was
    derived from and the ``--set`` that turns it off; None for another key."""
    if key not in DERIVED_FROM:
        return None
    src, what, off, null = DERIVED_FROM[key]
    if node is None:
        return f"{key} is not written, so it is null: {null}"
    value: Any = cfg
    for p in src.split("."):
        value = getattr(value, p, None)
    return (f"{key} is not written, so it is derived from {src}: {str(value).lower()} ({what}): "
            f"{node.model_dump()}; only --set {off}")


def _filled_from_defaults(node: Any, default: Any) -> dict:
    """The fields of section ``node`` that differ from its schema default ``default`` only where the default is None
    (a value the validators derived from the other settings: ``parallelism.data_parallel_size`` from the world size),
    ``{field: value}``; empty when any other field differs (the section is not the schema's defaults)."""
    filled = {}
    for name in type(node).model_fields:
        mine, theirs = getattr(node, name), getattr(default, name)
        if mine == theirs:
            continue
        if theirs is not None:
            return {}
        filled[name] = mine
    return filled


def null_override_notes(cfg: Any, overrides: list[str]) -> list[str]:
    """One line per ``--set KEY=null`` of ``overrides`` that removed a scalar key (``null_override`` "remove"),
    saying what the valid scenario ``cfg`` took in its place: the schema's default, or the value its validators
    derived from the other settings (``parallelism.data_parallel_size``), or that it is left unset for the run to
    resolve from the framework (``training.clip_grad``: ``None``). A section removed is noted when it took the
    schema's defaults (``aio=null``: their values; ``parallelism=null``: with the fields the validators derived, as
    ``data_parallel_size``, named) or, one whose default is None, when the validators filled it in
    from other keys (derived, with its value); a key of ``DERIVED_FROM`` names the key it came from and the
    ``--set`` that turns it off (``fsdp.offload_policy`` from ``training.enable_cpu_offload``), or, left null, what
    null means there; other sections are not. Raises nothing: a text that does not parse is skipped."""
    from pydantic import BaseModel

    out = []
    for text in overrides:
        try:
            parts, value = parse_override(text)
        except ScenarioError:
            continue
        if value is not None or null_override(parts) != "remove":
            continue
        node: Any = cfg
        owner: Any = None
        for p in parts:
            owner, node = node, getattr(node, p, None)
            if node is None:
                break
        key, raw = ".".join(parts), text.partition("=")[2].strip()
        field = type(owner).model_fields.get(parts[-1]) if isinstance(owner, BaseModel) else None
        default = field.get_default(call_default_factory=True) if field is not None and not field.is_required() \
            else None
        if (note := _derived_note(cfg, key, node)) is not None:  # fsdp.offload_policy from enable_cpu_offload
            out.append(f"--set {key}={raw}: {note}")
            continue
        if isinstance(node, BaseModel) and field is not None and default is None:  # a section the validators fill
            out.append(f"--set {key}={raw}: {key} is not written, so it is derived from the other settings: "
                       f"{node.model_dump()}")
            continue
        if isinstance(node, BaseModel) and node == default:  # a section of schema defaults (aio=null)
            out.append(f"--set {key}={raw}: {key} is not written, so it takes the schema's defaults: "
                       f"{node.model_dump()}")
            continue
        if isinstance(node, BaseModel) and isinstance(default, BaseModel) and (
                filled := _filled_from_defaults(node, default)):  # parallelism=null: dp derived from the world size
            derived = ", ".join(f"{k} {v!r}" for k, v in filled.items())
            out.append(f"--set {key}={raw}: {key} is not written, so it takes the schema's defaults, with {derived} "
                       f"derived from the other settings: {node.model_dump()}")
            continue
        if isinstance(node, BaseModel) or isinstance(node, (list, dict)):
            continue
        if node is None and default is None and (note := _absent_section_note(cfg, key, field)) is not None:
            out.append(f"--set {key}={raw}: {note}")  # activation_checkpoint=null: the section left out
            continue
        if node is None:
            out.append(f"--set {key}={raw}: {key} is not written, so it is left unset: the run resolves it from the "
                       "other settings (see its documentation)")
        elif node == default:
            out.append(f"--set {key}={raw}: {key} is not written, so it takes the schema's default: {node!r}")
        else:
            out.append(f"--set {key}={raw}: {key} is not written, so it is derived from the other settings: {node!r}")
    return out
