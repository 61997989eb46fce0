"""Loss terms: PPO dual clip, k3 KL, entropy, M1 alignment (case 45), SDAR (case 46), micro-batch scaling (case 5)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from alignopsd.canonical import canonicalize
from alignopsd.losses import (
    AuxTerm,
    alignment_loss,
    auxiliary_loss,
    entropy_bonus,
    low_var_kl,
    microbatch_scales,
    ppo_loss,
    sdar_loss,
    token_mean,
    weighted_token_count,
)


def _ppo_loop(logp, old, adv, mask, w, cl=0.2, ch=0.2, dc=3.0):
    num = den = 0.0
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            if not mask[i, j]:
                continue
            ratio = float(torch.exp(logp[i, j] - old[i, j]))
            a = float(adv[i, j])
            l1 = max(-a * ratio, -a * min(max(ratio, 1 - cl), 1 + ch))
            if a < 0:
                l1 = min(l1, -a * dc)
            num += l1 * float(w[i])
            den += float(w[i])
    return num / den


def test_ppo_loss_matches_loop_and_stats():
    g = torch.Generator().manual_seed(0)
    logp = (torch.randn(4, 6, generator=g) * 0.5 - 1).requires_grad_()
    old = logp.detach() + torch.randn(4, 6, generator=g) * 0.6
    adv = torch.randn(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.3
    w = torch.tensor([1.0, 0.5, 0.5, 1.0])
    loss, stats = ppo_loss(logp, old, adv, mask, row_weight=w)
    assert loss.item() == pytest.approx(_ppo_loop(logp.detach(), old, adv, mask, w), abs=1e-6)
    assert set(stats) == {"clipfrac", "clipfrac_lower", "approx_kl"}
    assert all(isinstance(v, float) for v in stats.values())
    assert 0 <= stats["clipfrac"] <= 1 and 0 <= stats["clipfrac_lower"] <= 1
    mf = mask.float() * w[:, None]
    assert stats["approx_kl"] == pytest.approx(float(((old - logp.detach()) * mf).sum() / mf.sum()), abs=1e-6)
    loss.backward()
    assert logp.grad is not None and (logp.grad[~mask] == 0).all()


def test_ppo_dual_clip_caps_negative_advantage():
    logp = torch.tensor([[2.0]])  # ratio e^2 ≈ 7.39 > 3
    loss, stats = ppo_loss(logp, torch.zeros(1, 1), torch.tensor([[-1.0]]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(3.0)
    assert stats["clipfrac_lower"] == 1.0
    loss, _ = ppo_loss(logp, torch.zeros(1, 1), torch.tensor([[1.0]]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(-1.2)  # upper clip for positive advantage
    loss, _ = ppo_loss(logp, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1))  # [R] broadcast
    assert loss.item() == pytest.approx(-1.2)


def test_low_var_kl_and_entropy():
    logp = torch.tensor([[-1.0, -2.0, -50.0]])
    ref = torch.tensor([[-1.0, -1.0, 0.0]])
    kl = low_var_kl(logp, ref)
    assert kl[0, 0].item() == 0.0
    d = 1.0
    assert kl[0, 1].item() == pytest.approx(torch.exp(torch.tensor(d)).item() - d - 1)
    assert kl[0, 2].item() == 10.0  # clamped
    ent = torch.tensor([[1.0, 3.0, 100.0]], requires_grad=True)
    bonus = entropy_bonus(ent, torch.tensor([[1, 1, 0]]), coef=0.001)
    assert bonus.item() == pytest.approx(-0.002)


def test_case45_alignment_loss():
    logp = torch.zeros(1, 2, requires_grad=True)
    teacher = torch.tensor([[1.0, -1.0]], requires_grad=True)
    gap = torch.tensor([[0.2, -0.2]], requires_grad=True)
    loss, stats = alignment_loss(logp, teacher, gap, torch.ones(1, 2), beta=5.0, coef=1.0)
    assert loss.item() == pytest.approx(0.231059, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.365529, -0.134471]]), atol=1e-6, rtol=0)
    assert teacher.grad is None and gap.grad is None
    assert stats["gate_active_ratio"] == 0.5
    assert stats["gate_mean"] == pytest.approx(0.5)
    assert stats["corrected_gap_mean"] == pytest.approx(0.0, abs=1e-7)
    assert stats["alignment_loss"] == pytest.approx(0.231059, abs=1e-6)
    # copies with 1/k weights leave the loss and the canonical gradient unchanged
    lp2 = torch.zeros(3, 2, requires_grad=True)
    loss2, _ = alignment_loss(
        lp2,
        teacher.detach().expand(3, 2),
        gap.detach().expand(3, 2),
        torch.ones(3, 2),
        beta=5.0,
        coef=1.0,
        row_weight=torch.tensor([1 / 3, 1 / 3, 1 / 3]),
    )
    assert loss2.item() == pytest.approx(0.231059, abs=1e-6)
    loss2.backward()
    torch.testing.assert_close(lp2.grad.sum(0, keepdim=True), logp.grad, atol=1e-6, rtol=0)
    # coef scales the returned loss only
    loss3, st3 = alignment_loss(torch.zeros(1, 2), teacher.detach(), gap.detach(), torch.ones(1, 2), coef=0.01)
    assert loss3.item() == pytest.approx(0.00231059, abs=1e-8) and st3["alignment_coef"] == 0.01


def test_case46_sdar_gradient_and_duplicates():
    g = torch.Generator().manual_seed(2)
    logp = (torch.randn(2, 3, generator=g) - 1).requires_grad_()
    diag = torch.randn(2, 3, generator=g) - 1
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]]).float()
    coef, beta = 0.01, 5.0
    loss, stats = sdar_loss(logp, diag, mask, beta=beta, coef=coef)
    loss.backward()
    gate = torch.sigmoid(beta * (diag - logp.detach()))
    torch.testing.assert_close(logp.grad, -coef * gate * mask / mask.sum(), atol=1e-8, rtol=1e-6)
    assert stats["sdar/coef"] == coef and stats["sdar/weighted_loss"] == pytest.approx(coef * stats["sdar/loss"])
    # duplicate row 1 with weight 1/2 each: no extra mass
    lp_dup = logp.detach()[[0, 1, 1]].clone().requires_grad_()
    loss_dup, _ = sdar_loss(
        lp_dup, diag[[0, 1, 1]], mask[[0, 1, 1]], beta=beta, coef=coef, row_weight=torch.tensor([1.0, 0.5, 0.5])
    )
    assert loss_dup.item() == pytest.approx(loss.item(), abs=1e-9)
    loss_dup.backward()
    torch.testing.assert_close(lp_dup.grad[1] + lp_dup.grad[2], logp.grad[1], atol=1e-9, rtol=1e-6)


def test_case5_microbatch_split_equals_canonical_loss():
    can = canonicalize(["t", "t", "t"], ["r1", "r2", "r1"], [0, 0, 0])
    torch.testing.assert_close(can.row_weight, torch.tensor([0.5, 1.0, 0.5]))
    g = torch.Generator().manual_seed(5)
    L = 4
    logp_c = torch.randn(2, L, generator=g) - 1
    old_c = logp_c + 0.3 * torch.randn(2, L, generator=g)
    adv_c = torch.randn(2, L, generator=g)
    mask_c = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]).float()
    # canonical reference
    lc = logp_c.clone().requires_grad_()
    loss_c, _ = ppo_loss(lc, old_c, adv_c, mask_c)
    loss_c.backward()
    # expanded rows, micro-batches {0,1} and {2}
    lr = can.expand(logp_c).clone().requires_grad_()
    old_r, adv_r, mask_r, w_r = can.expand(old_c), can.expand(adv_c), can.expand(mask_c), can.row_weight
    micro = [torch.tensor([0, 1]), torch.tensor([2])]
    counts = [weighted_token_count(mask_r[m], w_r[m]) for m in micro]
    scales = microbatch_scales(counts)
    total = 0.0
    for m, s in zip(micro, scales):
        loss_m, _ = ppo_loss(lr[m], old_r[m], adv_r[m], mask_r[m], row_weight=w_r[m])
        (loss_m * s).backward()
        total += float(loss_m.detach()) * s
    assert total == pytest.approx(loss_c.item(), abs=1e-6)
    grad_c = torch.zeros(2, L).index_add_(0, can.row_to_canonical, lr.grad)
    torch.testing.assert_close(grad_c, lc.grad, atol=1e-7, rtol=1e-6)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), world=st.integers(1, 3), n_micro=st.integers(1, 3))
def test_property_microbatch_scales_global_mean(seed, world, n_micro):
    g = torch.Generator().manual_seed(seed)
    R, L = world * n_micro * 2, 5
    term = torch.randn(R, L, generator=g)
    mask = (torch.rand(R, L, generator=g) > 0.3).float()
    mask[:, 0] = 1
    w = torch.rand(R, generator=g) + 0.1
    target = float((term * mask * w[:, None]).sum() / (mask * w[:, None]).sum())
    rows = torch.arange(R).reshape(world, n_micro, 2)
    total_w = weighted_token_count(mask, w)
    grad_avg = 0.0
    for rank in range(world):
        counts = [weighted_token_count(mask[rows[rank, i]], w[rows[rank, i]]) for i in range(n_micro)]
        scales = microbatch_scales(counts, global_weighted_tokens=total_w, world_size=world)
        local = sum(
            float(token_mean(term[rows[rank, i]], mask[rows[rank, i]], w[rows[rank, i]])) * s
            for i, s in enumerate(scales)
        )
        grad_avg += local / world  # data-parallel averaging
    assert grad_avg == pytest.approx(target, rel=1e-5, abs=1e-6)


def test_auxiliary_term_dispatch_and_validation():
    teacher = torch.tensor([[1.0, -1.0], [0.0, 0.0]])
    gap = torch.tensor([[0.2, -0.2], [0.0, 0.0]])
    term = AuxTerm("alignment", teacher, coef=1.0, beta=5.0, gate_gap_ML=gap)
    loss, _ = auxiliary_loss(term, torch.zeros(1, 2), torch.ones(1, 2), rows=torch.tensor([0]))
    assert loss.item() == pytest.approx(0.231059, abs=1e-6)
    with pytest.raises(ValueError, match="gate_gap_ML"):
        AuxTerm("alignment", teacher, coef=1.0, beta=5.0)
    with pytest.raises(ValueError, match="kind"):
        AuxTerm("kl", teacher, coef=1.0, beta=5.0)
    with pytest.raises(ValueError, match="beta"):
        AuxTerm("sdar", teacher, coef=1.0, beta=0.0)


def test_bad_inputs():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="old_logp"):
        ppo_loss(x, torch.zeros(2, 4), x, x)
    with pytest.raises(ValueError, match="advantage"):
        ppo_loss(x, x, torch.full((2, 3), float("nan")), x)
    with pytest.raises(ValueError, match="mask"):
        ppo_loss(x, x, x, torch.ones(3, 3))
    with pytest.raises(ValueError, match="row_weight"):
        ppo_loss(x, x, x, x, row_weight=torch.ones(3))
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_loss(x, x, x, x, dual_clip=1.0)
    with pytest.raises(ValueError, match="ref_logp"):
        low_var_kl(x, torch.zeros(3, 3))
    with pytest.raises(ValueError, match="beta"):
        alignment_loss(x, x, x, x, beta=0.0)
    with pytest.raises(ValueError, match="corrected_gap"):
        alignment_loss(x, x, torch.zeros(2, 2), x)
    with pytest.raises(ValueError, match="coef"):
        sdar_loss(x, x, x, coef=-1.0)
    with pytest.raises(ValueError, match="global_weighted_tokens"):
        microbatch_scales([0.0, 0.0])
    with pytest.raises(ValueError, match="world_size"):
        microbatch_scales([1.0], world_size=0)
    with pytest.raises(ValueError, match="global_weighted_tokens"):
        microbatch_scales([1.0], world_size=2)


def test_actor_loss_sums_the_terms():
    from alignopsd.losses import actor_loss

    g = torch.Generator().manual_seed(9)
    R, L = 3, 4
    logp = (torch.randn(R, L, generator=g) - 1).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(R, L, generator=g)
    ref = logp.detach() + 0.2 * torch.randn(R, L, generator=g)
    adv = torch.randn(R, L, generator=g)
    ent = torch.rand(R, L, generator=g)
    mask = torch.ones(R, L)
    mask[0, 3] = 0
    w = torch.tensor([1.0, 0.5, 0.5])
    teacher = torch.randn(2, L, generator=g) - 1
    gap = torch.randn(2, L, generator=g)
    rows = torch.tensor([0, 1, 1])
    aux = [AuxTerm("alignment", teacher, coef=0.01, beta=5.0, gate_gap_ML=gap), AuxTerm("sdar", teacher, 0.02, 5.0)]
    loss, stats = actor_loss(
        logp, old, adv, mask, row_weight=w, entropy=ent, ref_logp=ref, kl_coef=0.01, aux=aux, rows=rows
    )
    pg, _ = ppo_loss(logp, old, adv, mask, row_weight=w)
    kl = token_mean(low_var_kl(logp, ref), mask, w)
    al, _ = alignment_loss(logp, teacher[rows], gap[rows], mask, coef=0.01, row_weight=w)
    sd, _ = sdar_loss(logp, teacher[rows], mask, coef=0.02, row_weight=w)
    expect = pg + 0.01 * kl - 0.001 * token_mean(ent, mask, w) + al + sd
    assert loss.item() == pytest.approx(expect.item(), abs=1e-7)
    assert {
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/entropy",
        "beyond_timestamps/alignment_loss",
        "sdar/gate_mean",
        "actor/loss",
    } <= set(stats)
    with pytest.raises(ValueError, match="ref_logp"):
        actor_loss(logp, old, adv, mask, kl_coef=0.1)


def test_ppo_ratio_uses_fp32_old_logp_with_a_bf16_policy():
    # the ratio is exp(ℓ_θ − ℓ^old) in FP32: ℓ^old must not be rounded to the policy's bf16 first
    old = torch.tensor([[-1.2345678, -3.3333333]])
    logp = old.bfloat16()
    adv = torch.tensor([[1.0, -1.0]])
    loss, st = ppo_loss(logp, old, adv, torch.ones(1, 2))
    ratio = torch.exp(logp.float() - old)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(float((-adv * ratio).mean()), abs=1e-7)
    assert st["approx_kl"] == pytest.approx(float((old - logp.float()).mean()), abs=1e-7)
    kl = low_var_kl(logp, old)
    d = old - logp.float()
    torch.testing.assert_close(kl, torch.exp(d) - d - 1.0)
