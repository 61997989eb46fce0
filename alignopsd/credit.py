"""Mechanism 2: semi-Markov hierarchical credit (ALGORITHM.md §3.2-§3.11).

Legend: M = canonical turns, L = response length, T = trajectories, G = tasks, N = turns of the
largest task (a task block), K = adjacent turn pairs, S = segments (spans), Q = policy tokens.
Suffixes name tensor shapes where tensors meet (``P_MM``, ``H_GSN`` = [task, source, target]).

Pipeline of ``allocate_credit`` (everything detached; profiles and distances in float32, budgets,
densities, projection and weights in float64, outputs float32):

1. outcome advantage A per trajectory (§3.1) and turn gap g_u = mean corrected gap over policy tokens;
2. correspondence profiles P[t, s] = softmax over eligible s of H[s, t] / T_p, per task block (§3.2);
3. adjacent-turn distances with their validity rules (§3.3) and the batch threshold tau (§3.4);
4. segmentation of every trajectory (§3.5; C++ ``alignopsd._C.segment_batch`` or the Python loop);
5. span budgets b, within-span budgets q, raw density h (§3.7), box projection (§3.8; C++ or Python,
   bit-identical), mixing w = (1 - eta) + eta x (§3.9), token advantages; invalid residual (§3.10).

The hot path is vectorised over the whole batch; segmentation and projection are the sequential parts.
On CUDA tensors (with triton importable) steps 2-3 and the public ``correspondence_profiles`` /
``boundary_scores`` run on the Triton kernels of ``alignopsd.kernels`` instead (same rules, tested equal).
Slow per-turn loop references of every vectorised function live in ``alignopsd.reference``.
Ablations (§3.11): mode "adaptive" (E), "token" (B), "turn" (C), "random" (D). Ablation A is the
Mechanism-1 side (alpha_max = 0) and needs nothing here.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch
from torch import Tensor

from alignopsd import _native
from alignopsd._checks import as_tensor, check_choice, check_finite, check_ids, check_ndim, check_real
from alignopsd._kernels import use_kernels
from alignopsd.advantage import (
    TurnIndex,
    advantage_from_index,
    build_turn_index,
    check_invalid,
    check_outcome,
    check_two_rollouts,
    residual_from_index,
    trajectory_outcomes,
)

__all__ = [
    "CreditConfig",
    "Segmentation",
    "Credit",
    "correspondence_profiles",
    "boundary_scores",
    "segmentation_threshold",
    "segment",
    "segment_random",
    "project_to_box",
    "allocate_credit",
]

MODES = ("adaptive", "turn", "token", "random")
WEIGHTINGS = ("legacy", "bounded")
DISTANCES = ("jsd", "entropy", "cosine")
GRPO_SCOPES = ("trajectory", "turn")

# boundary kinds (Credit.boundary_kind, C++ segment_batch)
KIND_NONE, KIND_SEMANTIC, KIND_GUIDED, KIND_FORCED, KIND_RANDOM = 0, 1, 2, 3, 4

PROJECTION_TOL = 1e-5  # tol of §3.8 and the conservation check of §3.9 (violations > 1e-5 * N_tau)
NEAR_ZERO_DISTANCE = 1e-6  # a valid distance at or below this counts in m2/near_zero_jsd_rate
ADVANTAGE_EPS = 1e-6


# ----------------------------------------------------------------------------------------------------
# configuration and results
# ----------------------------------------------------------------------------------------------------


@dataclass
class CreditConfig:
    """Settings of Mechanism 2 (defaults: ALGORITHM.md §5, common to the paper's profiles)."""

    mode: str = "adaptive"
    """Ablation mode: "adaptive" (E, full method), "turn" (C, one span per trajectory), "token" (B, flat
    token-level credit, no eta mixing), "random" (D, random spans seeded by trajectory index)."""
    weighting: str = "legacy"
    """Box of the projected density x: "legacy" = [0, density_upper_bound]; "bounded" = 1 -/+ multiplier_band."""
    credit_temperature: float = 0.5
    """T_c > 0: temperature of the span and within-span budgets (softmax of log N + S / T_c)."""
    mixing: float = 0.5
    """eta in [0, 1]: turn weight w = (1 - eta) + eta * x (not applied in mode "token")."""
    density_upper_bound: float = 4.0
    """h_max >= 1: upper bound of x in legacy weighting."""
    multiplier_band: float = 0.2
    """band in [0, 1]: bounded weighting keeps x in [1 - band, 1 + band]."""
    profile_temperature: float = 0.1
    """T_p >= 1e-6: temperature of the correspondence profiles softmax(H[s, t] / T_p)."""
    quantile: float = 0.8
    """q in [0, 1]: the segmentation threshold is the q-quantile of valid adjacent distances (linear)."""
    tau_min: float = 0.01
    """Lower clip of the threshold, and the minimum distance of a correspondence-guided fallback boundary."""
    tau_max: float = 0.10
    """Upper clip of the threshold (tau_max >= tau_min)."""
    min_span_turns: int = 2
    """L_min >= 1: minimum span length in turns (a trajectory shorter than this is one short span)."""
    max_span_turns: int = 8
    """L_max >= 2 * L_min - 1: maximum span length; longer gaps are repaired (guided, else forced)."""
    gamma: float = 0.8
    """The Mechanism-1 similarity threshold; a profile is valid iff its best eligible H >= gamma."""
    distance: str = "jsd"
    """Adjacent-profile distance: "jsd" (JS divergence / ln 2), "entropy" (|H(p)-H(q)| / ln M), "cosine"."""
    grpo_scope: str = "turn"
    """Outcome-advantage statistics over "trajectory" (each once) or "turn" (weighted by turn count)."""
    norm_by_std: bool = True
    """Divide the centred outcome by (unbiased std + 1e-6)."""
    invalid_penalty: float = 0.1
    """c >= 0 of the invalid-action residual (§3.10), added after allocation; 0 disables it."""
    seed: int = 0
    """Base seed of mode "random": trajectory j (sorted (task, rollout) order) uses Random(seed + j)."""
    impl: str = "auto"
    """Segmentation/projection implementation: "auto" (C++ if built), "python" or "cpp"."""

    def __post_init__(self) -> None:
        check_choice(self.mode, "mode", MODES)
        check_choice(self.weighting, "weighting", WEIGHTINGS)
        check_choice(self.distance, "distance", DISTANCES)
        check_choice(self.grpo_scope, "grpo_scope", GRPO_SCOPES)
        check_choice(self.impl, "impl", _native.IMPLS)
        self.credit_temperature = check_real(self.credit_temperature, "credit_temperature")
        if self.credit_temperature <= 0:
            raise ValueError(f"credit_temperature: must be > 0, got {self.credit_temperature}")
        self.mixing = check_real(self.mixing, "mixing", lo=0.0, hi=1.0)
        self.density_upper_bound = check_real(self.density_upper_bound, "density_upper_bound", lo=1.0)
        self.multiplier_band = check_real(self.multiplier_band, "multiplier_band", lo=0.0, hi=1.0)
        self.profile_temperature = check_real(self.profile_temperature, "profile_temperature")
        if self.profile_temperature < 1e-6:
            raise ValueError(f"profile_temperature: must be >= 1e-6, got {self.profile_temperature}")
        self.quantile = check_real(self.quantile, "quantile", lo=0.0, hi=1.0)
        self.tau_min = check_real(self.tau_min, "tau_min")
        self.tau_max = check_real(self.tau_max, "tau_max")
        if self.tau_max < self.tau_min:
            raise ValueError(f"tau_max: must be >= tau_min = {self.tau_min}, got {self.tau_max}")
        for name in ("min_span_turns", "max_span_turns", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name}: expected an int, got {type(v).__name__} {v!r}")
        if self.min_span_turns < 1:
            raise ValueError(f"min_span_turns: must be >= 1, got {self.min_span_turns}")
        if self.max_span_turns < 2 * self.min_span_turns - 1:
            raise ValueError(
                f"max_span_turns: must be >= 2 * min_span_turns - 1 = {2 * self.min_span_turns - 1}, "
                f"got {self.max_span_turns}"
            )
        self.gamma = check_real(self.gamma, "gamma")
        if not isinstance(self.norm_by_std, bool):
            raise ValueError(f"norm_by_std: expected a bool, got {type(self.norm_by_std).__name__}")
        self.invalid_penalty = check_real(self.invalid_penalty, "invalid_penalty", lo=0.0)

    @property
    def box(self) -> tuple[float, float]:
        """(lo, hi) of the projected density x."""
        if self.weighting == "legacy":
            return 0.0, self.density_upper_bound
        return 1.0 - self.multiplier_band, 1.0 + self.multiplier_band


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


@dataclass
class Credit:
    """Result of ``allocate_credit``; per-turn tensors in the order the turns were given.

    Fields:
        advantage: [M] outcome advantage A of the turn's trajectory (GRPO, §3.1).
        turn_weight: [M] w_u (mode "token": mean token weight of the turn).
        token_advantage: [M, L] final advantage mask * (A * w + residual); exactly 0 outside the mask.
        segment_index: [M] long, global span index in sorted (task, rollout) order, left to right; -1 in
            modes "turn" and "token".
        threshold: the segmentation threshold tau (math.inf when none: no valid distance, or no spans).
        metrics: the m2/* and episode/* diagnostics of ALGORITHM.md §4.3 as Python floats.
        turn_gap: [M] g_u, mean corrected gap over the turn's policy tokens.
        score: [M] s_u = sign(A) * g_u.
        raw_density: [M] h_u before projection (mode "token": mean over the turn's tokens).
        density: [M] projected x_u (mode "token": mean over the turn's tokens).
        residual: [M] invalid-action residual r_u (0 when disabled).
        boundary_kind: [M] long, kind of the boundary starting at this turn (0 none, 1 semantic,
            2 guided, 3 forced, 4 random).
        profile_valid: [M] bool (all False in modes "turn"/"token", which compute no profiles).
        boundary_distance: [M] d of the turn (0 where invalid or not computed).
        boundary_valid: [M] bool.
        token_weight: [M, L] per-token weights in mode "token", else None.
    """

    advantage: Tensor
    turn_weight: Tensor
    token_advantage: Tensor
    segment_index: Tensor
    threshold: float
    metrics: dict[str, float]
    turn_gap: Tensor
    score: Tensor
    raw_density: Tensor
    density: Tensor
    residual: Tensor
    boundary_kind: Tensor
    profile_valid: Tensor
    boundary_distance: Tensor
    boundary_valid: Tensor
    token_weight: Tensor | None = None


# ----------------------------------------------------------------------------------------------------
# input checks
# ----------------------------------------------------------------------------------------------------


def _square(x, name: str, m: int, *, floating: bool) -> Tensor:
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


def _bool_vector(x, name: str, m: int) -> Tensor:
    t = as_tensor(x, name)
    check_ndim(t, name, 1)
    if t.shape[0] != m:
        raise ValueError(f"{name}: expected shape ({m},), got {tuple(t.shape)}")
    if t.dtype != torch.bool:
        raise ValueError(f"{name}: expected a bool tensor, got {t.dtype}")
    return t


def _policy_mask(mask, shape: tuple[int, int]) -> Tensor:
    """Bool [M, L] policy mask from a bool or 0/1 numeric mask."""
    t = as_tensor(mask, "mask")
    check_ndim(t, "mask", 2)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"mask: expected shape {tuple(shape)} like gap, got {tuple(t.shape)}")
    if t.dtype == torch.bool:
        return t
    if t.is_floating_point():
        check_finite(t, "mask")
    mb = t != 0
    if not bool((t[mb] == 1).all()):
        raise ValueError("mask: expected a bool or 0/1 policy-token mask")
    return mb


