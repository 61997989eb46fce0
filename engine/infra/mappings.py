"""Plain nested mappings (a run config as data, a checkpoint's saved config) as flat ones."""

from __future__ import annotations

from typing import Any


def flatten_config(data: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config mapping as ``{dotted key: value}`` (``{"trainer": {"seed": 1}}`` -> ``{"trainer.seed":
    1}``); an empty mapping is a value of its own, so a section emptied by a change still shows as a key."""
    if isinstance(data, dict) and data:
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(flatten_config(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: data}
