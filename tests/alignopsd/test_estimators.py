"""Estimator registry and the seven built-in estimators on a small synthetic step."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch

from alignopsd.advantage import grpo_advantage, invalid_action_residual
from alignopsd.config import AlgorithmConfig, apply_overrides, get_preset
from alignopsd.estimators import (
    ESTIMATORS,
    EstimatorInputs,
    EstimatorName,
    EstimatorPhases,
    get_estimator,
    register_estimator,
    rlsd_lambda,
    rowwise_grpo_advantage,
)
from alignopsd.losses import auxiliary_loss
from alignopsd.rectification import eligibility, pairs_from_selection, select_sources


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
    none = EstimatorPhases(teacher_diag=False, alignment=False, ref=False, mechanism2=False)
    assert get_estimator("grpo").phases(cfg) == none
    ph = get_estimator("alignopsd").phases(AlgorithmConfig())
    assert ph == EstimatorPhases(teacher_diag=True, alignment=True, ref=True, mechanism2=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ph.ref = False
    assert get_estimator("sdar").phases(AlgorithmConfig(estimator="sdar")).teacher_diag
    assert not get_estimator("rlsd").phases(AlgorithmConfig(estimator="rlsd")).alignment
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


# ------------------------------------------------------------------------------------------------- hand-computed batch
# One task, rollout 0 with turns 0 and 1 (R = 1), rollout 1 with turn 0 (R = 0); L = 2, ℓ^old ≡ −1.
# Turn 1 of rollout 0 had an invalid action. H[source, target]: H[0,2] = .8, H[1,2] = .9 (same rollout:
# only the best, source 1, survives), H[2,0] = .75, H[2,1] = .5 (< γ = .7: target 1 falls back).
# Numbers below were computed by hand (plain Python floats), not by the library.

_A_TURN = [0.5773492692, 0.5773492692, -1.1546985384]  # R = [1, 1, 0]: (R - 2/3) / (std_unbiased + 1e-6)
_RESID = [0.0883998080, -0.0931681222, 0.0047683142]  # norm(R - .1·invalid) - norm(R) over the task's turns
_MASK = [[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]]


def _hand(copies=None) -> EstimatorInputs:
    task = torch.tensor([0, 0, 0])
    rollout = torch.tensor([0, 0, 1])
    turn = torch.tensor([0, 1, 0])
    H = torch.zeros(3, 3)
    H[0, 2], H[1, 2], H[2, 0], H[2, 1] = 0.8, 0.9, 0.75, 0.5
    ok = torch.ones(3, dtype=torch.bool)
    B = eligibility(task, rollout, ok, ok)
    sel = select_sources(H, B, task, rollout, turn, gamma=0.7, top_k=3)
    assert sel == [[2], [], [1]]
    return EstimatorInputs(
        old_logp=torch.full((3, 2), -1.0),
        mask=torch.tensor(_MASK).bool(),
        outcome=torch.tensor([1.0, 1.0, 0.0]),
        task=task,
        rollout=rollout,
        turn=turn,
        invalid=torch.tensor([False, True, False]),
        diag=torch.tensor([[-1.5, -0.5], [-1.2, -1.0], [-2.0, -1.0]]),
        cross=torch.tensor([[-0.5, -0.5], [-1.0, -1.0]]),  # pairs (2→0), (1→2)
        pairs=pairs_from_selection(sel),
        H=H,
        eligible=B,
        copies=copies,
        step=3,
    )


def _hand_cfg(name: str, *over: str) -> AlgorithmConfig:
    return apply_overrides(AlgorithmConfig(), [f"estimator={name}", "rectify.gamma=0.7", "rectify.top_k=3", *over])


def _rows(per_turn, mask=_MASK) -> torch.Tensor:
    """[M, L] expected advantages: per-turn scalars (or per-token lists) times the mask."""
    out = []
    for v, m in zip(per_turn, mask):
        vals = v if isinstance(v, list) else [v, v]
        out.append([x * k for x, k in zip(vals, m)])
    return torch.tensor(out)


def test_hand_grpo():
    out = get_estimator("grpo")(_hand(), _hand_cfg("grpo"))
    torch.testing.assert_close(out.token_advantage, _rows([a + r for a, r in zip(_A_TURN, _RESID)]))
    assert out.token_advantage.dtype == torch.float32 and out.aux == []


def test_hand_sdar_and_opsd():
    # token-mean over the 5 policy tokens of σ(5Δ)·Δ with Δ = ℓ^diag − ℓ_θ at ℓ_θ = ℓ^old: 0.0727321370
    raw = 0.07273213696
    out = get_estimator("sdar")(_hand(), _hand_cfg("sdar"))
    torch.testing.assert_close(out.token_advantage, _rows([a + r for a, r in zip(_A_TURN, _RESID)]))
    loss, st = auxiliary_loss(out.aux[0], torch.full((3, 2), -1.0), torch.tensor(_MASK))
    assert loss.item() == pytest.approx(0.01 * raw, abs=1e-8) and st["sdar/loss"] == pytest.approx(raw, abs=1e-6)
    out = get_estimator("opsd")(_hand(), _hand_cfg("opsd"))
    assert torch.equal(out.token_advantage, torch.zeros(3, 2))
    loss, _ = auxiliary_loss(out.aux[0], torch.full((3, 2), -1.0), torch.tensor(_MASK))
    assert loss.item() == pytest.approx(1.0 * raw, abs=1e-6)


def test_hand_grpo_opsd():
    # m = clip(exp(sign(A)·Δ), .8, 1.2), normalised to token-mean 1 per turn; Â = A·(.5 + .5·m/mean) + r
    expect = [[0.6080141502, 0.7234840041], [0.4841811470, 0.0], [-1.2024165214, -1.0974439270]]
    out = get_estimator("grpo_opsd")(_hand(), _hand_cfg("grpo_opsd"))
    torch.testing.assert_close(out.token_advantage, torch.tensor(expect))


def test_hand_rlsd():
    # step 3 of 150, λ_init .5 → λ = .49; Â = A·(.51 + .49·clip(exp(sign(A)·Δ), .8, 1.2)) + r
    expect = [[0.6091688488, 0.7223293055], [0.4328998701, 0.0], [-1.2630906809, -1.1499302242]]
    out = get_estimator("rlsd")(_hand(), _hand_cfg("rlsd"))
    torch.testing.assert_close(out.token_advantage, torch.tensor(expect))
    assert out.metrics["rlsd/lambda"] == pytest.approx(0.49)


def test_hand_alignopsd_full_and_ablations():
    inp = _hand()
    # M1 (α_max .8): target 0 ← source 2: ρ = (.75−.7)/.3 = 1/6, α = .13333; target 2 ← source 1: ρ = 2/3, α = .53333
    out = get_estimator("alignopsd")(inp, _hand_cfg("alignopsd"))
    r = out.rectified
    torch.testing.assert_close(r.alpha, torch.tensor([0.8 / 6, 0.0, 0.8 * 2 / 3]))
    torch.testing.assert_close(r.corrected, torch.tensor([[-1.3666667, -0.5], [-1.2, -1.0], [-1.4666667, -1.0]]))
    assert torch.equal(r.corrected[1], inp.diag[1])  # fallback target: exactly the diagonal
    # M2: trajectory (0, 0) is one span (2 turns < 2·L_min); g = [1/15, −.2], q = softmax(log N + s / .5),
    # h = 3q/N = [1.15980298, 0.68039404], w = .5 + .5h; the one-turn trajectory has w = 1
    expect_e = _rows([0.7118801447, 0.3919190119, -1.1499302242])
    torch.testing.assert_close(out.token_advantage, expect_e)
    torch.testing.assert_close(out.credit.turn_weight, torch.tensor([1.0799014912, 0.8401970175, 1.0]))
    for ablation in ("C", "D"):  # one span per trajectory here, so C and D coincide with E
        o = get_estimator("alignopsd")(inp, _hand_cfg("alignopsd", f"ablation={ablation}"))
        torch.testing.assert_close(o.token_advantage, expect_e)
    # A: α = 0, so δ̃ = ℓ^diag − ℓ^old and g = [0, −.2]; selection and cross scoring still ran
    o = get_estimator("alignopsd")(inp, _hand_cfg("alignopsd", "ablation=A"))
    assert torch.equal(o.rectified.corrected, inp.diag) and o.rectified.pairs.tolist() == [[2, 0], [1, 2]]
    torch.testing.assert_close(o.token_advantage, _rows([0.7013890898, 0.4129011217, -1.1499302242]))
    # B: flat token softmax(sign(A)·δ̃ / .5) per trajectory, raw = N_τ·q, no η mixing
    o = get_estimator("alignopsd")(inp, _hand_cfg("alignopsd", "ablation=B"))
    expect_b = [[0.3034248023, 1.3053310673], [0.2069234317, 0.0], [-1.6528038786, -0.6470565698]]
    torch.testing.assert_close(o.token_advantage, torch.tensor(expect_b))


def test_hand_alignopsd_m1():
    # verl-agent GRPO over all rows of the uid on R − .1·invalid = [1, .9, 0]; α_max .2 (M1-only launchers)
    cfg = apply_overrides(get_preset("m1_alfworld"), ["rectify.top_k=3"])
    out = get_estimator("alignopsd_m1")(_hand(), cfg)
    torch.testing.assert_close(out.token_advantage, _rows([0.6657490771, 0.4841811470, -1.1499302242]))
    torch.testing.assert_close(out.rectified.alpha, torch.tensor([0.2 / 6, 0.0, 0.2 * 2 / 3]))
    (term,) = out.aux
    assert term.kind == "alignment" and (term.coef, term.beta) == (0.01, 5.0)
    # coef · token-mean(σ(5 δ̃)·(ℓ̃ − ℓ_θ)) at ℓ_θ = ℓ^old, δ̃ = [[−.46667, .5], [−.2, 0], [−.86667, 0]]
    loss, st = auxiliary_loss(term, torch.full((3, 2), -1.0), torch.tensor(_MASK))
    assert st["alignment_loss"] == pytest.approx(0.0711605758, abs=1e-6)
    assert loss.item() == pytest.approx(0.01 * 0.0711605758, abs=1e-8)
    # copies: turn 0 has two rows, so the all-row statistics use the multiset [1, 1, .9, 0]
    out = get_estimator("alignopsd_m1")(_hand(copies=torch.tensor([2, 1, 1])), cfg)
    torch.testing.assert_close(out.token_advantage, _rows([0.5662773679, 0.3603583251, -1.4929130609]))


def test_alignopsd_m1_ablation_a_disables_rectification():
    # §3.11: "When the consumer is M1-only, only A has any effect" — A sets α_max = 0 there too
    cfg = apply_overrides(get_preset("m1_alfworld"), ["ablation=A"])
    assert cfg.effective_alpha_max == 0.0
    inp = _hand()
    out = get_estimator("alignopsd_m1")(inp, cfg)
    assert torch.equal(out.rectified.corrected, inp.diag) and (out.rectified.alpha == 0).all()
    loss, st = auxiliary_loss(out.aux[0], torch.full((3, 2), -1.0), torch.tensor(_MASK))
    assert st["alignment_loss"] == pytest.approx(0.0727321370, abs=1e-6)
    # B–E change nothing for the M1-only consumer
    base = get_estimator("alignopsd_m1")(inp, get_preset("m1_alfworld"))
    for ablation in "BCD":
        o = get_estimator("alignopsd_m1")(inp, apply_overrides(get_preset("m1_alfworld"), [f"ablation={ablation}"]))
        assert torch.equal(o.rectified.corrected, base.rectified.corrected)
        assert torch.equal(o.token_advantage, base.token_advantage)


@pytest.mark.parametrize(
    "name,diag,align,m2",
    [
        ("grpo", False, False, False),
        ("opsd", True, False, False),
        ("grpo_opsd", True, False, False),
        ("sdar", True, False, False),
        ("rlsd", True, False, False),
        ("alignopsd", True, True, True),
        ("alignopsd_m1", True, True, False),
    ],
)
def test_phases_of_every_estimator(name, diag, align, m2):
    for kl in (0.0, 0.01):
        ph = get_estimator(name).phases(AlgorithmConfig(estimator=name, kl_coef=kl))
        assert ph == EstimatorPhases(teacher_diag=diag, alignment=align, ref=kl > 0, mechanism2=m2)
    if name == "alignopsd":  # ablation A still pays for selection and cross scoring (M2 needs H and B)
        assert get_estimator(name).phases(AlgorithmConfig(estimator=name, ablation="A")).alignment


def test_rowwise_grpo_and_rlsd_lambda_bad_inputs():
    with pytest.raises(ValueError, match="task"):
        rowwise_grpo_advantage(torch.ones(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="score"):
        rowwise_grpo_advantage(torch.tensor([float("nan"), 1.0]), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="copies"):
        rowwise_grpo_advantage(torch.ones(2), torch.zeros(2, dtype=torch.long), torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="decay_steps"):
        rlsd_lambda(1, lambda_init=0.5, decay_steps=0)
    with pytest.raises(ValueError, match="step"):
        rlsd_lambda(-1, lambda_init=0.5, decay_steps=10)
    inp = _hand()
    with pytest.raises(ValueError, match="outcome"):
        EstimatorInputs(inp.old_logp, inp.mask, torch.tensor([1.0, float("nan"), 0.0]), inp.task, inp.rollout, inp.turn)


def _configs(name: str) -> list[AlgorithmConfig]:
    cfgs = [_cfg(name), _cfg(name, **{"sdar.enabled": "true"}), _cfg(name, use_invalid_penalty="false")]
    return cfgs + [_cfg(name, ablation=a) for a in "ABCD"] if name.startswith("alignopsd") else cfgs


@pytest.mark.parametrize("name", [e.value for e in EstimatorName])
def test_declared_aux_matches_what_the_estimator_returns(name):
    """``has_aux(config)`` is exactly whether the estimator's output carries auxiliary terms."""
    spec = get_estimator(name)
    for cfg in _configs(name):
        out = spec(_batch(), cfg)
        assert spec.has_aux(cfg) == bool(out.aux), (name, cfg.sdar.enabled)
        if any(term.kind == "sdar" for term in out.aux):
            assert spec.needs_teacher_diag(cfg)
    assert get_estimator("alignopsd").has_aux(_cfg("alignopsd", **{"sdar.enabled": "true"}))
    assert not get_estimator("alignopsd").has_aux(_cfg("alignopsd"))


