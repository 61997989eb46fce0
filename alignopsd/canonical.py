"""Canonical turns and duplicate rows (ALGORITHM.md §1.2).

Legend: R = batch rows (possibly with exact copies, in any order), M = canonical turns.
A turn's identity is (task_id, rollout_id, turn_id) = (uid string, traj_uid string, int turn_step).
Canonical index = position in the lexicographically sorted set of identities (strings compared
as strings, the turn as an integer); it does not depend on the batch order. The first row of a
turn in batch order represents it; each of its k rows gets weight 1/k.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["Canonical", "canonicalize"]


@dataclass
class Canonical:
    """Row ↔ canonical-turn maps of one batch.

    identities: M sorted (task_id, rollout_id, turn_id) triples.
    row_to_canonical: [R] long, canonical index of each row.
    canonical_to_rows: M lists of row indices (batch order).
    first_row: [M] long, the representative row of each turn.
    counts: [M] long, k = copies per turn. row_weight: [R] float32, 1/k of the row's turn.
    task, rollout, turn: [M] long integer ids for the core; (task, rollout, turn) order equals the
    identity order: task = rank of the uid string, rollout = rank of the traj_uid string within its task.
    task_names: sorted uid strings (index = integer task id).
    """

    identities: list[tuple[str, str, int]]
    row_to_canonical: Tensor
    canonical_to_rows: list[list[int]]
    first_row: Tensor
    counts: Tensor
    row_weight: Tensor
    task: Tensor
    rollout: Tensor
    turn: Tensor
    task_names: list[str]

    @property
    def num_rows(self) -> int:
        return int(self.row_to_canonical.numel())

    @property
    def num_turns(self) -> int:
        return len(self.identities)

    def expand(self, values: Any) -> Any:
        """Copy per-turn values ([M, ...] tensor or length-M sequence) to every row ([R, ...] / length R)."""
        if isinstance(values, Tensor):
            if values.dim() == 0 or values.shape[0] != self.num_turns:
                raise ValueError(f"values: expected leading dimension {self.num_turns}, got {tuple(values.shape)}")
            return values[self.row_to_canonical.to(values.device)]
        if isinstance(values, Sequence) and not isinstance(values, (str, bytes)):
            if len(values) != self.num_turns:
                raise ValueError(f"values: expected {self.num_turns} entries, got {len(values)}")
            return [values[i] for i in self.row_to_canonical.tolist()]
        raise ValueError(f"values: expected a tensor or a sequence, got {type(values).__name__}")

    def gather(self, row_values: Any) -> Any:
        """Per-row values ([R, ...] or length R) → per-turn values from each turn's first row."""
        if isinstance(row_values, Tensor):
            if row_values.dim() == 0 or row_values.shape[0] != self.num_rows:
                got = tuple(row_values.shape)
                raise ValueError(f"row_values: expected leading dimension {self.num_rows}, got {got}")
            return row_values[self.first_row.to(row_values.device)]
        if isinstance(row_values, Sequence) and not isinstance(row_values, (str, bytes)):
            if len(row_values) != self.num_rows:
                raise ValueError(f"row_values: expected {self.num_rows} entries, got {len(row_values)}")
            return [row_values[i] for i in self.first_row.tolist()]
        raise ValueError(f"row_values: expected a tensor or a sequence, got {type(row_values).__name__}")


def _to_list(x: Any, name: str) -> list:
    if isinstance(x, Tensor):
        return x.tolist()
    if isinstance(x, (str, bytes)) or not isinstance(x, Sequence):
        try:
            return list(x)
        except TypeError:
            raise ValueError(f"{name}: expected a sequence, got {type(x).__name__}") from None
    return list(x)


