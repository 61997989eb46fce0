"""The error of every config check, and the one-line message a pydantic validation error becomes.

A config error is one line that starts with the dotted key it is about (``trainer.optimizer.lr: must be > 0, got
-1.0``): the CLI prints it and exits with code 2. The schema's models raise pydantic's ``ValidationError``;
:func:`describe` turns its first error into that line, and :func:`rule` is how a validator that checks several fields
names the one it blames.
"""

from __future__ import annotations

from typing import Any

from alignopsd.engine.infra.errors import README_HINT, ConfigError
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

__all__ = ["RULE", "README_HINT", "ConfigError", "describe", "rule"]

RULE = "config_rule"
"""The pydantic error type of :func:`rule`."""


def rule(key: str, reason: str) -> PydanticCustomError:
    """The error a validator raises for a rule over several fields: ``key`` (dotted, relative to the model the
    validator belongs to) is the field to blame, ``reason`` says what is wrong."""
    return PydanticCustomError(RULE, "{key}: {reason}", {"key": key, "reason": reason})


def _dotted(loc: list[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _field_names(model: type[BaseModel], loc: list[Any]) -> list[str]:
    """The keys allowed in the section ``loc`` of ``model`` (the root's when ``loc`` leaves the models)."""
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        sub = getattr(field, "annotation", None)
        if not (isinstance(sub, type) and issubclass(sub, BaseModel)):
            break
        model = sub
    return list(model.model_fields)


BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
EXPECTED = {
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "model_type": "a mapping",
    "dict_type": "a mapping",
    "tuple_type": "a list",
    "list_type": "a list",
}


def _reason(err: dict[str, Any], model: type[BaseModel], loc: list[Any]) -> str:
    kind, ctx, got = err["type"], err.get("ctx") or {}, err.get("input")
    if kind == "extra_forbidden":
        return f"unknown key; allowed keys here: {', '.join(_field_names(model, loc[:-1]))}"
    if kind == "literal_error":
        return f"unknown value {got!r}; allowed: {ctx['expected'].replace(' or ', ', ')}"
    if kind in EXPECTED:
        return f"expected {EXPECTED[kind]}, got {got!r}"
    if kind == "finite_number":
        return f"expected a finite number, got {got!r}"
    if kind in BOUNDS:
        bound = next(iter(ctx.values()))
        return f"must be {BOUNDS[kind]} {bound}, got {got!r}"
    if kind == "string_too_short":
        return "must be a non-empty string"
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    return err["msg"].replace("Input should be", "must be")


def describe(exc: ValidationError, model: type[BaseModel], prefix: str = "") -> str:
    """One line for the first error of ``exc`` raised while building ``model``: its location as a dotted key
    (``prefix`` is the model's own key in a run config, empty for the root) and the reason."""
    err = exc.errors(include_url=False)[0]
    loc = list(err["loc"])
    where = [prefix, *loc] if prefix else loc
    if err["type"] == RULE:
        return f"{_dotted([*where, *err['ctx']['key'].split('.')])}: {err['ctx']['reason']}"
    reason = _reason(err, model, loc)
    key = _dotted(where)
    if not key or reason.startswith(f"{key}.") or reason.startswith(f"{key}:"):
        return reason  # a message that already names its key (the algorithm core's loader)
    return f"{key}: {reason}"
