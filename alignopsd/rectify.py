"""Mechanism 1: decision-aligned supervision rectification (ALGORITHM.md §2.2–2.8).

Legend: M = canonical turns, L = response length, P = kept (source, target) pairs,
T = tasks, N = turns of the largest task block, D = embedding width.
``H_ST[source, target]`` is the thinking similarity, ``eligible_ST`` its structural mask.

Everything here is a pure, detached tensor function. The slow per-target loop references
live in :mod:`alignopsd.reference_m1` and are tested equal to these.
"""

from __future__ import annotations

import inspect
import math
import re
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from alignopsd._checks import as_tensor, check_choice, check_finite, check_ids, check_ndim, check_real, check_shape
from alignopsd._kernels import use_kernels
from alignopsd.kernels.sibling_topk import sibling_topk_from_similarity

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
    "webshop_rule_applies",
]

MODES = ("probability_mixture", "log_mean")
_WEBSHOP_RE = re.compile(r"\s*(search|click)\[(.*)\]\s*", re.DOTALL)


# ----------------------------------------------------------------------------- helpers


def check_finite_fast(t: Tensor, name: str) -> None:
    """ValueError naming ``name`` if ``t`` has NaN/inf; one aminmax pass (NaN propagates), exact message on failure."""
    if not t.is_floating_point() or t.numel() == 0:
        return
    lo, hi = torch.aminmax(t.detach())
    if not (math.isfinite(float(lo)) and math.isfinite(float(hi))):
        check_finite(t, name)


def _check_square(x, name: str, M: int, *, dtype=None) -> Tensor:
    t = as_tensor(x, name)
    check_ndim(t, name, 2)
    check_shape(t, name, (M, M))
    if dtype is torch.bool:
        if t.dtype != torch.bool:
            raise ValueError(f"{name}: expected a bool tensor, got {t.dtype}")
        return t
    if not t.is_floating_point():
        raise ValueError(f"{name}: expected a floating tensor, got {t.dtype}")
    check_finite_fast(t, name)
    return t.float()


def _check_top_k(top_k) -> int:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k: expected an integer >= 1, got {top_k!r}")
    return int(top_k)


def _check_gamma(gamma) -> float:
    g = check_real(gamma, "gamma", lo=-1.0)
    if g >= 1.0:
        raise ValueError(f"gamma: must be < 1 (confidence divides by 1 - gamma), got {g}")
    return g


def _check_vec(x, name: str, M: int, *, dtype=None) -> Tensor:
    t = as_tensor(x, name)
    check_ndim(t, name, 1)
    check_shape(t, name, (M,))
    if dtype is torch.bool:
        if t.dtype != torch.bool:
            raise ValueError(f"{name}: expected a bool tensor, got {t.dtype}")
    return t


# ----------------------------------------------------------------------------- §2.2 similarity


def similarity_matrix(teacher_emb_MD: Tensor, student_emb_MD: Tensor, task_M: Tensor) -> Tensor:
    """H[source, target] = <teacher_emb[source], student_emb[target]>, clamped to [-1, 1], 0 across tasks.

    teacher_emb_MD, student_emb_MD: [M, D] unit (or zero, for invalid text) vectors.
    Returns H_ST [M, M] float32.
    """
    t = as_tensor(teacher_emb_MD, "teacher_emb")
    s = as_tensor(student_emb_MD, "student_emb")
    check_ndim(t, "teacher_emb", 2)
    check_ndim(s, "student_emb", 2)
    if t.shape != s.shape:
        raise ValueError(f"student_emb: expected shape {tuple(t.shape)} like teacher_emb, got {tuple(s.shape)}")
    check_finite_fast(t, "teacher_emb")
    check_finite_fast(s, "student_emb")
    task, _, _ = check_ids(task_M, task_M)
    check_shape(task, "task", (t.shape[0],))
    H = (t.float() @ s.float().T).clamp_(-1.0, 1.0)
    return torch.where(task[:, None] == task[None, :], H, torch.zeros((), dtype=H.dtype, device=H.device))


# ----------------------------------------------------------------------------- §2.3 eligibility


