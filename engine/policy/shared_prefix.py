"""Shared prompt prefixes in a training forward: each prefix computed once, forward and backward.

Legend: B = rows, T = a forward's trimmed row width, N = positions of its one packed sequence, P = a group's shared
prefix (tokens), S = a row's suffix (its tokens after the prefix).

The rows of one task share prompt prefixes: the G siblings' first prompts are identical, and every prompt of a task
opens with the same chat header, instructions and task text. Padded and padding-free rows compute such a prefix once
per row. Here the rows of a forward go in one packed sequence laid out as a tree of one level: each group of rows
with a common prompt prefix brings the prefix once (its root: the group's first row whole), then every other row's
suffix; a row of no group is a root of its own (:func:`tree_inputs`). The position ids hold the structure: a segment
begins where they do not continue by one; one that begins at 0 is a root, one that begins at p > 0 is a suffix reading
the first p positions of the last root before it (engine/policy/varlen_attention.py ``prefix_tree_attention``). The
gradients of every suffix reach the prefix through its keys and values, so log-probs, loss and every gradient are the
unshared forward's up to reassociation (fp32, 1e-5; tests/engine/test_shared_prefix_update.py), with LoRA and with
gradient checkpointing (the recomputation runs the attention the forward ran, on the same position ids).

Grouping (:func:`plan_shared`): rows sorted by prompt, so rows sharing long prefixes are neighbours and the common
prefix of a run of neighbours is the smallest of its adjacent ones; a dynamic programme over the sorted rows picks the
runs that save the most positions (a run of k rows over a prefix of P tokens saves (k - 1) x P), a run's prefix being
at least :data:`MIN_SHARED` tokens. A prefix is prompt tokens only, so every row keeps its responses as its own.

Where it is taken (:func:`takes`, a rule on positions): the layout pushes fewer positions than the rows' own layout
(padded or packed) by at least :data:`MIN_SAVED` of them. The planning reads the prompts on the host: it is taken on
the CPU only, where the tree's attention runs (``prefix_tree_supported``); the update's count of what it pushed
(engine/step/micro_batches.py ``Footprint``) asks the same two functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

MIN_SHARED = 16  # tokens: a shorter common prefix is pushed with each row (its segment calls cost more than it saves)
# share of the other layout's positions the tree must save: a margin for its per-suffix attention calls, not a timed
# break-even (on a 2-core machine under load 9 the update's time could not resolve it: shared and packed rows took
# 1.00-1.05x each other's time at 28 % fewer positions; bench/results/shared-prefix-update-2026-12-07.md)
MIN_SAVED = 0.05


@dataclass(frozen=True)
class SharedPlan:
    """Row ``r`` reads the first ``prefix[r]`` tokens of row ``root[r]``'s prompt (0: none, the row pushes all its
    tokens: a root, alone or the first of its group); ``positions``: what the tree pushes, ``row_tokens``: what the
    rows hold (the padding-free layout's positions)."""

    root: list[int]
    prefix: list[int]
    positions: int
    row_tokens: int

    @property
    def saved(self) -> int:
        return self.row_tokens - self.positions


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def plan_shared(prompts: Sequence[Sequence[int]], lengths: Sequence[int]) -> SharedPlan:
    """The grouping of rows with the fewest positions (module docstring). ``prompts``: each row's attended prompt
    tokens; ``lengths``: each row's positions in the forward (prompt + pushed response tokens)."""
    n = len(prompts)
    if len(lengths) != n:
        raise ValueError(f"lengths: {len(lengths)} rows, prompts has {n}")
    order = sorted(range(n), key=lambda r: tuple(prompts[r]))
    adj = [common_prefix(prompts[a], prompts[b]) for a, b in zip(order, order[1:])]
    best, cut = [0] * (n + 1), [(0, 0)] * (n + 1)  # best[j]: most saved over the first j sorted rows
    for j in range(1, n + 1):
        best[j], cut[j] = best[j - 1], (j - 1, 0)
        lcp = None
        for i in range(j - 2, -1, -1):  # the run order[i..j-1]
            lcp = adj[i] if lcp is None else min(lcp, adj[i])
            if lcp < MIN_SHARED:
                break
            if best[i] + (j - 1 - i) * lcp > best[j]:
                best[j], cut[j] = best[i] + (j - 1 - i) * lcp, (i, lcp)
    root, prefix = list(range(n)), [0] * n
    j = n
    while j > 0:
        i, lcp = cut[j]
        for r in order[i + 1 : j] if lcp else ():
            root[r], prefix[r] = order[i], lcp
        j = i
    total = int(sum(lengths))
    return SharedPlan(root, prefix, total - best[n], total)


def takes(plan: SharedPlan, other_positions: int) -> bool:
    """Whether the tree layout of ``plan`` is taken over a layout pushing ``other_positions`` (the rows' padded or
    packed forward): it must save at least :data:`MIN_SAVED` of them."""
    return plan.positions <= (1.0 - MIN_SAVED) * other_positions


def plan_rows(ids_BT: Tensor, mask_BT: Tensor, prompt_width: int) -> SharedPlan:
    """:func:`plan_shared` of a forward's rows ``[prompt (left-padded) | response (right-padded)]`` trimmed as the
    forward pushes them (``prompt_width``: the prompt's columns). Reads the rows on the host."""
    keep = mask_BT.bool().cpu()
    ids = ids_BT.cpu()
    prompts = [row[k].tolist() for row, k in zip(ids[:, :prompt_width], keep[:, :prompt_width])]
    return plan_shared(prompts, keep.sum(1).tolist())


def tree_inputs(ids_BT: Tensor, mask_BT: Tensor, plan: SharedPlan) -> tuple[Tensor, Tensor, Tensor]:
    """The packed sequence of ``plan`` (``lm_head.packed_inputs``' contract): ``[1, N]`` ids, ``[1, N]`` position ids
    (each row's own positions, a suffix's continuing its prefix's) and the ``[B, T]`` slot of each attended position
    of each row (a prefix position's slot is in its root; 0 at positions the mask leaves out)."""
    dev = ids_BT.device
    keep = mask_BT.bool()
    cols = [k.nonzero().squeeze(1) for k in keep]  # each row's attended columns, in order
    members: dict[int, list[int]] = {}
    for r, (root, p) in enumerate(zip(plan.root, plan.prefix)):
        if p:
            members.setdefault(root, []).append(r)
    seq_ids, seq_pos, slot = [], [], torch.zeros(keep.shape, dtype=torch.long, device=dev)
    n = 0
    for r in range(len(cols)):
        if plan.prefix[r]:
            continue  # pushed behind its root
        for q in [r, *members.get(r, [])]:
            first = plan.prefix[q]
            own = cols[q][first:]
            seq_ids.append(ids_BT[q, own])
            seq_pos.append(torch.arange(first, first + int(own.numel()), device=dev))
            if first:
                slot[q, cols[q][:first]] = slot[r, cols[r][:first]]
            slot[q, own] = torch.arange(n, n + int(own.numel()), device=dev)
            n += int(own.numel())
    return torch.cat(seq_ids).unsqueeze(0), torch.cat(seq_pos).unsqueeze(0), slot
