"""The strict generic loader of config dataclasses: plain mappings in (:func:`from_dict`, unknown keys refused,
values checked by ``alignopsd.config_values``), plain mappings out (:func:`to_dict`), and dotted ``a.b=c``
overrides (:func:`override_mapping`, :func:`apply_overrides`; values parsed as bounded YAML, never executed).

Generic over the dataclasses it builds: a class may declare ``_check_derived(data, path)`` (called before it is
built), ``_DERIVED`` (dotted fields :func:`to_dict` leaves out) and ``_registered_sections()`` (keys beyond its
fields, each a section dataclass registered at run time: built here and passed to its constructor by key, which
keeps them in the instance's ``registered`` mapping, written back by :func:`to_dict` as keys of their own; the
``registered`` field itself is no key), as ``alignopsd.config.AlgorithmConfig`` does.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import typing
from typing import Any

import yaml

from alignopsd.config_values import coerce_value
from alignopsd.config_yaml import MAX_DEPTH, MAX_VALUE_BYTES, YamlLimitError, check_size, load_yaml, yaml_error_line

__all__ = ["apply_overrides", "from_dict", "override_mapping", "to_dict"]


def from_dict(cls: type, data: dict, path: str = "") -> Any:
    """Build dataclass ``cls`` (and nested sections) from a plain mapping, strictly.

    Unknown keys raise ValueError with the dotted key and the allowed keys; values are type-checked
    and converted (int → float where a float is expected; Literal fields list their allowed values);
    the dataclasses' own ``__post_init__`` validation runs, with errors prefixed by ``path``.
    """
    if not dataclasses.is_dataclass(cls) or not isinstance(cls, type):
        raise ValueError(f"cls: expected a dataclass type, got {cls!r}")
    if not isinstance(data, dict):
        raise ValueError(f"{path or cls.__name__}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    registered = getattr(cls, "_registered_sections", None)
    names = [f.name for f in dataclasses.fields(cls) if f.init and not (registered and f.name == "registered")]
    where = f"{path}." if path else ""
    sections = {k: v for k, v in (registered() if registered is not None else {}).items() if k not in names}
    for k in data:
        if k not in names and k not in sections:
            raise ValueError(f"{where}{k}: unknown key; allowed keys here: {', '.join([*names, *sections])}")
    check = getattr(cls, "_check_derived", None)
    if check is not None:
        check(data, path)
    kwargs = {
        k: coerce_value(f"{where}{k}", sections[k] if k in sections else hints[k], v, from_dict)
        for k, v in data.items()
    }
    try:
        return cls(**kwargs)
    except ValueError as exc:
        msg = str(exc)
        raise ValueError(f"{where}{msg}" if path and not msg.startswith(path) else msg) from exc


def to_dict(obj: Any) -> Any:
    """Plain mapping of a config (enums → values, tuples → lists); derived fields are left out."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        sections = getattr(type(obj), "_registered_sections", None) is not None
        fields = [f.name for f in dataclasses.fields(obj) if f.init and not (sections and f.name == "registered")]
        out = {name: to_dict(getattr(obj, name)) for name in fields}
        if sections:
            out.update({k: to_dict(v) for k, v in obj.registered.items()})
        for dotted in getattr(type(obj), "_DERIVED", {}):
            parts = dotted.split(".")
            node = out
            for p in parts[:-1]:
                node = node.get(p, {})
            if isinstance(node, dict):
                node.pop(parts[-1], None)
        return out
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _short(text: str, n: int = 60) -> str:
    return text if len(text) <= n else f"{text[: n - 3]}..."


def _parse_value(raw: str, max_depth: int) -> Any:
    """An override's value: bounded YAML (alignopsd.config_yaml), at most ``max_depth`` levels of nesting."""
    if not raw.strip():
        return ""
    try:
        return load_yaml(raw, max_depth=max_depth)
    except yaml.YAMLError as exc:
        raise ValueError(f"cannot parse value {_short(raw)!r} ({yaml_error_line(exc)})") from None


def override_mapping(data: dict, overrides: list[str], *, what: str = "overrides") -> dict:
    """A copy of the raw mapping ``data`` with dotted ``key=value`` overrides applied (missing sections are made).

    Values are parsed as YAML scalars/flow collections (safe loader, nothing is executed) within the bounds of
    alignopsd.config_yaml: an item of at most MAX_VALUE_BYTES, a key of at most MAX_DEPTH parts, a value of at
    most MAX_NODES values nested no deeper than MAX_DEPTH levels counted from the top of the mapping (so a key of
    n parts leaves MAX_DEPTH - n levels to its value). ValueError names the key (``what``: how
    the caller calls its overrides in messages, e.g. ``--set``). The one parser of overrides:
    :func:`apply_overrides` and the engine's config loading both use it."""
    out = copy.deepcopy(data)
    for item in overrides or []:
        if not isinstance(item, str) or "=" not in item:
            raise ValueError(f"{what}: expected 'key=value', got {_short(str(item))!r}")
        key, raw = item.split("=", 1)
        key = key.strip()
        try:
            check_size(len(item.encode("utf-8", "surrogatepass")), MAX_VALUE_BYTES, f"{what} item")
        except YamlLimitError as exc:
            raise ValueError(f"{_short(key)}: {exc.problem}") from None
        parts = key.split(".")
        if not key or any(not p for p in parts):
            raise ValueError(f"{what}: empty key in {_short(item)!r}")
        if len(parts) > MAX_DEPTH:
            raise ValueError(f"{_short(key)}: a key of {len(parts)} parts, over the limit of {MAX_DEPTH} levels")
        try:
            value = _parse_value(raw, MAX_DEPTH - len(parts))
        except ValueError as exc:
            raise ValueError(f"{_short(key)}: {exc}") from None
        node = out
        for i, p in enumerate(parts[:-1]):
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ValueError(f"{'.'.join(parts[: i + 1])}: is a value, not a section (in {what} {_short(item)!r})")
            node = nxt
        node[parts[-1]] = value
    return out


def apply_overrides(obj: Any, overrides: list[str]) -> Any:
    """Return a new config with dotted ``key=value`` overrides applied (``rectify.gamma=0.8``).

    Values are parsed as YAML scalars/flow collections (safe loader, nothing is executed); the result
    goes through :func:`from_dict`, so unknown keys and bad values raise ValueError naming the key.
    """
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise ValueError(f"obj: expected a dataclass instance, got {type(obj).__name__}")
    return from_dict(type(obj), override_mapping(to_dict(obj), overrides))
