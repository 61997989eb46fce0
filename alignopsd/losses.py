"""Actor loss terms (ALGORITHM.md §3.12, §2.9, §2.10).

Legend: R = rows of a (micro-)batch, M = rows of a whole batch, L = response length. ``logp_RL`` are
current-policy log-probs of the sampled tokens (with grad), ``old_logp_RL`` the rollout-time ones,
``mask_RL`` the policy-loss mask, ``row_weight_R`` the 1/k copy weights of §1.2.

Every term is a token-mean over the mask with per-row weights:
``Σ(term · mask · w_row) / Σ(mask · w_row)``. :func:`microbatch_scales` gives the factor that
turns per-micro-batch token-means into the exact global weighted token-mean (§3.12).

Rollout–trainer mismatch: :mod:`alignopsd.rollout_correction` measures it and gives the importance-sampling
correction, which :func:`ppo_loss` / :func:`actor_loss` take as ``is_weight`` (multiplies the per-token policy
loss) and ``is_keep`` (rejected tokens leave the loss and its token-mean denominator); its functions are
re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from alignopsd._checks import as_tensor, check_choice, check_finite, check_ndim, check_real, check_shape, check_tokens
from alignopsd.rollout_correction import rollout_is_weights, rollout_mismatch_metrics

__all__ = [
    "AUX_KINDS",
    "AuxTerm",
    "actor_loss",
    "alignment_loss",
    "auxiliary_loss",
    "entropy_bonus",
    "low_var_kl",
    "microbatch_scales",
    "ppo_loss",
    "rollout_is_weights",
    "rollout_mismatch_metrics",
    "sdar_loss",
    "token_mean",
    "weighted_token_count",
]

AUX_KINDS = ("alignment", "sdar")


def _mask_weight(mask, row_weight, shape: tuple[int, int], device) -> Tensor:
    """mask · w_row as float [R, L]."""
    m = check_tokens(mask, "mask", shape).to(device=device, dtype=torch.float32)
    if row_weight is None:
        return m
    w = as_tensor(row_weight, "row_weight")
    check_ndim(w, "row_weight", 1)
    check_shape(w, "row_weight", (shape[0],))
    check_finite(w, "row_weight")
    if bool((w < 0).any()):
        raise ValueError("row_weight: must be non-negative")
    return m * w.to(device=device, dtype=torch.float32)[:, None]


def _keep_mask(mask, is_keep, shape: tuple[int, int]) -> Tensor:
    """mask with the tokens rejected by ``is_keep`` ([R, L] bool) zeroed; ``mask`` itself when None."""
    if is_keep is None:
        return mask
    m = check_tokens(mask, "mask", shape)
    k = check_tokens(is_keep, "is_keep", shape)
    if k.dtype != torch.bool:
        raise ValueError(f"is_keep: expected a bool tensor, got {k.dtype}")
    return m * k.to(m.device)


def weighted_token_count(mask: Tensor, row_weight: Tensor | None = None) -> float:
    """Σ mask · w_row of a (micro-)batch: the weighted token count used by :func:`microbatch_scales`."""
    m = check_tokens(mask, "mask")
    return float(_mask_weight(m, row_weight, tuple(m.shape), m.device).double().sum())


def token_mean(term: Tensor, mask: Tensor, row_weight: Tensor | None = None) -> Tensor:
    """Σ(term · mask · w) / Σ(mask · w) for term [R, L]; 0 (keeping the graph) when the mask is empty."""
    t = as_tensor(term, "term")
    check_ndim(t, "term", 2)
    mw = _mask_weight(mask, row_weight, tuple(t.shape), t.device)
    denom = mw.sum()
    num = (t * mw).sum()
    return num / denom.clamp_min(1e-12)


def microbatch_scales(
    weighted_tokens: Sequence[float], *, global_weighted_tokens: float | None = None, world_size: int = 1
) -> list[float]:
    """Scale of each micro-batch's token-mean loss (§3.12): n_i / D with D = global total / world_size.

    weighted_tokens: Σ mask · w_row of each of this rank's micro-batches in the mini-batch.
    global_weighted_tokens: the sum over all ranks (default: the local sum, i.e. one rank).
    With data-parallel gradient averaging over ``world_size`` ranks, Σ_i scale_i · mean_i is then the
    exact global weighted token-mean of the mini-batch.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected an integer >= 1, got {world_size!r}")
    n = [check_real(v, "weighted_tokens", lo=0.0) for v in weighted_tokens]
    total = sum(n) if global_weighted_tokens is None else check_real(global_weighted_tokens, "global_weighted_tokens")
    if total <= 0:
        raise ValueError(f"global_weighted_tokens: the mini-batch has no weighted policy token (total {total})")
    if global_weighted_tokens is None and world_size != 1:
        raise ValueError("global_weighted_tokens: required when world_size > 1")
    D = total / world_size
    return [v / D for v in n]


