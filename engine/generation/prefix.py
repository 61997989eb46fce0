"""Shared prompt prefixes of a generation batch: which rows share which prefix, and what the prefill costs.

Legend: B = prompts, P = a shared prefix's length, S = a row's suffix length (its prompt after its prefix).

The G siblings of a task start every turn from prompts that share the system prompt and the task (the whole
prompt at the first turn), and every teacher prompt of a task starts with the same privileged block (skills)
before the student's own prompt. :func:`plan_prefixes` groups rows by a common token prefix so the generator
(engine/generation/hf.py) pushes each prefix through the model once and gives every row of the group a copy of its
keys and values, then pushes only the rows' suffixes.

Grouping works on the unpadded token lists and picks, among the groupings of sorted neighbours at each common-prefix
threshold, the one that pushes the fewest positions (:func:`plan_prefixes`): for a step's teacher prompts that is
usually one group sharing the privileged block, not many small groups of identical sibling prompts. A prefix always
leaves each row at least its last token, whose forward gives the row's first logits.

The suffixes go through one padded forward, so a single row left without a long prefix makes every row's suffix
as wide as its whole prompt; the lowest threshold (one group of all rows over their common prefix: the privileged
block and the task text before the histories diverge) is among the plans compared.
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
    """Group ``prompts`` (unpadded token lists) by shared prefixes: the plan with the fewest prefill positions.

    Rows are sorted, so rows sharing long prefixes are neighbours and the common prefix of a run of neighbours is
    the smallest common prefix of adjacent pairs in it. Every distinct adjacent common prefix ``t >= min_shared``
    is tried as a threshold: runs whose adjacent pairs share at least ``t`` tokens become groups (a run of one
    row has no prefix), and each group length is tried as a cap on all prefixes. Prefixes and suffixes are pushed
    as two padded batches, so a plan costs ``groups x longest prefix + rows x longest suffix``
    (:meth:`PrefixPlan.token_forwards`); the cheapest plan wins, and none (an empty plan) when no plan is cheaper
    than one padded batch. The planning costs milliseconds beside a forward."""
    if min_shared < 1:
        raise ValueError(f"min_shared: must be >= 1, got {min_shared}")
    empty = PrefixPlan(group=[-1] * len(prompts), length=[], source=[])
    if len(prompts) < 2:
        return empty
    lengths = [len(p) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda r: tuple(prompts[r]))
    # common prefix of sorted neighbours, capped to leave both rows their last token (its forward gives the logits)
    adj = [min(common_prefix(prompts[a], prompts[b]), lengths[a] - 1, lengths[b] - 1) for a, b in zip(order, order[1:])]
    best, best_cost = empty, len(prompts) * max(lengths)
    for t in sorted({a for a in adj if a >= min_shared}):
        plan = _plan_at(order, adj, t, len(prompts))
        for cap in sorted(set(plan.length)):  # shorter prefixes can pay: the prefix batch pads to the longest
            capped = PrefixPlan(plan.group, [min(n, cap) for n in plan.length], plan.source)
            cost = capped.token_forwards(lengths)
            if cost < best_cost:
                best, best_cost = capped, cost
    return best


def _plan_at(order: list[int], adj: list[int], threshold: int, n_rows: int) -> PrefixPlan:
    """The plan whose groups are the runs of sorted rows with adjacent common prefixes >= ``threshold``."""
    group, length, source = [-1] * n_rows, [], []
    k = 0
    while k < len(order):
        end = k
        while end < len(adj) and adj[end] >= threshold:
            end += 1
        if end > k:  # rows order[k..end] form a group; their prefix is the smallest adjacent common prefix
            for r in order[k : end + 1]:
                group[r] = len(length)
            length.append(min(adj[k:end]))
            source.append(order[k])
        k = end + 1
    return PrefixPlan(group=group, length=length, source=source)
