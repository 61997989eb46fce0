"""Metrics of the credit-assignment benchmark (bench/credit.py): learning curves over seeds and the mechanisms
against the environments' ground truth (engine/envs/credit/env.py).

Learning (per estimator, over seeds): success per step (the training batch's episode success rate; mean and 95 %
t-interval over seeds), steps to 80 % success (the first step whose batch success is >= 0.8; median and IQR over
seeds, a seed that never reaches it counts as infinite), area under the success curve (mean success over the
steps, in [0, 1]) and a paired comparison with GRPO on the same seeds (difference of areas: mean, 95 % interval,
wins / losses / ties and the two-sided exact sign-test p-value).

Mechanisms (per run, from the audit's per-turn records of every step, engine/observe/audit.py, read by
:func:`read_audit`):

* decisive share: Σ |token advantage| on decisive turns / Σ |token advantage| on all turns (response tokens);
  GRPO's value is the uniform baseline (every token of an episode gets the same |A|);
* Mechanism 2's boundaries: per trajectory the predicted boundaries are the turns that open a span (other than
  the trajectory's first turn), the true ones are the environment's span boundaries (the decisive turns other
  than turn 0); precision = hits / predicted, recall = hits / true, pooled over the run's trajectories, exact and
  within one turn;
* Mechanism 1's rectified gap: mean δ̃ = ℓ̃ − ℓ^old per response token, on decisive turns and on the other turns;
  the identity gap δ^diag = ℓ^diag − ℓ^old (the teacher with the skill against the student on the same prefix)
  likewise; and each one's magnitude, Σ_turns |Σ_tokens gap| / tokens (a gap that is large but of either sign
  averages out in the mean; this does not).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from statistics import mean

from alignopsd.engine.observe import intervals

TARGET = 0.8


def mean_ci(xs: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of the 95 % t-interval); half-width nan with fewer than 2 values (the engine's
    ``observe.intervals.mean_ci``)."""
    m, h, _ = intervals.mean_ci(xs)
    return m, h


def steps_to(curve: Sequence[float], target: float = TARGET) -> float:
    """First 1-based step whose success is >= target; inf when never."""
    return next((float(i + 1) for i, s in enumerate(curve) if s >= target), math.inf)


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile; inf where an infinite value takes part."""
    v = sorted(xs)
    if not v:
        return float("nan")
    pos = q * (len(v) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    if math.isinf(v[lo]) or math.isinf(v[hi]):
        return math.inf
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def auc(curve: Sequence[float]) -> float:
    """Area under the success curve, normalised to [0, 1] (mean success over the steps)."""
    return mean(curve) if curve else float("nan")


def sign_test_p(wins: int, losses: int) -> float:
    """Two-sided exact sign-test p-value (ties dropped)."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    p = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * p)


def paired(ours: dict[int, float], base: dict[int, float]) -> dict[str, float]:
    """Paired comparison on the seeds both have: mean difference (ours - base), 95 % half-width, W/L/T, p."""
    seeds = sorted(set(ours) & set(base))
    d = [ours[s] - base[s] for s in seeds]
    m, h = mean_ci(d)
    wins, losses = sum(x > 1e-12 for x in d), sum(x < -1e-12 for x in d)
    return {
        "n": len(d),
        "diff": m,
        "ci": h,
        "wins": wins,
        "losses": losses,
        "ties": len(d) - wins - losses,
        "p": sign_test_p(wins, losses),
    }


def learning_summary(curves: dict[int, list[float]]) -> dict[str, object]:
    """Per-step mean/CI, steps-to-target median/IQR, AUC mean/CI, per-seed AUCs of one estimator's runs."""
    seeds = sorted(curves)
    n_steps = min(len(curves[s]) for s in seeds)
    per_step = [mean_ci([curves[s][i] for s in seeds]) for i in range(n_steps)]
    reach = [steps_to(curves[s]) for s in seeds]
    aucs = {s: auc(curves[s][:n_steps]) for s in seeds}
    return {
        "per_step": per_step,
        "steps_to_median": quantile(reach, 0.5),
        "steps_to_q1": quantile(reach, 0.25),
        "steps_to_q3": quantile(reach, 0.75),
        "reached": sum(not math.isinf(r) for r in reach),
        "auc": mean_ci(list(aucs.values())),
        "auc_by_seed": aucs,
    }


def read_audit(audit_dir: str | Path, step: int | None = None, kind: str | None = None) -> list[dict]:
    """Records of a run's audit files (one step or all, all ranks; ``kind``: only records of that kind), in step
    then rank then file order."""
    from alignopsd.engine.observe.audit import AUDIT_FILE_RE

    d = Path(audit_dir)
    files = []
    for p in d.glob("step_*.rank*.jsonl") if d.is_dir() else []:
        mt = AUDIT_FILE_RE.match(p.name)
        if mt and (step is None or int(mt.group(1)) == step):
            files.append((int(mt.group(1)), int(mt.group(2)), p))
    out = []
    for _, _, p in sorted(files):
        for line in p.read_text().splitlines():
            rec = json.loads(line)
            if kind is None or rec.get("kind") == kind:
                out.append(rec)
    return out


