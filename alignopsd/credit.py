"""Mechanism 2: semi-Markov hierarchical credit, the allocator (ALGORITHM.md §3.1, §3.6-§3.11).

Legend: M = canonical turns, L = response length, T = trajectories, G = tasks, S = segments (spans),
Q = policy tokens. Suffix ``_s``: per turn in identity order (task, rollout, turn); ``_M``: in the order given.

Pipeline of ``allocate_credit`` (everything detached; profiles and distances in float32, budgets,
densities, projection and weights in float64, outputs float32):

1. outcome advantage A per trajectory (§3.1) and turn gap g_u = mean corrected gap over policy tokens;
2. profiles, adjacent distances and the batch threshold tau (§3.2-§3.4, ``alignopsd.profiles``);
3. segmentation of every trajectory (§3.5, ``alignopsd.segmentation``; C++ or the Python loop);
4. span budgets b, within-span budgets q, raw density h (§3.7), box projection (§3.8,
   ``alignopsd.projection``; C++ or Python, bit-identical), mixing w = (1 - eta) + eta x (§3.9), token
   advantages; invalid residual (§3.10).

The hot path is vectorised over the whole batch; segmentation and projection are the sequential parts.
Slow per-turn loop references of every vectorised function live in ``alignopsd.testing``.
Ablations (§3.11): mode "adaptive" (E), "token" (B), "turn" (C), "random" (D). Ablation A is the
Mechanism-1 side (alpha_max = 0) and needs nothing here.

Data parallelism: a call may see one share of the step's batch (whole tasks). Everything above is per task,
trajectory or turn except tau, the ln M of the "entropy" distance, the task-block width of the profile sums and
the global trajectory index of the ablation-D seeds; ``whole_batch`` (``credit_config.WholeBatch``, gathered by
the engine) carries those, and the share then gets exactly its turns' results of the whole batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from alignopsd import _native
from alignopsd._checks import as_tensor, check_finite, check_ids, check_ndim, check_square
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
from alignopsd.credit_config import CreditConfig, WholeBatch
from alignopsd.metrics import Metrics
from alignopsd.profiles import BatchDistances, batch_distances
from alignopsd.projection import PROJECTION_TOL, project_batch
from alignopsd.reduction import extreme_max, pooled_std, same, summed, weighted_mean
from alignopsd.segmentation import segment_trajectories

__all__ = ["Credit", "CreditConfig", "WholeBatch", "allocate_credit"]

ADVANTAGE_EPS = 1e-6
_ZERO_F32 = torch.zeros((), dtype=torch.float32)


@dataclass
@dataclass
class Credit:
    """Result of ``allocate_credit``; per-turn tensors in the order the turns were given.

    Fields:
        advantage: [M] outcome advantage A of the turn's trajectory (GRPO, §3.1).
        turn_weight: [M] w_u (mode "token": mean token weight of the turn).
        token_advantage: [M, L] final advantage mask * (A * w + residual); exactly 0 outside the mask.
        segment_index: [M] long, global span index in sorted (task, rollout) order, left to right; -1 in
            modes "turn" and "token". For a share of a larger batch (``whole_batch``) the indices count from 0
            in the share; adding the span count of the shares before it gives the whole batch's.
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
# the batch in identity order
# ----------------------------------------------------------------------------------------------------


@dataclass
class _Turns:
    """Checked inputs and the per-turn quantities every allocation mode reads (``_s``: identity order)."""

    index: TurnIndex
    gap: Tensor  # [M, L] as given
    mask_b: Tensor  # [M, L] bool, as given
    mask_f: Tensor  # [M, L] in gap's dtype
    H: Tensor  # [M, M] float32
    E: Tensor  # [M, M] bool
    invalid: Tensor | None  # [M] bool
    r_T: Tensor  # [T] outcome per trajectory
    A_T: Tensor  # [T] outcome advantage
    A_s: Tensor  # [M]
    g_s: Tensor  # [M] turn gap
    s_s: Tensor  # [M] outcome-aligned score sign(A) g
    ntok_s: Tensor  # [M] policy tokens, float64
    ntraj_T: Tensor  # [T] policy tokens per trajectory
    residual_s: Tensor  # [M] invalid-action residual, float64

    @property
    def m(self) -> int:
        return self.index.num_turns