@pytest.mark.parametrize("name", [e.value for e in EstimatorName])
def test_outcome_scaled_estimators_give_zero_advantage_without_outcome_signal(name):
    """Constant outcomes and validity per task: an estimator declared outcome-scaled gives zero
    token advantage (what lets a step skip its model passes); the others are not bound by it."""
    spec = get_estimator(name)
    inp = _batch()
    flat = EstimatorInputs(
        inp.old_logp,
        inp.mask,
        inp.task.float() * 3.0,  # equal within each task, different across tasks
        inp.task,
        inp.rollout,
        inp.turn,
        invalid=inp.task == 1,  # equal within each task
        diag=inp.diag,
        cross=inp.cross,
        pairs=inp.pairs,
        H=inp.H,
        eligible=inp.eligible,
        step=3,
    )
    for cfg in _configs(name):
        adv = spec(flat, cfg).token_advantage
        if spec.outcome_scaled:
            # zero up to the rounding of a constant's mean in the invalid residual (~1e-9)
            torch.testing.assert_close(adv, torch.zeros_like(adv), rtol=0.0, atol=1e-6, msg=name)
    # and with outcome signal, an outcome-scaled estimator is not trivially zero
    if spec.outcome_scaled:
        assert bool((spec(inp, _cfg(name)).token_advantage != 0).any())
    assert spec.outcome_scaled == (name != "opsd")


