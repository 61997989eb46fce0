"""Mechanism 1: decision-aligned supervision rectification (ALGORITHM.md §2.2–2.8).

Legend: M = canonical turns, L = response length, P = kept (source, target) pairs,
T = tasks, N = turns of the largest task block, D = embedding width.
``H_ST[source, target]`` is the thinking similarity, ``eligible_ST`` its structural mask.

This module holds the teacher-forcing inputs of the kept pairs (§2.6), the policy mask (§2.8) and the
rectification itself (§2.7). The earlier steps live in modules of their own and are re-exported here:
similarity, structural mask and source selection (§2.2–2.4) in :mod:`alignopsd.selection`, the
action-consistency filter (§2.5) in :mod:`alignopsd.actions`.

Everything here is a pure, detached tensor function. The slow per-target loop references
are the test suite's (tests/m1_oracle.py), and these are tested equal to them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from alignopsd._checks import (
    as_tensor,
    check_choice,
    check_finite_fast,
    check_gamma,
    check_ndim,
    check_pairs,
    check_real,
    check_shape,
    check_turn_matrix,
)
from alignopsd.actions import action_filter, parse_webshop_action, validate_action_threshold, webshop_actions_agree
from alignopsd.selection import eligibility, pairs_from_selection, select_sources, similarity_matrix

__all__ = [
    "MODES",
    "Rectified",
    "action_filter",
    "cross_inputs",
    "eligibility",
    "pairs_from_selection",
    "parse_webshop_action",
    "policy_mask",
    "rectify",
    "select_sources",
    "similarity_matrix",
    "validate_action_threshold",
    "webshop_actions_agree",
]

MODES = ("probability_mixture", "log_mean")


# ----------------------------------------------------------------------------- §2.6 teacher-forcing inputs


def cross_inputs(
    prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor, pairs: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Cross teacher-forcing rows (§2.6): [teacher prompt of source s] + [sampled response of target t].

    prompt_ids, prompt_mask: [M, Lp] (left-padded privileged prompts); response_ids, response_mask: [M, L].
    pairs: [P, 2] (source, target). Returns input_ids [P, Lp+L], attention_mask [P, Lp+L] and
    position_ids [P, Lp+L] = cumsum(mask) - 1 clipped at 0.
    """
    pi = as_tensor(prompt_ids, "prompt_ids")
    pm = as_tensor(prompt_mask, "prompt_mask")
    ri = as_tensor(response_ids, "response_ids")
    rm = as_tensor(response_mask, "response_mask")
    check_ndim(pi, "prompt_ids", 2)
    check_ndim(ri, "response_ids", 2)
    check_shape(pm, "prompt_mask", tuple(pi.shape))
    check_shape(rm, "response_mask", tuple(ri.shape))
    M = pi.shape[0]
    if ri.shape[0] != M:
        raise ValueError(f"response_ids: expected {M} rows like prompt_ids, got {ri.shape[0]}")
    pr = check_pairs(pairs, M)
    s, t = pr[:, 0], pr[:, 1]
    ids = torch.cat([pi[s], ri[t]], dim=1)
    mask = torch.cat([pm[s].long(), rm[t].long()], dim=1)
    pos = (torch.cumsum(mask, dim=1) - 1).clamp_(min=0)
    return ids, mask, pos


def policy_mask(attention_mask: Tensor, response_length: int, loss_mask: Tensor | None = None) -> Tensor:
    """Policy-loss mask [R, L]: the last ``response_length`` columns of ``attention_mask``,
    or of ``loss_mask`` in multi-turn mode (§2.8)."""
    if isinstance(response_length, bool) or not isinstance(response_length, int) or response_length < 1:
        raise ValueError(f"response_length: expected an integer >= 1, got {response_length!r}")
    src_name = "loss_mask" if loss_mask is not None else "attention_mask"
    src = as_tensor(loss_mask if loss_mask is not None else attention_mask, src_name)
    check_ndim(src, src_name, 2)
    if src.shape[1] < response_length:
        raise ValueError(f"{src_name}: has {src.shape[1]} columns, fewer than response_length={response_length}")
    return src[:, -response_length:]


# ----------------------------------------------------------------------------- §2.7 rectification