def _trajectories(records: Iterable[dict]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("kind") == "turn":
            out[(r["step"], r["task"], r["rollout"])].append(r)
    return out


def recorded_truth(traj: list[dict]) -> tuple[set[int], set[int]]:
    """(decisive turns, true span boundaries) of one trajectory from its records' ``truth`` (an environment whose
    decisions depend on the agent's actions reports it per turn): the turns marked ``decisive``, and the turns
    whose ``goal`` differs from the previous turn's."""
    traj = sorted(traj, key=lambda r: r["turn"])
    truths = [r.get("truth") or {} for r in traj]
    dec = {r["turn"] for r, tr in zip(traj, truths) if tr.get("decisive")}
    cuts = {traj[k]["turn"] for k in range(1, len(traj)) if truths[k].get("goal") != truths[k - 1].get("goal")}
    return dec, cuts


def mechanism_tallies(
    records: Iterable[dict],
    decisive: Callable[[str], list[int]] | None = None,
    boundaries: Callable[[str], list[int]] | None = None,
) -> dict[str, float]:
    """Sums over one run's audit ``turn`` records (every step); ``decisive(task_key)`` / ``boundaries(task_key)``:
    the ground truth of a task (None: each trajectory's recorded ``truth``, :func:`recorded_truth`). Combine with
    :func:`mechanism_metrics`."""
    t: dict[str, float] = defaultdict(float)
    for traj in _trajectories(records).values():
        key = traj[0]["task_key"]
        if decisive is None or boundaries is None:
            dec, truth = recorded_truth(traj)
        else:
            dec, truth = set(decisive(key)), set(boundaries(key))
        for r in traj:
            reg = r["regions"]["response"]
            side = "dec" if r["turn"] in dec else "oth"
            t[f"abs_adv_{side}"] += float(reg.get("sum_abs_advantage") or 0.0)
            t[f"tokens_{side}"] += float(reg["tokens"])
            if reg.get("sum_corrected_gap") is not None:
                t[f"gap_{side}"] += float(reg["sum_corrected_gap"])
                t[f"absgap_{side}"] += abs(float(reg["sum_corrected_gap"]))
                t[f"gap_tokens_{side}"] += float(reg["tokens"])
            if reg.get("sum_diag_gap") is not None:
                t[f"idgap_{side}"] += float(reg["sum_diag_gap"])
                t[f"absidgap_{side}"] += abs(float(reg["sum_diag_gap"]))
                t[f"idgap_tokens_{side}"] += float(reg["tokens"])
        if all("m2" in r and "span_start" in r["m2"] for r in traj):
            first = min(r["turn"] for r in traj)
            pred = {r["m2"]["span_start"] for r in traj} - {first}
            t["b_pred"] += len(pred)
            t["b_true"] += len(truth)
            t["b_hit"] += len(pred & truth)
            t["b_hit_tol1_pred"] += sum(any(abs(p - q) <= 1 for q in truth) for p in pred)
            t["b_hit_tol1_true"] += sum(any(abs(p - q) <= 1 for p in pred) for q in truth)
    return dict(t)


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def mechanism_metrics(t: dict[str, float]) -> dict[str, float]:
    """Per-run mechanism metrics from :func:`mechanism_tallies` (nan where the estimator has no such quantity)."""
    g = t.get
    has_gap = bool(g("gap_tokens_dec", 0) or g("gap_tokens_oth", 0))
    has_id = bool(g("idgap_tokens_dec", 0) or g("idgap_tokens_oth", 0))
    has_m2 = "b_pred" in t
    nan = float("nan")
    return {
        "decisive_share": _ratio(g("abs_adv_dec", 0.0), g("abs_adv_dec", 0.0) + g("abs_adv_oth", 0.0)),
        "decisive_token_share": _ratio(g("tokens_dec", 0.0), g("tokens_dec", 0.0) + g("tokens_oth", 0.0)),
        "m2_precision": _ratio(g("b_hit", 0.0), g("b_pred", 0.0)) if has_m2 else nan,
        "m2_recall": _ratio(g("b_hit", 0.0), g("b_true", 0.0)) if has_m2 else nan,
        "m2_precision_tol1": _ratio(g("b_hit_tol1_pred", 0.0), g("b_pred", 0.0)) if has_m2 else nan,
        "m2_recall_tol1": _ratio(g("b_hit_tol1_true", 0.0), g("b_true", 0.0)) if has_m2 else nan,
        "gap_decisive": _ratio(g("gap_dec", 0.0), g("gap_tokens_dec", 0.0)) if has_gap else nan,
        "gap_other": _ratio(g("gap_oth", 0.0), g("gap_tokens_oth", 0.0)) if has_gap else nan,
        "abs_gap_decisive": _ratio(g("absgap_dec", 0.0), g("gap_tokens_dec", 0.0)) if has_gap else nan,
        "abs_gap_other": _ratio(g("absgap_oth", 0.0), g("gap_tokens_oth", 0.0)) if has_gap else nan,
        "id_gap_decisive": _ratio(g("idgap_dec", 0.0), g("idgap_tokens_dec", 0.0)) if has_id else nan,
        "id_gap_other": _ratio(g("idgap_oth", 0.0), g("idgap_tokens_oth", 0.0)) if has_id else nan,
        "abs_id_gap_decisive": _ratio(g("absidgap_dec", 0.0), g("idgap_tokens_dec", 0.0)) if has_id else nan,
        "abs_id_gap_other": _ratio(g("absidgap_oth", 0.0), g("idgap_tokens_oth", 0.0)) if has_id else nan,
    }
