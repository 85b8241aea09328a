"""Frames built on first use: a run's counters frame, which its summary does not read, is built only when asked for.

``Deferred(build)`` holds a builder; a dataclass field declared ``= DeferredField()`` accepts either a value or a
``Deferred`` and, read, gives the value (building it once, then kept in the field's place). A sweep that keeps only
the summaries never builds the frames it does not read; whoever reads the field gets the frame the eager build gave.
"""

from __future__ import annotations

from typing import Any, Callable

_UNSET = object()


class Deferred:
    """A value built on first use.

    Args:
        build: Called once, with no argument, by the first ``value()``; what it returns is kept (the builder and
            what it holds are then dropped).
    """

    __slots__ = ("_build", "_value")

    def __init__(self, build: Callable[[], Any]):
        self._build = build
        self._value = _UNSET

    def value(self) -> Any:
        """The built value (built now on the first call)."""
        if self._value is _UNSET:
            self._value, self._build = self._build(), None
        return self._value


class DeferredField:
    """A dataclass field (``name: T = DeferredField()`` or ``DeferredField(default)``) whose value may be given as a
    ``Deferred``: reading it gives ``Deferred.value()``, then that value stays in the field. Works on frozen
    dataclasses (their ``__init__`` sets fields through ``object.__setattr__``, which calls ``__set__``); a frozen
    instance still refuses assignment. ``raw(obj, name)`` reads the field without building it.

    Args:
        default: The field's default (none when not given).
    """

    def __init__(self, default: Any = _UNSET):
        self._default = default
        self._slot = ""

    def __set_name__(self, owner, name: str) -> None:
        self._slot = f"_deferred_{name}"

    def __get__(self, obj, owner=None):
        if obj is None:  # the dataclass's default (AttributeError: none)
            if self._default is _UNSET:
                raise AttributeError(self._slot)
            return self._default
        v = obj.__dict__[self._slot]
        if isinstance(v, Deferred):
            v = obj.__dict__[self._slot] = v.value()
        return v

    def __set__(self, obj, value) -> None:
        if self._slot in obj.__dict__ and getattr(type(obj), "__dataclass_params__").frozen:
            raise AttributeError(f"cannot assign to field {self._slot[len('_deferred_'):]!r}")
        obj.__dict__[self._slot] = value

    @staticmethod
    def raw(obj, name: str) -> Any:
        """Field ``name`` of ``obj`` as stored: the value, or the ``Deferred`` that builds it (nothing is built)."""
        return obj.__dict__[f"_deferred_{name}"]


def build_fields(obj) -> None:
    """Build every ``DeferredField`` of ``obj`` not built yet (before pickling: a builder is a closure)."""
    for name, attr in vars(type(obj)).items():
        if isinstance(attr, DeferredField):
            getattr(obj, name)
