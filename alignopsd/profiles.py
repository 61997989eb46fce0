"""Correspondence profiles, adjacent-turn distances and the segmentation threshold (ALGORITHM.md §3.2-§3.4).

Legend: M = canonical turns, G = tasks, N = turns of the largest task (a task block), K = adjacent turn
pairs, R = rows of the flattened blocks (G*N), V = valid profile rows. Suffixes name tensor shapes where
tensors meet (``P_MM``, ``H_GSN`` = [task, source, target]).

Profiles P[t, s] = softmax over eligible s of H[s, t] / T_p, per task block (§3.2); adjacent distances with
their validity rules (§3.3); the batch threshold tau (§3.4). Everything here is float32 and detached.

Paths: the public dense entries (:func:`correspondence_profiles`, :func:`boundary_scores`) are the entries of
``alignopsd.kernels`` (Triton on CUDA, the kernels' torch path on CPU). The allocator's batch path
(:func:`batch_distances`) runs the same kernel entries on CUDA; on CPU it keeps a fused torch path (profiles
only of the valid rows, their sum p log p taken from the log-softmax and reused by the distances over
compacted neighbours), which measured as fast as or faster than the kernels' torch path inside
``allocate_credit``. Slow loop references live in ``alignopsd.reference``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from alignopsd._checks import (
    as_tensor,
    check_bool_vector,
    check_choice,
    check_finite,
    check_ids,
    check_ndim,
    check_real,
    check_square,
)
from alignopsd._kernels import use_kernels
from alignopsd.advantage import TurnIndex
from alignopsd.credit_config import DISTANCES, CreditConfig
from alignopsd.kernels import batch_threshold, boundary_scores_blocks, profiles_blocks
from alignopsd.kernels import boundary_scores as kernel_boundary_scores
from alignopsd.kernels.blocks import blocks_from_order
from alignopsd.metrics import Metrics

__all__ = [
    "NEAR_ZERO_DISTANCE",
    "BatchDistances",
    "batch_distances",
    "boundary_scores",
    "correspondence_profiles",
    "segmentation_threshold",
]

NEAR_ZERO_DISTANCE = 1e-6  # a valid distance at or below this counts in m2/near_zero_jsd_rate
_FLT_MIN = float(torch.finfo(torch.float32).tiny)
_MASKED_H = -1e30  # stands for an ineligible cell: exp((-1e30) / T_p - max) is exactly 0 in float32


def _rowdot(a_KN: Tensor, b_KN: Tensor) -> Tensor:
    """sum_j a[..., j] * b[..., j]."""
    return (a_KN * b_KN).sum(-1)


def _masked_logits(
    H_BNS: Tensor, E_BNS: Tensor, gamma: float, has_BN: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Target-major masked similarities X_BNS (ineligible cells = -1e30), has_BN, valid_BN.

    Inputs: H_BNS[b, t, s] = H[s, t] (float32, any strides), E_BNS contiguous bool, ``has_BN`` (some
    eligible source) when already known. valid[t] = some eligible source and max eligible H[s, t] >=
    gamma (float32 comparison, like Mechanism 1's selection H >= gamma). A NaN/inf at an eligible cell
    raises ValueError naming ``H`` (tested on the row sums: the -1e30 fills stay finite).
    """
    X = torch.empty(H_BNS.shape, dtype=torch.float32, device=H_BNS.device)
    torch.where(E_BNS, H_BNS, torch.tensor(_MASKED_H, dtype=torch.float32, device=X.device), out=X)
    if not bool(torch.isfinite(X.sum(-1)).all()):
        raise ValueError("H: contains NaN or inf at eligible cells")
    has = E_BNS.any(-1) if has_BN is None else has_BN
    valid = has & (X.amax(-1) >= gamma)
    return X, has, valid


