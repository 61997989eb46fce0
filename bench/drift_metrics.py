"""The drift benchmark's premise, measured from a run's own audit records and metrics (bench/drift.py).

Every audit ``turn`` record of ``credit_drift`` carries the environment's ``truth`` for the state the turn was
played in (bench/credit_drift.py: ``decision``, ``goal``, ``decisive``). From them, per run:

* **displacement**: for every task and step, the turn at which each sibling met the decision's first step
  (``examine``), and |turn_a - turn_b| over every pair of siblings that met it (pooled; the premise reads the
  median);
* **Mechanism 1's matches against the ground truth**: Σ ω over the selected (source, target) pairs whose source
  turn plays the same functional decision as the target (``truth.decision``), over Σ ω of all selected pairs
  (match precision), on every target and on decisive targets; the off-turn match weight of ALGORITHM.md §4.3
  recomputed from the same records (Σ_t Σ_j ω_j·1[turn(s_j) ≠ turn(t)] / #matched targets), on every target and on
  decisive targets, beside the share of matched targets (coverage);
* **groups without signal**: the share of (step, task) groups whose siblings all had the same outcome (all won
  or all lost: the outcome advantage is zero there, whatever the credit's allocation);
* **where the credit went**: the share of |advantage| on decisive turns, in won and in lost episodes apart;
* **spans**: the true spans' lengths (runs of one ``goal``) and Mechanism 2's learned spans' lengths (from the
  records' ``m2.span_start``), per trajectory.

:func:`premise_tallies` sums one run's records (they pool over runs by adding), :func:`premise_metrics` turns the
sums into the numbers of the premise.

The statistics the report's comparisons are read with sit at the end: Holm's adjustment over the family of
comparisons (:func:`holm`), the resolution of the area under the success curve (:func:`auc_resolution`) and the
rule that calls a difference separated only when its interval clears 0 by more than that resolution
(:func:`separated`). The sign test is ``bench.credit_metrics.sign_test_p`` (two-sided, exact, ties dropped).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable

FIRST_STEP = "examine"


def _by_step_rank(records: list[dict]) -> dict[tuple, dict]:
    return {(r["step"], r["rank"], r["canonical_index"]): r for r in records}


def _spans(starts: list[bool]) -> list[int]:
    """Lengths of the spans a trajectory's start flags cut (the first turn always opens one)."""
    out: list[int] = []
    for k, s in enumerate(starts):
        if k == 0 or s:
            out.append(0)
        out[-1] += 1
    return out


def premise_tallies(records: Iterable[dict]) -> dict[str, list | float]:
    """Sums and samples of one run's audit ``turn`` records that carry ``truth`` (see the module docstring)."""
    turns = [r for r in records if r.get("kind") == "turn" and isinstance(r.get("truth"), dict)]
    t: dict[str, float] = defaultdict(float)
    out: dict[str, list | float] = {"displacement": [], "true_spans": [], "learned_spans": []}
    first: dict[tuple, dict[int, int]] = defaultdict(dict)
    trajs: dict[tuple, list[dict]] = defaultdict(list)
    for r in turns:
        trajs[(r["step"], r["task"], r["rollout"])].append(r)
        if r["truth"].get("decision") == FIRST_STEP:
            first[(r["step"], r["task"])].setdefault(r["rollout"], r["turn"])
    outcomes: dict[tuple, dict[int, float]] = defaultdict(dict)
    for r in turns:
        outcomes[(r["step"], r["task"])][r["rollout"]] = float(r["outcome"])
    t["groups"] = float(len(outcomes))
    t["groups_uniform"] = float(sum(len(set(o.values())) == 1 for o in outcomes.values()))
    for r in turns:
        side = "win" if float(r["outcome"]) > 0 else "lose"
        a = float(r["regions"]["response"].get("sum_abs_advantage") or 0.0)
        t[f"absadv_{side}"] += a
        t[f"absadv_dec_{side}"] += a * bool(r["truth"].get("decisive"))
    for met in first.values():
        out["displacement"] += [abs(a - b) for a, b in itertools.combinations(sorted(met.values()), 2)]
    for traj in trajs.values():
        traj.sort(key=lambda r: r["turn"])
        goals = [r["truth"].get("goal") for r in traj]
        out["true_spans"] += _spans([k > 0 and goals[k] != goals[k - 1] for k in range(len(goals))])
        if all("span_start" in (r.get("m2") or {}) for r in traj):
            out["learned_spans"] += _spans([r["m2"]["span_start"] == r["turn"] for r in traj])
    index = _by_step_rank(turns)
    for r in turns:
        if r.get("m1") is None:
            continue
        t["targets"] += 1
        srcs = r["m1"].get("sources") or []
        if not srcs:
            continue
        t["matched"] += 1
        dec = bool(r["truth"].get("decisive"))
        t["matched_decisive"] += dec
        for s in srcs:
            src = index.get((r["step"], r["rank"], s["index"]))
            w = float(s["omega"])
            same = src is not None and src["truth"].get("decision") == r["truth"].get("decision")
            off = (src["turn"] if src is not None else s.get("turn")) != r["turn"]
            t["omega"] += w
            t["omega_same"] += w * same
            t["omega_off"] += w * off
            if dec:
                t["omega_dec"] += w
                t["omega_same_dec"] += w * same
                t["omega_off_dec"] += w * off
    out.update(t)
    return out


