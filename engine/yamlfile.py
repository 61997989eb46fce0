"""Reading a YAML config file into a mapping, every failure one message with file, line and column.

Only YAML's plain types are constructed (``yaml.safe_load``): a tag such as ``!!python/object`` is refused,
never executed. Used by engine/config.py, which turns :class:`YamlFileError` into its ConfigError.
"""

from __future__ import annotations

from pathlib import Path

import yaml


class YamlFileError(ValueError):
    """A config file that is not a readable YAML mapping (the message names the file, and the line when known)."""


def read_yaml(path: Path) -> dict:
    """The top-level mapping of a YAML config file; YamlFileError (file, line, column) for everything else: a missing
    or non-UTF-8 file, a syntax error (tabs included), a tag other than YAML's plain types (``!!python/object``
    and the like are refused, never constructed), an empty file, a top level that is not a mapping."""
    if not path.is_file():
        raise YamlFileError(f"--config: no such file {str(path)!r}")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise YamlFileError(
            f"{path}:{line}: not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start})"
        ) from None
    try:
        loaded = yaml.safe_load(text)
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
    if isinstance(exc, yaml.constructor.ConstructorError):
        return f"{where}: YAML tag refused ({problem}); configs hold plain values only"
    ctx = getattr(exc, "context", None)
    hint = " (YAML indentation must use spaces, not tabs)" if "\\t" in problem or "tab" in problem else ""
    return f"{where}: YAML syntax error: {f'{ctx}; ' if ctx else ''}{problem}{hint}"
