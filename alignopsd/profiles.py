"""Correspondence profiles, adjacent-turn distances and the segmentation threshold (ALGORITHM.md §3.2-§3.4).

Legend: M = canonical turns, G = tasks, N = turns of the largest task (a task block), K = adjacent turn
pairs, R = rows of the flattened blocks (G*N), V = valid profile rows. Suffixes name tensor shapes where
tensors meet (``P_MM``, ``H_GSN`` = [task, source, target]).

Profiles P[t, s] = softmax over eligible s of H[s, t] / T_p, per task block (§3.2); adjacent distances with
their validity rules (§3.3); the batch threshold tau (§3.4). Everything here is float32 and detached.
:func:`valid_distances` gives one share's part of the threshold's population (data parallelism).

Paths: everything runs on the entries of ``alignopsd.kernels`` (Triton on CUDA, the kernels' torch path on
CPU): the public dense entries (:func:`correspondence_profiles`, :func:`boundary_scores`) on the dense block
entries, the allocator's batch path (:func:`batch_distances`) on ``profile_rows`` / ``boundary_scores_rows``
(profiles only of the valid rows, their sum p log p taken from the log-softmax and reused by the distances
over compacted neighbours). Slow loop references live in ``alignopsd.testing``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from alignopsd._checks import (
    as_tensor,
    check_bool_vector,
    check_finite,
    check_ids,
    check_ndim,
    check_real,
    check_square,
)
from alignopsd.advantage import TurnIndex, build_turn_index
from alignopsd.credit_config import CreditConfig, WholeBatch
from alignopsd.kernels import batch_threshold, boundary_scores_rows, core_uses_kernels, profile_rows, profiles_blocks
from alignopsd.kernels import boundary_scores as kernel_boundary_scores
from alignopsd.kernels.blocks import blocks_from_order, packed_rows
from alignopsd.metrics import Metrics
from alignopsd.reduction import same, summed, weighted_mean

__all__ = [
    "NEAR_ZERO_DISTANCE",
    "BatchDistances",
    "batch_distances",
    "boundary_scores",
    "correspondence_profiles",
    "segmentation_threshold",
    "valid_distances",
]

NEAR_ZERO_DISTANCE = 1e-6  # a valid distance at or below this counts in m2/near_zero_jsd_rate


def _impl(*tensors: Tensor) -> str:
    """The kernels' Triton path for CUDA tensors (or under ``force_kernels``), else their torch path."""
    return "triton" if core_uses_kernels(*tensors) else "torch"


def correspondence_profiles(
    H: Tensor, eligible: Tensor, *, gamma: float, temperature: float = 0.1
) -> tuple[Tensor, Tensor]:
    """Dense correspondence profiles (§3.2).

    Args:
        H: [M, M] similarity H[source, target].
        eligible: [M, M] bool structural mask B[source, target].
        gamma: profile-validity threshold (the Mechanism-1 gamma); it never truncates the profile.
        temperature: T_p >= 1e-6.
    Returns:
        P [M, M] float32 with P[target, source] (rows sum to 1, or all 0 without an eligible source),
        valid [M] bool.
    Only cells with ``eligible`` true are read; they must be finite.
    """
    gamma = check_real(gamma, "gamma")
    temperature = check_real(temperature, "temperature")
    if temperature < 1e-6:
        raise ValueError(f"temperature: must be >= 1e-6, got {temperature}")
    Hf = as_tensor(H, "H").detach()
    check_ndim(Hf, "H", 2)
    m = int(Hf.shape[0])
    Hf = check_square(Hf, "H", m, floating=True)
    E = check_square(eligible, "eligible", m, floating=False).to(Hf.device)
    # the kernels' profile path (Triton on CUDA, else their torch path) on one [M, M] block (target-major)
    P_b, valid_b = profiles_blocks(
        Hf.t()[None], E.t().contiguous()[None], gamma=gamma, temperature=temperature, impl=_impl(Hf)
    )
    return P_b[0], valid_b[0]


