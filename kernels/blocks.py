"""Task-block layout shared by the alignment kernels.

Legend: M = canonical turns, T = tasks, N = turns of the largest task (block size).

Turns are sorted by identity (task, rollout, turn); every task becomes one zero-padded block
of N slots. Inside a block the slots are in identity order, so "smaller identity" is
"smaller slot", and the turns of one rollout are contiguous.

Regular layout: when every task has the same number G of rollouts and every rollout the same
number L of turns, there is no padding and slot n holds rollout n // L, so a block axis of N
slots reshapes to [G, L] (``Blocks.rollout_len`` = L; 0 otherwise). The selection's torch
code uses it for per-rollout maxima without scatter-reduces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

MASKED_LOGIT = -1.0e30  # an ineligible cell before the division by T_p: its probability is exactly 0
CHUNK_CELLS = 1 << 17  # cells of a group of blocks in the torch paths (512 KiB of float32: fits a core's L2)


@dataclass
class Blocks:
    """Identity-sorted task blocks.

    idx_TN: turn index (input order) of each slot (0 on padding); member_TN: slot holds a turn;
    lroll_TN: rollout index of the slot within its task (0..G-1, 0 on padding);
    block_M / slot_M: block and slot of each turn (input order); order_M: turn indices in identity order;
    traj_M: trajectory index (identity order of (task, rollout)) of each turn, input order.
    rollout_len: L when the layout is regular (every task G rollouts of L turns each: no padding,
    slot n in rollout n // L), else 0.
    """

    idx_TN: Tensor
    member_TN: Tensor
    lroll_TN: Tensor
    block_M: Tensor
    slot_M: Tensor
    order_M: Tensor
    traj_M: Tensor
    num_rollouts: int
    rollout_len: int = 0


def all_finite(x: Tensor) -> bool:
    """No NaN or inf in the floating tensor ``x``. A NaN or inf entry makes the sum NaN or inf, so a finite sum
    (one fast reduction) proves it; a non-finite sum (such entries, or finite ones that overflow) falls back
    to the elementwise check."""
    return not x.numel() or bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())


def check_id_vectors(task, rollout, turn) -> tuple[Tensor, Tensor, Tensor]:
    out = []
    M = None
    for name, t in (("task", task), ("rollout", rollout), ("turn", turn)):
        if not isinstance(t, Tensor):
            t = torch.as_tensor(t)
        if t.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(t.shape)}")
        if t.is_floating_point() or t.dtype == torch.bool:
            raise ValueError(f"{name}: expected an integer tensor, got {t.dtype}")
        if M is None:
            M = t.shape[0]
        elif t.shape[0] != M:
            raise ValueError(f"{name}: expected shape ({M},) like task, got {tuple(t.shape)}")
        out.append(t.long())
    return out[0], out[1], out[2]


def identity_order(task: Tensor, rollout: Tensor, turn: Tensor) -> Tensor:
    """Turn indices [M] in identity order: lexicographic (task, rollout, turn), stable."""
    order = torch.argsort(turn, stable=True)
    order = order[torch.argsort(rollout[order], stable=True)]
    return order[torch.argsort(task[order], stable=True)]


def task_blocks(task: Tensor, rollout: Tensor, turn: Tensor) -> Blocks:
    """Build the block layout; duplicate (task, rollout, turn) identities raise ValueError."""
    M = task.numel()
    dev = task.device
    order = identity_order(task, rollout, turn)
    task_s, roll_s, turn_s = task[order], rollout[order], turn[order]
    new_task = torch.ones(M, dtype=torch.bool, device=dev)
    new_traj = torch.ones(M, dtype=torch.bool, device=dev)
    if M > 1:
        new_task[1:] = task_s[1:] != task_s[:-1]
        new_traj[1:] = new_task[1:] | (roll_s[1:] != roll_s[:-1])
        dup = ~new_traj[1:] & (turn_s[1:] == turn_s[:-1])
        if bool(dup.any()):
            i = int(dup.nonzero()[0, 0])
            raise ValueError(
                f"turn: duplicate turn id {int(turn_s[i])} in trajectory (task {int(task_s[i])}, "
                f"rollout {int(roll_s[i])})"
            )
    return blocks_from_order(order, torch.cumsum(new_task.long(), 0) - 1, torch.cumsum(new_traj.long(), 0) - 1)


def blocks_from_order(order: Tensor, task_idx: Tensor, traj_idx: Tensor, *, width: int | None = None) -> Blocks:
    """The block layout of turns already in identity order: ``order`` [M] turn indices in identity order,
    ``task_idx`` / ``traj_idx`` [M] the task and trajectory index (0, 1, ... in identity order) of each sorted
    turn. ``width``: the block size N (None: the largest task's turn count; else at least that). A share of a
    larger batch passes the whole batch's N, so that its row sums run over exactly the cells of the whole
    batch's blocks (the sums of padded rows depend on their length in the last bits)."""
    M = order.numel()
    dev = order.device
    T = int(task_idx[-1]) + 1 if M else 0
    counts = torch.bincount(task_idx, minlength=T)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(M, device=dev) - starts[task_idx]
    local_roll = traj_idx - traj_idx[starts][task_idx]
    N = int(counts.max()) if M else 0
    if width is not None:
        if isinstance(width, bool) or not isinstance(width, int) or width < N:
            raise ValueError(f"width: expected an int >= the largest task's {N} turns, got {width!r}")
        N = width
    idx = torch.zeros(T, N, dtype=torch.long, device=dev)
    member = torch.zeros(T, N, dtype=torch.bool, device=dev)
    lroll = torch.zeros(T, N, dtype=torch.long, device=dev)
    idx[task_idx, pos] = order
    member[task_idx, pos] = True
    lroll[task_idx, pos] = local_roll
    block_M = torch.empty(M, dtype=torch.long, device=dev)
    slot_M = torch.empty(M, dtype=torch.long, device=dev)
    traj_M = torch.empty(M, dtype=torch.long, device=dev)
    block_M[order] = task_idx
    slot_M[order] = pos
    traj_M[order] = traj_idx
    G = int(local_roll.max()) + 1 if M else 0
    L = 0
    if M:
        lengths = torch.bincount(traj_idx)
        L = int(lengths[0])
        if not (bool((lengths == L).all()) and bool((counts == N).all())):
            L = 0  # all rollouts L long and all tasks N = G * L long: G rollouts per task, slot n in rollout n // L
    return Blocks(idx, member, lroll, block_M, slot_M, order, traj_M, G, L)


def to_blocks(x_MD: Tensor, b: Blocks, *, zero_padding: bool = True) -> Tensor:
    """Rows of x_MD [M, ...] gathered into blocks [T, N, ...] (padding rows zero, unless ``zero_padding`` is off)."""
    out = x_MD.index_select(0, b.idx_TN.reshape(-1)).view(b.idx_TN.shape + x_MD.shape[1:])
    if not zero_padding:
        return out
    mask = b.member_TN.reshape(b.member_TN.shape + (1,) * (x_MD.dim() - 1))
    return out * mask if out.dtype != torch.bool else out & mask


def dense_index(b: Blocks, M: int) -> tuple[Tensor, Tensor]:
    """Flat indices into a dense [M, M] (target-major: row = target, col = source) and the valid-cell mask.

    Returned lin_TNN[t, i, j] = idx[t, i] * M + idx[t, j] and mask_TNN = member_i & member_j.
    """
    lin = b.idx_TN[:, :, None] * M + b.idx_TN[:, None, :]
    mask = b.member_TN[:, :, None] & b.member_TN[:, None, :]
    return lin, mask


def scatter_dense(x_TNN: Tensor, b: Blocks, M: int, *, transpose: bool, fill=0) -> Tensor:
    """Dense [M, M] from target-major blocks; ``transpose`` writes x[t, i, j] at [idx_j, idx_i]."""
    out = torch.full((M, M), fill, dtype=x_TNN.dtype, device=x_TNN.device)
    if M == 0:
        return out
    lin, mask = dense_index(b, M)
    if transpose:
        lin = b.idx_TN[:, None, :] * M + b.idx_TN[:, :, None]
    out.view(-1)[lin[mask]] = x_TNN[mask]
    return out


def gather_blocks(x_MM: Tensor, b: Blocks, *, transpose: bool) -> Tensor:
    """Target-major blocks [T, N, N] of a dense matrix: x[idx_i, idx_j] (or x[idx_j, idx_i] if ``transpose``)."""
    M = x_MM.shape[0]
    if transpose:
        lin = b.idx_TN[:, None, :] * M + b.idx_TN[:, :, None]
    else:
        lin = b.idx_TN[:, :, None] * M + b.idx_TN[:, None, :]
    mask = b.member_TN[:, :, None] & b.member_TN[:, None, :]
    out = x_MM.reshape(-1)[lin]
    return out & mask if out.dtype == torch.bool else out * mask


def check_params(gamma, top_k, temperature, temperature_name: str = "profile_temperature") -> None:
    """ValueError naming the culprit: gamma and the temperature finite reals (temperature >= 1e-6), top_k (unless
    None) an integer >= 1."""
    for name, x in (("gamma", gamma), (temperature_name, temperature)):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(float(x)):
            raise ValueError(f"{name}: expected a finite real number, got {x!r}")
    if float(temperature) < 1e-6:
        raise ValueError(f"{temperature_name}: must be >= 1e-6, got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k: expected an integer >= 1, got {top_k!r}")


def check_eligible_finite(H_BTS: Tensor, E_BTS: Tensor) -> None:
    """ValueError naming ``H`` if an eligible cell is NaN or inf (the only cells the kernels read). A finite sum
    of all of H proves it without the masked copy, which is only made when some cell is not finite."""
    if not all_finite(H_BTS) and not all_finite(torch.where(E_BTS, H_BTS, 0.0)):
        raise ValueError("H: contains NaN or inf at eligible cells")


def block_groups(T: int, N: int) -> list[tuple[int, int]]:
    """Groups of consecutive blocks of about ``CHUNK_CELLS`` cells: the [T, N, N] passes run group by group on
    cache-resident temporaries instead of materialising full-size ones."""
    step = max(1, CHUNK_CELLS // max(1, N * N))
    return [(b0, min(T, b0 + step)) for b0 in range(0, T, step)]


def packed_rows(E_RN: Tensor) -> Tensor:
    """Rows of a bool matrix [R, N] as int64 words [R, ceil(N / 8)] (8 flags per word, zero-padded): row equality
    and row emptiness become 8x narrower comparisons."""
    u8 = E_RN.contiguous().view(torch.uint8)
    pad = (-E_RN.shape[1]) % 8
    if pad or u8.storage_offset() % 8:
        u8 = torch.nn.functional.pad(u8, (0, pad))
    return u8.view(torch.int64)
