"""Markdown reference of the scenario schema, generated from the pydantic models' fields."""

from __future__ import annotations

import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from simulator.config.schema import ScenarioConfig


def _models_in(annotation) -> list[type[BaseModel]]:
    out = []
    for a in typing.get_args(annotation) or (annotation,):
        if isinstance(a, type) and issubclass(a, BaseModel):
            out.append(a)
        else:
            out.extend(_models_in(a) if typing.get_args(a) else [])
    return out


def _type_name(annotation) -> str:
    """Readable type: ``Annotated`` metadata dropped, unions joined with ``|``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " | ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type_name(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def schema_markdown(model: type[BaseModel] = ScenarioConfig, prefix: str = "", seen=None) -> str:
    """One table per (nested) section: its docstring's first paragraph (lines joined), then key, type, default,
    description."""
    seen = set() if seen is None else seen
    intro = " ".join(line.strip() for line in (model.__doc__ or "").strip().split("\n\n")[0].splitlines())
    lines = [f"### `{prefix or '(top level)'}`", "", intro, "",
             "| key | type | default | description |", "|---|---|---|---|"]
    nested = []
    for name, f in model.model_fields.items():
        default = "required" if f.is_required() else (
            "" if f.default is PydanticUndefined else repr(f.default) if not isinstance(f.default, BaseModel) else "(defaults)")
        desc = (f.description or "").replace("|", "\\|")
        lines.append(f"| `{name}` | `{_type_name(f.annotation)}` | {default} | {desc} |")
        for sub in _models_in(f.annotation):
            if sub not in seen:
                seen.add(sub)
                nested.append((f"{prefix}.{name}" if prefix else name, sub))
    out = "\n".join(lines) + "\n\n"
    for p, sub in nested:
        out += schema_markdown(sub, p, seen)
    return out