def test_register_estimator_checks_declared_needs():
    with pytest.raises(ValueError, match="aux"):
        register_estimator("bad_aux", aux="yes")(lambda inp, cfg: None)
    with pytest.raises(ValueError, match="outcome_scaled"):
        register_estimator("bad_scaled", outcome_scaled=1)(lambda inp, cfg: None)
    assert "bad_aux" not in ESTIMATORS and "bad_scaled" not in ESTIMATORS


@pytest.fixture
def scaled_estimator():
    """A user estimator with a config section of its own: one registered function plus one config class."""
    from alignopsd.config_values import real_field
    from alignopsd.estimators import ESTIMATOR_SECTIONS

    @dataclasses.dataclass
    class ScaledConfig:
        scale: float = 2.0

        def __post_init__(self) -> None:
            real_field("scale", self.scale, lo=0.0)

    @register_estimator("scaled_grpo", settings=ScaledConfig, outcome_scaled=True)
    def scaled_grpo(inp, cfg):
        """GRPO with its token advantage scaled by ``algorithm.scaled_grpo.scale``."""
        out = get_estimator("grpo")(inp, cfg)
        out.token_advantage = out.token_advantage * cfg.section("scaled_grpo").scale
        return out

    try:
        yield ScaledConfig
    finally:
        ESTIMATORS.pop("scaled_grpo", None)
        ESTIMATOR_SECTIONS.pop("scaled_grpo", None)


