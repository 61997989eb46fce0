"""Estimator registry and the seven built-in estimators on a small synthetic step."""

from __future__ import annotations

import pytest
import torch

from alignopsd.advantage import grpo_advantage, invalid_action_residual
from alignopsd.config import AlgorithmConfig, apply_overrides, get_preset
from alignopsd.estimators import (
    ESTIMATORS,
    EstimatorInputs,
    EstimatorName,
    get_estimator,
    register_estimator,
    rlsd_lambda,
    rowwise_grpo_advantage,
)
from alignopsd.losses import auxiliary_loss
from alignopsd.rectify import eligibility, pairs_from_selection, select_sources


def _batch(seed: int = 0, L: int = 6, constant_gap: float | None = None) -> EstimatorInputs:
    g = torch.Generator().manual_seed(seed)
    ids = [(t, r, u) for t in range(2) for r in range(3) for u in range(2 + (r + t) % 3)]
    task = torch.tensor([i[0] for i in ids])
    rollout = torch.tensor([i[1] for i in ids])
    turn = torch.tensor([i[2] for i in ids])
    M = len(ids)
    outcome = torch.tensor([float((r + t) % 2) * 10 for t, r, _ in ids])
    old = -torch.rand(M, L, generator=g) * 3
    mask = torch.rand(M, L, generator=g) > 0.3
    mask[:, 0] = True
    diag = old + (constant_gap if constant_gap is not None else torch.randn(M, L, generator=g) * 0.5)
    emb_t = torch.nn.functional.normalize(torch.randn(M, 4, generator=g), dim=1)
    emb_s = torch.nn.functional.normalize(emb_t + 0.3 * torch.randn(M, 4, generator=g), dim=1)
    H = torch.where(task[:, None] == task[None, :], (emb_t @ emb_s.T).clamp(-1, 1), torch.zeros(()))
    ok = torch.ones(M, dtype=torch.bool)
    B = eligibility(task, rollout, ok, ok)
    sel = select_sources(H, B, task, rollout, turn, gamma=0.3, top_k=2)
    pairs = pairs_from_selection(sel)
    cross = old[pairs[:, 1]] + torch.randn(pairs.shape[0], L, generator=g) * 0.5
    invalid = torch.zeros(M, dtype=torch.bool)
    invalid[1] = True
    return EstimatorInputs(
        old,
        mask,
        outcome,
        task,
        rollout,
        turn,
        invalid=invalid,
        diag=diag,
        cross=cross,
        pairs=pairs,
        H=H,
        eligible=B,
        step=3,
    )


def _cfg(name: str, **kw) -> AlgorithmConfig:
    over = [f"estimator={name}", "rectify.gamma=0.3", "rectify.top_k=2"] + [f"{k}={v}" for k, v in kw.items()]
    return apply_overrides(AlgorithmConfig(), over)


def test_registry():
    assert set(ESTIMATORS) >= {e.value for e in EstimatorName}
    assert get_estimator("grpo") is get_estimator(EstimatorName.GRPO)
    with pytest.raises(ValueError, match="already registered"):
        register_estimator("grpo")(lambda inp, cfg: None)
    with pytest.raises(ValueError, match="unknown estimator"):
        get_estimator("ppo")
    cfg = AlgorithmConfig(estimator="grpo", kl_coef=0.0)
    assert get_estimator("grpo").phases(cfg) == {
        "teacher_diag": False,
        "alignment": False,
        "ref": False,
        "mechanism2": False,
    }
    ph = get_estimator("alignopsd").phases(AlgorithmConfig())
    assert ph == {"teacher_diag": True, "alignment": True, "ref": True, "mechanism2": True}
    assert get_estimator("sdar").phases(AlgorithmConfig(estimator="sdar"))["teacher_diag"]
    assert not get_estimator("rlsd").phases(AlgorithmConfig(estimator="rlsd"))["alignment"]
    for spec in ESTIMATORS.values():
        assert spec.description