def _checked_inputs(gap, mask, outcome, task, rollout, turn, H, eligible, invalid):
    """Validate the inputs (ValueError naming the argument); tensors on gap's device."""
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
    mask_b = _policy_mask(mask, (m, int(gap_t.shape[1]))).to(dev)
    r_M = check_outcome(outcome, m).detach().to(dev)
    H_f = check_square(H, "H", m, floating=True).detach().to(dev)
    E_b = check_square(eligible, "eligible", m, floating=False).to(dev)
    inv_M = None if invalid is None else check_invalid(invalid, m).to(dev)
    if m == 0:
        raise ValueError("task: empty batch (M = 0)")
    return gap_t, mask_b, r_M, H_f, E_b, inv_M, task_t.to(dev), roll_t.to(dev), turn_t.to(dev)


def _turns(gap, mask, outcome, task, rollout, turn, H, eligible, invalid, cfg: CreditConfig) -> _Turns:
    """Outcome advantage (§3.1), turn gaps and scores, token counts and the invalid residual (§3.10)."""
    gap_t, mask_b, r_M, H_f, E_b, inv_M, task_t, roll_t, turn_t = _checked_inputs(
        gap, mask, outcome, task, rollout, turn, H, eligible, invalid
    )
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
    s_s = torch.sign(A_T)[index.traj_M] * g_s
    ntraj_T = _group_sum(ntok_s, index.traj_M, index.num_trajectories)
    m = index.num_turns
    residual_s = torch.zeros(m, dtype=torch.float64, device=gap_t.device)
    if inv_M is not None and cfg.invalid_penalty > 0:
        residual_s = residual_from_index(
            r_M[order], inv_M[order], index.task_M, index.num_tasks, cfg.invalid_penalty, cfg.norm_by_std
        )
    return _Turns(index, gap_t, mask_b, mask_f, H_f, E_b, inv_M, r_T, A_T, A_s, g_s, s_s, ntok_s, ntraj_T, residual_s)


# ----------------------------------------------------------------------------------------------------
# allocation modes
# ----------------------------------------------------------------------------------------------------


@dataclass
class _Allocation:
    """What a mode allocated: per-turn w, h, x ([M], identity order), the token advantages [M, L] (order
    given), and the allocation units (turns, or tokens in mode "token") with their h, x, mixed weight, count
    and trajectory, for the conservation check and the diagnostics."""

    w_s: Tensor
    h_s: Tensor
    x_s: Tensor
    token_adv: Tensor
    unit_h: Tensor
    unit_x: Tensor
    unit_w: Tensor
    unit_c: Tensor
    unit_traj: Tensor
    token_weight: Tensor | None = None
    dists: BatchDistances | None = None
    seg_s: Tensor | None = None
    kind_s: Tensor | None = None


