"""Dotted ``--set key=value`` overrides of a raw config mapping, and the error every config check raises."""

from __future__ import annotations

from alignopsd.config import override_mapping


class ConfigError(ValueError):
    """A configuration key or value is invalid (the message names the dotted key)."""


def deep_merge(base: dict, over: dict) -> dict:
    """``base`` with ``over`` merged in, section by section (new mapping; ``over`` wins on values)."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply dotted ``key=value`` overrides to a raw config mapping (returns a new mapping): the algorithm core's
    parser (``alignopsd.config.override_mapping``), its errors as ConfigError."""
    try:
        return override_mapping(data, list(overrides or []), what="--set")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