def test_grpo_is_outcome_plus_residual():
    inp = _batch()
    cfg = _cfg("grpo")
    out = get_estimator("grpo")(inp, cfg)
    A = grpo_advantage(inp.outcome, inp.task, inp.rollout, scope="turn")
    r = invalid_action_residual(inp.outcome, inp.invalid, inp.task, penalty=0.1)
    torch.testing.assert_close(out.token_advantage, (A + r)[:, None] * inp.mask.float())
    assert out.aux == []
    assert (out.token_advantage[~inp.mask] == 0).all()


def test_alignopsd_uniform_evidence_is_exactly_grpo():
    inp = _batch(constant_gap=0.25)
    for ablation in ("A", "C"):
        cfg = _cfg("alignopsd", ablation=ablation, **{"rectify.alpha_max": 0.0})
        out = get_estimator("alignopsd")(inp, cfg)
        ref = get_estimator("grpo")(inp, _cfg("grpo"))
        torch.testing.assert_close(out.token_advantage, ref.token_advantage, atol=1e-5, rtol=1e-5)
        assert torch.equal(out.rectified.corrected, inp.diag)
        assert "m1/off_turn_match_weight" in out.metrics and "m1/valid_match_rate" in out.metrics


def test_alignopsd_ablations_and_sdar_aux():
    inp = _batch(seed=1)
    cfg_e = _cfg("alignopsd")
    out = get_estimator("alignopsd")(inp, cfg_e)
    assert out.rectified.matched.any() and out.credit is not None
    assert (out.token_advantage[~inp.mask] == 0).all()
    # ablation A: rectification off, everything else runs
    out_a = get_estimator("alignopsd")(inp, _cfg("alignopsd", ablation="A"))
    assert torch.equal(out_a.rectified.corrected, inp.diag) and (out_a.rectified.alpha == 0).all()
    # ablation B: per-token weights, segment indices -1
    out_b = get_estimator("alignopsd")(inp, _cfg("alignopsd", ablation="B"))
    assert (out_b.credit.segment_index == -1).all()
    # ablation D: random spans; C: one span per trajectory (segment index -1)
    out_d = get_estimator("alignopsd")(inp, _cfg("alignopsd", ablation="D"))
    assert (out_d.credit.segment_index >= 0).all()
    out_c = get_estimator("alignopsd")(inp, _cfg("alignopsd", ablation="C"))
    assert (out_c.credit.segment_index == -1).all()
    for o in (out_b, out_c, out_d):
        assert torch.isfinite(o.token_advantage).all() and (o.token_advantage[~inp.mask] == 0).all()
    # SDAR auxiliary when enabled
    out_s = get_estimator("alignopsd")(inp, _cfg("alignopsd", **{"sdar.enabled": "true"}))
    assert [a.kind for a in out_s.aux] == ["sdar"]
    assert torch.equal(out_s.aux[0].teacher_ML, inp.diag)


def test_alignopsd_m1_consumer():
    inp = _batch(seed=2)
    cfg = _cfg("alignopsd_m1", **{"rectify.alpha_max": 0.2})
    out = get_estimator("alignopsd_m1")(inp, cfg)
    score = inp.outcome.double() - 0.1 * inp.invalid.double()
    A = rowwise_grpo_advantage(score, inp.task)
    torch.testing.assert_close(out.token_advantage, A[:, None] * inp.mask.float())
    (term,) = out.aux
    assert term.kind == "alignment" and term.coef == 0.01 and term.beta == 5.0
    torch.testing.assert_close(term.gate_gap_ML, out.rectified.corrected - inp.old_logp)
    logp = inp.old_logp.clone().requires_grad_()
    loss, stats = auxiliary_loss(term, logp, inp.mask)
    loss.backward()
    assert 0 < stats["gate_mean"] < 1 and (logp.grad[~inp.mask] == 0).all()


def test_rowwise_grpo_counts_copies():
    s = torch.tensor([1.0, 0.0, 0.0, 5.0])
    task = torch.tensor([0, 0, 0, 1])
    a = rowwise_grpo_advantage(s, task, torch.tensor([2, 1, 1, 1]))
    rows = torch.tensor([1.0, 1.0, 0.0, 0.0])  # the multiset with the copy
    expect = (1.0 - rows.mean()) / (rows.std() + 1e-6)
    assert a[0].item() == pytest.approx(float(expect), abs=1e-6)
    assert a[3].item() == pytest.approx(5.0 / (1 + 1e-6))  # single row: mean 0, std 1