def _adjacent_pairs(index: TurnIndex) -> tuple[Tensor, Tensor]:
    """(prev_K, cur_K): consecutive turns of a trajectory, as positions in identity order."""
    m = index.num_turns
    if m < 2:
        e = torch.zeros(0, dtype=torch.long, device=index.order_M.device)
        return e, e
    same = index.traj_M[1:] == index.traj_M[:-1]
    cur = torch.nonzero(same).flatten() + 1
    return cur - 1, cur


def boundary_scores(
    P: Tensor,
    profile_valid: Tensor,
    eligible: Tensor,
    task: Tensor,
    rollout: Tensor,
    turn: Tensor,
    *,
    distance: str = "jsd",
) -> tuple[Tensor, Tensor]:
    """Adjacent profile distances (§3.3) on a dense profile matrix.

    Args:
        P: [M, M] profiles P[target, source]; profile_valid: [M] bool; eligible: [M, M] B[source, target].
        task, rollout, turn: [M] integer ids (any order; duplicate turn ids in a trajectory are an error).
        distance: "jsd" | "entropy" | "cosine".
    Returns:
        d [M] float32 (distance from the previous turn of the trajectory; 0 where invalid) and
        boundary_valid [M] bool: both profiles valid and the eligible source columns equal. The first
        turn of a trajectory is never a boundary.
    """
    # one implementation: the kernels' entry validates the inputs (ValueError naming the culprit) and computes the
    # distances (Triton on CUDA, or under ``force_kernels``; else its torch path); the core picks the path only
    P = P.detach() if isinstance(P, Tensor) else P
    return kernel_boundary_scores(P, profile_valid, eligible, task, rollout, turn, distance=distance, impl=_impl(P))


def segmentation_threshold(
    d: Tensor, boundary_valid: Tensor, *, quantile: float = 0.8, tau_min: float = 0.01, tau_max: float = 0.10
) -> float:
    """tau = clip(quantile_q of the valid distances (linear interpolation), tau_min, tau_max) (§3.4).

    The population is every valid adjacent pair of the whole batch. Returns ``math.inf`` when none is valid.
    When the batch is split into shares (data parallelism), pass the concatenated :func:`valid_distances` of
    every share (all valid): the quantile depends only on the multiset, so it is the whole batch's tau exactly.
    """
    quantile = check_real(quantile, "quantile", lo=0.0, hi=1.0)
    tau_min = check_real(tau_min, "tau_min")
    tau_max = check_real(tau_max, "tau_max")
    if tau_max < tau_min:
        raise ValueError(f"tau_max: must be >= tau_min = {tau_min}, got {tau_max}")
    dt = as_tensor(d, "d").detach()
    check_ndim(dt, "d", 1)
    check_finite(dt, "d")
    bv = check_bool_vector(boundary_valid, "boundary_valid", int(dt.shape[0]))
    return batch_threshold(dt, bv.to(dt.device), quantile=quantile, tau_min=tau_min, tau_max=tau_max)


def _top1_top3(P_RN: Tensor) -> tuple[Tensor, Tensor]:
    """(largest entry, sum of the 3 largest entries) of each row."""
    v = torch.topk(P_RN, min(3, int(P_RN.shape[1])), dim=-1, sorted=True).values
    return v[:, 0], v.sum(-1)