def test_an_estimator_with_settings_of_its_own(scaled_estimator):
    from alignopsd.config import from_dict, to_dict

    cfg = from_dict(AlgorithmConfig, {"estimator": "scaled_grpo", "kl_coef": 0.0, "scaled_grpo": {"scale": 3.0}})
    assert cfg.section("scaled_grpo") == scaled_estimator(scale=3.0)
    assert cfg.section("sdar") is cfg.sdar  # the built-in sections answer by the same key
    assert to_dict(cfg)["scaled_grpo"] == {"scale": 3.0}  # stored with the run, reloaded identically
    assert from_dict(AlgorithmConfig, to_dict(cfg)).section("scaled_grpo").scale == 3.0
    assert apply_overrides(cfg, ["scaled_grpo.scale=5"]).section("scaled_grpo").scale == 5.0
    assert AlgorithmConfig(estimator="scaled_grpo").section("scaled_grpo") == scaled_estimator()  # defaults
    assert "scaled_grpo" not in to_dict(AlgorithmConfig())  # other runs' stored config is unchanged
    with pytest.raises(ValueError, match="scaled_grpo.scale"):
        from_dict(AlgorithmConfig, {"estimator": "scaled_grpo", "scaled_grpo": {"scale": -1.0}}, "algorithm")
    with pytest.raises(ValueError, match="scaled_grpo.bogus: unknown key"):
        from_dict(AlgorithmConfig, {"estimator": "scaled_grpo", "scaled_grpo": {"bogus": 1}})
    with pytest.raises(ValueError, match="no config section 'scaled_grpo'"):
        AlgorithmConfig().section("scaled_grpo")
    with pytest.raises(ValueError, match="settings: expected a dataclass"):
        register_estimator("other", settings=dict)
    inp = _batch()
    plain = get_estimator("grpo")(inp, AlgorithmConfig(estimator="grpo", kl_coef=0.0)).token_advantage
    scaled = get_estimator("scaled_grpo")(inp, cfg).token_advantage
    assert plain.abs().sum() > 0 and torch.allclose(scaled, 3.0 * plain)