def test_rlsd_schedule_and_formula():
    assert rlsd_lambda(0, lambda_init=0.5, decay_steps=10) == 0.5
    assert rlsd_lambda(5, lambda_init=0.5, decay_steps=10) == 0.25
    assert rlsd_lambda(20, lambda_init=0.5, decay_steps=10) == 0.0
    inp = _batch(seed=3)
    cfg = _cfg("rlsd", **{"rlsd.decay_steps": 6, "rlsd.lambda_init": 1.0})
    out = get_estimator("rlsd")(inp, cfg)  # step 3 -> λ = 0.5
    A = grpo_advantage(inp.outcome, inp.task, inp.rollout, scope="turn")
    r = invalid_action_residual(inp.outcome, inp.invalid, inp.task, penalty=0.1)
    delta = inp.diag - inp.old_logp
    mult = torch.exp(torch.sign(A)[:, None] * delta).clamp(0.8, 1.2)
    expect = (A[:, None] * (0.5 + 0.5 * mult) + r[:, None]) * inp.mask.float()
    torch.testing.assert_close(out.token_advantage, expect)
    assert out.metrics["rlsd/lambda"] == 0.5
    inp.step = 6
    torch.testing.assert_close(
        get_estimator("rlsd")(inp, cfg).token_advantage, get_estimator("grpo")(inp, _cfg("grpo")).token_advantage
    )


def test_grpo_opsd_preserves_sign_and_step_budget():
    inp = _batch(seed=4)
    cfg = _cfg("grpo_opsd", use_invalid_penalty="false")
    out = get_estimator("grpo_opsd")(inp, cfg)
    A = grpo_advantage(inp.outcome, inp.task, inp.rollout, scope="turn")
    mf = inp.mask.float()
    torch.testing.assert_close(out.token_advantage.sum(1), A * mf.sum(1), atol=1e-5, rtol=1e-5)
    signs = torch.sign(out.token_advantage[inp.mask])
    assert (signs == torch.sign(A)[:, None].expand_as(mf)[inp.mask]).all()


def test_opsd_and_sdar():
    inp = _batch(seed=5)
    out = get_estimator("opsd")(inp, _cfg("opsd"))
    assert (out.token_advantage == 0).all()
    (term,) = out.aux
    assert term.kind == "sdar" and term.coef == 1.0 and torch.equal(term.teacher_ML, inp.diag)
    out = get_estimator("sdar")(inp, _cfg("sdar"))
    (term,) = out.aux
    assert term.kind == "sdar" and term.coef == 0.01
    torch.testing.assert_close(out.token_advantage, get_estimator("grpo")(inp, _cfg("grpo")).token_advantage)


def test_presets_run_end_to_end():
    inp = _batch(seed=6)
    for name in ("search_3b", "m1_webshop"):
        cfg = apply_overrides(get_preset(name), ["rectify.gamma=0.3"])
        out = get_estimator(cfg.estimator)(inp, cfg)
        assert torch.isfinite(out.token_advantage).all()


def test_inputs_validation():
    inp = _batch()
    mask = inp.mask.clone()
    mask[2] = False
    with pytest.raises(ValueError, match="mask"):
        EstimatorInputs(inp.old_logp, mask, inp.outcome, inp.task, inp.rollout, inp.turn)
    with pytest.raises(ValueError, match="outcome"):
        EstimatorInputs(inp.old_logp, inp.mask, inp.outcome[:3], inp.task, inp.rollout, inp.turn)
    with pytest.raises(ValueError, match="diag"):
        EstimatorInputs(inp.old_logp, inp.mask, inp.outcome, inp.task, inp.rollout, inp.turn, diag=inp.diag[:, :2])
    with pytest.raises(ValueError, match="invalid"):
        EstimatorInputs(inp.old_logp, inp.mask, inp.outcome, inp.task, inp.rollout, inp.turn, invalid=inp.outcome)
    bare = EstimatorInputs(inp.old_logp, inp.mask, inp.outcome, inp.task, inp.rollout, inp.turn)
    with pytest.raises(ValueError, match="diag"):
        get_estimator("sdar")(bare, _cfg("sdar"))