def _task_blocks(index: TurnIndex, H: Tensor, E: Tensor, width: int | None) -> tuple[Tensor, Tensor, Tensor]:
    """Same-task blocks H_GSN, E_GSN ([task, source, target], padded to N with ineligible cells) and
    the local position of each turn (identity order) inside its block.

    The layout is the kernels' task blocks (``alignopsd.kernels.blocks``) of the identity-sorted turns; N is
    ``width`` when given (the whole batch's, for a share of it), else the largest task's turn count.
    Only same-task cells are read: B is false across tasks by definition (§2.3).
    """
    m = index.num_turns
    dev = H.device
    order = index.order_M
    b = blocks_from_order(order, index.task_M, index.traj_M, width=width)
    g, nmax = b.idx_TN.shape
    local = b.slot_M[order]
    identity = bool((order == torch.arange(m, device=dev)).all())
    if identity and bool(b.member_TN.all()) and H.is_contiguous() and E.is_contiguous():
        # sorted input with equal task sizes: the blocks are strided views of the diagonal
        stride = (nmax * m + nmax, m, 1)
        H_GSN = H.as_strided((g, nmax, nmax), stride)
        E_GSN = E.as_strided((g, nmax, nmax), stride)
        return H_GSN, E_GSN, local
    idx, real = b.idx_TN, b.member_TN
    H_GSN = H[idx[:, :, None], idx[:, None, :]]
    E_GSN = E[idx[:, :, None], idx[:, None, :]] & real[:, :, None] & real[:, None, :]
    return H_GSN, E_GSN, local


@dataclass
class BatchDistances:
    """Profile validity, adjacent distances and threshold of a batch (identity order, [M] each)."""

    profile_valid_s: Tensor
    d_s: Tensor
    bvalid_s: Tensor
    threshold: float


def batch_distances(
    index: TurnIndex, H: Tensor, E: Tensor, cfg: CreditConfig, mx: Metrics, whole: WholeBatch | None = None
) -> BatchDistances:
    """Profiles (§3.2), adjacent distances (§3.3) and the threshold (§3.4) of a whole batch, for
    ``allocate_credit``; records the profile and distance diagnostics in ``mx``.

    ``whole``: the turns are one share of a larger batch: the blocks are ``whole.block_width`` wide, the
    "entropy" distance divides by ln ``whole.turns``, and tau is ``whole.threshold`` (when known; else the
    share's own quantile)."""
    m = index.num_turns
    dev = H.device
    width = whole.block_width if whole is not None else None
    H_GSN, E_GSN, local = _task_blocks(index, H, E, width)
    E_GNS = E_GSN.transpose(1, 2).contiguous()  # eligibility column of each target, as rows
    g, nmax = int(E_GNS.shape[0]), int(E_GNS.shape[1])
    rows = g * nmax
    words_R = packed_rows(E_GNS.view(rows, nmax))
    row_s = index.task_M * nmax + local  # row of each turn (identity order) in the flattened [G*N, N] blocks
    # consecutive turns of a trajectory sit in consecutive rows
    prev, cur = _adjacent_pairs(index)
    k = row_s[cur] - 1  # adjacent-row pair index (r-1, r) of each (prev, cur) turn pair
    same_R1 = (words_R[1:] == words_R[:-1]).all(-1) if rows > 1 else torch.zeros(0, dtype=torch.bool, device=dev)
    same_mask = same_R1[k]

    # the kernels' entries: profiles of the valid rows with their sum p log p, distances of the valid pairs
    pr = profile_rows(
        H_GSN.transpose(1, 2), E_GNS, gamma=cfg.gamma, temperature=cfg.profile_temperature, impl=_impl(H, E)
    )
    valid_R, P_VN, negent_V = pr.valid_BT.reshape(rows), pr.P_VN, pr.negent_V
    blocks = blocks_from_order(torch.arange(m, device=dev), index.task_M, index.traj_M, width=width)  # of H_GSN
    d_s, bvalid_s = boundary_scores_rows(
        P_VN,
        pr.valid_BT,
        E_GNS,
        blocks,
        negent_V=negent_V,
        distance=cfg.distance,
        impl=_impl(H, E),
        num_turns=whole.turns if whole is not None else None,
    )
    both = valid_R[k] & valid_R[k + 1]
    ok = bvalid_s[cur]  # = both & same_mask: the kernels apply the same structural rule
    dist = d_s[bvalid_s]
    if whole is not None and whole.threshold is not None:
        tau = float(whole.threshold)
    else:
        tau = batch_threshold(d_s, bvalid_s, quantile=cfg.quantile, tau_min=cfg.tau_min, tau_max=cfg.tau_max)
    valid_s = valid_R[row_s]

    mx.rate("m2/profile_valid_rate", valid_s)
    _profile_metrics(mx, P_VN, negent_V)
    mx.put("m2/adjacent_pair_count", int(cur.shape[0]), summed)
    mx.rate("m2/adjacent_profiles_valid_rate", both)
    mx.rate("m2/structural_mask_change_rate", ~same_mask)
    mx.rate("m2/valid_jsd_pair_rate", ok)
    mx.put("m2/valid_jsd_sample_count", int(dist.shape[0]), summed)
    mx.rate("m2/near_zero_jsd_rate", dist <= NEAR_ZERO_DISTANCE)
    mx.dist("m2/normalized_jsd", dist, (0.5, 0.8, 0.9))
    mx.put("m2/segmentation_threshold", tau if math.isfinite(tau) else -1.0, same)  # a whole-batch threshold
    mx.put("m2/segmentation_threshold_available", 1.0 if math.isfinite(tau) else 0.0, same)
    mx.put("m2/raw_semantic_candidate_count", (bvalid_s & (d_s.double() > tau)).sum(), summed)
    return BatchDistances(valid_s, d_s, bvalid_s, tau)