def eligibility(task: Tensor, rollout: Tensor, source_valid: Tensor, target_valid: Tensor) -> Tensor:
    """Structural mask B[source, target] (§2.3).

    task, rollout: [M] integer ids. source_valid: [M] bool, the teacher thinking of the source is
    valid. target_valid: [M] bool, the student thinking of the target is valid.
    Returns eligible_ST [M, M] bool: same task, different rollout, both sides valid.
    Turn ids are deliberately not compared.
    """
    task, rollout, _ = check_ids(task, rollout)
    M = task.numel()
    sv = _check_vec(source_valid, "source_valid", M, dtype=torch.bool)
    tv = _check_vec(target_valid, "target_valid", M, dtype=torch.bool)
    same_task = task[:, None] == task[None, :]
    other_rollout = rollout[:, None] != rollout[None, :]
    return same_task & other_rollout & sv[:, None] & tv[None, :]


# ----------------------------------------------------------------------------- §2.4 selection


def select_sources(
    H: Tensor, eligible: Tensor, task: Tensor, rollout: Tensor, turn: Tensor, *, gamma: float, top_k: int
) -> list[list[int]]:
    """Sparse source selection (§2.4), vectorised over padded task blocks.

    H: [M, M] similarity H[source, target]. eligible: [M, M] bool B[source, target] (same-task only).
    task, rollout, turn: [M] integer ids. Returns, for every target (in input order), the kept source
    indices best first: candidates with B and H >= gamma, the best source of each sibling rollout
    (ties: smaller identity), then the first ``top_k`` by (-H, identity).
    The rule is implemented once, in ``alignopsd.kernels.sibling_topk`` (any device); its test oracle is
    ``tests/selection_oracle.py``.
    """
    task, rollout, turn = check_ids(task, rollout, turn)
    M = task.numel()
    H_ST = _check_square(H, "H", M)
    B_ST = _check_square(eligible, "eligible", M, dtype=torch.bool)
    gamma = _check_gamma(gamma)
    top_k = _check_top_k(top_k)
    if M == 0:
        return []
    # one implementation of the rule on every device: the batched block selection of the kernels package
    # (torch ops; its Triton kernels compute H and the profiles, not the selection)
    res = sibling_topk_from_similarity(
        H_ST, B_ST, task, rollout, turn, gamma=gamma, top_k=top_k, profiles=False,
        impl="triton" if use_kernels(H_ST, B_ST) else "torch",
    )  # fmt: skip
    return res.selected_lists()


def pairs_from_selection(selected: Sequence[Sequence[int]], *, device=None) -> Tensor:
    """Flatten a per-target selection into pairs[P, 2] = (source, target), grouped by target in rank order."""
    src: list[int] = []
    tgt: list[int] = []
    for t, sources in enumerate(selected):
        src.extend(int(s) for s in sources)
        tgt.extend([t] * len(sources))
    return torch.tensor([src, tgt], dtype=torch.long, device=device).T.reshape(-1, 2)


# ----------------------------------------------------------------------------- §2.5 action filter