# ----------------------------------------------------------------------------------------------------
# profiles and adjacent distances (vectorised; loop references in alignopsd.reference)
# ----------------------------------------------------------------------------------------------------


_FLT_MIN = float(torch.finfo(torch.float32).tiny)
_ZERO_F32 = torch.zeros((), dtype=torch.float32)
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
    Hf = _square(Hf, "H", m, floating=True)
    E = _square(eligible, "eligible", m, floating=False).to(Hf.device)
    if use_kernels(Hf):
        # CUDA: the profile kernel of alignopsd.kernels on one [M, M] block (target-major)
        from alignopsd.kernels.sibling_topk import profiles_blocks  # noqa: PLC0415

        P_b, valid_b = profiles_blocks(Hf.t()[None], E.t()[None], gamma=gamma, temperature=temperature, impl="triton")
        return P_b[0], valid_b[0]
    X, has, valid = _masked_logits(Hf.t()[None], E.t().contiguous()[None], gamma)
    P, _ = _softmax_rows(X[0], temperature)
    P[~has[0]] = 0.0
    return P, valid[0]


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
    if isinstance(P, Tensor) and use_kernels(P):
        # CUDA: the fused Triton kernel of alignopsd.kernels (same rules, tested equal on CPU)
        from alignopsd.kernels.jsd_boundary import boundary_scores as kernel_boundary_scores  # noqa: PLC0415

        return kernel_boundary_scores(P, profile_valid, eligible, task, rollout, turn, distance=distance, impl="triton")
    task_t, roll_t, turn_t = check_ids(task, rollout, turn)
    m = int(task_t.shape[0])
    Pf = _square(P, "P", m, floating=True).detach()
    check_finite(Pf, "P")
    valid = _bool_vector(profile_valid, "profile_valid", m)
    E = _square(eligible, "eligible", m, floating=False)
    index = build_turn_index(task_t, roll_t, turn_t)
    prev, cur = _adjacent_pairs(index)
    ip, ic = index.order_M[prev], index.order_M[cur]
    ok = valid[ip] & valid[ic] & (E[:, ip] == E[:, ic]).all(0)
    d = torch.zeros(m, dtype=torch.float32, device=Pf.device)
    sel = torch.nonzero(ok).flatten()
    d[ic[sel]] = _adjacent_distance(Pf[ip[sel]], Pf[ic[sel]], distance, m)
    bv = torch.zeros(m, dtype=torch.bool, device=Pf.device)
    bv[ic] = ok
    return d, bv


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
    bv = _bool_vector(boundary_valid, "boundary_valid", int(dt.shape[0]))
    return _threshold(dt[bv.to(dt.device)], quantile, tau_min, tau_max)


