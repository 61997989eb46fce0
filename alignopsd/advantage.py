"""Outcome advantage per unique trajectory and the invalid-action residual (ALGORITHM.md §3.1, §3.10), and the
row-wise GRPO advantage of the M1-only estimator (§2.9).

Legend: M = canonical turns, T = trajectories (unique (task, rollout) pairs), G = tasks.

Everything here is computed in float64 and returned as detached float32 on the input's device.
``TurnIndex`` is the shared description of a batch's identity structure (sorted order,
trajectory and task indices); Mechanism 2 (``alignopsd.credit``) builds on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from alignopsd._checks import (
    as_tensor,
    check_choice,
    check_finite,
    check_finite_fast,
    check_ids,
    check_ndim,
    check_real,
    check_shape,
)

__all__ = ["grpo_advantage", "invalid_action_residual", "rowwise_grpo_advantage", "TurnIndex", "build_turn_index"]

_SCOPES = ("trajectory", "turn")


@dataclass(frozen=True)
class TurnIndex:
    """Identity structure of a batch of M turns, in identity order (task, rollout, turn).

    Fields (all LongTensor on the input's device):
        order_M: input index of the i-th turn in identity order (a permutation of 0..M-1).
        traj_M / task_M: trajectory / task index of each turn **in identity order**; trajectories are
            numbered in sorted (task, rollout) order, tasks in sorted task order.
        traj_offsets_T1: [T+1] start of each trajectory in identity order (last entry M).
        task_offsets_G1: [G+1] start of each task in identity order (last entry M).
        traj_task_T: task index of each trajectory.
    """

    order_M: Tensor
    traj_M: Tensor
    task_M: Tensor
    traj_offsets_T1: Tensor
    task_offsets_G1: Tensor
    traj_task_T: Tensor

    @property
    def num_turns(self) -> int:
        return int(self.order_M.shape[0])

    @property
    def num_trajectories(self) -> int:
        return int(self.traj_offsets_T1.shape[0]) - 1

    @property
    def num_tasks(self) -> int:
        return int(self.task_offsets_G1.shape[0]) - 1

    @property
    def largest_task_turns(self) -> int:
        """Turns of the largest task (the width of the task blocks); 0 for an empty batch."""
        sizes = self.task_offsets_G1[1:] - self.task_offsets_G1[:-1]
        return int(sizes.max()) if sizes.numel() else 0


def build_turn_index(task: Tensor, rollout: Tensor, turn: Tensor | None = None) -> TurnIndex:
    """Sort turns by identity and number trajectories and tasks (validated LongTensors [M]).

    With ``turn`` given, a duplicate turn id inside a trajectory raises ``ValueError`` naming ``turn``.
    """
    m = int(task.shape[0])
    dev = task.device
    if turn is not None:
        order = torch.argsort(turn, stable=True)
        order = order[torch.argsort(rollout[order], stable=True)]
    else:
        order = torch.argsort(rollout, stable=True)
    order = order[torch.argsort(task[order], stable=True)]
    task_s = task[order]
    roll_s = rollout[order]
    new_task = torch.ones(m, dtype=torch.bool, device=dev)
    new_traj = torch.ones(m, dtype=torch.bool, device=dev)
    if m > 1:
        new_task[1:] = task_s[1:] != task_s[:-1]
        new_traj[1:] = new_task[1:] | (roll_s[1:] != roll_s[:-1])
        if turn is not None:
            turn_s = turn[order]
            dup = ~new_traj[1:] & (turn_s[1:] == turn_s[:-1])
            if bool(dup.any()):
                i = int(torch.nonzero(dup)[0, 0]) + 1
                raise ValueError(
                    f"turn: duplicate turn id {int(turn_s[i])} in trajectory (task={int(task_s[i])}, "
                    f"rollout={int(roll_s[i])}); every (task, rollout, turn) must be unique"
                )
    traj_m = torch.cumsum(new_traj.long(), 0) - 1
    task_m = torch.cumsum(new_task.long(), 0) - 1
    end = torch.tensor([m], dtype=torch.long, device=dev)
    traj_off = torch.cat([torch.nonzero(new_traj).flatten(), end])
    task_off = torch.cat([torch.nonzero(new_task).flatten(), end])
    traj_task = task_m[traj_off[:-1]]
    return TurnIndex(order, traj_m, task_m, traj_off, task_off, traj_task)


def check_outcome(outcome, m: int, name: str = "outcome") -> Tensor:
    out = as_tensor(outcome, name).detach()
    check_ndim(out, name, 1)
    if out.shape[0] != m:
        raise ValueError(f"{name}: expected shape ({m},) like task, got {tuple(out.shape)}")
    if out.dtype == torch.bool:
        out = out.double()
    check_finite(out, name)
    return out.double()


def trajectory_outcomes(outcome_M: Tensor, index: TurnIndex, task: Tensor, rollout: Tensor) -> Tensor:
    """R per trajectory [T] (float64); ``ValueError`` naming ``outcome`` if it varies inside one."""
    r_s = outcome_M[index.order_M]
    if r_s.shape[0] > 1:
        same = index.traj_M[1:] == index.traj_M[:-1]
        bad = same & (r_s[1:] != r_s[:-1])
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0, 0]) + 1
            j = int(index.order_M[i])
            raise ValueError(
                f"outcome: varies inside trajectory (task={int(task[j])}, rollout={int(rollout[j])}): "
                f"{float(r_s[i - 1])} vs {float(r_s[i])}; the episode outcome must be equal on every turn"
            )
    return r_s[index.traj_offsets_T1[:-1]]


def check_two_rollouts(index: TurnIndex, task: Tensor) -> None:
    """Every task needs at least two trajectories (ValueError naming ``rollout``)."""
    per_task = torch.bincount(index.traj_task_T, minlength=index.num_tasks)
    if index.num_tasks and bool((per_task < 2).any()):
        g = int(torch.nonzero(per_task < 2)[0, 0])
        t = int(task[index.order_M[index.task_offsets_G1[g]]])
        raise ValueError(
            f"rollout: task {t} has {int(per_task[g])} distinct rollout(s); the group advantage needs at least 2"
        )


def advantage_from_index(
    r_T: Tensor, index: TurnIndex, *, scope: str, norm_by_std: bool, eps: float
) -> tuple[Tensor, Tensor]:
    """GRPO advantage per trajectory A_T and per turn in identity order (both float64).

    Mean and unbiased std per task over the trajectories' R (``trajectory``) or over the multiset
    where each R is repeated once per turn (``turn``). A task whose R are all equal gets exactly 0.
    """
    g = index.num_tasks
    tt = index.traj_task_T
    if scope == "turn":
        w = (index.traj_offsets_T1[1:] - index.traj_offsets_T1[:-1]).double()
    else:
        w = torch.ones_like(r_T)
    wsum = torch.zeros(g, dtype=torch.float64, device=r_T.device).index_add_(0, tt, w)
    mean = torch.zeros_like(wsum).index_add_(0, tt, w * r_T) / wsum
    dev = r_T - mean[tt]
    var = torch.zeros_like(wsum).index_add_(0, tt, w * dev * dev) / (wsum - 1.0)
    rmax = torch.full_like(wsum, -torch.inf).scatter_reduce_(0, tt, r_T, "amax")
    rmin = torch.full_like(wsum, torch.inf).scatter_reduce_(0, tt, r_T, "amin")
    a = dev / (var.sqrt()[tt] + eps) if norm_by_std else dev
    a = torch.where((rmax == rmin)[tt], torch.zeros_like(a), a)
    return a, a[index.traj_M]


def grpo_advantage(
    outcome: Tensor,
    task: Tensor,
    rollout: Tensor,
    *,
    scope: str = "trajectory",
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Outcome advantage of each turn, normalised per task over unique trajectories (§3.1).

    Args:
        outcome: [M] episode outcome R, equal on every turn of a trajectory.
        task, rollout: [M] integer ids; (task, rollout) names a trajectory.
        scope: ``"trajectory"`` (each trajectory counted once) or ``"turn"`` (weighted by its turn count).
        norm_by_std: divide by (unbiased std + eps); otherwise only centre.
        eps: added to the std.
    Returns:
        A [M] float32: (R_tau - mean) / (std + eps) of the turn's trajectory; 0 for tasks with equal R.
    Raises:
        ValueError naming the argument: shapes, NaN/inf, R varying inside a trajectory, a task with
        fewer than two rollouts, an unknown scope.
    """
    check_choice(scope, "scope", _SCOPES)
    eps = check_real(eps, "eps", lo=0.0)
    task_t, roll_t, _ = check_ids(task, rollout)
    r = check_outcome(outcome, int(task_t.shape[0]))
    if task_t.shape[0] == 0:
        return torch.zeros(0, dtype=torch.float32, device=r.device)
    index = build_turn_index(task_t, roll_t)
    check_two_rollouts(index, task_t)
    r_t = trajectory_outcomes(r, index, task_t, roll_t)
    _, a_sorted = advantage_from_index(r_t, index, scope=scope, norm_by_std=bool(norm_by_std), eps=eps)
    out = torch.empty_like(a_sorted)
    out[index.order_M] = a_sorted
    return out.float()


def residual_from_index(
    r_M: Tensor, invalid_M: Tensor, task_M: Tensor, num_tasks: int, penalty: float, norm_by_std: bool = True
) -> Tensor:
    """Invalid-action residual (float64 [M]) for turns grouped by ``task_M`` (task index per turn); the
    normalisation divides by (unbiased std + 1e-6) only when ``norm_by_std`` (else it centres only)."""
    dev = r_M.device
    cnt = torch.zeros(num_tasks, dtype=torch.float64, device=dev).index_add_(0, task_M, torch.ones_like(r_M))

    def norm(v: Tensor) -> Tensor:
        mean = torch.zeros_like(cnt).index_add_(0, task_M, v) / cnt
        d = v - mean[task_M]
        var = torch.zeros_like(cnt).index_add_(0, task_M, d * d) / (cnt - 1.0).clamp_min(1.0)
        single = (cnt == 1.0)[task_M]
        mean_u = torch.where(single, torch.zeros_like(v), mean[task_M])
        std_u = torch.where(single | (not norm_by_std), torch.ones_like(v), var.sqrt()[task_M] + 1e-6)
        return (v - mean_u) / std_u

    return norm(r_M - penalty * invalid_M.double()) - norm(r_M)


def check_invalid(invalid, m: int) -> Tensor:
    inv = as_tensor(invalid, "invalid")
    check_ndim(inv, "invalid", 1)
    if inv.shape[0] != m:
        raise ValueError(f"invalid: expected shape ({m},) like task, got {tuple(inv.shape)}")
    if inv.dtype != torch.bool:
        if inv.is_floating_point() and not bool(torch.isfinite(inv).all()):
            raise ValueError("invalid: contains NaN or inf; expected a bool flag per turn")
        if not bool(((inv == 0) | (inv == 1)).all()):
            raise ValueError("invalid: expected a bool flag per turn (values 0/1)")
        inv = inv != 0
    return inv


def invalid_action_residual(
    outcome: Tensor, invalid: Tensor, task: Tensor, *, penalty: float, norm_by_std: bool = True
) -> Tensor:
    """Residual r = norm(R - penalty*invalid) - norm(R) over each task's turns (§3.10).

    norm(v) = (v - mean) / (unbiased std + 1e-6) over the canonical turns of a task (each turn counts
    once) when ``norm_by_std``, else v - mean (as the outcome advantage, ``grpo_normalize_by_std``); a task
    with a single turn uses mean 0 and std 1. One invalid turn shifts every turn of its task.

    Args:
        outcome: [M] episode outcome R per turn.
        invalid: [M] bool, the environment rejected the turn's action.
        task: [M] integer task ids.
        penalty: c >= 0 (0 gives exactly 0).
    Returns:
        r [M] float32.
    """
    penalty = check_real(penalty, "penalty", lo=0.0)
    task_t = as_tensor(task, "task")
    check_ndim(task_t, "task", 1)
    if task_t.is_floating_point() or task_t.dtype == torch.bool:
        raise ValueError(f"task: expected an integer tensor, got {task_t.dtype}")
    m = int(task_t.shape[0])
    r = check_outcome(outcome, m)
    inv = check_invalid(invalid, m)
    if m == 0:
        return torch.zeros(0, dtype=torch.float32, device=r.device)
    _, task_idx = torch.unique(task_t.long(), return_inverse=True)
    g = int(task_idx.max()) + 1
    if not isinstance(norm_by_std, bool):
        raise ValueError(f"norm_by_std: expected a bool, got {type(norm_by_std).__name__}")
    return residual_from_index(r, inv.to(r.device), task_idx, g, penalty, norm_by_std).float()


def rowwise_grpo_advantage(
    score: Tensor, task: Tensor, copies: Tensor | None = None, *, norm_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """verl-agent GRPO over all rows: per task, mean and unbiased std (+eps) of the row scores.

    score: [M] per canonical turn; copies: [M] rows per turn (each turn's score is counted k times,
    as verl-agent does on the padded batch). A task with a single row uses mean 0 and std 1.
    Returns [M] float32.
    """
    s = as_tensor(score, "score")
    check_ndim(s, "score", 1)
    check_finite_fast(s, "score")
    s = s.double()
    M = s.numel()
    t, _, _ = check_ids(task, task)
    check_shape(t, "task", (M,))
    t = t.to(s.device)
    if copies is None:
        k = torch.ones(M, dtype=torch.float64, device=s.device)
    else:
        kc = as_tensor(copies, "copies")
        check_shape(kc, "copies", (M,))
        if kc.is_floating_point() or kc.dtype == torch.bool or bool((kc < 1).any()):
            raise ValueError("copies: expected integer row counts >= 1")
        k = kc.double().to(s.device)
    eps = check_real(eps, "eps", lo=0.0)
    if M == 0:
        return torch.zeros(0, dtype=torch.float32, device=s.device)
    _, tid = torch.unique(t, return_inverse=True)
    G = int(tid.max()) + 1 if M else 0
    n = torch.zeros(G, dtype=torch.float64, device=s.device).index_add_(0, tid, k)
    mean = torch.zeros_like(n).index_add_(0, tid, k * s) / n
    dev = s - mean[tid]
    var = torch.zeros_like(n).index_add_(0, tid, k * dev * dev) / (n - 1.0).clamp_min(1.0)
    single = n <= 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(var), var.sqrt())
    centred = s - mean[tid]
    out = centred / (std[tid] + eps) if norm_by_std else centred
    return out.float()