@dataclass
class Rectified:
    """Result of :func:`rectify`. Legend: M turns, L tokens, P pairs.

    corrected: [M, L] ℓ̃ = (1-α) ℓ^diag + α c (exactly ℓ^diag for fallback targets).
    rho: [M] confidence ρ ∈ [0, 1]. alpha: [M] strength α ∈ [0, α_max].
    weights: per target, its ω over the kept sources in pair order (empty for a fallback target).
    cross_score: [M, L] c (ℓ^diag on fallback targets). diag: [M, L] ℓ^diag (float32 copy).
    matched: [M] bool, the target has ≥ 1 kept source. pair_weight: [P] ω of each pair.
    pair_similarity: [P] H[source, target] of each pair. pairs: [P, 2] (source, target).
    """

    corrected: Tensor
    rho: Tensor
    alpha: Tensor
    cross_score: Tensor
    diag: Tensor
    matched: Tensor
    pair_weight: Tensor
    pair_similarity: Tensor
    pairs: Tensor
    gamma: float = 0.0
    alpha_max: float = 0.0
    mode: str = "probability_mixture"
    extra: dict = field(default_factory=dict)
    _weights: list[Tensor] | None = field(default=None, repr=False, compare=False)

    @property
    def weights(self) -> list[Tensor]:
        """Per target (M entries), ω of its kept sources in pair order; empty for a fallback target."""
        if self._weights is None:
            M = self.corrected.shape[0]
            empty = torch.zeros(0, dtype=torch.float32, device=self.corrected.device)
            out: list[Tensor] = [empty] * M
            tgt = self.pairs[:, 1]
            if tgt.numel():
                starts = torch.ones_like(tgt, dtype=torch.bool)
                starts[1:] = tgt[1:] != tgt[:-1]
                counts = torch.bincount(torch.cumsum(starts.long(), 0) - 1).tolist()
                for t_i, chunk in zip(tgt[starts].tolist(), torch.split(self.pair_weight, counts)):
                    out[t_i] = chunk
            self._weights = out
        return self._weights

    def gaps(self, old_logp_ML: Tensor) -> tuple[Tensor, Tensor]:
        """(δ^diag, δ̃) = (ℓ^diag - ℓ^old, ℓ̃ - ℓ^old), each [M, L] float32."""
        old = as_tensor(old_logp_ML, "old_logp")
        check_shape(old, "old_logp", tuple(self.corrected.shape))
        check_finite_fast(old, "old_logp")
        old = old.detach().float().to(self.corrected.device)
        return self.diag - old, self.corrected - old


def _check_grouped(pairs: Tensor, M: int) -> None:
    tgt = pairs[:, 1]
    if tgt.numel() == 0:
        return
    starts = torch.ones_like(tgt, dtype=torch.bool)
    starts[1:] = tgt[1:] != tgt[:-1]
    runs = torch.bincount(tgt[starts], minlength=M)
    if bool((runs > 1).any()):
        bad = int(torch.nonzero(runs > 1)[0])
        raise ValueError(f"pairs: the rows of target {bad} are not contiguous (pairs must be grouped by target)")
    key = pairs[:, 0] * M + pairs[:, 1]
    if torch.unique(key).numel() != key.numel():
        raise ValueError("pairs: contains a duplicate (source, target) pair")


def _rectify_inputs(diag, cross, pairs, H, gamma, alpha_max, temperature, mode):
    """Checked inputs of :func:`rectify` (ValueError naming the argument): diag [M, L], pairs [P, 2] grouped by
    target, cross [P, L], H [M, M], and the scalars."""
    d = as_tensor(diag, "diag")
    check_ndim(d, "diag", 2)
    if not d.is_floating_point():
        raise ValueError(f"diag: expected a floating tensor, got {d.dtype}")
    check_finite_fast(d, "diag")
    M, L = d.shape
    pr = check_pairs(pairs, M)
    P = pr.shape[0]
    c_in = as_tensor(cross, "cross")
    if c_in.numel() == 0 and P == 0 and c_in.dim() != 2:  # e.g. torch.zeros(0) or []: no pairs, no rows
        c_in = torch.zeros(0, L, dtype=torch.float32, device=d.device)
    check_ndim(c_in, "cross", 2)
    check_shape(c_in, "cross", (P, L))
    if not c_in.is_floating_point():
        raise ValueError(f"cross: expected a floating tensor, got {c_in.dtype}")
    check_finite_fast(c_in, "cross")
    H_ST = check_turn_matrix(H, "H", M)
    gamma = check_gamma(gamma)
    alpha_max = check_real(alpha_max, "alpha_max", lo=0.0, hi=1.0)
    temperature = check_real(temperature, "temperature")
    if temperature <= 0:
        raise ValueError(f"temperature: must be > 0, got {temperature}")
    check_choice(mode, "mode", MODES)
    _check_grouped(pr, M)
    return d, pr, c_in, H_ST, gamma, alpha_max, temperature


def _aggregate(x_QKL: Tensor, w32_QK: Tensor, mode: str) -> Tensor:
    """Cross score c [Q, L] of each target from its sources' scores x [Q, K, L] (overwritten) and weights ω.

    probability_mixture: c = max_j ℓ_j + log Σ_j ω_j exp(ℓ_j - max_j ℓ_j), clamped into [min_j, max_j] (so k
    equal sources return exactly their score); log_mean: c = Σ_j ω_j ℓ_j.
    """
    if mode == "probability_mixture":
        lmax = x_QKL.amax(1)
        lmin = x_QKL.amin(1)
        x_QKL.sub_(lmax[:, None]).exp_()
        acc = torch.einsum("qk,qkl->ql", w32_QK, x_QKL)
        return torch.minimum(torch.maximum(lmax + torch.log(acc), lmin), lmax)
    return torch.einsum("qk,qkl->ql", w32_QK, x_QKL)


class _TargetGroups(NamedTuple):
    """Dense layout of the pairs' target groups: Q targets with pairs, K = the largest group's size.

    group: [P] group of each pair; slot: [P] its position in the group; start: [Q] first pair of each group;
    target: [Q] target turn of each group.
    """

    group: Tensor
    slot: Tensor
    start: Tensor
    target: Tensor
    P: int
    Q: int
    K: int


