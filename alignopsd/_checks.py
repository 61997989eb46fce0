"""Input validation shared by the algorithm core.

Every check raises ``ValueError`` that names the argument and what is wrong with it.
Legend: M = canonical turns, L = response length.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def as_tensor(x, name: str, *, dtype: torch.dtype | None = None, device=None) -> Tensor:
    """Convert ``x`` to a tensor, naming ``name`` if that is impossible."""
    try:
        t = torch.as_tensor(x, device=device)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"{name}: cannot be converted to a tensor ({exc})") from exc
    if dtype is not None:
        t = t.to(dtype)
    return t


def check_ndim(t: Tensor, name: str, ndim: int) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim}-D tensor, got shape {tuple(t.shape)}")


def check_shape(t: Tensor, name: str, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")


def check_finite(t: Tensor, name: str) -> None:
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{name}: contains {bad} non-finite value(s) (NaN or inf)")


def check_ids(task, rollout, turn=None) -> tuple[Tensor, Tensor, Tensor | None]:
    """Validate identity tensors: 1-D integer tensors of equal length M."""
    task_t = as_tensor(task, "task")
    rollout_t = as_tensor(rollout, "rollout")
    check_ndim(task_t, "task", 1)
    check_ndim(rollout_t, "rollout", 1)
    for name, t in (("task", task_t), ("rollout", rollout_t)):
        if t.is_floating_point() or t.dtype == torch.bool:
            raise ValueError(f"{name}: expected an integer tensor, got {t.dtype}")
    if rollout_t.shape != task_t.shape:
        raise ValueError(f"rollout: expected shape {tuple(task_t.shape)} like task, got {tuple(rollout_t.shape)}")
    turn_t = None
    if turn is not None:
        turn_t = as_tensor(turn, "turn")
        check_ndim(turn_t, "turn", 1)
        if turn_t.is_floating_point() or turn_t.dtype == torch.bool:
            raise ValueError(f"turn: expected an integer tensor, got {turn_t.dtype}")
        if turn_t.shape != task_t.shape:
            raise ValueError(f"turn: expected shape {tuple(task_t.shape)} like task, got {tuple(turn_t.shape)}")
    return task_t.long(), rollout_t.long(), (turn_t.long() if turn_t is not None else None)


def check_real(x, name: str, *, lo: float | None = None, hi: float | None = None) -> float:
    """A real number (not bool, not str, finite) optionally inside [lo, hi]."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ValueError(f"{name}: expected a real number, got {type(x).__name__} {x!r}")
    v = float(x)
    if not math.isfinite(v):
        raise ValueError(f"{name}: expected a finite number, got {v}")
    if lo is not None and v < lo:
        raise ValueError(f"{name}: must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name}: must be <= {hi}, got {v}")
    return v


def check_choice(x: str, name: str, allowed) -> str:
    if x not in allowed:
        raise ValueError(f"{name}: unknown value {x!r}; allowed: {', '.join(map(repr, allowed))}")
    return x


def check_square(x, name: str, m: int, *, floating: bool) -> Tensor:
    """An [m, m] tensor: floating (returned as float32) or bool."""
    t = as_tensor(x, name)
    check_ndim(t, name, 2)
    if tuple(t.shape) != (m, m):
        raise ValueError(f"{name}: expected shape ({m}, {m}) (M turns), got {tuple(t.shape)}")
    if floating:
        if not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating tensor, got {t.dtype}")
        return t.float()
    if t.dtype != torch.bool:
        raise ValueError(f"{name}: expected a bool tensor, got {t.dtype}")
    return t


def check_bool_vector(x, name: str, m: int) -> Tensor:
    """A bool tensor of shape [m]."""
    t = as_tensor(x, name)
    check_ndim(t, name, 1)
    if t.shape[0] != m:
        raise ValueError(f"{name}: expected shape ({m},), got {tuple(t.shape)}")
    if t.dtype != torch.bool:
        raise ValueError(f"{name}: expected a bool tensor, got {t.dtype}")
    return t


def check_offsets(offsets: Tensor, k: int) -> None:
    """Offsets [T+1] of a flat batch of k entries: non-decreasing from 0 to k."""
    o = offsets.tolist()
    if not o or o[0] != 0 or o[-1] != k or any(o[i] > o[i + 1] for i in range(len(o) - 1)):
        raise ValueError(f"offsets: must be non-decreasing from 0 to {k}, got {o}")


def check_finite_fast(t: Tensor, name: str) -> None:
    """ValueError naming ``name`` if ``t`` has NaN/inf; one aminmax pass (NaN propagates), exact message on failure."""
    if not t.is_floating_point() or t.numel() == 0:
        return
    lo, hi = torch.aminmax(t.detach())
    if not (math.isfinite(float(lo)) and math.isfinite(float(hi))):
        check_finite(t, name)


def check_turn_matrix(x, name: str, m: int, *, dtype=None) -> Tensor:
    """An [m, m] matrix over turns: bool (``dtype=torch.bool``), else floating and finite (returned as float32)."""
    t = as_tensor(x, name)
    check_ndim(t, name, 2)
    check_shape(t, name, (m, m))
    if dtype is torch.bool:
        if t.dtype != torch.bool:
            raise ValueError(f"{name}: expected a bool tensor, got {t.dtype}")
        return t
    if not t.is_floating_point():
        raise ValueError(f"{name}: expected a floating tensor, got {t.dtype}")
    check_finite_fast(t, name)
    return t.float()


def check_turn_vector(x, name: str, m: int, *, dtype=None) -> Tensor:
    """A tensor of shape [m] (bool when ``dtype=torch.bool``)."""
    t = as_tensor(x, name)
    check_ndim(t, name, 1)
    check_shape(t, name, (m,))
    if dtype is torch.bool:
        if t.dtype != torch.bool:
            raise ValueError(f"{name}: expected a bool tensor, got {t.dtype}")
    return t


def check_gamma(gamma) -> float:
    """The similarity threshold γ of Mechanism 1: a real number in [-1, 1)."""
    g = check_real(gamma, "gamma", lo=-1.0)
    if g >= 1.0:
        raise ValueError(f"gamma: must be < 1 (confidence divides by 1 - gamma), got {g}")
    return g


def check_pairs(pairs, m: int) -> Tensor:
    """(source, target) pairs [P, 2] of turn indices in [0, m), as long (an empty input gives [0, 2])."""
    p = as_tensor(pairs, "pairs")
    if p.numel() == 0:
        return torch.zeros(0, 2, dtype=torch.long, device=p.device)
    check_ndim(p, "pairs", 2)
    if p.shape[1] != 2:
        raise ValueError(f"pairs: expected shape [P, 2], got {tuple(p.shape)}")
    if p.is_floating_point() or p.dtype == torch.bool:
        raise ValueError(f"pairs: expected an integer tensor, got {p.dtype}")
    p = p.long()
    if int(p.min()) < 0 or int(p.max()) >= m:
        raise ValueError(f"pairs: indices must lie in [0, {m})")
    return p


def check_tokens(x, name: str, shape: tuple[int, ...] | None = None, *, finite: bool = True) -> Tensor:
    """A 2-D token tensor [R, L] (of ``shape`` when given), finite unless ``finite=False``."""
    t = as_tensor(x, name)
    check_ndim(t, name, 2)
    if shape is not None:
        check_shape(t, name, shape)
    if finite:
        check_finite(t, name)
    return t
