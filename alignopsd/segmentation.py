"""Segmentation of trajectories into spans (ALGORITHM.md §3.5, ablation D of §3.11).

Legend: M = canonical turns, T = trajectories, K = boundaries. Positions are local to a trajectory
(0..n-1 in turn order); a boundary at p cuts between turns p-1 and p.

The Python path (:func:`segment_lists`, :func:`random_lists`) is the rule as written; the C++ path
``alignopsd._C.segment_batch`` is bit-identical and runs the whole batch (:func:`segment_batch`).
:func:`segment_trajectories` segments every trajectory of a batch for ``allocate_credit``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch
from torch import Tensor

from alignopsd import _native
from alignopsd._checks import as_tensor, check_bool_vector, check_finite, check_ndim, check_offsets, check_real
from alignopsd.advantage import TurnIndex
from alignopsd.credit_config import CreditConfig
from alignopsd.metrics import Metrics
from alignopsd.reduction import summed

__all__ = [
    "KIND_FORCED",
    "KIND_GUIDED",
    "KIND_NONE",
    "KIND_RANDOM",
    "KIND_SEMANTIC",
    "Segmentation",
    "random_lists",
    "segment",
    "segment_batch",
    "segment_lists",
    "segment_random",
    "segment_trajectories",
]

# boundary kinds (Credit.boundary_kind, C++ segment_batch)
KIND_NONE, KIND_SEMANTIC, KIND_GUIDED, KIND_FORCED, KIND_RANDOM = 0, 1, 2, 3, 4


@dataclass
@dataclass
class Segmentation:
    """Spans of one trajectory (local positions 0..n-1 in turn order).

    A boundary at p cuts between turns p-1 and p. ``spans`` are half-open (start, end) in order and
    partition 0..n; the boundary lists hold positions by kind, ascending.
    """

    spans: list[tuple[int, int]]
    semantic: list[int] = field(default_factory=list)
    guided: list[int] = field(default_factory=list)
    forced: list[int] = field(default_factory=list)
    random: list[int] = field(default_factory=list)

    @staticmethod
    def from_boundaries(n: int, boundaries: list[tuple[int, int]]) -> Segmentation:
        """Build from (position, kind) pairs (kinds: 1 semantic, 2 guided, 3 forced, 4 random)."""
        cuts = sorted(p for p, _ in boundaries)
        edges = [0] + cuts + [n]
        spans = [(edges[i], edges[i + 1]) for i in range(len(edges) - 1)] if n > 0 else []
        by_kind: dict[int, list[int]] = {k: [] for k in (1, 2, 3, 4)}
        for p, k in boundaries:
            by_kind[k].append(p)
        return Segmentation(
            spans, sorted(by_kind[1]), sorted(by_kind[2]), sorted(by_kind[3]), sorted(by_kind[KIND_RANDOM])
        )


def _insert(bounds: list[int], p: int) -> None:
    lo, hi = 0, len(bounds)
    while lo < hi:
        mid = (lo + hi) // 2
        if bounds[mid] <= p:
            lo = mid + 1
        else:
            hi = mid
    bounds.insert(lo, p)


def _repair_lists(
    d: list[float], valid: list[bool], bounds: list[int], min_len: int, max_len: int, tau_min: float, out: list
) -> None:
    """Max-length repair: split the leftmost overlong gap until none is longer than max_len."""
    while True:
        gap = next((i for i in range(len(bounds) - 1) if bounds[i + 1] - bounds[i] > max_len), None)
        if gap is None:
            return
        left, right = bounds[gap], bounds[gap + 1]
        best = -1
        for p in range(left + min_len, right - min_len + 1):
            if valid[p] and d[p] >= tau_min and (best < 0 or d[p] > d[best]):
                best = p
        kind = KIND_GUIDED
        if best < 0:
            kind = KIND_FORCED
            mid = (left + right) / 2.0
            best_dist = math.inf
            for p in range(left + min_len, right - min_len + 1):
                dist = abs(p - mid)
                if dist < best_dist:
                    best_dist, best = dist, p
        _insert(bounds, best)
        out.append((best, kind))


def segment_lists(
    d: list[float], valid: list[bool], tau: float, min_len: int, max_len: int, tau_min: float
) -> list[tuple[int, int]]:
    """Adaptive segmentation of one trajectory: (position, kind) boundaries in acceptance order."""
    n = len(d)
    bounds = [0, n]
    out: list[tuple[int, int]] = []
    cands = [p for p in range(1, n) if valid[p] and d[p] > tau]
    cands.sort(key=lambda p: (-d[p], p))
    for p in cands:
        i = next(j for j in range(len(bounds)) if bounds[j] > p)
        if p - bounds[i - 1] >= min_len and bounds[i] - p >= min_len:
            bounds.insert(i, p)
            out.append((p, KIND_SEMANTIC))
    _repair_lists(d, valid, bounds, min_len, max_len, tau_min, out)
    return out


def random_lists(
    n: int, min_len: int, max_len: int, seed: int, d: list[float] | None, valid: list[bool] | None, tau_min: float
) -> list[tuple[int, int]]:
    """Ablation D: Random(seed).shuffle of positions [min_len, n - min_len], greedy L_min acceptance, repair."""
    positions = list(range(min_len, n - min_len + 1))
    random.Random(seed).shuffle(positions)
    bounds = [0, n]
    out: list[tuple[int, int]] = []
    for p in positions:
        i = next(j for j in range(len(bounds)) if bounds[j] > p)
        if p - bounds[i - 1] >= min_len and bounds[i] - p >= min_len:
            bounds.insert(i, p)
            out.append((p, KIND_RANDOM))
    if d is None:
        d, valid = [0.0] * n, [False] * n
    _repair_lists(d, valid, bounds, min_len, max_len, tau_min, out)
    return out


def segment_batch(
    d_K: Tensor, valid_K: Tensor, offsets: Tensor, tau: float, min_len: int, max_len: int, tau_min: float, impl: str
) -> tuple[Tensor, Tensor, Tensor]:
    """Segment every trajectory of a flat batch (float32 d, bool validity, int64 offsets [T+1]).

    Returns (positions int64, kinds int8, boundary offsets int64 [T+1]) on the CPU; positions are
    local, ascending per trajectory, excluding 0 and n.
    """
    d_c = d_K.detach().to("cpu", torch.float32).contiguous()
    v_c = valid_K.detach().to("cpu", torch.bool).contiguous()
    o_c = offsets.detach().to("cpu", torch.int64).contiguous()
    if impl == "cpp":
        pos, kinds, bo = _native.native().segment_batch(
            d_c.numpy(), v_c.numpy(), o_c.numpy(), float(tau), int(min_len), int(max_len), float(tau_min)
        )
        return torch.from_numpy(pos), torch.from_numpy(kinds), torch.from_numpy(bo)
    check_offsets(o_c, int(d_c.shape[0]))
    d_l, v_l, o_l = d_c.tolist(), v_c.tolist(), o_c.tolist()
    return _pack(segment_lists(d_l[s:e], v_l[s:e], tau, min_len, max_len, tau_min) for s, e in zip(o_l[:-1], o_l[1:]))


def _pack(per_trajectory) -> tuple[Tensor, Tensor, Tensor]:
    """(positions int64, kinds int8, boundary offsets int64 [T+1]) of per-trajectory (position, kind) lists."""
    pos_l: list[int] = []
    kind_l: list[int] = []
    bo_l = [0]
    for res in per_trajectory:
        res = sorted(res)
        pos_l += [p for p, _ in res]
        kind_l += [k for _, k in res]
        bo_l.append(len(pos_l))
    return (
        torch.tensor(pos_l, dtype=torch.int64),
        torch.tensor(kind_l, dtype=torch.int8),
        torch.tensor(bo_l, dtype=torch.int64),
    )


def _check_span_lengths(min_len, max_len) -> tuple[int, int]:
    for name, v in (("min_len", min_len), ("max_len", max_len)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name}: expected an int, got {type(v).__name__} {v!r}")
    if min_len < 1:
        raise ValueError(f"min_len: must be >= 1, got {min_len}")
    if max_len < 2 * min_len - 1:
        raise ValueError(f"max_len: must be >= 2 * min_len - 1 = {2 * min_len - 1}, got {max_len}")
    return min_len, max_len


def segment(
    d: Tensor,
    boundary_valid: Tensor,
    *,
    tau: float,
    min_len: int = 2,
    max_len: int = 8,
    tau_min: float = 0.01,
    impl: str = "auto",
) -> Segmentation:
    """Adaptive segmentation of ONE trajectory (§3.5), local positions 0..n-1 in turn order.

    Semantic candidates: valid p in [1, n-1] with d[p] > tau (strict), accepted strongest first (ties:
    smaller p) when both neighbouring boundaries are at least min_len away. Then max-length repair of the
    leftmost overlong gap (l, r): the valid p in [l+min_len, r-min_len] with the largest d >= tau_min
    (guided; ties: smaller p), else the p closest to (l+r)/2 (forced; ties: smaller p).
    Distances are compared as float32 values (the dtype ``boundary_scores`` produces).

    Args:
        d: [n] distances; boundary_valid: [n] bool; tau: threshold (math.inf: no semantic boundary).
        min_len, max_len: L_min >= 1 and L_max >= 2 L_min - 1; tau_min: guided-fallback minimum.
        impl: "auto" | "python" | "cpp".
    """
    impl_r = _native.resolve_impl(impl)
    min_len, max_len = _check_span_lengths(min_len, max_len)
    tau = float(check_real(tau, "tau")) if not (isinstance(tau, float) and tau == math.inf) else math.inf
    tau_min = check_real(tau_min, "tau_min")
    dt = as_tensor(d, "d")
    check_ndim(dt, "d", 1)
    if not dt.is_floating_point():
        dt = dt.double()
    check_finite(dt, "d")
    n = int(dt.shape[0])
    bv = check_bool_vector(boundary_valid, "boundary_valid", n)
    offsets = torch.tensor([0, n], dtype=torch.int64)
    pos, kinds, _ = segment_batch(dt.float(), bv, offsets, tau, min_len, max_len, tau_min, impl_r)
    return Segmentation.from_boundaries(n, list(zip(pos.tolist(), kinds.tolist())))


def segment_random(
    n: int,
    *,
    min_len: int = 2,
    max_len: int = 8,
    seed: int,
    d: Tensor | None = None,
    boundary_valid: Tensor | None = None,
    tau_min: float = 0.01,
) -> Segmentation:
    """Ablation D for one trajectory of n turns (§3.11).

    ``random.Random(seed)`` shuffles positions [min_len, n - min_len]; each is accepted greedily under the
    L_min rule (recorded as ``random``, not semantic); then max-length repair (which never fires, since
    greedy filling leaves every gap <= 2 L_min - 1 <= L_max). ``d``/``boundary_valid`` (optional, [n])
    feed the repair's guided fallback as in the full method.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n: expected an int >= 0, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed: expected an int, got {type(seed).__name__} {seed!r}")
    min_len, max_len = _check_span_lengths(min_len, max_len)
    tau_min = check_real(tau_min, "tau_min")
    d_l = v_l = None
    if d is not None or boundary_valid is not None:
        if d is None or boundary_valid is None:
            raise ValueError("boundary_valid: d and boundary_valid must be given together")
        dt = as_tensor(d, "d")
        check_ndim(dt, "d", 1)
        if dt.shape[0] != n:
            raise ValueError(f"d: expected shape ({n},), got {tuple(dt.shape)}")
        check_finite(dt, "d")
        d_l = dt.float().tolist()
        v_l = check_bool_vector(boundary_valid, "boundary_valid", n).tolist()
    return Segmentation.from_boundaries(n, random_lists(n, min_len, max_len, seed, d_l, v_l, tau_min))


