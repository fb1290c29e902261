"""Type and range checks of config dataclass fields, from their annotations.

JSON-strict: a bool is not an int, an int is a float, a tuple field is homogeneous. Each check
reports through `fail(field, why)`, which raises the caller's error naming its option.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from typing import Any


class ConfigError(ValueError):
    """A configuration option has a value this engine does not support."""


_NAMES = {bool: "bool", int: "int", float: "float (or int)", str: "str", type(None): "null"}


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        return f"list of {_type_name(typing.get_args(hint)[0])}"
    return _NAMES.get(hint, getattr(hint, "__name__", str(hint)))


def _has_type(value: Any, hint: Any) -> bool:
    """isinstance against a field annotation, JSON-strict: bools are not ints, ints are floats."""
    if hint is Any:
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, a) for a in args)
    if origin is tuple:  # only homogeneous tuple[T, ...] fields exist
        return isinstance(value, tuple) and all(_has_type(v, args[0]) for v in value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, hint)


@functools.cache
def _field_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_field_types(obj: Any, fail: Callable[[str, str], None]) -> None:
    """Every field of the dataclass `obj` against its annotation; `fail(field, why)` raises."""
    hints = _field_hints(type(obj))
    for field in dataclasses.fields(obj):
        value, hint = getattr(obj, field.name), hints[field.name]
        if not _has_type(value, hint):
            fail(field.name, f"must be {_type_name(hint)}, got {value!r} ({type(value).__name__})")


def check_minimums(obj: Any, minimums: dict[str, int], fail: Callable[[str, str], None]) -> None:
    """Each named int field (or each entry of a tuple field) is None or at least its minimum."""
    for option, low in minimums.items():
        value = getattr(obj, option)
        if any(v is not None and v < low for v in (value if isinstance(value, tuple) else (value,))):
            fail(option, f"must be >= {low}, got {value!r}")
