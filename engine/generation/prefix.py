"""Shared prompt prefixes of a generation batch: which rows share which prefix, and what the prefill costs.

Legend: B = prompts, P = a shared prefix's length, S = a row's suffix length (its prompt after its prefix).

The G siblings of a task start every turn from prompts that share the system prompt and the task (the whole
prompt at the first turn), and every teacher prompt of a task starts with the same privileged block (skills)
before the student's own prompt. :func:`plan_prefixes` groups rows by a common token prefix so the generator
(engine/generation/hf.py) pushes each prefix through the model once and gives every row of the group a copy of its
keys and values, then pushes only the rows' suffixes.

Grouping works on the unpadded token lists: rows are sorted (rows sharing long prefixes become neighbours) and
walked in that order; a row joins the current group when its common prefix with the group is at least
``min_shared`` tokens, no shorter than the one it shares with the next row (else it opens a group with that row),
and the group's saving does not shrink ((n+1) rows x the shortened prefix >= n x the old one). A prefix always
leaves each row at least its last token, whose forward gives the row's first logits.

The suffixes go through one padded forward, so a single row left without a long prefix makes every row's suffix
as wide as its whole prompt. The plan is therefore the cheaper (:meth:`PrefixPlan.token_forwards`) of those groups
and one group of all rows sharing their common prefix (the teacher prompts of a step: the privileged block and the
task text before the histories diverge).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MIN_SHARED = 16  # tokens: a shorter common prefix is pushed with each row (not worth a forward of its own)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class PrefixPlan:
    """Row ``r`` reads the prefix ``group[r]`` (-1: none, its whole prompt is its suffix); prefix ``g`` is the first
    ``length[g]`` tokens of row ``source[g]``'s prompt, shared by at least two rows."""

    group: list[int]
    length: list[int]
    source: list[int]

    def prefix_of(self, row: int) -> int:
        """Tokens of ``row``'s prompt covered by its shared prefix (0 without one)."""
        g = self.group[row]
        return self.length[g] if g >= 0 else 0

    def token_forwards(self, lengths: Sequence[int]) -> int:
        """Token positions a prefill with this plan pushes, padding included: one forward of the prefixes
        left-padded to the longest, one of the suffixes left-padded to the longest."""
        if not self.length:
            return len(lengths) * max(lengths, default=0)
        suffix = max(n - self.prefix_of(r) for r, n in enumerate(lengths))
        return len(self.length) * max(self.length) + len(lengths) * suffix


def plan_prefixes(prompts: Sequence[Sequence[int]], min_shared: int = MIN_SHARED) -> PrefixPlan:
    """Group ``prompts`` (unpadded token lists) by shared prefixes (see the module doc)."""
    if min_shared < 1:
        raise ValueError(f"min_shared: must be >= 1, got {min_shared}")
    order = sorted(range(len(prompts)), key=lambda r: tuple(prompts[r]))

    def shared(a: int, b: int) -> int:  # common prefix, capped to leave both rows their last token
        return min(common_prefix(prompts[a], prompts[b]), len(prompts[a]) - 1, len(prompts[b]) - 1)

    groups: list[tuple[list[int], int]] = []  # (rows, their common prefix length)
    for k, r in enumerate(order):
        if groups:
            rows, p = groups[-1]
            lcp = min(p, shared(rows[0], r))
            n = len(rows)
            ahead = shared(r, order[k + 1]) if k + 1 < len(order) else 0  # r shares more with the next row
            if lcp >= min_shared and ahead <= lcp and (n == 1 or (n + 1) * lcp >= n * p):
                rows.append(r)
                groups[-1] = (rows, lcp)
                continue
        groups.append(([r], len(prompts[r]) - 1))
    group = [-1] * len(prompts)
    length: list[int] = []
    source: list[int] = []
    for rows, p in groups:
        if len(rows) < 2:
            continue
        for r in rows:
            group[r] = len(length)
        length.append(p)
        source.append(rows[0])
    plan = PrefixPlan(group=group, length=length, source=source)
    if len(prompts) < 2:
        return plan
    common = min(common_prefix(prompts[order[0]], prompts[order[-1]]), min(len(p) for p in prompts) - 1)
    if common < min_shared:  # sorted rows: the first and the last share the least
        return plan
    one = PrefixPlan(group=[0] * len(prompts), length=[common], source=[order[0]])
    lengths = [len(p) for p in prompts]
    return one if one.token_forwards(lengths) < plan.token_forwards(lengths) else plan
