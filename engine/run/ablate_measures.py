"""What ``alignopsd ablate`` measures of one paired update, and its summary over batches (engine/run/ablate.py).

Legend: M = canonical turns of the update, L = response length, P = probe states.

Per estimator case X, against a reference R (the full method E, and GRPO), on one batch:

* advantage mass moved: Σ |Â_X − Â_R| / Σ |Â_R| over the policy tokens (nan where R moved no mass: every group
  of the batch without outcome signal);
* per-turn weight divergence: mean over turns of |w_X − w_R|, with a turn's effective weight
  w_u = (mean of Â over the turn's policy tokens − r_u) / A_u, A_u the outcome advantage of its trajectory and r_u
  the invalid-action residual (ALGORITHM.md §3.1, §3.10; ``alignopsd.estimators.outcome_advantage``). This is
  Mechanism 2's turn weight where the estimator has one, 1 for GRPO, and the like for any estimator whose advantage
  is A times weights; turns with A_u = 0 (groups without signal) carry no weight and are left out;
* parameter step: the L2 norm of the trained parameters' change;
* probe states: Δ_i = Σ over the state's response tokens of the log-probability after the update minus before,
  reported as mean |Δ_i| and as the mean of s_i · Δ_i ("toward the better action"), s_i the sign of the episode's
  outcome against the mean outcome of its task's siblings (states with s_i = 0 left out).

Per batch, the groups (tasks) with outcome signal (siblings' outcomes not all equal) and without. Over batches,
each value's mean and 95 % t-interval (engine/observe/intervals.py); a batch whose value is nan is left out of it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
from alignopsd.engine.observe.intervals import mean_ci
from torch import Tensor

__all__ = [
    "ADVANTAGE_EPS",
    "CASE_METRICS",
    "mass_moved",
    "outcome_groups",
    "parameter_step",
    "probe_change",
    "summarise",
    "toward_better",
    "turn_weights",
    "weight_divergence",
]

ADVANTAGE_EPS = 1e-6  # |A| at or below this: the turn carries no outcome signal, its weight is undefined

CASE_METRICS = (
    "mass_moved_vs_full",
    "mass_moved_vs_grpo",
    "weight_divergence_vs_full",
    "weight_divergence_vs_grpo",
    "param_step",
    "probe_dlogp_abs",
    "probe_dlogp_toward_better",
)
"""The per-case values of one batch that the summary gives intervals for."""


def mass_moved(adv: Tensor, ref: Tensor, mask: Tensor) -> float:
    """Σ |adv − ref| / Σ |ref| over ``mask`` ([M, L] each); nan where ``ref`` has no mass there."""
    m = mask.bool()
    a, r = adv.double()[m], ref.double()[m]
    den = float(r.abs().sum())
    return float((a - r).abs().sum()) / den if den > 0 else float("nan")


def turn_weights(adv: Tensor, mask: Tensor, A: Tensor, r: Tensor) -> Tensor:
    """[M] float64 effective turn weights (mean policy-token advantage − r) / A; nan where |A| <= ADVANTAGE_EPS or the
    turn has no policy token. ``adv``, ``mask``: [M, L]; ``A``, ``r``: [M]."""
    mf = mask.double()
    n = mf.sum(1)
    mean = (adv.double() * mf).sum(1) / n.clamp_min(1.0)
    A, r = A.double().to(mean.device), r.double().to(mean.device)
    ok = (A.abs() > ADVANTAGE_EPS) & (n > 0)
    return torch.where(ok, (mean - r) / torch.where(ok, A, torch.ones_like(A)), torch.full_like(A, math.nan))


def weight_divergence(w: Tensor, ref: Tensor) -> float:
    """Mean |w − ref| over the turns where both are defined ([M] each); nan where none is."""
    ok = ~(w.isnan() | ref.isnan())
    return float((w[ok] - ref[ok]).abs().mean()) if bool(ok.any()) else float("nan")


def _episode_outcomes(task: Tensor, rollout: Tensor, outcome: Tensor) -> dict[int, dict[int, float]]:
    """{task: {rollout: outcome}} of a batch's rows."""
    out: dict[int, dict[int, float]] = defaultdict(dict)
    for t, k, o in zip(task.tolist(), rollout.tolist(), outcome.double().tolist()):
        out[t][k] = o
    return out


def outcome_groups(task: Tensor, rollout: Tensor, outcome: Tensor) -> tuple[int, int]:
    """(groups with outcome signal, groups without): a task's siblings' outcomes differ, or are all equal."""
    groups = _episode_outcomes(task, rollout, outcome).values()
    signal = sum(len(set(g.values())) > 1 for g in groups)
    return signal, len(groups) - signal


def toward_better(task: Tensor, rollout: Tensor, outcome: Tensor) -> Tensor:
    """[rows] float64 sign of each row's episode outcome against the mean outcome of its task's siblings."""
    groups = _episode_outcomes(task, rollout, outcome)
    mean = {t: math.fsum(g.values()) / len(g) for t, g in groups.items()}
    diff = [o - mean[t] for t, o in zip(task.tolist(), outcome.double().tolist())]
    return torch.tensor(diff, dtype=torch.float64).sign()


def probe_change(before: Tensor, after: Tensor, mask: Tensor, sign: Tensor) -> tuple[float, float]:
    """(mean |Δ|, mean s·Δ over the states with s ≠ 0) of the probe states' log-probability change Δ (the sum over
    each state's response tokens); nan where there is no state (no state with s ≠ 0). [P, L] each, ``sign`` [P]."""
    d = ((after.double() - before.double()) * mask.double()).sum(1).cpu()
    if not d.numel():
        return float("nan"), float("nan")
    s = sign.double().cpu()
    signed = s != 0
    toward = float((s[signed] * d[signed]).mean()) if bool(signed.any()) else float("nan")
    return float(d.abs().mean()), toward


def parameter_step(before: Iterable[Tensor], after: Iterable[Tensor]) -> float:
    """L2 norm of ``after`` − ``before`` over every pair of tensors (float64 sums)."""
    total = 0.0
    for b, a in zip(before, after, strict=True):
        total += float((a.detach().to("cpu", torch.float64) - b.to(torch.float64)).pow(2).sum())
    return math.sqrt(total)


def _interval(values: list) -> dict[str, float | int]:
    m, h, n = mean_ci(values)
    return {"mean": m, "half_width": h, "n": n}


def summarise(batches: list[dict], names: list[str]) -> dict:
    """Mean and 95 % t-interval over batches of every case's :data:`CASE_METRICS` and of the batch's outcome groups."""
    out: dict = {
        "groups_with_signal": _interval([b["groups_with_signal"] for b in batches]),
        "groups_without_signal": _interval([b["groups_without_signal"] for b in batches]),
        "cases": {},
    }
    for name in names:
        rows = [b["cases"][name] for b in batches]
        out["cases"][name] = {k: _interval([r[k] for r in rows]) for k in CASE_METRICS}
    return out