def _as_turn(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise ValueError(f"turn_ids: expected integers, got {type(v).__name__} {v!r}")
    return int(v)


def _equal_rows(a: Tensor, b: Tensor) -> Tensor:
    """[R] bool: rows equal (NaN equal to NaN)."""
    eq = a == b
    if a.is_floating_point():
        eq = eq | (torch.isnan(a) & torch.isnan(b))
    return eq.reshape(eq.shape[0], -1).all(dim=1) if eq.dim() > 1 else eq


def _check_copies(fields: Mapping[str, Any], rep: Tensor, keys: list) -> None:
    """Every row's fields equal those of its turn's representative row ``rep`` [R]; ValueError names the field."""
    R = len(keys)
    for name, values in fields.items():
        if isinstance(values, Tensor):
            if values.dim() == 0 or values.shape[0] != R:
                raise ValueError(f"{name}: expected leading dimension {R} (rows), got {tuple(values.shape)}")
            same = _equal_rows(values, values[rep.to(values.device)])
            if not bool(same.all()):
                bad = int(torch.nonzero(~same)[0])
                raise ValueError(f"{name}: copies of turn {keys[bad]} differ (row {bad} vs row {int(rep[bad])})")
            continue
        vals = _to_list(values, name)
        if len(vals) != R:
            raise ValueError(f"{name}: expected {R} entries (rows), got {len(vals)}")
        for r, rr in enumerate(rep.tolist()):
            a, b = vals[r], vals[rr]
            if a is b:
                continue
            if isinstance(a, Tensor) or isinstance(b, Tensor):
                ok = isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape
                ok = ok and bool(_equal_rows(a.reshape(1, -1), b.reshape(1, -1)).all())
            else:
                ok = a == b or (a != a and b != b)
            if not ok:
                raise ValueError(f"{name}: copies of turn {keys[r]} differ (row {r} vs row {rr})")


def canonicalize(
    task_ids: Sequence[Any],
    rollout_ids: Sequence[Any],
    turn_ids: Sequence[int] | Tensor,
    *,
    fields: Mapping[str, Any] | None = None,
) -> Canonical:
    """Canonical turns of a batch of R rows (§1.2).

    task_ids: R uid values (compared as strings). rollout_ids: R traj_uid values (strings).
    turn_ids: R integer turn steps. fields: optional name → per-row tensor [R, ...] or length-R
    sequence (input_ids, responses, attention_mask, loss_mask, data_source, gamefile, episode_rewards,
    episode_lengths, is_action_valid, ...) that must be identical across the copies of a turn; a
    difference raises ValueError naming the field.
    """
    tasks = [str(v) for v in _to_list(task_ids, "task_ids")]
    rolls = [str(v) for v in _to_list(rollout_ids, "rollout_ids")]
    turns = [_as_turn(v) for v in _to_list(turn_ids, "turn_ids")]
    R = len(tasks)
    if len(rolls) != R:
        raise ValueError(f"rollout_ids: expected {R} entries like task_ids, got {len(rolls)}")
    if len(turns) != R:
        raise ValueError(f"turn_ids: expected {R} entries like task_ids, got {len(turns)}")
    keys = list(zip(tasks, rolls, turns))
    identities = sorted(set(keys))
    index = {k: i for i, k in enumerate(identities)}
    r2c = [index[k] for k in keys]
    M = len(identities)
    c2r: list[list[int]] = [[] for _ in range(M)]
    for r, c in enumerate(r2c):
        c2r[c].append(r)
    row_to_canonical = torch.tensor(r2c, dtype=torch.long)
    counts = torch.tensor([len(rows) for rows in c2r], dtype=torch.long)
    first_row = torch.tensor([rows[0] for rows in c2r], dtype=torch.long)
    row_weight = (1.0 / counts.double())[row_to_canonical].float() if R else torch.zeros(0)

    task_names = sorted({t for t, _, _ in identities})
    task_index = {t: i for i, t in enumerate(task_names)}
    roll_index: dict[tuple[str, str], int] = {}
    per_task: dict[str, int] = {}
    for t, r, _ in identities:
        if (t, r) not in roll_index:
            roll_index[(t, r)] = per_task.get(t, 0)
            per_task[t] = roll_index[(t, r)] + 1
    task = torch.tensor([task_index[t] for t, _, _ in identities], dtype=torch.long)
    rollout = torch.tensor([roll_index[(t, r)] for t, r, _ in identities], dtype=torch.long)
    turn = torch.tensor([u for _, _, u in identities], dtype=torch.long)

    if fields:
        _check_copies(fields, first_row[row_to_canonical], keys)
    return Canonical(
        identities=identities,
        row_to_canonical=row_to_canonical,
        canonical_to_rows=c2r,
        first_row=first_row,
        counts=counts,
        row_weight=row_weight,
        task=task,
        rollout=rollout,
        turn=turn,
        task_names=task_names,
    )
