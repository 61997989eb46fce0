"""Dotted ``--set key=value`` overrides of a raw config mapping, and the error every config check raises."""

from __future__ import annotations

from typing import Any

import yaml


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


def parse_override(item: str) -> tuple[list[str], Any]:
    """'a.b.c=value' -> (['a', 'b', 'c'], YAML-parsed value)."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"{key}: cannot parse value {raw!r} ({exc})") from exc
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply dotted ``key=value`` overrides to a raw config mapping (returns a new mapping)."""
    out = deep_merge({}, data)
    for item in overrides or []:
        keys, value = parse_override(item)
        node = out
        for i, k in enumerate(keys[:-1]):
            nxt = node.get(k)
            if nxt is None:
                nxt = node[k] = {}
            elif not isinstance(nxt, dict):
                raise ConfigError(f"{'.'.join(keys[: i + 1])}: is a value, not a section (in --set {item!r})")
            node = nxt
        node[keys[-1]] = value
    return out