def _allocate_tokens(t: _Turns, cfg: CreditConfig, impl: str) -> _Allocation:
    """Ablation B: flat token-level credit within each trajectory, projected to the box, no eta mixing."""
    m, L = t.gap.shape
    order, traj_s = t.index.order_M, t.index.traj_M
    t_count = t.index.num_trajectories
    dev = t.gap.device
    lo, hi = cfg.box
    mask_s = t.mask_b[order]
    gap_s = t.gap[order]
    flat = torch.nonzero(mask_s.reshape(-1)).flatten()  # policy tokens in identity order
    tok_turn = flat // L
    tok_traj = traj_s[tok_turn]
    delta = gap_s.reshape(-1)[flat].double()
    q_tok = _group_softmax(torch.sign(t.A_T)[tok_traj] * delta / cfg.credit_temperature, tok_traj, t_count)
    raw_tok = t.ntraj_T[tok_traj] * q_tok
    tok_off = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), torch.cumsum(t.ntraj_T.long(), 0)])
    ones = torch.ones_like(raw_tok)
    x_tok = project_batch(raw_tok, ones, tok_off, lo, hi, PROJECTION_TOL, impl)
    w_s = _group_sum(x_tok, tok_turn, m) / t.ntok_s
    h_s = _group_sum(raw_tok, tok_turn, m) / t.ntok_s
    tw_s = torch.zeros(m * L, dtype=torch.float32, device=dev)
    tw_s[flat] = x_tok.float()
    tw_s = tw_s.view(m, L)
    # float32 products: a weight of exactly 1 reproduces the GRPO advantage bit for bit
    adv_s = (t.A_s.float()[:, None] * tw_s + t.residual_s.float()[:, None]) * mask_s
    return _Allocation(
        w_s=w_s,
        h_s=h_s,
        x_s=w_s,
        token_adv=_unsort(adv_s.add_(0.0), order),
        unit_h=raw_tok,
        unit_x=x_tok,
        unit_w=x_tok,  # no eta mixing in ablation B
        unit_c=ones,
        unit_traj=tok_traj,
        token_weight=_unsort(tw_s, order),
    )


def _allocate_spans(t: _Turns, cfg: CreditConfig, impl: str, mx: Metrics, whole: WholeBatch | None) -> _Allocation:
    """Modes "adaptive" (E), "random" (D) and "turn" (C: one span per trajectory): span budgets b, within-span
    budgets q, raw density h (§3.7), box projection (§3.8), mixing (§3.9). ``whole``: see ``allocate_credit``."""
    index = t.index
    traj_s, t_count = index.traj_M, index.num_trajectories
    dev = t.gap.device
    tc = cfg.credit_temperature
    dists = kind_s = None
    if not cfg.uses_distances:  # mode "turn"
        seg_s, n_seg = traj_s, t_count
    else:
        dists = batch_distances(index, t.H, t.E, cfg, mx, whole)
        first = whole.trajectory_offset if whole is not None else 0
        seg_s, kind_s, n_seg = segment_trajectories(
            index, dists.d_s, dists.bvalid_s, dists.threshold, cfg, impl, mx, trajectory_offset=first
        )
    seg_traj = torch.zeros(n_seg, dtype=torch.long, device=dev).index_put_((seg_s,), traj_s)
    turns_seg = _group_sum(torch.ones_like(t.s_s), seg_s, n_seg)
    S_seg = _group_sum(t.s_s, seg_s, n_seg) / turns_seg  # unweighted mean over the span's turns
    N_seg = _group_sum(t.ntok_s, seg_s, n_seg)
    b_seg = _group_softmax(torch.log(N_seg) + S_seg / tc, seg_traj, t_count)
    q_s = _group_softmax(torch.log(t.ntok_s) + t.s_s / tc, seg_s, n_seg)
    h_s = t.ntraj_T[traj_s] * b_seg[seg_s] * q_s / t.ntok_s
    lo, hi = cfg.box
    x_s = project_batch(h_s, t.ntok_s, index.traj_offsets_T1, lo, hi, PROJECTION_TOL, impl)
    w_s = (1.0 - cfg.mixing) + cfg.mixing * x_s
    # float32 products: a weight of exactly 1 reproduces the GRPO advantage bit for bit
    coef = t.A_s.float() * w_s.float() + t.residual_s.float()
    # exactly 0 outside the mask: 0 + (0 * negative) = +0.0, in one fused pass
    token_adv = torch.addcmul(_ZERO_F32.to(dev), t.mask_f.float(), _unsort(coef, index.order_M)[:, None])
    if cfg.mode == "turn":
        mx.put("m2/segment_budget_entropy_mean", 0.0, weighted_mean, t_count)
    else:
        mx.put(
            "m2/segment_budget_entropy_mean", _group_entropy(b_seg, seg_traj, t_count).mean(), weighted_mean, t_count
        )
    mx.put("m2/within_segment_turn_entropy_mean", _group_entropy(q_s, seg_s, n_seg).mean(), weighted_mean, n_seg)
    return _Allocation(
        w_s=w_s,
        h_s=h_s,
        x_s=x_s,
        token_adv=token_adv,
        unit_h=h_s,
        unit_x=x_s,
        unit_w=w_s,
        unit_c=t.ntok_s,
        unit_traj=traj_s,
        dists=dists,
        seg_s=seg_s if cfg.mode in ("adaptive", "random") else None,
        kind_s=kind_s,
    )


