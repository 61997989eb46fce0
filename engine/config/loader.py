"""The raw mapping of a run: a YAML file with dotted ``--set key=value`` overrides applied, every failure one
ConfigError naming the file (line, column) or the key.

Only YAML's plain types are constructed (the bounded safe loader of ``alignopsd.config_yaml``): a tag such as
``!!python/object`` is refused, never executed, and a file over that module's bounds (256 KiB, 64 levels of
nesting, 20,000 values with aliases expanded) is refused before it is read or while it is composed. Overrides are
parsed by the algorithm core's parser (``alignopsd.config.override_mapping``), so a value on the command line
goes through the same typed schema as the file (engine/config/schema.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from alignopsd.engine.config.errors import ConfigError
from alignopsd.engine.config.trainer_section import current_key, sectioned

from alignopsd.config import override_mapping
from alignopsd.config_yaml import MAX_FILE_BYTES, YamlLimitError, check_size, load_yaml


def read_yaml(path: Path) -> dict:
    """The top-level mapping of a YAML config file; ConfigError (file, line, column) for everything else: a missing
    or non-UTF-8 file, a syntax error (tabs included), a tag other than YAML's plain types (``!!python/object``
    and the like are refused, never constructed), a file over the bounds of alignopsd.config_yaml (its size is
    checked before it is read, at most MAX_FILE_BYTES + 1 bytes are ever read), an empty file, a top level that is
    not a mapping."""
    if not path.is_file():
        raise ConfigError(f"--config: no such file {str(path)!r}")
    try:
        check_size(path.stat().st_size, MAX_FILE_BYTES, "the file")
        with path.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
        check_size(len(raw), MAX_FILE_BYTES, "the file")
    except YamlLimitError as exc:
        raise ConfigError(f"{path}: {exc.problem}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start})") from None
    try:
        loaded = load_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(_yaml_message(path, exc)) from None
    if loaded is None:
        raise ConfigError(f"{path}: the file is empty (no settings); write at least the keys the run needs")
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(loaded).__name__}")
    return loaded


def _yaml_message(path: Path, exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(exc, "problem", None) or str(exc)
    if isinstance(exc, YamlLimitError):
        return f"{where}: {problem}"
    if isinstance(exc, yaml.constructor.ConstructorError):
        return f"{where}: YAML tag refused ({problem}); configs hold plain values only"
    ctx = getattr(exc, "context", None)
    hint = " (YAML indentation must use spaces, not tabs)" if "\\t" in problem or "tab" in problem else ""
    return f"{where}: YAML syntax error: {f'{ctx}; ' if ctx else ''}{problem}{hint}"


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
    parser (``alignopsd.config.override_mapping``), its errors as ConfigError. An earlier version's trainer key
    (``trainer.optimizer.lr=...``) sets its place now (engine/config/trainer_section.py ``current_key``)."""
    moved = []
    for item in overrides or []:
        key, sep, value = item.partition("=")
        moved.append(f"{current_key(key.strip())}{sep}{value}" if sep else item)
    try:
        return override_mapping(data, moved, what="--set")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def read_run_mapping(path: str | os.PathLike | None, overrides: list[str] | None = None) -> dict:
    """The raw mapping of a run: the file at ``path`` (none: every default), its ``name`` defaulting to the file's
    stem, its trainer keys of earlier versions moved to their sections and a relative ``env.skills_dir`` resolved
    against the file's folder, then the overrides."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        data = read_yaml(p)
        data.setdefault("name", p.stem)
        if "trainer" in data:  # before the overrides, which may set the same keys by either name
            try:
                data["trainer"] = sectioned(data["trainer"])
            except ValueError as exc:
                raise ConfigError(f"{p}: {exc}") from None
        section = data.get("env")
        skills = section.get("skills_dir") if isinstance(section, dict) else None
        if isinstance(skills, str) and not os.path.isabs(skills):
            section["skills_dir"] = str((p.resolve().parent / skills).resolve())  # relative to the file
    return apply_overrides(data, overrides or [])