def ppo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantage: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float = 3.0,
    row_weight: Tensor | None = None,
    is_weight: Tensor | None = None,
    is_keep: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate with dual clip, token-mean over the mask with optional row weights.

    logp, old_logp: [R, L] log-probs of the sampled tokens (grad flows through ``logp``).
    advantage: [R, L] token advantages (or [R], broadcast over tokens). mask: [R, L] policy mask.
    ratio = exp(logp - old_logp); loss_tok = max(-A·ratio, -A·clip(ratio, 1-clip_low, 1+clip_high)),
    and for A < 0 additionally min(loss_tok, -A·dual_clip). Returns (loss, stats) with the floats
    ``clipfrac``, ``clipfrac_lower`` and ``approx_kl`` (token-means of the same weighting).

    Rollout correction (:func:`rollout_is_weights`, default off): ``is_weight`` [R, L] multiplies each token's
    clipped loss (no gradient through it); ``is_keep`` [R, L] bool removes rejected tokens from the mask, so
    from the token-mean's numerator and denominator (and from the stats). With both None the loss is unchanged.
    """
    lp = check_tokens(logp, "logp")
    R, L = lp.shape
    old = check_tokens(old_logp, "old_logp", (R, L)).to(lp.device)  # kept in its own precision; ratio in FP32
    adv = as_tensor(advantage, "advantage")
    if adv.dim() == 1:
        check_shape(adv, "advantage", (R,))
        adv = adv[:, None].expand(R, L)
    check_shape(adv, "advantage", (R, L))
    check_finite(adv, "advantage")
    adv = adv.to(lp.device, torch.float32)
    cl = check_real(clip_low, "clip_low", lo=0.0, hi=1.0)
    ch = check_real(clip_high, "clip_high", lo=0.0)
    dc = check_real(dual_clip, "dual_clip")
    if dc <= 1.0:
        raise ValueError(f"dual_clip: must be > 1, got {dc}")
    mask = _keep_mask(mask, is_keep, (R, L))
    neg_kl = (lp.float() - old.float()).clamp(-20.0, 20.0)
    ratio = torch.exp(neg_kl)
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - cl, 1.0 + ch)
    clip1 = torch.maximum(pg1, pg2)
    pg3 = -adv * dc
    clip2 = torch.minimum(pg3, clip1)
    per_tok = torch.where(adv < 0, clip2, clip1)
    if is_weight is not None:
        w = check_tokens(is_weight, "is_weight", (R, L)).detach().to(lp.device, torch.float32)
        if bool((w < 0).any()):
            raise ValueError("is_weight: must be non-negative")
        per_tok = per_tok * w
    loss = token_mean(per_tok, mask, row_weight)
    with torch.no_grad():
        clipfrac = token_mean((pg2 > pg1).float(), mask, row_weight)
        lower = token_mean(((clip1 > pg3) & (adv < 0)).float(), mask, row_weight)
        approx_kl = token_mean(-neg_kl, mask, row_weight)
    stats = {"clipfrac": float(clipfrac), "clipfrac_lower": float(lower), "approx_kl": float(approx_kl)}
    return loss, stats


def low_var_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 KL estimator per token [R, L]: exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10]."""
    lp = check_tokens(logp, "logp")
    ref = check_tokens(ref_logp, "ref_logp", tuple(lp.shape)).to(lp.device)
    kl = (ref.float() - lp.float()).clamp(-20.0, 20.0)
    return (torch.exp(kl) - kl - 1.0).clamp(-10.0, 10.0)


def entropy_bonus(entropy: Tensor, mask: Tensor, *, coef: float = 0.001, row_weight: Tensor | None = None) -> Tensor:
    """The entropy term to ADD to the loss: -coef · token-mean(entropy) (entropy [R, L], with grad)."""
    e = check_tokens(entropy, "entropy")
    c = check_real(coef, "coef", lo=0.0)
    return -c * token_mean(e, mask, row_weight)