# ----------------------------------------------------------------------------------------------------
# conservation, diagnostics, result
# ----------------------------------------------------------------------------------------------------


def _conservation_errors(t: _Turns, a: _Allocation) -> tuple[Tensor, Tensor]:
    """Budget conservation (§3.9): sum N x = N_tau and sum N w = N_tau per trajectory, within 1e-5 N_tau
    (RuntimeError otherwise); returns the relative errors [T] of x and w."""
    t_count = t.index.num_trajectories
    err_x = (_group_sum(a.unit_c * a.unit_x, a.unit_traj, t_count) - t.ntraj_T).abs() / t.ntraj_T
    err_w = (_group_sum(a.unit_c * a.unit_w, a.unit_traj, t_count) - t.ntraj_T).abs() / t.ntraj_T
    worst = float(torch.maximum(err_x, err_w).max())
    if worst > PROJECTION_TOL:
        raise RuntimeError(f"allocate_credit: budget conservation violated (relative error {worst:.3g} > 1e-5)")
    return err_x, err_w


def _allocation_metrics(mx: Metrics, t: _Turns, a: _Allocation, cfg: CreditConfig, err_x: Tensor, err_w: Tensor):
    """Projection, weight and episode diagnostics (§4.3); in mode "token" the per-turn densities are the turn
    means of the token densities."""
    lo, hi = cfg.box
    t_count = t.index.num_trajectories
    mx.rate("m2/raw_density_over_cap_rate", a.unit_h > hi)
    mx.rate("m2/raw_density_under_floor_rate", a.unit_h < lo)
    left_box = _group_sum(((a.unit_h < lo) | (a.unit_h > hi)).double(), a.unit_traj, t_count) > 0
    mx.rate("m2/projection_activation_rate", left_box)
    mx.put("m2/projection_mean_absolute_change", (a.unit_x - a.unit_h).abs().mean(), weighted_mean, a.unit_h.numel())
    mx.put("m2/credit_conservation_error_max", err_x.max(), extreme_max, err_x.numel())
    mx.put("m2/mixed_credit_conservation_error_max", err_w.max(), extreme_max, err_w.numel())
    mx.dists(
        {
            "m2/turn_gap": t.g_s,
            "m2/outcome_aligned_score": t.s_s,
            "m2/raw_density": a.h_s,
            "m2/projected_density": a.x_s,
            "m2/turn_weight": a.w_s,
        }
    )
    mx.corr("m2/turn_weight_corr_num_tokens", a.w_s, t.ntok_s)
    mx.corr("m2/turn_weight_corr_turn_gap", a.w_s, t.g_s)
    mx.corr("m2/turn_weight_corr_abs_turn_gap", a.w_s, t.g_s.abs())
    mx.corr("m2/turn_weight_corr_score", a.w_s, t.s_s)
    mx.rate("m2/positive_outcome_alignment_rate", t.s_s > 0)
    a_mean, r_mean = t.A_T.mean(), t.r_T.mean()
    mx.put("m2/trajectory_advantage_mean", a_mean, weighted_mean, t_count)
    mx.put("m2/trajectory_advantage_std", t.A_T.std(correction=0), pooled_std, a_mean, t_count, 0)
    mx.put("m2/trajectory_advantage_abs_mean", t.A_T.abs().mean(), weighted_mean, t_count)
    mx.put("m2/invalid_residual_abs_mean", t.residual_s.abs().mean(), weighted_mean, t.residual_s.numel())
    mx.put("m2/grpo_normalization_turn", 1.0 if cfg.grpo_scope == "turn" else 0.0, same)
    offsets = t.index.traj_offsets_T1
    lengths_T = (offsets[1:] - offsets[:-1]).double()
    mx.put("episode/unique_trajectory_count", t_count, summed)
    mx.put("episode/outcome_mean", r_mean, weighted_mean, t_count)
    mx.put("episode/outcome_std", t.r_T.std(correction=0), pooled_std, r_mean, t_count, 0)
    mx.rate("episode/outcome_positive_rate", t.r_T > 0)
    mx.rate("episode/outcome_perfect_rate", t.r_T >= 1)
    mx.put("episode/trajectory_length_mean", lengths_T.mean(), weighted_mean, t_count)
    mx.put("episode/trajectory_length_max", lengths_T.max(), extreme_max, t_count)
    if t.invalid is not None:
        mx.rate("episode/valid_action_ratio", ~t.invalid)


