"""M1 diagnostics (ALGORITHM.md §4.3), paired sign flips (§6 case 18), off-turn match weight."""

from __future__ import annotations

import math

import pytest
import torch

from alignopsd.diagnostics import (
    action_filter_metrics,
    describe,
    m1_diagnostics,
    off_turn_match_weight,
    paired_sign_flips,
)
from alignopsd.rectification import rectify

P = "m1/paired/response/"


def _case18():
    d = torch.tensor([-1.0, 1.0, -1.0, 1.0, 0.0, 1e-6], dtype=torch.float64)
    c = torch.tensor([1.0, -1.0, -2.0, 2.0, 1.0, -1e-6], dtype=torch.float64)
    return d, c, 0.8 * d + 0.2 * c


def test_case18_paired_statistics():
    d, c, r = _case18()
    s = paired_sign_flips(d, c, r, eps=1e-4)
    assert s[P + "token_count"] == 6
    assert s[P + "strict/neg_to_pos_count"] == 1
    assert s[P + "strict/pos_to_neg_count"] == 2
    assert s[P + "strict/neg_to_pos_given_negative"] == 0.5
    assert s[P + "strict/pos_to_neg_given_positive"] == pytest.approx(2 / 3)
    assert s[P + "tolerance/pos_to_neg_count"] == 1
    assert s[P + "tolerance/neutral_count"] == 2
    assert s[P + "strict/corrected_neg_to_pos_count"] == 0
    assert s[P + "strict/neg_to_pos_rate"] == pytest.approx(1 / 6)
    assert s[P + "increase_count"] == 3 and s[P + "decrease_count"] == 3
    assert all(math.isfinite(v) for v in s.values())


def test_case18_empty_nan_and_eps():
    d, c, r = _case18()
    empty = paired_sign_flips(d, c, r, torch.zeros(6, dtype=torch.bool))
    assert empty[P + "token_count"] == 0 and all(v == 0 and math.isfinite(v) for v in empty.values())
    d2 = d.clone()
    d2[0] = float("nan")
    s = paired_sign_flips(d2, c, r)
    assert s[P + "nan_token_count"] == 1 and s[P + "token_count"] == 5
    assert s[P + "strict/neg_to_pos_count"] == 0
    for bad in (-1, float("nan"), float("inf"), True, "0.1"):
        with pytest.raises(ValueError, match="eps"):
            paired_sign_flips(d, c, r, eps=bad)
    with pytest.raises(ValueError, match="cross_gap"):
        paired_sign_flips(d, c[:3], r)


def test_off_turn_match_weight():
    turn = torch.tensor([0, 1, 0, 2])
    # target 2 (turn 0): sources 0 (turn 0, ω .25) and 1 (turn 1, ω .75); target 3 (turn 2): source 0 (ω 1)
    pairs = torch.tensor([[0, 2], [1, 2], [0, 3]])
    w = torch.tensor([0.25, 0.75, 1.0])
    assert off_turn_match_weight(pairs, w, turn) == pytest.approx((0.75 + 1.0) / 2)
    assert off_turn_match_weight(torch.zeros(0, 2, dtype=torch.long), torch.zeros(0), turn) == 0.0