def test_the_built_in_estimators_register_their_sections_like_a_new_one():
    """The built-in estimators give themselves settings with ``settings=`` (no section is a field of the config),
    shared sections under one key; every config keeps every built-in section, read by key or as an attribute."""
    import json
    from pathlib import Path

    from alignopsd.algorithm_sections import OpsdConfig, RectifyConfig, SdarConfig
    from alignopsd.config import from_dict, to_dict
    from alignopsd.credit_config import CreditConfig
    from alignopsd.estimators import ESTIMATOR_SECTIONS

    declared = {name: spec.sections for name, spec in ESTIMATORS.items() if name in {e.value for e in EstimatorName}}
    assert declared == {
        "grpo": (),
        "sdar": ("sdar",),
        "opsd": ("opsd",),
        "grpo_opsd": ("opsd",),
        "rlsd": ("rlsd",),
        "alignopsd": ("rectify", "credit", "sdar"),
        "alignopsd_m1": ("rectify", "alignment"),
    }
    assert ESTIMATOR_SECTIONS["rectify"] is RectifyConfig and ESTIMATOR_SECTIONS["credit"] is CreditConfig
    hints = typing.get_type_hints(AlgorithmConfig)
    assert "gamma" in vars(RectifyConfig()) and not any(dataclasses.is_dataclass(t) for t in hints.values())
    # every config holds the built-in sections, whatever its estimator (every stored config has them)
    grpo = AlgorithmConfig(estimator="grpo", opsd=OpsdConfig(mix=0.25))
    assert set(grpo.registered) == {"rectify", "credit", "alignment", "sdar", "rlsd", "opsd"}
    assert grpo.opsd.mix == 0.25 and grpo.section("opsd") is grpo.opsd and grpo.rectify == RectifyConfig()
    grpo.sdar = SdarConfig(coef=0.5)  # an attribute assignment replaces the section itself
    assert to_dict(grpo)["sdar"]["coef"] == 0.5
    kept = dataclasses.replace(grpo, kl_coef=0.0)
    assert kept.sdar.coef == 0.5 and kept.opsd.mix == 0.25 and kept.kl_coef == 0.0
    with pytest.raises(ValueError, match="^rectify: expected RectifyConfig, got SdarConfig"):
        AlgorithmConfig(rectify=SdarConfig())
    with pytest.raises(TypeError, match="'rectfy'"):
        AlgorithmConfig(rectfy=RectifyConfig())
    # a checkpoint's stored config (the first checkpoint format) loads and is written back with the same keys
    state = Path(__file__).resolve().parents[1] / "assets" / "checkpoint_v1" / "step_000002" / "trainer_state.json"
    stored = json.loads(state.read_text())["run_config"]["algorithm"]
    assert to_dict(from_dict(AlgorithmConfig, stored, "algorithm")) == stored