def _profile_metrics(mx: Metrics, P_VN: Tensor, negent_V: Tensor) -> None:
    """Entropy, largest probability, top-3 mass and effective support of the valid profiles."""
    if P_VN.shape[0]:
        ent = -negent_V.double()
        top1, top3 = _top1_top3(P_VN)
        n = P_VN.shape[0]
        mx.put("m2/profile_entropy_mean", ent.mean(), weighted_mean, n)
        mx.put("m2/profile_max_prob_mean", top1.double().mean(), weighted_mean, n)
        mx.put("m2/profile_top3_mass_mean", top3.double().mean(), weighted_mean, n)
        mx.put("m2/profile_effective_support_mean", torch.exp(ent).mean(), weighted_mean, n)
    else:
        for key in ("entropy", "max_prob", "top3_mass", "effective_support"):
            mx.put(f"m2/profile_{key}_mean", 0.0, weighted_mean, 0)


def valid_distances(
    task: Tensor,
    rollout: Tensor,
    turn: Tensor,
    H: Tensor,
    eligible: Tensor,
    config: CreditConfig,
    *,
    whole_batch: WholeBatch | None = None,
) -> Tensor:
    """The valid adjacent distances of a batch (§3.3): the population of the threshold (§3.4), float32 [V].

    Computed exactly as ``allocate_credit`` computes them (same path, same bits), so that a batch split into
    shares (data parallelism) gets the whole batch's tau: each share passes ``whole_batch`` (its ``turns`` and
    ``block_width``; the threshold is not read), the shares' results are concatenated and
    :func:`segmentation_threshold` of them, with every entry valid, is the whole batch's tau (the quantile does
    not depend on the order of its population). Arguments as ``allocate_credit``'s; ids in any order.
    """
    if not isinstance(config, CreditConfig):
        raise ValueError(f"config: expected a CreditConfig, got {type(config).__name__}")
    task_t, roll_t, turn_t = check_ids(task, rollout, turn)
    m = int(task_t.shape[0])
    if m == 0:
        raise ValueError("task: empty batch (M = 0)")
    H_f = check_square(H, "H", m, floating=True).detach()
    dev = H_f.device
    E_b = check_square(eligible, "eligible", m, floating=False).to(dev)
    index = build_turn_index(task_t.to(dev), roll_t.to(dev), turn_t.to(dev))
    if whole_batch is not None:
        if not isinstance(whole_batch, WholeBatch):
            raise ValueError(f"whole_batch: expected a WholeBatch, got {type(whole_batch).__name__}")
        whole_batch.check_share(turns=m, width=index.largest_task_turns)
    dists = batch_distances(index, H_f, E_b, config, Metrics(dev), whole_batch)
    return dists.d_s[dists.bvalid_s]
