"""The statistics the drift report reads its comparisons with (bench/drift_metrics.py, bench/drift_report.py): ties
as ties with the sign test that ignores them, Holm's adjustment, separation beyond the metric's resolution, the
hierarchical interval, and the off-turn match weight on decisive targets."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.drift_metrics import (  # noqa: E402
    auc_resolution,
    holm,
    pool,
    premise_metrics,
    premise_tallies,
    separated,
)
from bench.drift_report import compare, comparison_family, episodes_per_step, two_stage_ci  # noqa: E402


def test_ties_are_counted_and_the_sign_test_ignores_them():
    ours = {f"r{r}:{s}": 0.5 for r in range(3) for s in range(10)}
    diffs = [0.25] * 9 + [-0.125] * 3 + [0.0] * 18  # 9 wins, 3 losses, 18 ties
    base = {k: 0.5 - d for k, d in zip(sorted(ours), diffs)}
    v = compare(ours, base)
    assert (v["n"], v["wins"], v["losses"], v["ties"]) == (30, 9, 3, 18)
    # two-sided exact: 2 * P(X <= 3), X ~ Bin(12, 1/2); the 18 ties take no part
    assert v["p"] == pytest.approx(2 * (1 + 12 + 66 + 220) / 4096)
    none = compare({"a:0": 1.0, "a:1": 2.0}, {"a:0": 1.0, "a:1": 2.0})
    assert (none["wins"], none["losses"], none["ties"], none["p"]) == (0, 0, 2, 1.0)


def test_holm_on_known_p_values():
    adj = holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005})
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 -> 0.02, 0.03, 0.06, 0.04, made monotone -> 0.06 for d's last
    assert adj == pytest.approx({"d": 0.02, "a": 0.03, "c": 0.06, "b": 0.06})
    assert holm({"x": 0.6, "y": 0.7}) == {"x": 1.0, "y": 1.0}  # capped at 1
    assert holm({}) == {}


def test_separation_is_refused_within_one_resolution_unit():
    res = auc_resolution(8, 4)
    assert res == 1 / 32 and episodes_per_step(["env.tasks_per_step=2", "env.group_n=4"]) == 8
    assert separated(res, 0.2, res) is False  # one unit above 0 is one episode's worth: not separated
    assert separated(0.001, 0.059, res) is False
    assert separated(1.01 * res, 0.2, res) is True and separated(-0.2, -1.01 * res, res) is True
    assert separated(-0.2, -res, res) is False and separated(-0.1, 0.1, res) is False
    assert separated(math.nan, math.nan, res) is None
    with pytest.raises(ValueError, match="episodes_per_step"):
        auc_resolution(0, 4)


def test_the_interval_resamples_readers_then_seeds():
    # every seed of a reader agrees: resampling seeds alone would give no width, resampling readers does
    d = {f"r{r}:{s}": float(r) for r in range(3) for s in range(10)}
    lo, hi = two_stage_ci(d)
    assert lo < 1.0 < hi and hi - lo >= 1.0


def test_holm_runs_over_every_comparison_of_the_file():
    def summ(shift):
        return {"learn": {"auc_by_seed": {f"r{r}:{s}": 0.1 * s + shift for r in range(2) for s in range(5)}}}

    summary = {c: summ(0.05 * i) for i, c in enumerate(["grpo", "alignopsd", "alignopsd_A", "alignopsd_m1", "sdar"])}
    for c in summary:
        if c != "grpo":
            summary[c]["vs_grpo"] = compare(summary[c]["learn"]["auc_by_seed"], summary["grpo"]["learn"]["auc_by_seed"])
    sens = {"algorithm.rectify.gamma=0.8": compare({"r0:0": 0.2}, {"r0:0": 0.1})}
    fam = comparison_family(summary, sens)
    # 4 against GRPO, the one ablation pair (E, A; also its mechanism contrast), M1 against SDAR, one sensitivity
    assert set(fam) == {
        "alignopsd - grpo", "alignopsd_A - grpo", "alignopsd_m1 - grpo", "sdar - grpo", "alignopsd - alignopsd_A",
        "alignopsd_m1 - sdar", "algorithm.rectify.gamma=0.8 - reference",
    }  # fmt: skip
    assert fam["sdar - grpo"]["p"] == pytest.approx(2 / 1024)  # 10 wins, no loss
    assert fam["sdar - grpo"]["p_holm"] == pytest.approx(min(1.0, 7 * 2 / 1024))
    assert fam["sdar - grpo"] is summary["sdar"]["vs_grpo"]  # the table's numbers are the family's


def test_off_turn_weight_on_decisive_targets():
    def rec(idx, turn, decisive, sources):
        return {"kind": "turn", "step": 1, "rank": 0, "canonical_index": idx, "task": 0, "rollout": idx,
                "turn": turn, "outcome": 0.0, "truth": {"decision": "d", "goal": "g", "decisive": decisive},
                "regions": {"response": {"tokens": 1, "sum_abs_advantage": 1.0}},
                "m1": {"sources": [{"index": i, "omega": w} for i, w in sources]}}  # fmt: skip

    recs = [rec(0, 2, True, [(1, 0.5), (2, 0.5)]), rec(1, 2, False, [(2, 1.0)]), rec(2, 5, False, [(0, 1.0)])]
    m = premise_metrics(premise_tallies(recs))
    assert m["off_turn_weight"] == pytest.approx((0.5 + 1.0 + 1.0) / 3)  # every matched target
    assert m["off_turn_weight_decisive"] == pytest.approx(0.5)  # the decisive one: half its weight on turn 5
    old = {k: v for k, v in pool([premise_tallies(recs)]).items() if k != "omega_off_dec"}
    assert math.isnan(premise_metrics(old)["off_turn_weight_decisive"])  # records that predate the tally