def _random_batch(
    d_s: Tensor, bvalid_s: Tensor, offsets: Tensor, cfg: CreditConfig, first: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Ablation D on every trajectory: Python's random.Random(seed + trajectory index), the index counted from
    ``first`` (the batch's first trajectory in the whole batch); same outputs as :func:`segment_batch`."""
    d_l, v_l, o_l = d_s.tolist(), bvalid_s.tolist(), offsets.tolist()
    lo, hi, base = cfg.min_span_turns, cfg.max_span_turns, cfg.seed + first
    return _pack(
        random_lists(e - s, lo, hi, base + j, d_l[s:e], v_l[s:e], cfg.tau_min)
        for j, (s, e) in enumerate(zip(o_l[:-1], o_l[1:]))
    )


def segment_trajectories(
    index: TurnIndex,
    d_s: Tensor,
    bvalid_s: Tensor,
    tau: float,
    cfg: CreditConfig,
    impl: str,
    mx: Metrics,
    *,
    trajectory_offset: int = 0,
) -> tuple[Tensor, Tensor, int]:
    """Spans of every trajectory of a batch (identity order): mode "adaptive" (§3.5) or "random" (§3.11 D).

    d_s [M] float32 and bvalid_s [M] bool are the adjacent distances in identity order; tau the batch
    threshold (the whole batch's, when the batch is a share of it). trajectory_offset: trajectories of the
    whole batch before this one in sorted (task, rollout) order (mode "random" seeds by the global index).
    Returns (seg_s [M] long span index in this batch, kind_s [M] int8 kind of the boundary starting at each
    turn, number of spans) and records the boundary and span metrics in ``mx``.
    """
    m = index.num_turns
    dev = d_s.device
    offsets = index.traj_offsets_T1
    if cfg.mode == "adaptive":
        pos, kinds, bo = segment_batch(
            d_s, bvalid_s, offsets, tau, cfg.min_span_turns, cfg.max_span_turns, cfg.tau_min, impl
        )
    else:
        pos, kinds, bo = _random_batch(d_s, bvalid_s, offsets, cfg, trajectory_offset)
    pos, kinds, bo = pos.to(dev), kinds.to(dev), bo.to(dev)
    traj_of_b = torch.repeat_interleave(torch.arange(index.num_trajectories, device=dev), bo[1:] - bo[:-1])
    flat = offsets[:-1][traj_of_b] + pos
    start = torch.zeros(m, dtype=torch.bool, device=dev)
    start[offsets[:-1]] = True
    start[flat] = True
    seg_s = torch.cumsum(start.long(), 0) - 1
    kind_s = torch.zeros(m, dtype=torch.int8, device=dev)
    kind_s[flat] = kinds
    num_seg = int(seg_s[-1]) + 1 if m else 0

    kc = torch.bincount(kinds.long(), minlength=5) if kinds.numel() else torch.zeros(5, dtype=torch.long, device=dev)
    mx.put("m2/accepted_semantic_boundary_count", kc[KIND_SEMANTIC], summed)
    mx.put("m2/semantic_boundary_count", kc[KIND_SEMANTIC], summed)
    mx.put("m2/correspondence_guided_fallback_boundary_count", kc[KIND_GUIDED], summed)
    mx.put("m2/forced_max_boundary_count", kc[KIND_FORCED], summed)
    mx.put("m2/random_boundary_count", kc[KIND_RANDOM], summed)
    mx.put("m2/segment_count", num_seg, summed)
    seg_len = torch.bincount(seg_s, minlength=num_seg).double()
    mx.dist("m2/segment_length", seg_len, ())
    return seg_s, kind_s, num_seg