def _target_groups(tgt_P: Tensor) -> _TargetGroups:
    """The :class:`_TargetGroups` of pairs grouped by target (``tgt_P``: [P] target of each pair)."""
    P = int(tgt_P.numel())
    dev = tgt_P.device
    starts = torch.ones(P, dtype=torch.bool, device=dev)
    if P > 1:
        starts[1:] = tgt_P[1:] != tgt_P[:-1]
    group = torch.cumsum(starts.long(), 0) - 1  # [P]
    group_start = torch.nonzero(starts).flatten()  # [Q]
    group_tgt = tgt_P[group_start]  # [Q]
    slot = torch.arange(P, device=dev) - group_start[group]
    K = int(slot.max()) + 1 if P else 1
    return _TargetGroups(group, slot, group_start, group_tgt, P, int(group_tgt.numel()), K)


def _on_targets(base_M: Tensor, target_Q: Tensor, values_Q: Tensor) -> Tensor:
    """``base_M`` (per turn, modified in place) with the rows of the grouped targets replaced by ``values_Q``."""
    base_M[target_Q] = values_Q
    return base_M


def rectify(
    diag: Tensor,
    cross: Tensor,
    pairs: Tensor,
    H: Tensor,
    *,
    gamma: float,
    alpha_max: float,
    temperature: float = 0.1,
    mode: str = "probability_mixture",
) -> Rectified:
    """Aggregate the cross scores of each target, then blend with the diagonal teacher (§2.7–2.8).

    diag: [M, L] ℓ^diag. cross: [P, L] ℓ^{s→t} in pair order. pairs: [P, 2] (source, target), grouped
    by target in rank order. H: [M, M] H[source, target]. Weights ω = softmax(h / temperature) per target;
    c = logsumexp(log ω + ℓ) (probability_mixture) or Σ ω ℓ (log_mean); ρ = Σ ω clip((h-γ)/(1-γ), 0, 1);
    α = clip(α_max ρ, 0, α_max); ℓ̃ = (1-α) ℓ^diag + α c. Targets with no pair keep ℓ^diag exactly.
    Vectorised over targets with a dense [targets, K, L] layout of the target groups (no loop over targets);
    token-level aggregation runs in FP32 (per-pair weights and ρ in float64), outputs are float32.
    """
    d, pr, c_in, H_ST, gamma, alpha_max, temperature = _rectify_inputs(
        diag, cross, pairs, H, gamma, alpha_max, temperature, mode
    )
    M, L = d.shape
    dev = d.device
    d32 = d.detach().float()
    pr = pr.to(dev)
    src, tgt = pr[:, 0], pr[:, 1]
    h = H_ST.detach().to(dev)[src, tgt].double()  # [P]
    matched = torch.zeros(M, dtype=torch.bool, device=dev)
    matched[tgt] = True
    g = _target_groups(tgt)
    z_QK = torch.full((g.Q, g.K), -math.inf, dtype=torch.float64, device=dev)
    z_QK[g.group, g.slot] = h / temperature
    log_w_QK = torch.log_softmax(z_QK, dim=1)  # ω in log space; -inf on padding
    w_QK = torch.exp(log_w_QK)
    # token-level work in FP32 (§2.7); the clamp into [min_j, max_j] makes k equal sources return exactly
    # their score. Padding slots repeat the group's first source: max/min unchanged, weight exactly 0.
    x_PL = c_in.detach().to(dev).float()
    x_QKL = (
        x_PL[g.start][:, None, :].repeat(1, g.K, 1) if g.P else torch.zeros(0, g.K, L, dtype=torch.float32, device=dev)
    )
    x_QKL[g.group, g.slot] = x_PL
    c_QL = _aggregate(x_QKL, w_QK.float(), mode)
    h_QK = torch.zeros(g.Q, g.K, dtype=torch.float64, device=dev)
    h_QK[g.group, g.slot] = h
    conf_QK = ((h_QK - gamma) / (1.0 - gamma)).clamp(0.0, 1.0)
    rho_Q = (w_QK * conf_QK).sum(1).clamp(0.0, 1.0)
    alpha_Q = (alpha_max * rho_Q).clamp(0.0, alpha_max)
    a32 = alpha_Q.float()[:, None]
    blend_QL = (1.0 - a32) * d32[g.target] + a32 * c_QL
    return Rectified(
        corrected=_on_targets(d32.clone(), g.target, blend_QL),
        rho=_on_targets(torch.zeros(M, dtype=torch.float32, device=dev), g.target, rho_Q.float()),
        alpha=_on_targets(torch.zeros(M, dtype=torch.float32, device=dev), g.target, alpha_Q.float()),
        cross_score=_on_targets(d32.clone(), g.target, c_QL),
        diag=d32.clone(),
        matched=matched,
        pair_weight=w_QK[g.group, g.slot].float(),  # [P]
        pair_similarity=h.float(),
        pairs=pr,
        gamma=gamma,
        alpha_max=alpha_max,
        mode=mode,
    )
