"""The checks between settings of a scenario that pydantic did not run because some key or value is bad.

pydantic runs a model's ``mode="after"`` validators only once every field of it is valid, and stops at the first
one that raises; ``ScenarioConfig``'s ``mode="before"`` ``_resolve_data_parallel`` raising hides every field
error. So a file with a misspelt key and a tensor-parallel size that does not divide the heads would show its
problems in two rounds. ``cross_setting_errors`` runs every after-validator of the schema (each section's and the
scenario's) on a read-only view of the scenario in which the bad values are unknown: a validator that reads an
unknown value is skipped (its inputs are themselves invalid), every other one is evaluated and each refusal kept.
It runs only after validation failed, so a valid scenario is validated by pydantic alone, as before.

The unit skipped is one validator method: it stops at its first refusal as pydantic does, and a method that
reads an unknown value before reaching one of its checks skips that check too; a method whose rules are each
their own (``errors.refuse_each``) skips only the rule reading it, and tells every rule it breaks.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from typing import Annotated, Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from simulator.config.errors import UnknownValue


class _Unknown(UnknownValue):
    """A check read a value that is itself invalid (or missing): the check (or its rule, ``errors.refuse_each``)
    is skipped."""


#: a field whose value is unknown (invalid, missing, or the intended key of a misspelt one)
_UNSET = object()


class _View:
    """A read-only stand-in for an instance of a pydantic model whose validation failed: its valid fields as
    validated, reading an unknown one raises ``_Unknown``; properties and methods of the model run on the view."""

    __slots__ = ("_cls", "_values", "model_fields_set")
    model_fields: dict = {}

    def __init__(self, cls: type[BaseModel], values: dict[str, Any], given: set[str]):
        object.__setattr__(self, "_cls", cls)
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "model_fields_set", given)  # the keys written, as pydantic's

    def __getattr__(self, name: str):
        values = object.__getattribute__(self, "_values")
        if name in values:
            if values[name] is _UNSET:
                raise _Unknown(name)
            return values[name]
        cls = object.__getattribute__(self, "_cls")
        attr = inspect.getattr_static(cls, name)
        if isinstance(attr, property):
            return attr.fget(self)
        if isinstance(attr, types.FunctionType):
            return types.MethodType(attr, self)
        return getattr(cls, name)

    def __setattr__(self, name, value):
        raise AttributeError(f"{name}: a view is read-only")


@functools.lru_cache(maxsize=None)
def _view_class(cls: type[BaseModel]) -> type[_View]:
    """A ``_View`` subclass whose ``model_fields`` are ``cls``'s (validators read ``type(self).model_fields``)."""
    return type(f"{cls.__name__}View", (_View,), {"__slots__": (), "model_fields": cls.model_fields})


@functools.lru_cache(maxsize=None)
def _adapter(cls: type[BaseModel], name: str) -> TypeAdapter:
    field = cls.model_fields[name]
    return TypeAdapter(Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation)


def _field_validators(cls: type[BaseModel], name: str, mode: str) -> list:
    return [d.func for d in cls.__pydantic_decorators__.field_validators.values()
            if name in d.info.fields and d.info.mode == mode]


def _validated(cls: type[BaseModel], name: str, raw: Any) -> Any:
    """``raw`` (a value pydantic accepted for field ``name`` of ``cls``) as the validated model holds it."""
    v = raw
    for f in _field_validators(cls, name, "before"):
        v = f(v)
    v = _adapter(cls, name).validate_python(v)
    for f in _field_validators(cls, name, "after"):
        v = f(v)
    return v


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The one pydantic model a field's annotation admits (``FsdpConfig | None``, ``PresetRef | str``), or None."""
    found, stack = [], [annotation]
    while stack:
        a = stack.pop()
        if isinstance(a, type) and issubclass(a, BaseModel):
            found.append(a)
        elif typing.get_origin(a) is not list:
            stack.extend(typing.get_args(a))
    return found[0] if len(found) == 1 else None


def _view(cls: type[BaseModel], data: Any, path: tuple, bad: set[tuple], out: list[dict],
          before: bool = True) -> Any:
    """``data`` of model ``cls`` at key path ``path`` as a view (``_UNSET`` where it cannot be read), every
    after-validator of ``cls`` run on it and each refusal appended to ``out`` (a pydantic-style error)."""
    for d in cls.__pydantic_decorators__.model_validators.values():
        if before and d.info.mode == "before":
            try:
                data = d.func(data)
            except Exception:  # the section's own before-check refused it: pydantic's error names it
                return _UNSET
    if not isinstance(data, dict):
        return _UNSET
    values: dict[str, Any] = {}
    for name, field in cls.model_fields.items():
        sub = (*path, name)
        if not any(loc[:len(sub)] == sub for loc in bad):
            if name not in data:
                values[name] = _UNSET if field.is_required() else field.get_default(call_default_factory=True)
                continue
            try:
                values[name] = _validated(cls, name, data[name])
            except Exception:  # accepted by pydantic in context only (should not happen): unknown here
                values[name] = _UNSET
            continue
        model = _section_model(field.annotation)
        ok = model is not None and isinstance(data.get(name), dict)  # a section: its valid keys stay readable
        values[name] = _view(model, data[name], sub, bad, out) if ok else _UNSET
    view = _view_class(cls)(cls, values, {k for k in data if k in cls.model_fields})
    for d in cls.__pydantic_decorators__.model_validators.values():
        if d.info.mode != "after":
            continue
        try:
            d.func(view)
        except _Unknown:
            continue
        except ValidationError as exc:  # several refusals of one check (errors.refuse): one error each
            out.extend({"type": "value_error", "loc": path, "msg": e["msg"]} for e in exc.errors())
        except ValueError as exc:
            out.append({"type": "value_error", "loc": path, "msg": f"Value error, {exc}"})
        except Exception:  # a check that assumed an earlier one passed: it runs again once the file is fixed
            continue
    return view


def cross_setting_errors(model: type[BaseModel], data: dict, bad: set[tuple]) -> list[dict]:
    """The refusals of every after-validator of ``model`` and its sections whose inputs are valid.

    Args:
        model: The scenario model (``ScenarioConfig``).
        data: The scenario mapping after ``model``'s before-validators.
        bad: Key paths (tuples of keys and list indices, as ``loader.errors_by_key`` gives them) whose values
            are invalid or unknown; a validator reading one of them, or a value below one, is skipped.

    Returns:
        pydantic-style error dicts (``type`` value_error, ``loc``, ``msg``), in validator order, for
        ``loader.format_validation_error``.
    """
    out: list[dict] = []
    _view(model, data, (), bad, out, before=False)
    return out
