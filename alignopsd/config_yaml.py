"""The one YAML loader of configuration text (config files and ``--set`` values), bounded before it builds anything.

Only YAML's plain types are constructed (a subclass of ``yaml.SafeLoader``: a tag such as ``!!python/object`` is
refused, never executed). On top of that, every document is bounded while it is composed, before any Python value
exists, so hostile text ends in one error within a second or two rather than exhausting time, memory or the stack:

* :data:`MAX_FILE_BYTES` (256 KiB) per config file and :data:`MAX_VALUE_BYTES` (64 KiB) per ``--set`` item: the
  largest shipped config is under 3 KB. The caller checks the size before it reads or parses (:func:`check_size`).
* :data:`MAX_DEPTH` (64) levels of nested lists and mappings, a document's top-level mapping being level 1;
  an alias counts at its expanded depth (``[*a]`` is one level deeper than ``a``).
* :data:`MAX_NODES` (20,000) values per document, an alias counted at its expanded size: a "billion laughs"
  (anchors of ten aliases of the previous anchor) is refused at its fifth level instead of growing to 10^9.
  The count is checked as the parser goes, so no more than 20,000 nodes are ever parsed (about a second
  with PyYAML's pure-Python parser).
* an alias inside the collection it names (``&a [*a]``, a value containing itself) is refused.

Errors are :class:`YamlLimitError`, a ``yaml.MarkedYAMLError`` whose mark is where the limit was crossed.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.events import AliasEvent, MappingStartEvent, SequenceStartEvent

__all__ = [
    "MAX_DEPTH",
    "MAX_FILE_BYTES",
    "MAX_NODES",
    "MAX_VALUE_BYTES",
    "BoundedSafeLoader",
    "YamlLimitError",
    "check_size",
    "load_yaml",
    "yaml_error_line",
]

MAX_FILE_BYTES = 256 * 1024
"""Largest config file read (bytes)."""
MAX_VALUE_BYTES = 64 * 1024
"""Largest ``--set key=value`` item (bytes of its UTF-8 text)."""
MAX_DEPTH = 64
"""Deepest nesting of lists and mappings in one document (aliases at their expanded depth)."""
MAX_NODES = 20_000
"""Most values (scalars, lists, mappings) in one document, aliases counted at their expanded size."""


class YamlLimitError(yaml.MarkedYAMLError):
    """A document over one of this module's bounds (size, nesting, expanded values, a self-containing alias)."""


def check_size(nbytes: int, limit: int, what: str) -> None:
    """YamlLimitError (no mark) when ``nbytes`` exceeds ``limit``; ``what`` names the text (``--set item``)."""
    if nbytes > limit:
        raise YamlLimitError(problem=f"{what} is {nbytes} bytes, over the limit of {limit} bytes ({limit // 1024} KiB)")


class BoundedSafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` whose composer refuses documents past ``max_depth`` / ``max_nodes`` (see the module
    docstring) as it composes them, so the constructor only ever sees a bounded, acyclic node graph."""

    def __init__(self, stream: str, *, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES) -> None:
        super().__init__(stream)
        self.max_depth = max_depth
        self.max_nodes = max_nodes
        self._open = 0  # collections being composed around the current node
        self._total = 0  # values of the document so far, aliases at their expanded size
        self._measured: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded size, expanded depth), once complete

    def compose_document(self) -> Any:
        self._open, self._total, self._measured = 0, 0, {}
        node = super().compose_document()
        self._measured = {}
        return node

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, AliasEvent):
            node = super().compose_node(parent, index)
            if id(node) not in self._measured:
                raise YamlLimitError(
                    problem=f"alias *{event.anchor} is inside the value it names (a value containing itself)",
                    problem_mark=event.start_mark,
                )
            size, depth = self._measured[id(node)]
            self._count(size, self._open + depth, event.start_mark)
            return node
        collection = isinstance(event, (SequenceStartEvent, MappingStartEvent))
        self._count(1, self._open + collection, event.start_mark)
        self._open += collection
        node = super().compose_node(parent, index)
        self._open -= collection
        self._measured[id(node)] = self._measure(node, collection)
        return node

    def _measure(self, node: Any, collection: bool) -> tuple[int, int]:
        if not collection:
            return 1, 0
        children = [c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode) else node.value
        sizes = [self._measured[id(c)] for c in children]
        return 1 + sum(s for s, _ in sizes), 1 + max((d for _, d in sizes), default=0)

    def _count(self, size: int, depth: int, mark: Any) -> None:
        self._total += size
        if depth > self.max_depth:
            raise YamlLimitError(
                problem=f"lists and mappings nested deeper than the limit of {self.max_depth} levels",
                problem_mark=mark,
            )
        if self._total > self.max_nodes:
            raise YamlLimitError(
                problem=f"more than the limit of {self.max_nodes} values (an alias counts as the values it repeats)",
                problem_mark=mark,
            )


def load_yaml(text: str, *, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES) -> Any:
    """The one document of ``text`` as plain Python values, within the bounds; ``yaml.YAMLError`` otherwise
    (:class:`YamlLimitError` for a bound, the parser's own errors for bad syntax and refused tags)."""
    loader = BoundedSafeLoader(text, max_depth=max_depth, max_nodes=max_nodes)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def yaml_error_line(exc: yaml.YAMLError) -> str:
    """One line for a YAML error: ``line L, column C: context; problem`` (a ``--set`` value's error, where the
    multi-line rendering of PyYAML would break the one-message rule)."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    ctx = getattr(exc, "context", None)
    return f"{where}{f'{ctx}; ' if ctx else ''}{problem}"