def test_m1_diagnostics_small_batch():
    # task 0: rollouts 0 (turns 0, 1) and 1 (turn 0); target 2 matched by sources 0 and 1
    turn = torch.tensor([0, 1, 0])
    H = torch.tensor([[0.0, 0.0, 0.8], [0.0, 0.0, 0.9], [0.5, 0.75, 0.0]])
    B = torch.tensor([[False, False, True], [False, False, True], [True, True, False]])
    diag = torch.tensor([[-1.0, -1.0], [-2.0, -2.0], [-3.0, -3.0]])
    cross = torch.tensor([[-1.0, -3.0], [-3.0, -1.0]])
    old = torch.full((3, 2), -2.0)
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    r = rectify(diag, cross, [[0, 2], [1, 2]], H, gamma=0.7, alpha_max=0.2)
    m = m1_diagnostics(r, old, mask, H, B, turn, top_k=3, student_thinking_valid=torch.tensor([True, True, False]))
    assert m["m1/valid_match_rate"] == pytest.approx(1 / 3)
    assert m["m1/fallback_turn_fraction"] == pytest.approx(2 / 3)
    assert m["m1/cross_pair_count"] == 2
    assert m["m1/mean_matched_teachers"] == pytest.approx(2 / 3)
    assert m["m1/top_k_saturation_rate"] == 0.0
    assert m["m1/structural_eligibility_density"] == pytest.approx(4 / 9)
    assert m["m1/threshold_eligibility_density"] == pytest.approx(3 / 9)  # .8, .9, .75
    assert m["m1/threshold_candidate_zero_rate"] == pytest.approx(1 / 3)  # target 1 has no candidate
    assert m["m1/correction_active_rate"] == pytest.approx(1 / 3)
    assert m["m1/invalid_student_thinking_fraction"] == pytest.approx(1 / 3)
    assert m["m1/diagonal_gap_count"] == 5
    assert m["m1/diagonal_gap_mean"] == pytest.approx((1 + 1 + 0 - 1 - 1) / 5)
    assert m["m1/cross_gap_count"] == 2
    assert m["m1/selected_similarity_mean"] == pytest.approx(0.85, abs=1e-6)
    assert m["m1/diagonal_similarity_max"] == 0.0
    assert m["m1/off_turn_match_weight"] == pytest.approx(float(r.weights[2][1]))
    gap = (r.corrected - old)[mask.bool()].double()
    assert m["m1/teacher_student_gap_mean"] == pytest.approx(float(gap.mean()), abs=1e-6)
    assert m["m1/teacher_student_gap_std"] == pytest.approx(float(gap.pow(2).mean().sqrt()), abs=1e-6)
    assert m["m1/correction_strength_mean"] == pytest.approx(float(r.alpha.double().mean()), abs=1e-7)
    for key in ("corrected_gap_p10", "corrected_gap_p50", "corrected_gap_p90", "corrected_diagonal_delta_max"):
        assert "m1/" + key in m
    assert all(isinstance(v, float) and math.isfinite(v) for v in m.values())


def test_describe_and_action_filter_metrics():
    s = describe(torch.tensor([1.0, 2.0, 3.0, float("nan")]), "x")
    assert s["x_count"] == 3 and s["x_mean"] == 2.0 and s["x_p50"] == 2.0 and s["x_std"] == 1.0
    assert describe(torch.zeros(0), "y")["y_mean"] == 0.0
    a = action_filter_metrics([[0, 1], [2], []], [[1], [], []], enabled=True, threshold=0.8, seconds=0.5)
    assert a["m1/action_filter/candidate_pairs"] == 3 and a["m1/action_filter/accepted_pairs"] == 1
    assert a["m1/action_filter/rejected_pairs"] == 2
    assert a["m1/action_filter/retained_fraction"] == pytest.approx(1 / 3)
    assert a["m1/action_filter/new_fallback_turn_fraction"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="after"):
        action_filter_metrics([[0]], [], enabled=True, threshold=0.8)


def test_formula_comparison_case15():
    from alignopsd.diagnostics import formula_comparison

    p = torch.tensor([[0.70, 0.80, 0.95], [0.10, 0.30, 0.90], [0.50, 0.70, 0.80]])
    H = torch.zeros(4, 4)
    H[:3, 3] = 0.95 + 0.1 * torch.log(torch.tensor([0.5, 0.3, 0.2]))
    diag = torch.log(torch.full((4, 3), 0.5))
    old = torch.log(torch.tensor([[0.40, 0.80, 0.90]] * 4))
    s = formula_comparison(diag, torch.log(p), [[0, 3], [1, 3], [2, 3]], H, old, torch.ones(4, 3), gamma=0.7)
    assert s[P + "probability_minus_log_mean_count"] == 3
    assert s[P + "probability_minus_log_mean_p10"] >= 0
    # token 0: mixture .48 > .40 > log_mean .365 -> one sign flip between the formulas
    assert s[P + "formula_neg_to_pos_count"] == 1
    assert s[P + "probability_minus_log_mean_mean"] > 0


def test_describe_quantiles_match_torch():
    v = torch.randn(1001, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    s = describe(v, "v")
    q = torch.quantile(v, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()
    assert [s["v_p10"], s["v_p50"], s["v_p90"]] == pytest.approx(q, abs=1e-12)
    assert s["v_std"] == pytest.approx(float(v.std()))


def test_off_turn_match_weight_bad_pairs():
    turn = torch.tensor([0, 1, 0])
    with pytest.raises(ValueError, match="pairs"):
        off_turn_match_weight(torch.tensor([[0, 1, 2], [1, 2, 0]]), torch.ones(3), turn)
    with pytest.raises(ValueError, match="pairs"):
        off_turn_match_weight(torch.tensor([[0, 5]]), torch.ones(1), turn)
