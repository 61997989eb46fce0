"""Reading a YAML config file into a mapping, every failure one message with file, line and column.

Only YAML's plain types are constructed (the bounded safe loader of ``alignopsd.config_yaml``): a tag such as
``!!python/object`` is refused, never executed, and a file over that module's bounds (256 KiB, 64 levels of
nesting, 20,000 values with aliases expanded) is refused before it is read or while it is composed. Used by
engine/config/schema.py, which turns :class:`YamlFileError` into its ConfigError.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from alignopsd.config_yaml import MAX_FILE_BYTES, YamlLimitError, check_size, load_yaml


class YamlFileError(ValueError):
    """A config file that is not a readable YAML mapping (the message names the file, and the line when known)."""


def read_yaml(path: Path) -> dict:
    """The top-level mapping of a YAML config file; YamlFileError (file, line, column) for everything else: a missing
    or non-UTF-8 file, a syntax error (tabs included), a tag other than YAML's plain types (``!!python/object``
    and the like are refused, never constructed), a file over the bounds of alignopsd.config_yaml (its size is
    checked before it is read, at most MAX_FILE_BYTES + 1 bytes are ever read), an empty file, a top level that is
    not a mapping."""
    if not path.is_file():
        raise YamlFileError(f"--config: no such file {str(path)!r}")
    try:
        check_size(path.stat().st_size, MAX_FILE_BYTES, "the file")
        with path.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
        check_size(len(raw), MAX_FILE_BYTES, "the file")
    except YamlLimitError as exc:
        raise YamlFileError(f"{path}: {exc.problem}") from None
    except OSError as exc:
        raise YamlFileError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise YamlFileError(
            f"{path}:{line}: not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start})"
        ) from None
    try:
        loaded = load_yaml(text)
    except yaml.YAMLError as exc:
        raise YamlFileError(_yaml_message(path, exc)) from None
    if loaded is None:
        raise YamlFileError(f"{path}: the file is empty (no settings); write at least the keys the run needs")
    if not isinstance(loaded, dict):
        raise YamlFileError(f"{path}: top level must be a mapping, got {type(loaded).__name__}")
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
