"""Rollout–trainer mismatch: diagnostics and the truncated / masked importance-sampling correction
(alignopsd.losses.rollout_mismatch_metrics, rollout_is_weights, ppo_loss/actor_loss is_weight/is_keep),
against hand-computed cases."""

from __future__ import annotations

from math import log

import pytest
import torch

from alignopsd.losses import actor_loss, ppo_loss, rollout_is_weights, rollout_mismatch_metrics

# Two rows: row 0 has three tokens, row 1 one. Token ratios r = π_trainer / π_rollout: 0.5, 3, 1 | 4.
ROLLOUT = torch.tensor([[log(0.5), log(0.2), log(0.4)], [log(0.1), 0.0, 0.0]])
TRAINER = torch.tensor([[log(0.25), log(0.6), log(0.4)], [log(0.4), 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_mismatch_metrics_hand_computed():
    got = rollout_mismatch_metrics(ROLLOUT, TRAINER, MASK)
    log_r = [log(0.5), log(3.0), 0.0, log(4.0)]
    r = [0.5, 3.0, 1.0, 4.0]
    want = {
        "mismatch/kl": -sum(log_r) / 4,
        "mismatch/k3_kl": sum(x - 1 - lx for x, lx in zip(r, log_r)) / 4,
        "mismatch/chi2_token": (0.25 + 9 + 1 + 16) / 4 - 1,
        "mismatch/chi2_seq": (1.5**2 + 4.0**2) / 2 - 1,  # row ratios 0.5·3·1 and 4
        "mismatch/rollout_ppl": (0.04 ** (-1 / 3) + 10.0) / 2,  # 0.5·0.2·0.4 = 0.04 over 3 tokens; 1/0.1
        "mismatch/trainer_ppl": (0.06 ** (-1 / 3) + 2.5) / 2,
        "mismatch/ppl_ratio": (1.5 ** (-1 / 3) + 0.25) / 2,
        "mismatch/log_ppl_diff": (-log(1.5) / 3 - log(4.0)) / 2,
        "mismatch/abs_diff_mean": sum(abs(x) for x in log_r) / 4,
        "mismatch/abs_diff_max": log(4.0),
        "mismatch/tokens": 4.0,
    }
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-6), k
    # identical log-probs: no mismatch; an empty mask gives neutral values
    same = rollout_mismatch_metrics(ROLLOUT, ROLLOUT, MASK)
    assert same["mismatch/k3_kl"] == 0 and same["mismatch/chi2_token"] == pytest.approx(0, abs=1e-12)
    assert same["mismatch/ppl_ratio"] == 1.0
    empty = rollout_mismatch_metrics(ROLLOUT, TRAINER, torch.zeros_like(MASK))
    assert empty["mismatch/tokens"] == 0 and empty["mismatch/ppl_ratio"] == 1.0


@pytest.mark.parametrize(
    "level, mode, lower, weight, keep",
    [
        ("token", "truncate", None, [[0.5, 2.0, 1.0], [2.0, 0, 0]], [[1, 1, 1], [1, 0, 0]]),
        ("token", "mask", 0.3, [[0.5, 0, 1.0], [0, 0, 0]], [[1, 0, 1], [0, 0, 0]]),
        ("token", "mask", 0.6, [[0, 0, 1.0], [0, 0, 0]], [[0, 0, 1], [0, 0, 0]]),
        ("sequence", "truncate", None, [[1.5, 1.5, 1.5], [2.0, 0, 0]], [[1, 1, 1], [1, 0, 0]]),
        ("sequence", "mask", None, [[1.5, 1.5, 1.5], [0, 0, 0]], [[1, 1, 1], [0, 0, 0]]),
    ],
)
def test_is_weights_hand_computed(level, mode, lower, weight, keep):
    w, k, st = rollout_is_weights(ROLLOUT, TRAINER, MASK, level=level, mode=mode, threshold=2.0, lower=lower)
    assert w.dtype == torch.float32 and not w.requires_grad and k.dtype == torch.bool
    torch.testing.assert_close(w, torch.tensor(weight), rtol=1e-6, atol=1e-7)
    assert torch.equal(k, torch.tensor(keep, dtype=torch.bool))
    assert st["rollout_is/rejected_frac"] == pytest.approx(1 - sum(map(sum, keep)) / 4)
    if mode == "truncate":  # token: r = 3 and 4 exceed 2; sequence: the row of ratio 4 (1 of 4 tokens)
        assert st["rollout_is/truncated_frac"] == pytest.approx(0.5 if level == "token" else 0.25)
    if level == "sequence":
        assert st["rollout_is/rejected_seq_frac"] == (0.5 if mode == "mask" else 0.0)
        assert st["rollout_is/max"] == pytest.approx(4.0) and st["rollout_is/min"] == pytest.approx(1.5)
    else:
        assert st["rollout_is/mean"] == pytest.approx((0.5 + 3 + 1 + 4) / 4)
    kept = torch.tensor(weight)[torch.tensor(keep, dtype=torch.bool)]
    assert st["rollout_is/ess"] == pytest.approx(float(kept.sum() ** 2 / (kept.numel() * (kept**2).sum())))


def test_is_weights_validation():
    with pytest.raises(ValueError, match="threshold"):
        rollout_is_weights(ROLLOUT, TRAINER, MASK, threshold=1.0)
    with pytest.raises(ValueError, match="lower"):
        rollout_is_weights(ROLLOUT, TRAINER, MASK, mode="mask", lower=1.0)
    with pytest.raises(ValueError, match="level"):
        rollout_is_weights(ROLLOUT, TRAINER, MASK, level="turn")
    with pytest.raises(ValueError, match="mode"):
        rollout_is_weights(ROLLOUT, TRAINER, MASK, mode="clip")
    with pytest.raises(ValueError, match="trainer_old_logp"):
        rollout_is_weights(ROLLOUT, TRAINER[:, :2], MASK)
    with pytest.raises(ValueError, match="rollout_logp"):
        rollout_mismatch_metrics(ROLLOUT.clone().fill_diagonal_(float("nan")), TRAINER, MASK)


def test_ppo_loss_with_is_weight_and_keep_hand_computed():
    adv = torch.tensor([[1.0, 2.0, -1.0], [3.0, 0.0, 0.0]])
    logp = TRAINER.clone().requires_grad_(True)  # ratio 1: every token's loss is -A
    base, _ = ppo_loss(logp, TRAINER, adv, MASK)
    same, _ = ppo_loss(logp, TRAINER, adv, MASK, is_weight=None, is_keep=None)
    assert base.item() == pytest.approx((-1 - 2 + 1 - 3) / 4) and same.item() == base.item()
    w, k, _ = rollout_is_weights(ROLLOUT, TRAINER, MASK, mode="truncate")
    tis, _ = ppo_loss(logp, TRAINER, adv, MASK, is_weight=w, is_keep=k)
    assert tis.item() == pytest.approx((-1 * 0.5 - 2 * 2.0 + 1 * 1.0 - 3 * 2.0) / 4)
    w, k, _ = rollout_is_weights(ROLLOUT, TRAINER, MASK, mode="mask", lower=0.3)
    mis, st = ppo_loss(logp, TRAINER, adv, MASK, is_weight=w, is_keep=k)
    assert mis.item() == pytest.approx((-1 * 0.5 + 1 * 1.0) / 2)  # two kept tokens in the denominator
    (g,) = torch.autograd.grad(mis, logp)
    torch.testing.assert_close(g, torch.tensor([[-0.25, 0.0, 0.5], [0.0, 0.0, 0.0]]))  # -A·w / 2 at ratio 1
    assert st["approx_kl"] == 0.0
    with pytest.raises(ValueError, match="is_keep"):
        ppo_loss(logp, TRAINER, adv, MASK, is_keep=k.float())
    with pytest.raises(ValueError, match="is_weight"):
        ppo_loss(logp, TRAINER, adv, MASK, is_weight=-w)


def test_actor_loss_drops_rejected_tokens_from_every_term():
    adv = torch.tensor([[1.0, 2.0, -1.0], [3.0, 0.0, 0.0]])
    ent = torch.tensor([[1.0, 5.0, 3.0], [7.0, 0.0, 0.0]])
    w, k, _ = rollout_is_weights(ROLLOUT, TRAINER, MASK, mode="mask", lower=0.3)
    loss, st = actor_loss(TRAINER, TRAINER, adv, MASK, entropy=ent, entropy_coef=0.1, is_weight=w, is_keep=k)
    assert st["actor/entropy"] == pytest.approx((1.0 + 3.0) / 2)  # only the kept tokens
    assert float(loss) == pytest.approx((-0.5 + 1.0) / 2 - 0.1 * 2.0)
    plain, _ = actor_loss(TRAINER, TRAINER, adv, MASK, entropy=ent, entropy_coef=0.1)
    assert float(plain) == pytest.approx(-1.25 - 0.1 * 4.0)
