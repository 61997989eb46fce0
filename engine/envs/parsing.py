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

Nothing here raises on any string input; non-strings raise ValueError.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ACTION_TAGS: tuple[str, ...] = ("action", "search", "answer")

_THINK_RE = re.compile(r"<think\b[^>]*>(.*?)</think\s*>", re.IGNORECASE | re.DOTALL)
_TAG_RE = {tag: re.compile(rf"<{tag}>(.*?)</{tag}>", re.DOTALL) for tag in ACTION_TAGS}
_TAG_RE_CI = {tag: re.compile(rf"<{tag}\s*>(.*?)</{tag}\s*>", re.IGNORECASE | re.DOTALL) for tag in ACTION_TAGS}
_OPEN_RE = {tag: re.compile(rf"<{tag}\s*>", re.IGNORECASE) for tag in ACTION_TAGS}
_CLOSE_RE = {tag: re.compile(rf"</{tag}\s*>", re.IGNORECASE) for tag in ACTION_TAGS}
# CJK Unified Ideographs (+ extension A) and CJK punctuation / full-width forms.
_CJK_RE = re.compile(r"[\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uff00-\uffef]")


def _require_str(text: object, name: str) -> str:
    if not isinstance(text, str):
        raise ValueError(f"{name}: expected str, got {type(text).__name__}")
    return text


def parse_thinking(text: str) -> tuple[str, bool]:
    """Inner text of the first ``<think …>…</think>`` block, stripped; valid when non-empty (§1.5)."""
    _require_str(text, "text")
    m = _THINK_RE.search(text)
    if m is None:
        return "", False
    inner = m.group(1).strip()
    return inner, bool(inner)


def parse_action(text: str, tags: tuple[str, ...] = ACTION_TAGS) -> tuple[str, bool, str | None]:
    """Action of §1.5: first matching tag *type* in ``tags`` order, first occurrence, stripped.

    Returns ``(action, valid, tag)``; ``tag`` is the tag type that matched (None when none did).
    Tags are matched exactly as written (lower-case), as in the reference parser.
    """
    _require_str(text, "text")
    for tag in tags:
        if tag not in _TAG_RE:
            raise ValueError(f"tags: unknown action tag {tag!r}; known: {ACTION_TAGS}")
        m = _TAG_RE[tag].search(text)
        if m is not None:
            inner = m.group(1).strip()
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
        if tag not in _TAG_RE:
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
        m = _TAG_RE_CI[tag].search(text)
        if m is not None:
            inner = m.group(1)
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
            m = _TAG_RE_CI[t].search(text)
            if m is not None:
                action, action_valid, tag = m.group(1).strip(), True, t
                break
    return ParsedResponse(thinking, thinking_valid, action, action_valid, tag, ok, reason)


def contains_cjk(text: str) -> bool:
    """True when ``text`` has CJK ideographs or full-width punctuation."""
    return bool(_CJK_RE.search(_require_str(text, "text")))