def _threshold(values: Tensor, quantile: float, tau_min: float, tau_max: float) -> float:
    if values.numel() == 0:
        return math.inf
    q = float(torch.quantile(values.double(), quantile, interpolation="linear"))
    return min(max(q, tau_min), tau_max)


# ----------------------------------------------------------------------------------------------------
# segmentation (Python path; the C++ path is alignopsd._C.segment_batch, bit-identical)
# ----------------------------------------------------------------------------------------------------


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


def _segment_lists(
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


def _random_lists(
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


def _segment_batch(
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
    _check_offsets(o_c, int(d_c.shape[0]))
    d_l, v_l, o_l = d_c.tolist(), v_c.tolist(), o_c.tolist()
    pos_l: list[int] = []
    kind_l: list[int] = []
    bo_l = [0]
    for j in range(len(o_l) - 1):
        s, e = o_l[j], o_l[j + 1]
        res = sorted(_segment_lists(d_l[s:e], v_l[s:e], tau, min_len, max_len, tau_min))
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
    bv = _bool_vector(boundary_valid, "boundary_valid", n)
    offsets = torch.tensor([0, n], dtype=torch.int64)
    pos, kinds, _ = _segment_batch(dt.float(), bv, offsets, tau, min_len, max_len, tau_min, impl_r)
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
        v_l = _bool_vector(boundary_valid, "boundary_valid", n).tolist()
    return Segmentation.from_boundaries(n, _random_lists(n, min_len, max_len, seed, d_l, v_l, tau_min))


# ----------------------------------------------------------------------------------------------------
# box projection (Python path; the C++ path is alignopsd._C.project_batch, bit-identical)
# ----------------------------------------------------------------------------------------------------


def _seqsum(x: Tensor) -> float:
    """Left-to-right float64 sum starting at 0.0 (a sequential cumulative sum; matches the C++ loop)."""
    if x.numel() == 0:
        return 0.0
    return float(torch.cumsum(x, 0)[-1])


def _project_one_py(h: Tensor, c: Tensor, lo: float, hi: float, tol: float) -> tuple[Tensor | None, str]:
    """§3.8 on one float64 vector; returns (x, "") or (None, error message)."""
    n = int(h.shape[0])
    total = _seqsum(c)
    budget = _seqsum(c * h)
    allowed = max(max(tol * total, 32.0 * _FLT_EPS * total * float(n)), 1e-5)
    if abs(budget - total) > allowed:
        return None, (
            f"raw budget sum(counts*h) = {budget!r} differs from sum(counts) = {total!r} by more than {allowed!r}"
        )
    if lo == 1.0 or hi == 1.0:
        return torch.ones_like(h), ""
    if bool(((h >= lo) & (h <= hi)).all()):
        return h.clone(), ""
    a = float((h - hi).min())
    b = float((h - lo).max())
    stop = 1e-7 * max(total, 1.0)
    mid = 0.5 * (a + b)
    for _ in range(100):
        mid = 0.5 * (a + b)
        e = _seqsum(c * torch.clamp(h - mid, lo, hi)) - total
        if abs(e) <= stop:
            break
        if e > 0.0:
            a = mid
        else:
            b = mid
    x = torch.clamp(h - mid, lo, hi)
    for _ in range(3):
        free = (x > lo) & (x < hi)
        denom = _seqsum(c[free])
        if not denom > 0.0:
            break
        step = (total - _seqsum(c * x)) / denom
        x = torch.where(free, x + step, x)
    x = torch.clamp(x, lo, hi)
    s = _seqsum(c * x)
    if abs(s - total) > 5.0 * tol * total:
        return None, f"projection lost the budget: sum(counts*x) = {s!r} vs {total!r}"
    return x, ""


_FLT_EPS = float(torch.finfo(torch.float32).eps)


def _check_box(lo, hi, tol) -> tuple[float, float, float]:
    lo = check_real(lo, "lo", lo=0.0, hi=1.0)
    hi = check_real(hi, "hi", lo=1.0)
    tol = check_real(tol, "tol")
    if tol <= 0:
        raise ValueError(f"tol: must be > 0, got {tol}")
    return lo, hi, tol


def _project_batch(h_K: Tensor, c_K: Tensor, offsets: Tensor, lo: float, hi: float, tol: float, impl: str) -> Tensor:
    """Project every trajectory's slice of the flat float64 h (counts c, int64 offsets [T+1]); float64 x."""
    dev = h_K.device
    h_c = h_K.detach().to("cpu", torch.float64).contiguous()
    c_c = c_K.detach().to("cpu", torch.float64).contiguous()
    o_c = offsets.detach().to("cpu", torch.int64).contiguous()
    if impl == "cpp":
        x = _native.native().project_batch(h_c.numpy(), c_c.numpy(), o_c.numpy(), lo, hi, tol)
        return torch.from_numpy(x).to(dev)
    _check_offsets(o_c, int(h_c.shape[0]))
    if int(c_c.shape[0]) != int(h_c.shape[0]):
        raise ValueError(f"counts: expected length {int(h_c.shape[0])} like h, got {int(c_c.shape[0])}")
    if not bool(torch.isfinite(h_c).all()) or bool((h_c < 0).any()):
        i = int(torch.nonzero(~torch.isfinite(h_c) | (h_c < 0))[0, 0])
        raise ValueError(f"h: must be finite and >= 0; got {float(h_c[i])} at flat position {i}")
    if not bool(torch.isfinite(c_c).all()) or not bool((c_c > 0).all()):
        i = int(torch.nonzero(~torch.isfinite(c_c) | ~(c_c > 0))[0, 0])
        raise ValueError(f"counts: must be finite and > 0; got {float(c_c[i])} at flat position {i}")
    out = torch.empty_like(h_c)
    o_l = o_c.tolist()
    for j in range(len(o_l) - 1):
        s, e = o_l[j], o_l[j + 1]
        if e == s:
            continue
        x, err = _project_one_py(h_c[s:e], c_c[s:e], lo, hi, tol)
        if x is None:
            raise ValueError(f"h: trajectory {j}: {err}")
        out[s:e] = x
    return out.to(dev)


def _check_offsets(offsets: Tensor, k: int) -> None:
    o = offsets.tolist()
    if not o or o[0] != 0 or o[-1] != k or any(o[i] > o[i + 1] for i in range(len(o) - 1)):
        raise ValueError(f"offsets: must be non-decreasing from 0 to {k}, got {o}")


def project_to_box(h: Tensor, counts: Tensor, *, lo: float, hi: float, tol: float = 1e-5, impl: str = "auto") -> Tensor:
    """argmin sum counts*(x-h)^2 s.t. lo <= x <= hi and sum counts*x = sum counts (§3.8, one trajectory).

    Preconditions (else ValueError): h finite and >= 0, counts > 0, lo in [0, 1], hi >= 1, and the raw
    budget sum counts*h within max(tol*N, 32*eps_fp32*N*n, 1e-5) of N = sum counts. lo = 1 or hi = 1 gives
    all ones; h inside the box is returned unchanged; otherwise bisection on lambda of x = clip(h - lambda)
    (100 iterations, stop at |budget - N| <= 1e-7 max(N, 1)), 3 correction passes on the free
    coordinates, final clamp. Computed in float64 (C++ or Python, bit-identical); returned as float32.

    Args:
        h: [n] raw densities. counts: [n] positive weights (token counts).
    """
    impl_r = _native.resolve_impl(impl)
    lo, hi, tol = _check_box(lo, hi, tol)
    ht = as_tensor(h, "h")
    check_ndim(ht, "h", 1)
    ct = as_tensor(counts, "counts")
    check_ndim(ct, "counts", 1)
    if ct.shape != ht.shape:
        raise ValueError(f"counts: expected shape {tuple(ht.shape)} like h, got {tuple(ct.shape)}")
    offsets = torch.tensor([0, int(ht.shape[0])], dtype=torch.int64)
    return _project_batch(ht.double(), ct.double(), offsets, lo, hi, tol, impl_r).float()


# ----------------------------------------------------------------------------------------------------
# grouped helpers (float64)
# ----------------------------------------------------------------------------------------------------


def _group_sum(x: Tensor, group: Tensor, n: int) -> Tensor:
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_add_(0, group, x)


def _group_softmax(logit: Tensor, group: Tensor, n: int) -> Tensor:
    """Softmax of ``logit`` within each group (float64)."""
    gmax = torch.full((n,), -math.inf, dtype=logit.dtype, device=logit.device).scatter_reduce_(0, group, logit, "amax")
    e = torch.exp(logit - gmax[group])
    return e / _group_sum(e, group, n)[group]


def _group_entropy(p: Tensor, group: Tensor, n: int) -> Tensor:
    return -_group_sum(torch.special.xlogy(p, p), group, n)


def _unsort(v_s: Tensor, order: Tensor) -> Tensor:
    out = torch.empty_like(v_s)
    out[order] = v_s
    return out


# ----------------------------------------------------------------------------------------------------
# metrics
# ----------------------------------------------------------------------------------------------------


class _Metrics:
    """Collects 0-d tensors and Python numbers; one device->host transfer at the end."""

    def __init__(self, device) -> None:
        self.device = device
        self.keys: list[str] = []
        self.vals: list[Tensor] = []
        self.floats: dict[str, float] = {}

    def put(self, key: str, value) -> None:
        if isinstance(value, Tensor):
            self.keys.append(key)
            self.vals.append(value.detach().reshape(()).to(torch.float64))
        else:
            self.floats[key] = float(value)

    def rate(self, key: str, flags: Tensor) -> None:
        self.put(key, flags.double().mean() if flags.numel() else 0.0)

    def dist(self, prefix: str, x: Tensor, quantiles: tuple[float, ...] = (0.95,), names: tuple[str, ...] = ()):
        names = names or tuple(f"p{round(q * 100)}" for q in quantiles)
        keys = ["mean", "std", "min", "max", *names]
        if x.numel() == 0:
            for k in keys:
                self.floats[f"{prefix}_{k}"] = 0.0
            return
        x = x.double()
        qs = torch.quantile(x, torch.tensor(quantiles, dtype=torch.float64, device=x.device)) if quantiles else None
        stats = [x.mean(), x.std(correction=0), x.min(), x.max()] + ([qs[i] for i in range(len(quantiles))])
        for k, v in zip(keys, stats):
            self.put(f"{prefix}_{k}", v)

    def dists(self, named: dict[str, Tensor], quantile: float = 0.95) -> None:
        """mean/std/min/max/p95 of several equally long non-empty distributions in one batched pass."""
        keys = list(named)
        x = torch.stack([named[k].double() for k in keys])
        q = torch.quantile(x, quantile, dim=1)
        stats = torch.stack([x.mean(1), x.std(1, correction=0), x.amin(1), x.amax(1), q], 1)
        for i, k in enumerate(keys):
            for j, name in enumerate(("mean", "std", "min", "max", f"p{round(quantile * 100)}")):
                self.keys.append(f"{k}_{name}")
                self.vals.append(stats[i, j])

    def corr(self, key: str, x: Tensor, y: Tensor) -> None:
        if x.numel() < 2:
            self.put(key, 0.0)
            return
        x = x.double() - x.double().mean()
        y = y.double() - y.double().mean()
        den = torch.sqrt((x * x).sum() * (y * y).sum())
        self.put(key, torch.where(den > 0, (x * y).sum() / den.clamp_min(1e-300), torch.zeros_like(den)))

    def result(self) -> dict[str, float]:
        out = dict(self.floats)
        if self.vals:
            out.update(zip(self.keys, torch.stack(self.vals).cpu().tolist()))
        return out


# ----------------------------------------------------------------------------------------------------
# allocate_credit
# ----------------------------------------------------------------------------------------------------


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

    Only same-task cells are read: B is false across tasks by definition (§2.3).
    """
    m = index.num_turns
    dev = H.device
    toff = index.task_offsets_G1
    sizes = toff[1:] - toff[:-1]
    g = index.num_tasks
    nmax = int(sizes.max())
    local = torch.arange(m, device=dev) - toff[index.task_M]
    order = index.order_M
    identity = bool((order == torch.arange(m, device=dev)).all())
    if identity and bool((sizes == nmax).all()) and H.is_contiguous() and E.is_contiguous():
        # sorted input with equal task sizes: the blocks are strided views of the diagonal
        stride = (nmax * m + nmax, m, 1)
        H_GSN = H.as_strided((g, nmax, nmax), stride)
        E_GSN = E.as_strided((g, nmax, nmax), stride)
        return H_GSN, E_GSN, local
    idx = torch.zeros(g, nmax, dtype=torch.long, device=dev)
    real = torch.zeros(g, nmax, dtype=torch.bool, device=dev)
    idx[index.task_M, local] = order
    real[index.task_M, local] = True
    H_GSN = H[idx[:, :, None], idx[:, None, :]]
    E_GSN = E[idx[:, :, None], idx[:, None, :]] & real[:, :, None] & real[:, None, :]
    return H_GSN, E_GSN, local


@dataclass
class _Structure:
    """Profiles, distances and segmentation of a batch (identity order)."""

    profile_valid_s: Tensor
    d_s: Tensor
    bvalid_s: Tensor
    threshold: float
    seg_s: Tensor | None  # global segment index per turn; None: one span per trajectory
    kind_s: Tensor  # int8 boundary kind starting at each turn
    num_segments: int


def _kernel_profiles_distances(
    index: TurnIndex, H_GSN: Tensor, E_GNS: Tensor, local: Tensor, cfg: CreditConfig
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, float]:
    """Profiles (§3.2), adjacent distances (§3.3) and threshold (§3.4) on ``alignopsd.kernels`` (Triton).

    Same rules as the torch path of ``_structure`` (tested equal under the Triton interpreter).
    Returns valid_R [G*N] bool, P_VN (profiles of the valid rows, row order), negent_V (sum p log p of
    those rows), d_s [M] float32 and bvalid_s [M] bool (identity order), tau.
    """
    from alignopsd.kernels import batch_threshold, boundary_scores_blocks, profiles_blocks  # noqa: PLC0415
    from alignopsd.kernels._blocks import task_blocks  # noqa: PLC0415

    m = index.num_turns
    dev = H_GSN.device
    g, nmax = int(E_GNS.shape[0]), int(E_GNS.shape[1])
    P_GNS, valid_GN = profiles_blocks(
        H_GSN.transpose(1, 2), E_GNS, gamma=cfg.gamma, temperature=cfg.profile_temperature, impl="triton"
    )
    # the kernels' block layout of the turns in identity order: the same task blocks and slots as H_GSN
    blocks = task_blocks(index.task_M, index.traj_M, torch.arange(m, device=dev))
    valid_s = valid_GN[index.task_M, local]
    d_s, bvalid_s = boundary_scores_blocks(P_GNS, E_GNS, valid_s, blocks, distance=cfg.distance, impl="triton")
    tau = batch_threshold(d_s, bvalid_s, quantile=cfg.quantile, tau_min=cfg.tau_min, tau_max=cfg.tau_max)
    valid_R = valid_GN.reshape(g * nmax)
    P_VN = P_GNS.view(g * nmax, nmax)[valid_R]
    return valid_R, P_VN, _neg_entropy(P_VN), d_s, bvalid_s, tau


def _structure(index: TurnIndex, H: Tensor, E: Tensor, cfg: CreditConfig, impl: str, mx: _Metrics) -> _Structure:
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
        valid_s = valid_R[row_s]
        both = valid_R[k] & valid_R[k + 1]
        ok = bvalid_s[cur]  # = both & same_mask: the kernel applies the same structural rule
        dist = d_s[bvalid_s]
    else:
        has_R = (words_R != 0).any(-1)
        X_GNS, _, valid_GN = _masked_logits(H_GSN.transpose(1, 2), E_GNS, cfg.gamma, has_R.view(g, nmax))
        valid_R = valid_GN.reshape(rows)
        valid_s = valid_R[row_s]
        # profiles only of valid rows (the only ones distances and diagnostics read), compacted in row order
        all_valid = bool(valid_R.all())
        vrows = None if all_valid else torch.nonzero(valid_R).flatten()
        X_VN = X_GNS.view(rows, nmax) if all_valid else X_GNS.view(rows, nmax).index_select(0, vrows)
        P_VN, negent_V = _softmax_rows(X_VN, cfg.profile_temperature)

        # two consecutive VALID rows are also consecutive in the compacted matrix: score all compacted
        # neighbours, keep the true pairs
        both = valid_R[k] & valid_R[k + 1]
        ok = both & same_mask
        sel = torch.nonzero(ok).flatten()
        pos_R = torch.arange(rows, device=dev) if all_valid else torch.cumsum(valid_R.long(), 0) - 1
        dist_V1 = _adjacent_distance(P_VN[:-1], P_VN[1:], cfg.distance, m, negent_V[:-1], negent_V[1:])
        dist = dist_V1[pos_R[k[sel]]]
        d_s = torch.zeros(m, dtype=torch.float32, device=dev)
        d_s[cur[sel]] = dist
        bvalid_s = torch.zeros(m, dtype=torch.bool, device=dev)
        bvalid_s[cur[sel]] = True
        tau = _threshold(dist, cfg.quantile, cfg.tau_min, cfg.tau_max)

    # diagnostics of profiles and distances
    mx.rate("m2/profile_valid_rate", valid_s)
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

    offsets = index.traj_offsets_T1
    if cfg.mode == "adaptive":
        pos, kinds, bo = _segment_batch(
            d_s, bvalid_s, offsets, tau, cfg.min_span_turns, cfg.max_span_turns, cfg.tau_min, impl
        )
    else:  # random spans (ablation D), Python's random.Random(seed + trajectory index)
        d_l, v_l, o_l = d_s.tolist(), bvalid_s.tolist(), offsets.tolist()
        pos_l: list[int] = []
        kind_l: list[int] = []
        bo_l = [0]
        for j in range(len(o_l) - 1):
            s, e = o_l[j], o_l[j + 1]
            res = sorted(
                _random_lists(
                    e - s, cfg.min_span_turns, cfg.max_span_turns, cfg.seed + j, d_l[s:e], v_l[s:e], cfg.tau_min
                )
            )
            pos_l += [p for p, _ in res]
            kind_l += [k for _, k in res]
            bo_l.append(len(pos_l))
        pos = torch.tensor(pos_l, dtype=torch.int64)
        kinds = torch.tensor(kind_l, dtype=torch.int8)
        bo = torch.tensor(bo_l, dtype=torch.int64)
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
    mx.put("m2/accepted_semantic_boundary_count", kc[KIND_SEMANTIC])
    mx.put("m2/semantic_boundary_count", kc[KIND_SEMANTIC])
    mx.put("m2/correspondence_guided_fallback_boundary_count", kc[KIND_GUIDED])
    mx.put("m2/forced_max_boundary_count", kc[KIND_FORCED])
    mx.put("m2/random_boundary_count", kc[KIND_RANDOM])
    mx.put("m2/segment_count", num_seg)
    seg_len = torch.bincount(seg_s, minlength=num_seg).double()
    mx.dist("m2/segment_length", seg_len, ())
    return _Structure(valid_s, d_s, bvalid_s, tau, seg_s, kind_s, num_seg)


def allocate_credit(
    gap: Tensor,
    mask: Tensor,
    outcome: Tensor,
    task: Tensor,
    rollout: Tensor,
    turn: Tensor,
    H: Tensor,
    eligible: Tensor,
    config: CreditConfig | None = None,
    *,
    invalid: Tensor | None = None,
) -> Credit:
    """Mechanism 2: token advantages from outcome advantage, corrected gaps and correspondence (§3).

    Args:
        gap: [M, L] corrected teacher-student gap per token (delta-tilde); finite.
        mask: [M, L] bool or 0/1 policy-token mask; every turn needs at least one policy token.
        outcome: [M] episode outcome R, equal on every turn of a trajectory.
        task, rollout, turn: [M] integer ids, any order; (task, rollout, turn) unique.
        H: [M, M] similarity H[source, target]; eligible: [M, M] bool structural mask B[source, target].
            Only same-task cells are read (B is false across tasks by definition); eligible cells must be
            finite. Modes "turn" and "token" read neither.
        config: CreditConfig (defaults if None).
        invalid: optional [M] bool, the environment rejected the turn's action. With
            config.invalid_penalty > 0, the residual of §3.10 is added to the token advantages after
            allocation (outside budget conservation).
    Returns:
        Credit (see its docstring); per-turn tensors in the order given, float32 (or bool/long).
    Raises:
        ValueError naming the argument on bad input: shapes, NaN/inf, a turn without policy token, an
        outcome varying inside a trajectory, duplicate turn ids, a task with fewer than two rollouts,
        unknown mode names (in CreditConfig).
    """
    cfg = CreditConfig() if config is None else config
    if not isinstance(cfg, CreditConfig):
        raise ValueError(f"config: expected a CreditConfig, got {type(cfg).__name__}")
    impl = _native.resolve_impl(cfg.impl, "impl")
    task_t, roll_t, turn_t = check_ids(task, rollout, turn)
    m = int(task_t.shape[0])
    gap_t = as_tensor(gap, "gap").detach()
    check_ndim(gap_t, "gap", 2)
    if gap_t.shape[0] != m:
        raise ValueError(f"gap: expected {m} rows like task, got shape {tuple(gap_t.shape)}")
    if not gap_t.is_floating_point():
        raise ValueError(f"gap: expected a floating tensor, got {gap_t.dtype}")
    if not bool(torch.isfinite(gap_t.sum(1)).all()):  # fast test; the exact one only on failure
        check_finite(gap_t, "gap")
    dev = gap_t.device
    L = int(gap_t.shape[1])
    mask_b = _policy_mask(mask, (m, L)).to(dev)
    r_M = check_outcome(outcome, m).detach().to(dev)
    H_f = _square(H, "H", m, floating=True).detach().to(dev)
    E_b = _square(eligible, "eligible", m, floating=False).to(dev)
    inv_M = None if invalid is None else check_invalid(invalid, m).to(dev)
    if m == 0:
        raise ValueError("task: empty batch (M = 0)")
    task_t, roll_t, turn_t = task_t.to(dev), roll_t.to(dev), turn_t.to(dev)

    index = build_turn_index(task_t, roll_t, turn_t)
    check_two_rollouts(index, task_t)
    order = index.order_M
    mask_f = mask_b.to(gap_t.dtype)
    n_M = mask_f.sum(1)
    if bool((n_M == 0).any()):
        j = int(torch.nonzero(n_M == 0)[0, 0])
        raise ValueError(
            f"mask: turn (task={int(task_t[j])}, rollout={int(roll_t[j])}, turn={int(turn_t[j])}) has no policy "
            "token; every canonical turn needs at least one"
        )
    r_T = trajectory_outcomes(r_M, index, task_t, roll_t)
    A_T, A_s = advantage_from_index(r_T, index, scope=cfg.grpo_scope, norm_by_std=cfg.norm_by_std, eps=ADVANTAGE_EPS)
    ntok_s = n_M[order].double()
    # float64 accumulation: a constant gap gives exactly equal turn gaps (uniform evidence => w == 1)
    gsum_M = (gap_t * mask_f).sum(1, dtype=torch.float64)
    g_s = gsum_M[order] / ntok_s
    sign_T = torch.sign(A_T)
    s_s = sign_T[index.traj_M] * g_s
    t_count = index.num_trajectories
    traj_s = index.traj_M
    offsets = index.traj_offsets_T1
    ntraj_T = _group_sum(ntok_s, traj_s, t_count)
    lo, hi = cfg.box
    tc = cfg.credit_temperature
    mx = _Metrics(dev)

    residual_s = torch.zeros(m, dtype=torch.float64, device=dev)
    if inv_M is not None and cfg.invalid_penalty > 0:
        residual_s = residual_from_index(r_M[order], inv_M[order], index.task_M, index.num_tasks, cfg.invalid_penalty)

    token_weight = None
    if cfg.mode == "token":
        struct = None
        seg_s = None
        mask_s = mask_b[order]
        gap_s = gap_t[order]
        flat = torch.nonzero(mask_s.reshape(-1)).flatten()  # policy tokens in identity order
        tok_turn = flat // L
        tok_traj = traj_s[tok_turn]
        delta = gap_s.reshape(-1)[flat].double()
        q_tok = _group_softmax(sign_T[tok_traj] * delta / tc, tok_traj, t_count)
        raw_tok = ntraj_T[tok_traj] * q_tok
        tok_off = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), torch.cumsum(ntraj_T.long(), 0)])
        ones = torch.ones_like(raw_tok)
        x_tok = _project_batch(raw_tok, ones, tok_off, lo, hi, PROJECTION_TOL, impl)
        unit_h, unit_x, unit_traj, unit_c = raw_tok, x_tok, tok_traj, ones
        w_unit = x_tok  # no eta mixing in ablation B
        w_s = _group_sum(x_tok, tok_turn, m) / ntok_s
        h_s = _group_sum(raw_tok, tok_turn, m) / ntok_s
        x_s = w_s
        tw_s = torch.zeros(m * L, dtype=torch.float32, device=dev)
        tw_s[flat] = x_tok.float()
        tw_s = tw_s.view(m, L)
        # float32 products: a weight of exactly 1 reproduces the GRPO advantage bit for bit
        adv_s = (A_s.float()[:, None] * tw_s + residual_s.float()[:, None]) * mask_s
        token_adv = _unsort(adv_s.add_(0.0), order)
        token_weight = _unsort(tw_s, order)
    else:
        if cfg.mode == "turn":
            struct = None
            seg_s, n_seg = traj_s, t_count
        else:
            struct = _structure(index, H_f, E_b, cfg, impl, mx)
            seg_s, n_seg = struct.seg_s, struct.num_segments
        seg_traj = torch.zeros(n_seg, dtype=torch.long, device=dev).index_put_((seg_s,), traj_s)
        turns_seg = _group_sum(torch.ones_like(s_s), seg_s, n_seg)
        S_seg = _group_sum(s_s, seg_s, n_seg) / turns_seg  # unweighted mean over the span's turns
        N_seg = _group_sum(ntok_s, seg_s, n_seg)
        b_seg = _group_softmax(torch.log(N_seg) + S_seg / tc, seg_traj, t_count)
        q_s = _group_softmax(torch.log(ntok_s) + s_s / tc, seg_s, n_seg)
        h_s = ntraj_T[traj_s] * b_seg[seg_s] * q_s / ntok_s
        x_s = _project_batch(h_s, ntok_s, offsets, lo, hi, PROJECTION_TOL, impl)
        w_s = (1.0 - cfg.mixing) + cfg.mixing * x_s
        unit_h, unit_x, unit_traj, unit_c = h_s, x_s, traj_s, ntok_s
        w_unit = w_s
        # float32 products: a weight of exactly 1 reproduces the GRPO advantage bit for bit
        coef = A_s.float() * w_s.float() + residual_s.float()
        # exactly 0 outside the mask: 0 + (0 * negative) = +0.0, in one fused pass
        token_adv = torch.addcmul(_ZERO_F32.to(dev), mask_f.float(), _unsort(coef, order)[:, None])
        if cfg.mode == "turn":
            mx.put("m2/segment_budget_entropy_mean", 0.0)
        else:
            mx.put("m2/segment_budget_entropy_mean", _group_entropy(b_seg, seg_traj, t_count).mean())
        mx.put("m2/within_segment_turn_entropy_mean", _group_entropy(q_s, seg_s, n_seg).mean())

    # budget conservation (§3.9): sum N x = N_tau and sum N w = N_tau per trajectory, within 1e-5 N_tau
    err_x = (_group_sum(unit_c * unit_x, unit_traj, t_count) - ntraj_T).abs() / ntraj_T
    err_w = (_group_sum(unit_c * w_unit, unit_traj, t_count) - ntraj_T).abs() / ntraj_T
    worst = float(torch.maximum(err_x, err_w).max())
    if worst > PROJECTION_TOL:
        raise RuntimeError(f"allocate_credit: budget conservation violated (relative error {worst:.3g} > 1e-5)")

    # diagnostics
    mx.rate("m2/raw_density_over_cap_rate", unit_h > hi)
    mx.rate("m2/raw_density_under_floor_rate", unit_h < lo)
    left_box = _group_sum(((unit_h < lo) | (unit_h > hi)).double(), unit_traj, t_count) > 0
    mx.rate("m2/projection_activation_rate", left_box)
    mx.put("m2/projection_mean_absolute_change", (unit_x - unit_h).abs().mean())
    mx.put("m2/credit_conservation_error_max", err_x.max())
    mx.put("m2/mixed_credit_conservation_error_max", err_w.max())
    # per-turn distributions (mode "token": the densities are the turn means of the token densities)
    mx.dists(
        {
            "m2/turn_gap": g_s,
            "m2/outcome_aligned_score": s_s,
            "m2/raw_density": h_s,
            "m2/projected_density": x_s,
            "m2/turn_weight": w_s,
        }
    )
    mx.corr("m2/turn_weight_corr_num_tokens", w_s, ntok_s)
    mx.corr("m2/turn_weight_corr_turn_gap", w_s, g_s)
    mx.corr("m2/turn_weight_corr_abs_turn_gap", w_s, g_s.abs())
    mx.corr("m2/turn_weight_corr_score", w_s, s_s)
    mx.rate("m2/positive_outcome_alignment_rate", s_s > 0)
    mx.put("m2/trajectory_advantage_mean", A_T.mean())
    mx.put("m2/trajectory_advantage_std", A_T.std(correction=0))
    mx.put("m2/trajectory_advantage_abs_mean", A_T.abs().mean())
    mx.put("m2/invalid_residual_abs_mean", residual_s.abs().mean())
    mx.put("m2/grpo_normalization_turn", 1.0 if cfg.grpo_scope == "turn" else 0.0)
    lengths_T = (offsets[1:] - offsets[:-1]).double()
    mx.put("episode/unique_trajectory_count", t_count)
    mx.put("episode/outcome_mean", r_T.mean())
    mx.put("episode/outcome_std", r_T.std(correction=0))
    mx.rate("episode/outcome_positive_rate", r_T > 0)
    mx.rate("episode/outcome_perfect_rate", r_T >= 1)
    mx.put("episode/trajectory_length_mean", lengths_T.mean())
    mx.put("episode/trajectory_length_max", lengths_T.max())
    if inv_M is not None:
        mx.rate("episode/valid_action_ratio", ~inv_M)

    kind_s = struct.kind_s if struct is not None else torch.zeros(m, dtype=torch.int8, device=dev)
    zeros_f = torch.zeros(m, dtype=torch.float32, device=dev)
    zeros_b = torch.zeros(m, dtype=torch.bool, device=dev)
    seg_out = _unsort(seg_s, order) if (seg_s is not None and cfg.mode in ("adaptive", "random")) else None
    return Credit(
        advantage=_unsort(A_s.float(), order),
        turn_weight=_unsort(w_s.float(), order),
        token_advantage=token_adv,
        segment_index=seg_out if seg_out is not None else torch.full((m,), -1, dtype=torch.long, device=dev),
        threshold=struct.threshold if struct is not None else math.inf,
        metrics=mx.result(),
        turn_gap=_unsort(g_s.float(), order),
        score=_unsort(s_s.float(), order),
        raw_density=_unsort(h_s.float(), order),
        density=_unsort(x_s.float(), order),
        residual=_unsort(residual_s.float(), order),
        boundary_kind=_unsort(kind_s.long(), order),
        profile_valid=_unsort(struct.profile_valid_s, order) if struct is not None else zeros_b,
        boundary_distance=_unsort(struct.d_s, order) if struct is not None else zeros_f,
        boundary_valid=_unsort(struct.bvalid_s, order) if struct is not None else zeros_b,
        token_weight=token_weight,
    )
