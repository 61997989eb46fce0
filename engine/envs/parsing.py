"""Response parsing (ALGORITHM.md §1.5) and the stricter validity the environment manager uses.

Two layers:

* :func:`parse_thinking`, :func:`parse_action`, :func:`parse_response` are the permissive
  extraction rules of §1.5, applied to student and teacher text alike (M1 embeds what they return):
  thinking is the inner text of the first ``<think …>…</think>`` (case-insensitive, across
  newlines), stripped, valid when non-empty; the action comes from the first tag *type* that matches
  at all, in the fixed order ``<action>``, ``<search>``, ``<answer>``, taking the first occurrence of
  that type, stripped, valid when non-empty.
* :func:`check_response` is the manager's projection (verl-agent style, made stricter): the response
  must contain a closed thinking block and exactly one action block of an allowed tag type, with no
  nested or stray action tags and no CJK characters. Admissibility against the environment's command
  list is checked by the manager on top of this.

Nothing here raises on any string input; non-strings raise ValueError. Every function is linear in the
length of the text: a block is found as its head, then the earliest closer after the head, never by one
regex with ``.*?`` between a repeated opener and a missing closer (quadratic: 32k characters of unclosed
``<think>`` took 1.2 s). The results are those of the regular expressions
``<think\\b[^>]*>(.*?)</think\\s*>`` (case-insensitive), ``<t>(.*?)</t>`` (§1.5 actions) and
``<t\\s*>(.*?)</t\\s*>`` (case-insensitive, strict check); the tests compare them on generated strings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ACTION_TAGS: tuple[str, ...] = ("action", "search", "answer")

# Tag heads and closers. None of these has ``.*?``, so a search is linear: an attempt fails at the first
# character that does not fit, and the white-space runs tried after different heads are disjoint.
_THINK_HEAD_RE = re.compile(r"<think\b", re.IGNORECASE)
_THINK_CLOSE_RE = re.compile(r"</think\s*>", re.IGNORECASE)
_OPEN_RE = {tag: re.compile(rf"<{tag}\s*>", re.IGNORECASE) for tag in ACTION_TAGS}
_CLOSE_RE = {tag: re.compile(rf"</{tag}\s*>", re.IGNORECASE) for tag in ACTION_TAGS}
# CJK Unified Ideographs (+ extension A) and CJK punctuation / full-width forms.
_CJK_RE = re.compile(r"[\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uff00-\uffef]")


def _require_str(text: object, name: str) -> str:
    if not isinstance(text, str):
        raise ValueError(f"{name}: expected str, got {type(text).__name__}")
    return text


def _think_span(text: str) -> tuple[int, int] | None:
    """Inner span of the first ``<think\\b[^>]*>…</think\\s*>`` (case-insensitive), as that regex finds it.

    Only the leftmost head can match: a later head ends at the same or a later ``>``, so it sees no
    closer the first one does not see; the closer is the earliest one after the head.
    """
    head = _THINK_HEAD_RE.search(text)
    if head is None:
        return None
    gt = text.find(">", head.end())
    if gt < 0:
        return None
    close = _THINK_CLOSE_RE.search(text, gt + 1)
    return None if close is None else (gt + 1, close.start())


def _block_ci(text: str, tag: str) -> tuple[int, int] | None:
    """Inner span of the first ``<tag\\s*>…</tag\\s*>`` (case-insensitive), as the lazy regex finds it
    (the same argument as for the thinking block: only the leftmost opener can match)."""
    head = _OPEN_RE[tag].search(text)
    if head is None:
        return None
    close = _CLOSE_RE[tag].search(text, head.end())
    return None if close is None else (head.end(), close.start())


def parse_thinking(text: str) -> tuple[str, bool]:
    """Inner text of the first ``<think …>…</think>`` block, stripped; valid when non-empty (§1.5)."""
    _require_str(text, "text")
    span = _think_span(text)
    if span is None:
        return "", False
    inner = text[span[0] : span[1]].strip()
    return inner, bool(inner)


def parse_action(text: str, tags: tuple[str, ...] = ACTION_TAGS) -> tuple[str, bool, str | None]:
    """Action of §1.5: first matching tag *type* in ``tags`` order, first occurrence, stripped.

    Returns ``(action, valid, tag)``; ``tag`` is the tag type that matched (None when none did).
    Tags are matched exactly as written (lower-case), as in the reference parser.
    """
    _require_str(text, "text")
    for tag in tags:
        if tag not in ACTION_TAGS:
            raise ValueError(f"tags: unknown action tag {tag!r}; known: {ACTION_TAGS}")
        opener = f"<{tag}>"
        i = text.find(opener)
        j = text.find(f"</{tag}>", i + len(opener)) if i >= 0 else -1
        if j >= 0:
            inner = text[i + len(opener) : j].strip()
            return inner, bool(inner), tag
    return "", False, None


@dataclass(frozen=True)
class ParsedResponse:
    """Result of :func:`parse_response` (§1.5 fields) plus the manager's strict verdict."""

    thinking: str
    thinking_valid: bool
    action: str
    action_valid: bool
    tag: str | None  # tag type the §1.5 action came from
    well_formed: bool  # strict check passed (see check_response)
    reason: str  # "" when well formed, otherwise why not


