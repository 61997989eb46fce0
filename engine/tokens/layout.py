"""Token layout: where the tokens of a row sit and how rows of different lengths share one tensor.

- ``position_ids``: positions from an attention mask (left-padded prompts start at position 0);
- ``left_pad`` / ``right_pad``: rows of ids (or values) into one ``[n, width]`` tensor and its mask, right-aligned
  (prompts) or left-aligned (responses);
- ``truncate_left``: the last tokens of an over-long prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def position_ids(mask: Tensor) -> Tensor:
    """Positions from an attention mask: cumulative count of attended tokens minus one, clipped at 0."""
    return (mask.long().cumsum(-1) - 1).clamp_min(0)


def truncate_left(ids: list[int], max_len: int) -> tuple[list[int], bool]:
    """Keep the last ``max_len`` tokens; returns (ids, whether anything was cut)."""
    if len(ids) <= max_len:
        return list(ids), False
    return list(ids[len(ids) - max_len :]), True


def left_pad(rows: Sequence[Sequence[int]], width: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([n, width] ids, [n, width] mask) with each row right-aligned."""
    ids = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r) > width:
            raise ValueError(f"rows: row {i} has {len(r)} tokens, more than the width {width}")
        if r:
            ids[i, width - len(r) :] = torch.tensor(list(r), dtype=torch.long)
            mask[i, width - len(r) :] = 1
    return ids, mask


def right_pad(
    rows: Sequence[Sequence[Any]], width: int, pad: Any, dtype=torch.long
) -> tuple[torch.Tensor, torch.Tensor]:
    """([n, width] values, [n, width] mask) with each row left-aligned."""
    vals = torch.full((len(rows), width), pad, dtype=dtype)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            vals[i, : len(r)] = torch.tensor(list(r), dtype=dtype)
            mask[i, : len(r)] = 1
    return vals, mask
