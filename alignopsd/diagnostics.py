"""Model-free Mechanism 1 diagnostics (ALGORITHM.md §4.3) and paired sign-flip statistics (§6 case 18).

Legend: M = canonical turns, L = response length, P = kept pairs. ``H_ST[source, target]``.
All functions return flat ``dict[str, float]`` with the spec's metric names (prefix ``m1/``
unless noted); every value is a finite Python float (empty populations give 0 and a count 0).
Also computes the **off-turn match weight** Σ_t Σ_j ω_j·1[turn(s_j) ≠ turn(t)] / #matched targets,
which the reference implementation does not log.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from alignopsd._checks import as_tensor, check_ndim, check_shape
from alignopsd.rectification import Rectified, rectify
from alignopsd.reduction import (
    Stat,
    extreme_max,
    extreme_min,
    percentile,
    pooled,
    pooled_std,
    rms,
    same,
    slowest,
    summed,
    weighted_mean,
)
from alignopsd.samples import record_samples

__all__ = [
    "action_filter_metrics",
    "describe",
    "formula_comparison",
    "m1_diagnostics",
    "off_turn_match_weight",
    "paired_sign_flips",
]

_QUANTILES = (("p10", 0.10), ("p50", 0.50), ("p90", 0.90))


def describe(values: Tensor, name: str, *, quantiles: Sequence[tuple[str, float]] = _QUANTILES) -> dict[str, float]:
    """{name}_{mean,std,min,max,p10,p50,p90,count} of the finite entries of ``values`` (std unbiased; 0 if < 2),
    each declared for the reduction over data-parallel ranks (``alignopsd.reduction``)."""
    v = as_tensor(values, name).detach().reshape(-1)
    if v.numel():
        lo_hi = torch.aminmax(v.float())
        if not (math.isfinite(float(lo_hi[0])) and math.isfinite(float(lo_hi[1]))):
            v = v[torch.isfinite(v)]
    n = int(v.numel())
    out = {f"{name}_count": summed(n)}
    ref = record_samples(name, v, 1)
    if n == 0:
        stats = dict.fromkeys(("mean", "std", "min", "max"), 0.0)
        qs = [0.0] * len(quantiles)
    else:
        a = v.cpu().double().numpy()
        stats = {
            "mean": float(a.mean()),
            "std": float(a.std(ddof=1)) if n > 1 else 0.0,
            "min": float(a.min()),
            "max": float(a.max()),
        }
        # linear-interpolation quantiles (selection, not a full sort; same definition as torch.quantile)
        qs = np.quantile(a, [q for _, q in quantiles]).tolist()
    out[f"{name}_mean"] = weighted_mean(stats["mean"], n)
    out[f"{name}_std"] = pooled_std(stats["std"], stats["mean"], n, 1, ref)
    out[f"{name}_min"] = extreme_min(stats["min"], n)
    out[f"{name}_max"] = extreme_max(stats["max"], n)
    for (label, q), val in zip(quantiles, qs):
        out[f"{name}_{label}"] = percentile(val, q, n, ref)
    return out


def off_turn_match_weight(pairs: Tensor, pair_weight: Tensor, turn: Tensor) -> float:
    """Σ_t Σ_j ω_j · 1[turn(s_j) ≠ turn(t)] / #matched targets (0 when nothing is matched).

    pairs: [P, 2] (source, target); pair_weight: [P] ω of each pair; turn: [M] turn ids.
    """
    pr = as_tensor(pairs, "pairs")
    if pr.numel() == 0:
        pr = pr.reshape(0, 2)
    check_ndim(pr, "pairs", 2)
    if pr.shape[1] != 2 or pr.is_floating_point() or pr.dtype == torch.bool:
        raise ValueError(f"pairs: expected an integer tensor of shape [P, 2], got {pr.dtype} {tuple(pr.shape)}")
    pr = pr.long()
    w = as_tensor(pair_weight, "pair_weight").reshape(-1).double()
    if w.numel() != pr.shape[0]:
        raise ValueError(f"pair_weight: expected {pr.shape[0]} entries like pairs, got {w.numel()}")
    tu = as_tensor(turn, "turn").long()
    check_ndim(tu, "turn", 1)
    if pr.numel() == 0:
        return 0.0
    if int(pr.min()) < 0 or int(pr.max()) >= tu.numel():
        raise ValueError(f"pairs: indices must lie in [0, {tu.numel()})")
    tu = tu.to(pr.device)
    off = (tu[pr[:, 0]] != tu[pr[:, 1]]).double()
    matched = int(torch.unique(pr[:, 1]).numel())
    return float((w.to(pr.device) * off).sum() / matched)


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    return x[mask]


def _gap_metrics(rect: Rectified, old: Tensor, m: Tensor) -> dict[str, float]:
    """Gaps before / after rectification over the policy tokens (cross gaps over matched targets' tokens)."""
    d_diag = rect.diag - old
    d_corr = rect.corrected - old
    matched_tok = m & rect.matched[:, None]
    out: dict[str, float] = {}
    out.update(describe(_masked(d_diag, m), "diagonal_gap"))
    out.update(describe(_masked(d_corr, m), "corrected_gap"))
    out.update(describe(_masked(rect.cross_score - old, matched_tok), "cross_gap"))
    out.update(describe(_masked(rect.cross_score - rect.diag, matched_tok), "cross_diagonal_delta"))
    out.update(describe(_masked(rect.corrected - rect.diag, m), "corrected_diagonal_delta"))
    out.update(describe(_masked((rect.cross_score - rect.diag).abs(), matched_tok), "cross_diagonal_abs_disagreement"))
    return out


def _similarity_metrics(
    rect: Rectified, H_ST: Tensor, B: Tensor, thr: Tensor, cand_per_target: Tensor
) -> dict[str, float]:
    """Similarity distributions: eligible cells, thresholded cells, the diagonal, selected pairs, counts."""
    out: dict[str, float] = {}
    out.update(describe(H_ST[B], "structural_similarity"))
    out.update(describe(H_ST[thr], "threshold_similarity"))
    out.update(describe(torch.diagonal(H_ST), "diagonal_similarity"))
    out.update(describe(rect.pair_similarity, "selected_similarity"))
    out.update(describe(torch.count_nonzero(B, dim=0).double(), "eligible_sources_per_target"))
    out.update(describe(cand_per_target.double(), "threshold_candidates_per_target"))
    return out


def _coverage_metrics(
    rect: Rectified, B: Tensor, thr: Tensor, cand_per_target: Tensor, top_k: int, validity: dict
) -> dict[str, float]:
    """Coverage (§4.3): match and fallback rates, teachers per target, eligibility densities, invalid fractions."""
    M = int(B.shape[0])
    dev = rect.corrected.device
    out: dict[str, float] = {}
    n_src = torch.bincount(rect.pairs[:, 1], minlength=M) if rect.pairs.numel() else torch.zeros(M, device=dev)
    valid_rate = float(rect.matched.sum()) / max(M, 1)
    out["valid_match_rate"] = weighted_mean(valid_rate, M)
    out["fallback_turn_fraction"] = weighted_mean(1.0 - valid_rate if M else 0.0, M)
    out["mean_matched_teachers"] = weighted_mean(float(n_src.double().mean()) if M else 0.0, M)
    out["top_k_saturation_rate"] = weighted_mean(float((n_src >= top_k).double().mean()) if M else 0.0, M)
    out["cross_pair_count"] = summed(rect.pairs.shape[0])
    nnz_b, nnz_thr = int(torch.count_nonzero(B)), int(torch.count_nonzero(thr))
    out["structural_eligibility_density"] = pooled(nnz_b / (M * M) if M else 0.0, "cell_density", nnz_b, M)
    out["threshold_eligibility_density"] = pooled(nnz_thr / (M * M) if M else 0.0, "cell_density", nnz_thr, M)
    out["threshold_candidate_zero_rate"] = weighted_mean(float((cand_per_target == 0).double().mean()) if M else 0.0, M)
    out["correction_active_rate"] = weighted_mean(float((rect.alpha > 0).double().mean()) if M else 0.0, M)
    for name, v in validity.items():
        if v is not None:
            vt = as_tensor(v, name).bool()
            check_shape(vt, name, (M,))
            out[name] = weighted_mean(float((~vt).double().mean()) if M else 0.0, M)
    return out


def m1_diagnostics(
    rect: Rectified,
    old_logp: Tensor,
    mask: Tensor,
    H: Tensor,
    eligible: Tensor,
    turn: Tensor,
    *,
    top_k: int,
    student_thinking_valid: Tensor | None = None,
    teacher_thinking_valid: Tensor | None = None,
    student_action_valid: Tensor | None = None,
    teacher_action_valid: Tensor | None = None,
    prefix: str = "m1/",
) -> dict[str, float]:
    """Coverage, similarity, gap-before/after, confidence and M1-only gap metrics of one batch.

    rect: the :class:`Rectified` result. old_logp: [M, L] ℓ^old. mask: [M, L] policy mask.
    H: [M, M] H[source, target]; eligible: [M, M] B. turn: [M] turn ids. top_k: K of the selection.
    Optional validity vectors [M] add the invalid_* fractions.
    """
    M, L = rect.corrected.shape
    dev = rect.corrected.device
    old = as_tensor(old_logp, "old_logp").detach().float().to(dev)
    check_shape(old, "old_logp", (M, L))
    m = as_tensor(mask, "mask").to(dev)
    check_shape(m, "mask", (M, L))
    m = m.bool()
    H_ST = as_tensor(H, "H").detach().float().to(dev)
    check_shape(H_ST, "H", (M, M))
    B = as_tensor(eligible, "eligible").to(dev).bool()
    check_shape(B, "eligible", (M, M))
    tu = as_tensor(turn, "turn").long().to(dev)
    check_shape(tu, "turn", (M,))
    gamma = rect.gamma
    out: dict[str, float] = {}

    def put(key: str, value: Stat) -> None:
        out[prefix + key] = value

    def put_all(d: dict[str, float]) -> None:
        for k, v in d.items():
            out[prefix + k] = v

    thr = B & (H_ST >= gamma)
    cand_per_target = torch.count_nonzero(thr, dim=0)
    validity = {
        "invalid_student_thinking_fraction": student_thinking_valid,
        "invalid_teacher_thinking_fraction": teacher_thinking_valid,
        "invalid_student_action_fraction": student_action_valid,
        "invalid_teacher_action_fraction": teacher_action_valid,
    }
    put_all(_coverage_metrics(rect, B, thr, cand_per_target, top_k, validity))

    # gaps before / after
    d_corr = rect.corrected - old
    put_all(_gap_metrics(rect, old, m))

    # confidence / strength
    put_all(describe(rect.rho, "correspondence_confidence"))
    put_all(describe(rect.alpha, "correction_strength"))
    put("correspondence_confidence_mean", weighted_mean(float(rect.rho.double().mean()) if M else 0.0, M))
    put("correction_strength_mean", weighted_mean(float(rect.alpha.double().mean()) if M else 0.0, M))

    # similarity
    put_all(_similarity_metrics(rect, H_ST, B, thr, cand_per_target))

    # M1-only gap summary: mean and RMS of ℓ̃ - ℓ^old over policy tokens
    g = d_corr[m].double()
    put("teacher_student_gap_mean", weighted_mean(float(g.mean()) if g.numel() else 0.0, g.numel()))
    put("teacher_student_gap_std", rms(float(torch.sqrt((g * g).mean())) if g.numel() else 0.0, g.numel()))

    matched = int(torch.unique(rect.pairs[:, 1]).numel()) if rect.pairs.numel() else 0
    put("off_turn_match_weight", weighted_mean(off_turn_match_weight(rect.pairs, rect.pair_weight, tu), matched))
    return out


def action_filter_metrics(
    before: Sequence[Sequence[int]],
    after: Sequence[Sequence[int]],
    *,
    enabled: bool,
    threshold: float,
    seconds: float = 0.0,
    prefix: str = "m1/",
) -> dict[str, float]:
    """``action_filter/*`` metrics from the selection before and after the filter (per target lists)."""
    if len(before) != len(after):
        raise ValueError(f"after: expected {len(before)} targets like before, got {len(after)}")
    cand = sum(len(s) for s in before)
    acc = sum(len(s) for s in after)
    M = len(before)
    new_fb = sum(1 for b, a in zip(before, after) if len(b) > 0 and len(a) == 0)
    p = prefix + "action_filter/"
    return {
        p + "enabled": same(bool(enabled)),
        p + "similarity_threshold": same(threshold),
        p + "candidate_pairs": summed(cand),
        p + "accepted_pairs": summed(acc),
        p + "rejected_pairs": summed(cand - acc),
        p + "retained_fraction": weighted_mean(acc / cand if cand else 0.0, cand),
        p + "new_fallback_turn_fraction": weighted_mean(new_fb / M if M else 0.0, M),
        p + "seconds": slowest(seconds),
    }


def _check_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise ValueError(f"eps: expected a real number >= 0, got {type(eps).__name__} {eps!r}")
    e = float(eps)
    if not math.isfinite(e) or e < 0:
        raise ValueError(f"eps: expected a finite number >= 0, got {e}")
    return e


def paired_sign_flips(
    diag_gap: Tensor,
    cross_gap: Tensor,
    corrected_gap: Tensor,
    mask: Tensor | None = None,
    *,
    eps: float = 1e-4,
    prefix: str = "m1/paired/response/",
) -> dict[str, float]:
    """Paired token statistics of δ^diag (d), the cross gap (c) and δ̃ (r) over the masked tokens.

    All inputs share one shape ([M, L] or [N]); ``mask`` selects the scope (e.g. policy tokens of matched
    turns, or one region). Tokens where any of d, c, r is NaN/inf are counted (``nan_token_count``)
    and excluded. For the strict band (ε = 0) and the tolerance band (ε = ``eps``), a value is negative
    if < −ε and positive if > ε: neg→pos / pos→neg counts and per-token rates for c and r against d,
    the same conditioned on the sign of d, and the neutral count (|d| ≤ ε). Also increase/decrease
    counts (c > d, c < d) and distributions of d, c, r, c − d and r − d. An empty scope gives zeros.
    """
    e = _check_eps(eps)
    d = as_tensor(diag_gap, "diag_gap").detach().double()
    c = as_tensor(cross_gap, "cross_gap").detach().double()
    r = as_tensor(corrected_gap, "corrected_gap").detach().double()
    check_shape(c, "cross_gap", tuple(d.shape))
    check_shape(r, "corrected_gap", tuple(d.shape))
    if mask is None:
        sel = torch.ones_like(d, dtype=torch.bool)
    else:
        sel = as_tensor(mask, "mask").to(d.device)
        check_shape(sel, "mask", tuple(d.shape))
        sel = sel.bool()
    finite = torch.isfinite(d) & torch.isfinite(c) & torch.isfinite(r)
    n_nan = int((sel & ~finite).sum())
    keep = sel & finite
    d, c, r = d[keep], c[keep], r[keep]
    n = int(d.numel())
    out: dict[str, float] = {prefix + "token_count": summed(n), prefix + "nan_token_count": summed(n_nan)}

    def rate(a: int, b: int) -> Stat:
        return weighted_mean(a / b if b else 0.0, b)

    for band, eb in (("strict", 0.0), ("tolerance", e)):
        dn, dp = d < -eb, d > eb
        n_neg, n_pos = int(dn.sum()), int(dp.sum())
        q = f"{prefix}{band}/"
        out[q + "neutral_count"] = summed(n - n_neg - n_pos)
        out[q + "negative_count"] = summed(n_neg)
        out[q + "positive_count"] = summed(n_pos)
        for label, x in (("", c), ("corrected_", r)):
            xn, xp = x < -eb, x > eb
            n2p = int((dn & xp).sum())
            p2n = int((dp & xn).sum())
            out[q + f"{label}neg_to_pos_count"] = summed(n2p)
            out[q + f"{label}pos_to_neg_count"] = summed(p2n)
            out[q + f"{label}neg_to_pos_rate"] = rate(n2p, n)
            out[q + f"{label}pos_to_neg_rate"] = rate(p2n, n)
            out[q + f"{label}neg_to_pos_given_negative"] = rate(n2p, n_neg)
            out[q + f"{label}pos_to_neg_given_positive"] = rate(p2n, n_pos)
    out[prefix + "increase_count"] = summed(int((c > d).sum()))
    out[prefix + "decrease_count"] = summed(int((c < d).sum()))
    out[prefix + "corrected_increase_count"] = summed(int((r > d).sum()))
    out[prefix + "corrected_decrease_count"] = summed(int((r < d).sum()))
    q5 = (("p10", 0.10), ("p50", 0.50), ("p90", 0.90))
    for name, v in (
        ("diagonal_gap", d),
        ("cross_gap", c),
        ("corrected_gap", r),
        ("cross_delta", c - d),
        ("corrected_delta", r - d),
    ):
        for k, val in describe(v, name, quantiles=q5).items():
            if k.endswith(("_min", "_max", "_count")):
                continue
            out[prefix + k] = val
    return out


def formula_comparison(
    diag: Tensor,
    cross: Tensor,
    pairs: Tensor,
    H: Tensor,
    old_logp: Tensor,
    mask: Tensor,
    *,
    gamma: float,
    temperature: float = 0.1,
    prefix: str = "m1/paired/response/",
) -> dict[str, float]:
    """probability_mixture versus log_mean cross scores over the policy tokens of matched targets.

    diag: [M, L]; cross: [P, L]; pairs: [P, 2]; H: [M, M]; old_logp, mask: [M, L].
    Returns ``probability_minus_log_mean_{mean,std,p10,p50,p90}`` (≥ 0 by Jensen) and
    ``formula_neg_to_pos_count``: tokens whose cross gap c − ℓ^old is < 0 under log_mean and > 0 under
    probability_mixture.
    """
    rp = rectify(diag, cross, pairs, H, gamma=gamma, alpha_max=0.0, temperature=temperature)
    rl = rectify(diag, cross, pairs, H, gamma=gamma, alpha_max=0.0, temperature=temperature, mode="log_mean")
    old = as_tensor(old_logp, "old_logp").detach().float().to(rp.cross_score.device)
    check_shape(old, "old_logp", tuple(rp.cross_score.shape))
    m = as_tensor(mask, "mask").to(old.device)
    check_shape(m, "mask", tuple(old.shape))
    sel = m.bool() & rp.matched[:, None]
    diff = (rp.cross_score - rl.cross_score)[sel]
    flips = ((rl.cross_score - old < 0) & (rp.cross_score - old > 0))[sel]
    out = {prefix + "formula_neg_to_pos_count": summed(int(flips.sum()))}
    for k, v in describe(diff, "probability_minus_log_mean").items():
        if not k.endswith(("_min", "_max")):
            out[prefix + k] = v
    return out