def pool(tallies: Iterable[dict]) -> dict[str, list | float]:
    """The sum of several runs' :func:`premise_tallies` (lists concatenated)."""
    out: dict[str, list | float] = {}
    for tl in tallies:
        for k, v in tl.items():
            out[k] = (out.get(k) or ([] if isinstance(v, list) else 0.0)) + v
    return out


def _median(xs: list) -> float:
    v = sorted(xs)
    if not v:
        return float("nan")
    m = len(v) // 2
    return float(v[m]) if len(v) % 2 else (v[m - 1] + v[m]) / 2


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def premise_metrics(t: dict) -> dict[str, float]:
    """The premise's numbers from pooled tallies (nan where a run had no such record)."""
    g = t.get
    disp, true_sp, learned = g("displacement") or [], g("true_spans") or [], g("learned_spans") or []
    return {
        "displacement_median": _median(disp),
        "displacement_mean": _ratio(sum(disp), len(disp)),
        "displacement_pairs": float(len(disp)),
        "off_turn_weight": _ratio(g("omega_off", 0.0), g("matched", 0.0)),
        # nan for records tallied before ``omega_off_dec`` existed (bench/results/drift-2026-12-06.json)
        "off_turn_weight_decisive": _ratio(g("omega_off_dec", math.nan), g("matched_decisive", 0.0)),
        "coverage": _ratio(g("matched", 0.0), g("targets", 0.0)),
        "match_precision": _ratio(g("omega_same", 0.0), g("omega", 0.0)),
        "match_precision_decisive": _ratio(g("omega_same_dec", 0.0), g("omega_dec", 0.0)),
        "coverage_decisive_targets": g("matched_decisive", 0.0),
        "uniform_group_share": _ratio(g("groups_uniform", 0.0), g("groups", 0.0)),
        "decisive_share_won": _ratio(g("absadv_dec_win", 0.0), g("absadv_win", 0.0)),
        "decisive_share_lost": _ratio(g("absadv_dec_lose", 0.0), g("absadv_lose", 0.0)),
        "true_span_mean": _ratio(sum(true_sp), len(true_sp)),
        "learned_span_mean": _ratio(sum(learned), len(learned)),
    }


# ---------------------------------------------------------------------------------------------------------------------
# statistics of the comparisons (bench/drift_report.py)


def holm(pvalues: dict) -> dict:
    """Holm's step-down adjustment of a family of p-values (``{comparison: p}``, the same keys back): the i-th
    smallest of m is multiplied by m - i + 1, made monotone in that order and capped at 1. Controls the family-wise
    error rate over every comparison of the family, whatever their dependence."""
    order = sorted(pvalues, key=lambda k: pvalues[k])
    m, run, out = len(order), 0.0, {}
    for i, k in enumerate(order):
        run = max(run, min(1.0, (m - i) * float(pvalues[k])))
        out[k] = run
    return out


def auc_resolution(episodes_per_step: int, steps: int) -> float:
    """The smallest change of one run's area under the success curve: one episode of one step, 1 / (episodes per
    step × steps) (the batch success of a step is a fraction of its episodes; the area is its mean over steps)."""
    if episodes_per_step < 1 or steps < 1:
        raise ValueError(f"episodes_per_step, steps: must be >= 1, got {episodes_per_step}, {steps}")
    return 1.0 / (episodes_per_step * steps)


def separated(lo: float, hi: float, resolution: float) -> bool | None:
    """Whether an interval [lo, hi] of a difference excludes 0 by more than the metric's ``resolution`` (a bound
    within one resolution unit of 0 is one episode's worth: not a separation); None when the interval is nan."""
    if math.isnan(lo) or math.isnan(hi):
        return None
    return lo > resolution or hi < -resolution