def validate_action_threshold(threshold) -> float:
    """The action-consistency threshold: a real number (not bool or str) in [-1, 1]."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise ValueError(f"threshold: expected a real number in [-1, 1], got {type(threshold).__name__} {threshold!r}")
    v = float(threshold)
    if not math.isfinite(v) or v < -1.0 or v > 1.0:
        raise ValueError(f"threshold: expected a finite number in [-1, 1], got {v}")
    return v


def webshop_rule_applies(env_name: str) -> bool:
    """The WebShop search/click rule is on iff the environment name, lower-cased, is exactly "webshop"."""
    return isinstance(env_name, str) and env_name.lower() == "webshop"


def parse_webshop_action(action: str | None) -> tuple[str, str] | None:
    """(verb, stripped argument) of a WebShop action ``search[...]`` / ``click[...]``, or None if it does not parse.

    Case-sensitive: only lower-case verbs parse. The stripped argument must be non-empty.
    """
    if not isinstance(action, str):
        return None
    m = _WEBSHOP_RE.fullmatch(action)
    if m is None:
        return None
    arg = m.group(2).strip()
    if not arg:
        return None
    return m.group(1), arg


def _action_valid(actions: Sequence[str | None] | None, valid: Tensor, name: str) -> Tensor:
    if actions is None:
        return valid
    if len(actions) != valid.numel():
        raise ValueError(f"{name}: expected {valid.numel()} action strings, got {len(actions)}")
    nonempty = torch.tensor([isinstance(a, str) and bool(a.strip()) for a in actions], dtype=torch.bool)
    return valid & nonempty.to(valid.device)


def action_filter(
    selected: Sequence[Sequence[int]],
    action_sim: Tensor,
    source_action_valid: Tensor,
    target_action_valid: Tensor,
    *,
    threshold: float = 0.8,
    source_actions: Sequence[str | None] | None = None,
    target_actions: Sequence[str | None] | None = None,
    webshop: bool = False,
) -> list[list[int]]:
    """Action-consistency filter (§2.5): removes pairs, never adds; keeps rank order.

    selected: per target, source indices (as from :func:`select_sources`), len M.
    action_sim: [M, M] cosine of teacher action of the source vs student action of the target.
    source_action_valid / target_action_valid: [M] bool. A pair is kept iff both actions are valid,
    action_sim is finite and >= threshold, and (``webshop=True``) the search/click rule holds:
    both parse, verbs equal, and two clicks have exactly equal stripped arguments.
    source_actions / target_actions: the action strings (required for ``webshop=True``); a
    whitespace-only string counts as invalid.
    """
    thr = validate_action_threshold(threshold)
    if not isinstance(webshop, bool):
        raise ValueError(f"webshop: expected a bool, got {webshop!r}")
    M = len(selected)
    A = as_tensor(action_sim, "action_sim")
    check_ndim(A, "action_sim", 2)
    check_shape(A, "action_sim", (M, M))
    if not A.is_floating_point():
        raise ValueError(f"action_sim: expected a floating tensor, got {A.dtype}")
    sv = _check_vec(source_action_valid, "source_action_valid", M, dtype=torch.bool)
    tv = _check_vec(target_action_valid, "target_action_valid", M, dtype=torch.bool)
    sv = _action_valid(source_actions, sv.cpu(), "source_actions")
    tv = _action_valid(target_actions, tv.cpu(), "target_actions")
    if webshop and (source_actions is None or target_actions is None):
        raise ValueError("source_actions: the WebShop rule needs source_actions and target_actions")
    pairs = pairs_from_selection(selected)
    if pairs.numel() == 0:
        return [[] for _ in range(M)]
    if int(pairs.min()) < 0 or int(pairs.max()) >= M:
        raise ValueError(f"selected: source indices must lie in [0, {M})")
    s, t = pairs[:, 0], pairs[:, 1]
    sim = A.detach().float().cpu()[s, t]
    keep = sv[s] & tv[t] & torch.isfinite(sim) & (sim >= thr)
    if webshop:
        parsed_src = [parse_webshop_action(a) for a in source_actions]  # type: ignore[union-attr]
        parsed_tgt = [parse_webshop_action(a) for a in target_actions]  # type: ignore[union-attr]
        rule = []
        for si, ti in pairs.tolist():
            a, b = parsed_src[si], parsed_tgt[ti]
            ok = a is not None and b is not None and a[0] == b[0] and (a[0] != "click" or a[1] == b[1])
            rule.append(ok)
        keep &= torch.tensor(rule, dtype=torch.bool)
    out: list[list[int]] = [[] for _ in range(M)]
    for (si, ti), k in zip(pairs.tolist(), keep.tolist()):
        if k:
            out[ti].append(si)
    return out


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
    pr = _check_pairs(pairs, M)
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


def _check_pairs(pairs, M: int) -> Tensor:
    p = as_tensor(pairs, "pairs")
    if p.numel() == 0:
        return torch.zeros(0, 2, dtype=torch.long, device=p.device)
    check_ndim(p, "pairs", 2)
    if p.shape[1] != 2:
        raise ValueError(f"pairs: expected shape [P, 2], got {tuple(p.shape)}")
    if p.is_floating_point() or p.dtype == torch.bool:
        raise ValueError(f"pairs: expected an integer tensor, got {p.dtype}")
    p = p.long()
    if int(p.min()) < 0 or int(p.max()) >= M:
        raise ValueError(f"pairs: indices must lie in [0, {M})")
    return p


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
    pr = _check_pairs(pairs, M)
    P = pr.shape[0]
    c_in = as_tensor(cross, "cross")
    if c_in.numel() == 0 and P == 0 and c_in.dim() != 2:  # e.g. torch.zeros(0) or []: no pairs, no rows
        c_in = torch.zeros(0, L, dtype=torch.float32, device=d.device)
    check_ndim(c_in, "cross", 2)
    check_shape(c_in, "cross", (P, L))
    if not c_in.is_floating_point():
        raise ValueError(f"cross: expected a floating tensor, got {c_in.dtype}")
    check_finite_fast(c_in, "cross")
    H_ST = _check_square(H, "H", M)
    gamma = _check_gamma(gamma)
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
    P = pr.shape[0]

    dev = d.device
    d32 = d.detach().float()
    pr = pr.to(dev)
    src, tgt = pr[:, 0], pr[:, 1]
    h = H_ST.detach().to(dev)[src, tgt].double()  # [P]
    matched = torch.zeros(M, dtype=torch.bool, device=dev)
    matched[tgt] = True
    # dense layout of the target groups: [Q targets with pairs, Kmax slots]
    starts = torch.ones(P, dtype=torch.bool, device=dev)
    if P > 1:
        starts[1:] = tgt[1:] != tgt[:-1]
    group = torch.cumsum(starts.long(), 0) - 1  # [P]
    group_start = torch.nonzero(starts).flatten()  # [Q]
    group_tgt = tgt[group_start]  # [Q]
    Q = int(group_tgt.numel())
    slot = torch.arange(P, device=dev) - group_start[group]
    K = int(slot.max()) + 1 if P else 1
    z_QK = torch.full((Q, K), -math.inf, dtype=torch.float64, device=dev)
    z_QK[group, slot] = h / temperature
    log_w_QK = torch.log_softmax(z_QK, dim=1)  # ω in log space; -inf on padding
    w_QK = torch.exp(log_w_QK)
    # padding slots repeat the group's first source: max/min unchanged, and their weight is exactly 0
    # token-level work in FP32 (§2.7); the clamp into [min_j, max_j] makes k equal sources return exactly
    # their score. Padding slots repeat the group's first source: max/min unchanged, weight exactly 0.
    x_PL = c_in.detach().to(dev).float()
    x_QKL = (
        x_PL[group_start][:, None, :].repeat(1, K, 1) if P else torch.zeros(0, K, L, dtype=torch.float32, device=dev)
    )
    x_QKL[group, slot] = x_PL
    c_QL = _aggregate(x_QKL, w_QK.float(), mode)
    h_QK = torch.zeros(Q, K, dtype=torch.float64, device=dev)
    h_QK[group, slot] = h
    conf_QK = ((h_QK - gamma) / (1.0 - gamma)).clamp(0.0, 1.0)
    rho_Q = (w_QK * conf_QK).sum(1).clamp(0.0, 1.0)
    alpha_Q = (alpha_max * rho_Q).clamp(0.0, alpha_max)
    a32 = alpha_Q.float()[:, None]
    blend_QL = (1.0 - a32) * d32[group_tgt] + a32 * c_QL
    corrected = d32.clone()
    corrected[group_tgt] = blend_QL
    c32 = d32.clone()
    c32[group_tgt] = c_QL
    rho32 = torch.zeros(M, dtype=torch.float32, device=dev)
    rho32[group_tgt] = rho_Q.float()
    alpha32 = torch.zeros(M, dtype=torch.float32, device=dev)
    alpha32[group_tgt] = alpha_Q.float()
    w32 = w_QK[group, slot].float()  # [P]
    return Rectified(
        corrected=corrected,
        rho=rho32,
        alpha=alpha32,
        cross_score=c32,
        diag=d32.clone(),
        matched=matched,
        pair_weight=w32,
        pair_similarity=h.float(),
        pairs=pr,
        gamma=gamma,
        alpha_max=alpha_max,
        mode=mode,
    )


# ----------------------------------------------------------------------------- the public name `alignopsd.rectify`


class _CallableModule(types.ModuleType):
    """``alignopsd.rectify`` names both this submodule and the API function :func:`rectify`.

    Python binds the package attribute to the submodule as soon as it is imported, so the module itself
    is made callable: ``alignopsd.rectify(...)`` (or ``from alignopsd import rectify``) calls the function
    whatever the import order, while ``alignopsd.rectify.select_sources`` keeps working.
    """

    def __call__(self, *args, **kwargs) -> Rectified:
        return rectify(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
__signature__ = inspect.signature(rectify)
