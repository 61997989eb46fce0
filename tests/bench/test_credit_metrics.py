"""The credit benchmark's metrics on hand-made curves and audit records."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.credit_metrics import (  # noqa: E402
    learning_summary,
    mean_ci,
    mechanism_metrics,
    mechanism_tallies,
    paired,
    quantile,
    sign_test_p,
    steps_to,
)


def test_learning_numbers():
    m, h = mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0 and h == pytest.approx(4.303 * 1.0 / math.sqrt(3))
    assert steps_to([0.1, 0.5, 0.8, 0.2]) == 3.0 and math.isinf(steps_to([0.1, 0.79]))
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5 and math.isinf(quantile([1.0, math.inf, math.inf], 0.5))
    s = learning_summary({0: [0.0, 0.5, 1.0], 1: [0.0, 0.9, 0.9], 2: [0.0, 0.0, 0.0]})
    assert s["per_step"][1][0] == pytest.approx(1.4 / 3)
    assert s["steps_to_median"] == 3.0 and s["reached"] == 2 and math.isinf(s["steps_to_q3"])
    assert s["auc_by_seed"] == {0: 0.5, 1: pytest.approx(0.6), 2: 0.0}


def test_paired_comparison_and_sign_test():
    assert sign_test_p(10, 0) == pytest.approx(2 / 1024) and sign_test_p(3, 3) == 1.0
    v = paired({0: 0.5, 1: 0.6, 2: 0.4, 3: 0.9}, {0: 0.4, 1: 0.6, 2: 0.5, 4: 0.0})
    assert (v["n"], v["wins"], v["losses"], v["ties"]) == (3, 1, 1, 1) and v["diff"] == pytest.approx(0.0)


def turn(step, task, rollout, t, key, abs_adv, tokens, gap=None, span_start=None):
    reg = {"tokens": tokens, "sum_abs_advantage": abs_adv}
    if gap is not None:
        reg["sum_corrected_gap"] = gap
    rec = {"kind": "turn", "step": step, "task": task, "rollout": rollout, "turn": t, "task_key": key,
           "regions": {"response": reg}}  # fmt: skip
    if span_start is not None:
        rec["m2"] = {"span_start": span_start}
    return rec


def test_mechanism_metrics_against_ground_truth():
    # one 4-turn trajectory; decisive turns 0 and 2, true boundary 2; M2 spans [0, 1) [1, 3) [3, 4)
    spans = {0: 0, 1: 1, 2: 1, 3: 3}
    recs = [turn(1, 0, 0, t, "k", abs_adv=a, tokens=10, gap=g, span_start=spans[t])
            for t, a, g in zip(range(4), (3.0, 1.0, 5.0, 1.0), (2.0, -1.0, 4.0, -1.0))]  # fmt: skip
    recs.append({"kind": "step"})
    t = mechanism_tallies(recs, lambda k: [0, 2], lambda k: [2])
    m = mechanism_metrics(t)
    assert m["decisive_share"] == pytest.approx(8 / 10) and m["decisive_token_share"] == pytest.approx(0.5)
    assert m["m2_precision"] == 0.0 and m["m2_recall"] == 0.0  # predicted {1, 3}, true {2}
    assert m["m2_precision_tol1"] == 1.0 and m["m2_recall_tol1"] == 1.0
    assert m["gap_decisive"] == pytest.approx(6 / 20) and m["gap_other"] == pytest.approx(-2 / 20)
    # GRPO-like records (no M1, no M2): those metrics are n/a, the share is still computed
    g = mechanism_metrics(mechanism_tallies([turn(1, 0, 0, t, "k", 1.0, 10) for t in range(4)], lambda k: [0], list))
    assert g["decisive_share"] == pytest.approx(0.25) and math.isnan(g["m2_recall"]) and math.isnan(g["gap_other"])


def test_identity_gap_and_gap_magnitudes_per_turn_kind():
    # decisive turn 0: the teacher's gap is large and of either sign across two rollouts; turn 1 flat
    recs = []
    for roll, d0 in ((0, 6.0), (1, -4.0)):
        for t, d in ((0, d0), (1, 0.5)):
            r = turn(1, 0, roll, t, "k", abs_adv=1.0, tokens=10, gap=d / 2)
            r["regions"]["response"]["sum_diag_gap"] = d
            recs.append(r)
    m = mechanism_metrics(mechanism_tallies(recs, lambda k: [0], lambda k: []))
    assert m["id_gap_decisive"] == pytest.approx(2 / 20) and m["abs_id_gap_decisive"] == pytest.approx(10 / 20)
    assert m["id_gap_other"] == pytest.approx(1 / 20) and m["abs_id_gap_other"] == pytest.approx(1 / 20)
    assert m["abs_gap_decisive"] == pytest.approx(5 / 20) and m["gap_decisive"] == pytest.approx(1 / 20)
    g = mechanism_metrics(mechanism_tallies([turn(1, 0, 0, 0, "k", 1.0, 10)], lambda k: [0], list))
    assert math.isnan(g["id_gap_decisive"]) and math.isnan(g["abs_gap_other"])
