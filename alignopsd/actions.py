"""Mechanism 1's action-consistency filter (ALGORITHM.md §2.5): a selected (source, target) pair is kept only when
the teacher's action of the source agrees with the student's action of the target, by embedding similarity and, where
the environment has one, by a rule on the two action strings.

The rule is a pair rule (:data:`ActionRule`): ``rule(source_action, target_action) -> keep``. An environment supplies
its own (the engine's environment registry names it in the environment's row); the method itself defines one, the
WebShop search/click rule of §2.5 (:func:`webshop_actions_agree`, also ``action_filter(..., webshop=True)``). That
rule reads the action text as the method states it, case-sensitively (§7.18); the WebShop environment reads its actions
with the same grammar (:data:`WEBSHOP_ACTION_RE`), case-insensitively, to step its pages.

Legend: M = canonical turns, P = selected (source, target) pairs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from alignopsd._checks import as_tensor, check_ndim, check_shape, check_turn_vector
from alignopsd.selection import pairs_from_selection

__all__ = [
    "WEBSHOP_ACTION_RE",
    "ActionRule",
    "action_filter",
    "parse_webshop_action",
    "validate_action_threshold",
    "webshop_actions_agree",
]

ActionRule = Callable[[str | None, str | None], bool]
"""A pair rule of the filter: (teacher action of the source, student action of the target) -> keep the pair. Either
action may be None or whitespace only (an invalid action): the filter has already rejected such a pair."""

WEBSHOP_ACTION_RE = re.compile(r"\s*(search|click)\[(.*)\]\s*", re.DOTALL)
"""WebShop's action grammar: the whole action is ``search[...]`` or ``click[...]`` (no space before the bracket), with
optional spaces around it; group 1 is the verb, group 2 the argument. The method's rule matches it against the raw
text (case-sensitive); the WebShop environment matches it against the lower-cased text (engine/envs/webshop/env.py)."""


def validate_action_threshold(threshold) -> float:
    """The action-consistency threshold: a real number (not bool or str) in [-1, 1]."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise ValueError(f"threshold: expected a real number in [-1, 1], got {type(threshold).__name__} {threshold!r}")
    v = float(threshold)
    if not math.isfinite(v) or v < -1.0 or v > 1.0:
        raise ValueError(f"threshold: expected a finite number in [-1, 1], got {v}")
    return v


def parse_webshop_action(action: str | None) -> tuple[str, str] | None:
    """(verb, stripped argument) of a WebShop action ``search[...]`` / ``click[...]``, or None if it does not parse.

    Case-sensitive: only lower-case verbs parse. The stripped argument must be non-empty.
    """
    if not isinstance(action, str):
        return None
    m = WEBSHOP_ACTION_RE.fullmatch(action)
    if m is None:
        return None
    arg = m.group(2).strip()
    if not arg:
        return None
    return m.group(1), arg


def webshop_actions_agree(source_action: str | None, target_action: str | None) -> bool:
    """The WebShop rule of §2.5: both actions parse (:func:`parse_webshop_action`), their verbs are equal, and two
    clicks have exactly equal stripped arguments (two searches need only the embedding threshold)."""
    a, b = parse_webshop_action(source_action), parse_webshop_action(target_action)
    return a is not None and b is not None and a[0] == b[0] and (a[0] != "click" or a[1] == b[1])


def _action_valid(actions: Sequence[str | None] | None, valid: Tensor, name: str) -> Tensor:
    if actions is None:
        return valid
    if len(actions) != valid.numel():
        raise ValueError(f"{name}: expected {valid.numel()} action strings, got {len(actions)}")
    nonempty = torch.tensor([isinstance(a, str) and bool(a.strip()) for a in actions], dtype=torch.bool)
    return valid & nonempty.to(valid.device)


def action_filter(
    selected: Sequence[Sequence[int]],
    action_sim: Tensor,
    source_action_valid: Tensor,
    target_action_valid: Tensor,
    *,
    threshold: float = 0.8,
    source_actions: Sequence[str | None] | None = None,
    target_actions: Sequence[str | None] | None = None,
    webshop: bool = False,
    rule: ActionRule | None = None,
) -> list[list[int]]:
    """Action-consistency filter (§2.5): removes pairs, never adds; keeps rank order.

    selected: per target, source indices (as from :func:`select_sources`), len M.
    action_sim: [M, M] cosine of teacher action of the source vs student action of the target.
    source_action_valid / target_action_valid: [M] bool. A pair is kept iff both actions are valid,
    action_sim is finite and >= threshold, and the environment's pair rule (if any) keeps it:
    ``rule(source_actions[s], target_actions[t])``; ``webshop=True`` is ``rule=webshop_actions_agree`` (both
    parse, verbs equal, and two clicks have exactly equal stripped arguments).
    source_actions / target_actions: the action strings (required with a rule); a
    whitespace-only string counts as invalid.
    """
    thr = validate_action_threshold(threshold)
    if not isinstance(webshop, bool):
        raise ValueError(f"webshop: expected a bool, got {webshop!r}")
    if rule is not None and not callable(rule):
        raise ValueError(f"rule: expected a function (source_action, target_action) -> bool, got {rule!r}")
    if webshop and rule is not None:
        raise ValueError("rule: give webshop=True (the WebShop rule) or a rule of your own, not both")
    rule = webshop_actions_agree if webshop else rule
    M = len(selected)
    A = as_tensor(action_sim, "action_sim")
    check_ndim(A, "action_sim", 2)
    check_shape(A, "action_sim", (M, M))
    if not A.is_floating_point():
        raise ValueError(f"action_sim: expected a floating tensor, got {A.dtype}")
    sv = check_turn_vector(source_action_valid, "source_action_valid", M, dtype=torch.bool)
    tv = check_turn_vector(target_action_valid, "target_action_valid", M, dtype=torch.bool)
    sv = _action_valid(source_actions, sv.cpu(), "source_actions")
    tv = _action_valid(target_actions, tv.cpu(), "target_actions")
    if rule is not None and (source_actions is None or target_actions is None):
        raise ValueError("source_actions: an action rule (webshop=True or rule=) needs both sides' action strings")
    pairs = pairs_from_selection(selected)
    if pairs.numel() == 0:
        return [[] for _ in range(M)]
    if int(pairs.min()) < 0 or int(pairs.max()) >= M:
        raise ValueError(f"selected: source indices must lie in [0, {M})")
    s, t = pairs[:, 0], pairs[:, 1]
    sim = A.detach().float().cpu()[s, t]
    keep = sv[s] & tv[t] & torch.isfinite(sim) & (sim >= thr)
    if rule is not None:
        agree = [  # the rule is asked only about pairs the checks above kept (both actions valid)
            k and bool(rule(source_actions[si], target_actions[ti]))  # type: ignore[index]
            for (si, ti), k in zip(pairs.tolist(), keep.tolist())
        ]
        keep &= torch.tensor(agree, dtype=torch.bool)
    out: list[list[int]] = [[] for _ in range(M)]
    for (si, ti), k in zip(pairs.tolist(), keep.tolist()):
        if k:
            out[ti].append(si)
    return out