def alignment_loss(
    logp: Tensor,
    corrected: Tensor,
    corrected_gap: Tensor,
    mask: Tensor,
    *,
    beta: float = 5.0,
    coef: float = 0.01,
    row_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """M1-only alignment loss (§2.9): coef · token-mean(g ⊙ (ℓ̃ - ℓ_θ)), g = σ(β δ̃) from the frozen δ̃.

    logp: [R, L] ℓ_θ (grad). corrected: [R, L] ℓ̃ (frozen). corrected_gap: [R, L] δ̃ = ℓ̃ - ℓ^old at rollout.
    Gradient only through ``logp``: per token -coef · g · w_row / Σ(mask · w_row).
    Returns (coef · L_align, stats) with ``alignment_loss`` (= L_align), ``gate_mean``, ``gate_active_ratio``
    (g > 0.5), ``corrected_gap_mean`` and ``alignment_coef``.
    """
    lp = check_tokens(logp, "logp")
    shape = tuple(lp.shape)
    teacher = check_tokens(corrected, "corrected", shape).detach().to(lp.device, torch.float32)
    gap = check_tokens(corrected_gap, "corrected_gap", shape).detach().to(lp.device, torch.float32)
    b = check_real(beta, "beta")
    if b <= 0:
        raise ValueError(f"beta: must be > 0, got {b}")
    c = check_real(coef, "coef", lo=0.0)
    gate = torch.sigmoid(b * gap)
    raw = token_mean(gate * (teacher - lp.float()), mask, row_weight)
    with torch.no_grad():
        stats = {
            "alignment_loss": float(raw),
            "gate_mean": float(token_mean(gate, mask, row_weight)),
            "gate_active_ratio": float(token_mean((gate > 0.5).float(), mask, row_weight)),
            "corrected_gap_mean": float(token_mean(gap, mask, row_weight)),
            "alignment_coef": c,
        }
    return c * raw, stats


def sdar_loss(
    logp: Tensor,
    diag: Tensor,
    mask: Tensor,
    *,
    beta: float = 5.0,
    coef: float = 0.01,
    row_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """SDAR auxiliary (§2.10): coef · token-mean(σ(β(ℓ^diag - sg[ℓ_θ])) · (ℓ^diag - ℓ_θ)).

    logp: [R, L] ℓ_θ (grad; the gate uses it detached). diag: [R, L] ℓ^diag, the diagonal (uncorrected)
    teacher, frozen. Gradient per token: -coef · gate · mask · w_row / N. Returns (coef · L, stats) with
    ``sdar/gate_mean``, ``sdar/gate_active_ratio``, ``sdar/teacher_gap_mean``, ``sdar/loss``, ``sdar/coef``,
    ``sdar/weighted_loss``.
    """
    lp = check_tokens(logp, "logp")
    teacher = check_tokens(diag, "diag", tuple(lp.shape)).detach().to(lp.device, torch.float32)
    b = check_real(beta, "beta")
    if b <= 0:
        raise ValueError(f"beta: must be > 0, got {b}")
    c = check_real(coef, "coef", lo=0.0)
    gap_now = teacher - lp.detach().float()
    gate = torch.sigmoid(b * gap_now)
    raw = token_mean(gate * (teacher - lp.float()), mask, row_weight)
    with torch.no_grad():
        stats = {
            "sdar/gate_mean": float(token_mean(gate, mask, row_weight)),
            "sdar/gate_active_ratio": float(token_mean((gate > 0.5).float(), mask, row_weight)),
            "sdar/teacher_gap_mean": float(token_mean(gap_now, mask, row_weight)),
            "sdar/loss": float(raw),
            "sdar/coef": c,
            "sdar/weighted_loss": c * float(raw),
        }
    return c * raw, stats


@dataclass
class AuxTerm:
    """One auxiliary loss term an estimator asks the actor update to add (frozen tensors, per canonical turn).

    kind: "alignment" (§2.9: teacher = ℓ̃, gate_gap = δ̃ frozen) or "sdar" (§2.10: teacher = ℓ^diag,
    gate from the current policy). teacher_ML: [M, L]. gate_gap_ML: [M, L] or None. coef, beta: scalars.
    The actor slices ``teacher_ML``/``gate_gap_ML`` to its rows (e.g. via Canonical.expand) and calls
    :func:`auxiliary_loss`.
    """

    kind: str
    teacher_ML: Tensor
    coef: float
    beta: float
    gate_gap_ML: Tensor | None = None

    def __post_init__(self) -> None:
        check_choice(self.kind, "kind", AUX_KINDS)
        if self.kind == "alignment" and self.gate_gap_ML is None:
            raise ValueError("gate_gap_ML: required for the alignment term (the rollout-frozen corrected gap)")
        check_real(self.coef, "coef", lo=0.0)
        if check_real(self.beta, "beta") <= 0:
            raise ValueError(f"beta: must be > 0, got {self.beta}")


def auxiliary_loss(
    term: AuxTerm,
    logp: Tensor,
    mask: Tensor,
    *,
    rows: Tensor | None = None,
    row_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Evaluate an :class:`AuxTerm` on a micro-batch. rows: [R] canonical index of each row (default: all)."""
    teacher = term.teacher_ML if rows is None else term.teacher_ML[rows]
    if term.kind == "alignment":
        gap = term.gate_gap_ML if rows is None else term.gate_gap_ML[rows]  # type: ignore[index]
        return alignment_loss(logp, teacher, gap, mask, beta=term.beta, coef=term.coef, row_weight=row_weight)
    return sdar_loss(logp, teacher, mask, beta=term.beta, coef=term.coef, row_weight=row_weight)


def actor_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantage: Tensor,
    mask: Tensor,
    *,
    row_weight: Tensor | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.001,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    aux: Sequence[AuxTerm] = (),
    rows: Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float = 3.0,
    is_weight: Tensor | None = None,
    is_keep: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The whole actor objective of one micro-batch (§3.12), a weighted token-mean over ``mask``:

    PPO(dual clip) − entropy_coef · entropy + kl_coef · k3(logp, ref_logp) + Σ aux terms (§2.9, §2.10).

    logp, old_logp, advantage, mask: [R, L]; row_weight: [R] (1/k); entropy: [R, L] (with grad) or None;
    ref_logp: [R, L] or None (required when kl_coef > 0); aux: terms from an estimator, evaluated on
    ``rows`` ([R] canonical index of each row). Multiply the result by this micro-batch's
    :func:`microbatch_scales` factor before backward. Returns (loss, stats) with ``actor/*`` floats.
    Rollout correction (:func:`rollout_is_weights`): ``is_weight`` scales the PPO term per token; ``is_keep``
    drops rejected tokens from every term's mask (so the micro-batch's weighted token count, and hence its
    :func:`microbatch_scales` factor, must be taken over ``mask & is_keep`` too).
    """
    mask = _keep_mask(mask, is_keep, tuple(as_tensor(logp, "logp").shape))
    pg, st = ppo_loss(
        logp,
        old_logp,
        advantage,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        row_weight=row_weight,
        is_weight=is_weight,
    )
    total = pg
    stats = {
        "actor/pg_loss": float(pg.detach()),
        "actor/pg_clipfrac": st["clipfrac"],
        "actor/pg_clipfrac_lower": st["clipfrac_lower"],
        "actor/ppo_kl": st["approx_kl"],
    }
    kc = check_real(kl_coef, "kl_coef", lo=0.0)
    if kc > 0:
        if ref_logp is None:
            raise ValueError("ref_logp: required when kl_coef > 0")
        kl = token_mean(low_var_kl(logp, ref_logp), mask, row_weight)
        total = total + kc * kl
        stats["actor/kl_loss"] = float(kl.detach())
        stats["actor/kl_coef"] = kc
    if entropy is not None:
        ent = entropy_bonus(entropy, mask, coef=entropy_coef, row_weight=row_weight)
        total = total + ent
        stats["actor/entropy"] = float(token_mean(entropy.detach(), mask, row_weight))
    for term in aux:
        loss_t, st_t = auxiliary_loss(term, logp, mask, rows=rows, row_weight=row_weight)
        total = total + loss_t
        key = "beyond_timestamps/" if term.kind == "alignment" else ""
        stats.update({(key + k if not k.startswith("sdar/") else k): v for k, v in st_t.items()})
    stats["actor/loss"] = float(total.detach())
    return total, stats