def _credit(t: _Turns, a: _Allocation, metrics: dict[str, float]) -> Credit:
    """Per-turn results back in the order given."""
    m, order, dev = t.m, t.index.order_M, t.gap.device
    d = a.dists
    kind_s = a.kind_s if a.kind_s is not None else torch.zeros(m, dtype=torch.int8, device=dev)
    zeros_f = torch.zeros(m, dtype=torch.float32, device=dev)
    zeros_b = torch.zeros(m, dtype=torch.bool, device=dev)
    return Credit(
        advantage=_unsort(t.A_s.float(), order),
        turn_weight=_unsort(a.w_s.float(), order),
        token_advantage=a.token_adv,
        segment_index=(
            _unsort(a.seg_s, order) if a.seg_s is not None else torch.full((m,), -1, dtype=torch.long, device=dev)
        ),
        threshold=d.threshold if d is not None else math.inf,
        metrics=metrics,
        turn_gap=_unsort(t.g_s.float(), order),
        score=_unsort(t.s_s.float(), order),
        raw_density=_unsort(a.h_s.float(), order),
        density=_unsort(a.x_s.float(), order),
        residual=_unsort(t.residual_s.float(), order),
        boundary_kind=_unsort(kind_s.long(), order),
        profile_valid=_unsort(d.profile_valid_s, order) if d is not None else zeros_b,
        boundary_distance=_unsort(d.d_s, order) if d is not None else zeros_f,
        boundary_valid=_unsort(d.bvalid_s, order) if d is not None else zeros_b,
        token_weight=a.token_weight,
    )


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
    whole_batch: WholeBatch | None = None,
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
        whole_batch: the turns given are one share of a larger batch (data parallelism: whole tasks per
            rank) and these are the whole batch's statistics (:class:`WholeBatch`): its threshold tau, turn
            count M (ln M of the "entropy" distance), task-block width and the share's first trajectory
            index (mode "random" seeds). Everything else of §3 is per task or per trajectory, so the share
            gets exactly the spans, budgets and token advantages of its turns in the whole batch; only
            ``segment_index`` counts from 0 in the share. None: the turns given are the whole batch.
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
    t = _turns(gap, mask, outcome, task, rollout, turn, H, eligible, invalid, cfg)
    if whole_batch is not None:
        if not isinstance(whole_batch, WholeBatch):
            raise ValueError(f"whole_batch: expected a WholeBatch, got {type(whole_batch).__name__}")
        whole_batch.check_share(turns=t.m, width=t.index.largest_task_turns)
        whole_batch.check_threshold(cfg)
    mx = Metrics(t.gap.device)
    a = _allocate_tokens(t, cfg, impl) if cfg.mode == "token" else _allocate_spans(t, cfg, impl, mx, whole_batch)
    err_x, err_w = _conservation_errors(t, a)
    _allocation_metrics(mx, t, a, cfg, err_x, err_w)
    return _credit(t, a, mx.result())