def check_response(text: str, tags: tuple[str, ...] = ("action",), require_think: bool = True) -> tuple[bool, str]:
    """The manager's strict form check. Returns ``(ok, reason)``.

    Rules: exactly one ``<t>…</t>`` block over all allowed tag types ``tags`` (case-insensitive tag
    names, so ``<ACTION>`` counts as a block and two blocks are caught), balanced open/close tags for
    every known action tag, no action tag outside ``tags``, a non-empty inner text, a closed non-empty
    ``<think>`` block when ``require_think``, and no CJK characters anywhere in the response.
    """
    _require_str(text, "text")
    for tag in tags:
        if tag not in ACTION_TAGS:
            raise ValueError(f"tags: unknown action tag {tag!r}; known: {ACTION_TAGS}")
    if _CJK_RE.search(text):
        return False, "cjk"
    if require_think and not parse_thinking(text)[1]:
        return False, "no_think"
    blocks = 0
    for tag in ACTION_TAGS:
        n_open = len(_OPEN_RE[tag].findall(text))
        n_close = len(_CLOSE_RE[tag].findall(text))
        if n_open != n_close:
            return False, f"unbalanced_{tag}"
        if n_open and tag not in tags:
            return False, f"tag_{tag}_not_allowed"
        blocks += n_open
    if blocks == 0:
        return False, "no_action"
    if blocks > 1:
        return False, "multiple_actions"
    for tag in tags:
        span = _block_ci(text, tag)
        if span is not None:
            inner = text[span[0] : span[1]]
            if any(_OPEN_RE[t].search(inner) or _CLOSE_RE[t].search(inner) for t in ACTION_TAGS):
                return False, "nested"
            if not inner.strip():
                return False, "empty_action"
            return True, ""
    return False, "no_action"  # pragma: no cover - unreachable when the counts above agree


def parse_response(text: str, tags: tuple[str, ...] = ACTION_TAGS, require_think: bool = True) -> ParsedResponse:
    """Both layers at once: §1.5 extraction with ``tags`` order plus the strict verdict for ``tags``."""
    thinking, thinking_valid = parse_thinking(text)
    action, action_valid, tag = parse_action(text, tags)
    ok, reason = check_response(text, tags, require_think=require_think)
    if ok and tag is None:
        # The single block used upper-case tag names, which §1.5 extraction does not see; take it here.
        for t in tags:
            span = _block_ci(text, t)
            if span is not None:
                action, action_valid, tag = text[span[0] : span[1]].strip(), True, t
                break
    return ParsedResponse(thinking, thinking_valid, action, action_valid, tag, ok, reason)