def test_a_new_estimator_shares_a_built_in_section():
    """A section registered by several estimators is one section (one key, one dataclass); another dataclass under
    a built-in key is refused."""
    from alignopsd.algorithm_sections import RectifyConfig, SdarConfig
    from alignopsd.config import from_dict
    from alignopsd.estimators import ESTIMATOR_SECTIONS

    register_estimator("m1_plain", settings={"rectify": RectifyConfig})(get_estimator("grpo").fn)
    try:
        cfg = from_dict(AlgorithmConfig, {"estimator": "m1_plain", "rectify": {"gamma": 0.5}})
        assert get_estimator("m1_plain").sections == ("rectify",) and cfg.section("rectify").gamma == 0.5
        assert cfg.credit.gamma == 0.5  # Mechanism 2's gamma still follows the shared section
        with pytest.raises(ValueError, match="'sdar' is already registered with SdarConfig"):
            register_estimator("bad_sdar", settings={"sdar": RectifyConfig})
        with pytest.raises(ValueError, match="section: give the keys"):
            register_estimator("bad_both", settings={"sdar": SdarConfig}, section="sdar")
    finally:
        ESTIMATORS.pop("m1_plain", None)
    assert ESTIMATOR_SECTIONS["rectify"] is RectifyConfig  # shared: still there for the built-in estimators