def _softmax_rows(X_KN: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """Profiles P = softmax(X / T_p) and negent = sum P log P of masked logit rows (X is divided in place).

    The -1e30 fills (finite for T_p >= 1e-6) get probability exactly 0 and no NaN appears; the fused
    softmax kernels are used because a plain exp of such arguments is slow on CPU. A row without any
    eligible source comes out uniform: callers zero or skip it.
    """
    X_KN.div_(temperature)
    P = torch.softmax(X_KN, dim=-1)
    return P, _rowdot(P, torch.log_softmax(X_KN, dim=-1))


def _neg_entropy(P_KN: Tensor) -> Tensor:
    """sum_j p_j log p_j per row (zero-probability terms contribute 0), float32 [K].

    Probabilities are clamped at the smallest normal float32 before the log: it keeps log off its slow
    path for 0 and subnormals and changes the sum by less than 1e-36 per term.
    """
    return _rowdot(P_KN, torch.log(P_KN.clamp_min(_FLT_MIN)))


def _adjacent_distance(
    p_KN: Tensor, q_KN: Tensor, distance: str, m_total: int, negent_p: Tensor | None = None, negent_q=None
) -> Tensor:
    """Distance between profile rows (float32 [K]); the one place a fused kernel can plug in.

    jsd: JS divergence (natural log) / ln 2, clamped to [0, 1], zero-probability terms skipped, computed
    as JSD = 0.5 (sum p log p + sum q log q) - sum m log m with m = (p + q) / 2.
    entropy: |H(p) - H(q)| / ln(m_total) (m_total = the batch's canonical turn count M).
    cosine: 1 - cos(p, q), clamped to [0, 1].
    ``negent_p``/``negent_q`` optionally pass precomputed sum p log p of the rows.
    """
    if p_KN.shape[0] == 0:
        return torch.zeros(0, dtype=torch.float32, device=p_KN.device)
    if distance == "cosine":
        num = _rowdot(p_KN, q_KN)
        den = torch.sqrt(_rowdot(p_KN, p_KN)) * torch.sqrt(_rowdot(q_KN, q_KN))
        return (1.0 - num / den).clamp(0.0, 1.0)
    ep = _neg_entropy(p_KN) if negent_p is None else negent_p
    eq = _neg_entropy(q_KN) if negent_q is None else negent_q
    if distance == "entropy":
        if m_total <= 1:
            return torch.zeros_like(ep)
        return ((ep - eq).abs() / math.log(m_total)).clamp_min(0.0)
    mid = torch.add(p_KN, q_KN).mul_(0.5)
    jsd = 0.5 * (ep + eq) - _neg_entropy(mid)
    return (jsd / math.log(2.0)).clamp(0.0, 1.0)


def _impl(*tensors: Tensor) -> str:
    """The kernels' Triton path for CUDA tensors (or under ``force_kernels``), else their torch path."""
    return "triton" if use_kernels(*tensors) else "torch"


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
    check_choice(distance, "distance", DISTANCES)
    task_t, roll_t, turn_t = check_ids(task, rollout, turn)
    m = int(task_t.shape[0])
    Pf = check_square(P, "P", m, floating=True).detach()
    check_finite(Pf, "P")
    valid = check_bool_vector(profile_valid, "profile_valid", m)
    E = check_square(eligible, "eligible", m, floating=False)
    # the kernels' adjacent-distance path (Triton on CUDA, else their torch path) on the task blocks of P
    return kernel_boundary_scores(Pf, valid, E, task_t, roll_t, turn_t, distance=distance, impl=_impl(Pf))


def segmentation_threshold(
    d: Tensor, boundary_valid: Tensor, *, quantile: float = 0.8, tau_min: float = 0.01, tau_max: float = 0.10
) -> float:
    """tau = clip(quantile_q of the valid distances (linear interpolation), tau_min, tau_max) (§3.4).

    The population is every valid adjacent pair of the whole batch. Returns ``math.inf`` when none is valid.
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
    return _threshold(dt[bv.to(dt.device)], quantile, tau_min, tau_max)


def _threshold(values: Tensor, quantile: float, tau_min: float, tau_max: float) -> float:
    if values.numel() == 0:
        return math.inf
    q = float(torch.quantile(values.double(), quantile, interpolation="linear"))
    return min(max(q, tau_min), tau_max)


def _top1_top3(P_RN: Tensor) -> tuple[Tensor, Tensor]:
    """(largest entry, sum of the 3 largest entries) of each row."""
    v = torch.topk(P_RN, min(3, int(P_RN.shape[1])), dim=-1, sorted=True).values
    return v[:, 0], v.sum(-1)


def _packed_rows(E_RN: Tensor) -> Tensor:
    """Rows of a contiguous bool matrix [R, N] as int64 words [R, ceil(N / 8)] (8 flags per word, zero-padded).

    Row equality and row emptiness become 8x narrower comparisons.
    """
    u8 = E_RN.view(torch.uint8)
    pad = (-E_RN.shape[1]) % 8
    if pad:
        u8 = torch.nn.functional.pad(u8, (0, pad))
    return u8.view(torch.int64)


def _task_blocks(index: TurnIndex, H: Tensor, E: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Same-task blocks H_GSN, E_GSN ([task, source, target], padded to N with ineligible cells) and
    the local position of each turn (identity order) inside its block.

    The layout is the kernels' task blocks (``alignopsd.kernels.blocks``) of the identity-sorted turns.
    Only same-task cells are read: B is false across tasks by definition (§2.3).
    """
    m = index.num_turns
    dev = H.device
    order = index.order_M
    b = blocks_from_order(order, index.task_M, index.traj_M)
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


def _kernel_profiles_distances(
    index: TurnIndex, H_GSN: Tensor, E_GNS: Tensor, local: Tensor, cfg: CreditConfig
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, float]:
    """Profiles (§3.2), adjacent distances (§3.3) and threshold (§3.4) on ``alignopsd.kernels`` (Triton).

    Same rules as the torch path of ``_structure`` (tested equal under the Triton interpreter).
    Returns valid_R [G*N] bool, P_VN (profiles of the valid rows, row order), negent_V (sum p log p of
    those rows), d_s [M] float32 and bvalid_s [M] bool (identity order), tau.
    """
    m = index.num_turns
    dev = H_GSN.device
    g, nmax = int(E_GNS.shape[0]), int(E_GNS.shape[1])
    P_GNS, valid_GN = profiles_blocks(
        H_GSN.transpose(1, 2), E_GNS, gamma=cfg.gamma, temperature=cfg.profile_temperature, impl="triton"
    )
    # the kernels' block layout of the turns in identity order: the same task blocks and slots as H_GSN
    blocks = blocks_from_order(torch.arange(m, device=dev), index.task_M, index.traj_M)
    valid_s = valid_GN[index.task_M, local]
    d_s, bvalid_s = boundary_scores_blocks(P_GNS, E_GNS, valid_s, blocks, distance=cfg.distance, impl="triton")
    tau = batch_threshold(d_s, bvalid_s, quantile=cfg.quantile, tau_min=cfg.tau_min, tau_max=cfg.tau_max)
    valid_R = valid_GN.reshape(g * nmax)
    P_VN = P_GNS.view(g * nmax, nmax)[valid_R]
    return valid_R, P_VN, _neg_entropy(P_VN), d_s, bvalid_s, tau


@dataclass
class BatchDistances:
    """Profile validity, adjacent distances and threshold of a batch (identity order, [M] each)."""

    profile_valid_s: Tensor
    d_s: Tensor
    bvalid_s: Tensor
    threshold: float


def _torch_profiles_distances(
    index: TurnIndex, H_GSN: Tensor, E_GNS: Tensor, words_R: Tensor, k: Tensor, cfg: CreditConfig
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The torch path of profiles and adjacent distances: profiles only of the valid rows (the only ones the
    distances and diagnostics read), compacted in row order. Returns valid_R, P_VN, negent_V and the distance
    of every adjacent pair k whose rows are both valid (dist_K1 over compacted neighbours, read at pos_R[k])."""
    g, nmax = int(E_GNS.shape[0]), int(E_GNS.shape[1])
    rows = g * nmax
    has_R = (words_R != 0).any(-1)
    X_GNS, _, valid_GN = _masked_logits(H_GSN.transpose(1, 2), E_GNS, cfg.gamma, has_R.view(g, nmax))
    valid_R = valid_GN.reshape(rows)
    all_valid = bool(valid_R.all())
    vrows = None if all_valid else torch.nonzero(valid_R).flatten()
    X_VN = X_GNS.view(rows, nmax) if all_valid else X_GNS.view(rows, nmax).index_select(0, vrows)
    P_VN, negent_V = _softmax_rows(X_VN, cfg.profile_temperature)
    # two consecutive VALID rows are also consecutive in the compacted matrix: score all compacted
    # neighbours, keep the true pairs
    pos_R = torch.arange(rows, device=H_GSN.device) if all_valid else torch.cumsum(valid_R.long(), 0) - 1
    dist_V1 = _adjacent_distance(P_VN[:-1], P_VN[1:], cfg.distance, index.num_turns, negent_V[:-1], negent_V[1:])
    return valid_R, P_VN, negent_V, dist_V1, pos_R


def batch_distances(index: TurnIndex, H: Tensor, E: Tensor, cfg: CreditConfig, mx: Metrics) -> BatchDistances:
    """Profiles (§3.2), adjacent distances (§3.3) and the threshold (§3.4) of a whole batch, for
    ``allocate_credit``; records the profile and distance diagnostics in ``mx``."""
    m = index.num_turns
    dev = H.device
    H_GSN, E_GSN, local = _task_blocks(index, H, E)
    E_GNS = E_GSN.transpose(1, 2).contiguous()  # eligibility column of each target, as rows
    g, nmax = int(E_GNS.shape[0]), int(E_GNS.shape[1])
    rows = g * nmax
    words_R = _packed_rows(E_GNS.view(rows, nmax))
    row_s = index.task_M * nmax + local  # row of each turn (identity order) in the flattened [G*N, N] blocks
    # consecutive turns of a trajectory sit in consecutive rows
    prev, cur = _adjacent_pairs(index)
    k = row_s[cur] - 1  # adjacent-row pair index (r-1, r) of each (prev, cur) turn pair
    same_R1 = (words_R[1:] == words_R[:-1]).all(-1) if rows > 1 else torch.zeros(0, dtype=torch.bool, device=dev)
    same_mask = same_R1[k]

    if use_kernels(H, E):
        # CUDA (or force_kernels): profile kernel, fused adjacent-distance kernel, batch threshold
        valid_R, P_VN, negent_V, d_s, bvalid_s, tau = _kernel_profiles_distances(index, H_GSN, E_GNS, local, cfg)
        both = valid_R[k] & valid_R[k + 1]
        ok = bvalid_s[cur]  # = both & same_mask: the kernel applies the same structural rule
        dist = d_s[bvalid_s]
    else:
        valid_R, P_VN, negent_V, dist_V1, pos_R = _torch_profiles_distances(index, H_GSN, E_GNS, words_R, k, cfg)
        both = valid_R[k] & valid_R[k + 1]
        ok = both & same_mask
        sel = torch.nonzero(ok).flatten()
        dist = dist_V1[pos_R[k[sel]]]
        d_s = torch.zeros(m, dtype=torch.float32, device=dev)
        d_s[cur[sel]] = dist
        bvalid_s = torch.zeros(m, dtype=torch.bool, device=dev)
        bvalid_s[cur[sel]] = True
        tau = _threshold(dist, cfg.quantile, cfg.tau_min, cfg.tau_max)
    valid_s = valid_R[row_s]

    mx.rate("m2/profile_valid_rate", valid_s)
    _profile_metrics(mx, P_VN, negent_V)
    mx.put("m2/adjacent_pair_count", int(cur.shape[0]))
    mx.rate("m2/adjacent_profiles_valid_rate", both)
    mx.rate("m2/structural_mask_change_rate", ~same_mask)
    mx.rate("m2/valid_jsd_pair_rate", ok)
    mx.put("m2/valid_jsd_sample_count", int(dist.shape[0]))
    mx.rate("m2/near_zero_jsd_rate", dist <= NEAR_ZERO_DISTANCE)
    mx.dist("m2/normalized_jsd", dist, (0.5, 0.8, 0.9))
    mx.put("m2/segmentation_threshold", tau if math.isfinite(tau) else -1.0)
    mx.put("m2/segmentation_threshold_available", 1.0 if math.isfinite(tau) else 0.0)
    mx.put("m2/raw_semantic_candidate_count", (bvalid_s & (d_s.double() > tau)).sum())
    return BatchDistances(valid_s, d_s, bvalid_s, tau)


def _profile_metrics(mx: Metrics, P_VN: Tensor, negent_V: Tensor) -> None:
    """Entropy, largest probability, top-3 mass and effective support of the valid profiles."""
    if P_VN.shape[0]:
        ent = -negent_V.double()
        top1, top3 = _top1_top3(P_VN)
        mx.put("m2/profile_entropy_mean", ent.mean())
        mx.put("m2/profile_max_prob_mean", top1.double().mean())
        mx.put("m2/profile_top3_mass_mean", top3.double().mean())
        mx.put("m2/profile_effective_support_mean", torch.exp(ent).mean())
    else:
        for key in ("entropy", "max_prob", "top3_mass", "effective_support"):
            mx.put(f"m2/profile_{key}_mean", 0.0)
