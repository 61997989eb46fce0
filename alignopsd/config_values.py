"""Value rules shared by the configuration loaders: the algorithm config (``alignopsd.config``) and the
engine's run config build their dataclasses through :func:`coerce_value`, and validate scalar fields with
the ``*_field`` checks. Every error is a ValueError naming the field (its dotted path when loading).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

from alignopsd._checks import check_real

__all__ = ["SectionBuilder", "bool_field", "choice_field", "coerce_value", "int_field", "real_field", "type_name"]

SectionBuilder = Callable[[type, dict, str], Any]
"""``builder(cls, data, path)``: builds a nested dataclass section from a plain mapping."""


def real_field(name: str, v: Any, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> float:
    """A finite real number (not bool) in [lo, hi] (or (lo, hi] with ``lo_open``)."""
    x = check_real(v, name, hi=hi)
    if lo is not None and (x < lo or (lo_open and x == lo)):
        raise ValueError(f"{name}: must be {'>' if lo_open else '>='} {lo}, got {x}")
    return x


def int_field(name: str, v: Any, *, lo: int | None = None) -> int:
    """An integer (not bool), optionally >= lo."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name}: expected an integer, got {type(v).__name__} {v!r}")
    if lo is not None and v < lo:
        raise ValueError(f"{name}: must be >= {lo}, got {v}")
    return v


def bool_field(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"{name}: expected true or false, got {v!r}")
    return v


def choice_field(name: str, v: Any, allowed: tuple[str, ...]) -> str:
    if v not in allowed:
        raise ValueError(f"{name}: unknown value {v!r}; allowed: {', '.join(map(repr, allowed))}")
    return v


def type_name(tp: Any) -> str:
    """Readable name of an annotation, for error messages."""
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce_float(path: str, value: Any) -> float:
    if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{path}: expected a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{path}: expected a number, got {value!r}")
    x = float(value)
    if not math.isfinite(x):  # YAML's .nan / .inf, or the strings "nan" / "inf"
        raise ValueError(f"{path}: expected a finite number, got {value!r}")
    return x


def _coerce_union(path: str, args: tuple, value: Any, section: SectionBuilder) -> Any:
    if value is None:
        if type(None) in args:
            return None
        raise ValueError(f"{path}: must not be null")
    for a in args:
        if a is type(None):
            continue
        try:
            return coerce_value(path, a, value, section)
        except ValueError:
            continue
    raise ValueError(f"{path}: expected {' or '.join(type_name(a) for a in args)}, got {value!r}")


def _coerce_sequence(path: str, tp: Any, value: Any, section: SectionBuilder) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{path}: expected a list, got {value!r}")
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return tuple(coerce_value(f"{path}[{i}]", args[0], v, section) for i, v in enumerate(value))
    if origin is tuple and args:
        if len(args) != len(value):
            raise ValueError(f"{path}: expected {len(args)} entries, got {len(value)}")
        return tuple(coerce_value(f"{path}[{i}]", a, v, section) for i, (a, v) in enumerate(zip(args, value)))
    inner = args[0] if args else Any
    out = [coerce_value(f"{path}[{i}]", inner, v, section) for i, v in enumerate(value)]
    return tuple(out) if (origin is tuple or tp is tuple) else out


def _coerce_enum(path: str, tp: type[enum.Enum], value: Any) -> Any:
    if isinstance(value, tp):
        return value
    try:
        return tp(value)
    except ValueError:
        raise ValueError(f"{path}: unknown value {value!r}; allowed: {', '.join(repr(m.value) for m in tp)}") from None


def _coerce_scalar(path: str, tp: Any, value: Any) -> Any:
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        return _coerce_float(path, value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{path}: expected a string, got {value!r}")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ValueError(f"{path}: expected {tp.__name__}, got {value!r}")
    return value


def coerce_value(path: str, tp: Any, value: Any, section: SectionBuilder) -> Any:
    """Check ``value`` against the annotation ``tp``; ValueError names ``path``.

    Converts int to float and numeric strings to float where a float is expected (a non-finite float,
    NaN or ±inf, also given as a string, is an error), lists to tuples where a tuple is expected;
    Literal and Enum fields list their allowed values. ``section(cls, data, path)`` builds nested
    dataclass sections, so each loader keeps its own section rules while sharing these value rules.
    """
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        if value not in args or isinstance(value, bool) != any(isinstance(a, bool) for a in args if a == value):
            raise ValueError(f"{path}: unknown value {value!r}; allowed: {', '.join(map(repr, args))}")
        return value
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(path, args, value, section)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{path}: expected a mapping for section {tp.__name__}, got {value!r}")
        return section(tp, value, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _coerce_enum(path, tp, value)
    if origin in (list, tuple) or tp in (list, tuple):
        return _coerce_sequence(path, tp, value, section)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{path}: expected a mapping, got {value!r}")
        vt = args[1] if len(args) == 2 else Any
        return {k: coerce_value(f"{path}.{k}", vt, v, section) for k, v in value.items()}
    return _coerce_scalar(path, tp, value)
