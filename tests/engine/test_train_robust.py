"""Robustness of the step: non-finite updates are skipped, zero-advantage steps are skipped cheaply,
failing environments and malformed outputs are counted and never abort a step; data position and seeds."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from alignopsd.engine.config.schema import load_config
from alignopsd.engine.step.batch import TurnBatch
from alignopsd.engine.step.episodes import tasks_for_step
from alignopsd.engine.step.update import ppo_update

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"


@pytest.fixture(scope="module")
def tiny_policy():
    from alignopsd.engine.models.loading import build_tiny_model
    from alignopsd.engine.policy.hf import HFPolicy

    return HFPolicy(build_tiny_model(), lr=1e-3, weight_decay=0.0)


def _batch(m=6, lp=5, lr=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TurnBatch(
        task=torch.tensor([0, 0, 0, 1, 1, 1])[:m],
        rollout=torch.tensor([0, 1, 2, 0, 1, 2])[:m],
        turn=torch.zeros(m, dtype=torch.long),
        prompt_ids=torch.randint(3, 1000, (m, lp), generator=g),
        prompt_mask=torch.ones(m, lp, dtype=torch.long),
        response_ids=torch.randint(3, 1000, (m, lr), generator=g),
        response_mask=torch.ones(m, lr, dtype=torch.long),
        outcome=torch.zeros(m),
        action_valid=torch.ones(m, dtype=torch.bool),
    )


def _parts(policy, **over):
    cfg = load_config(TINY, [f"{k}={v}" for k, v in over.items()])
    return SimpleNamespace(
        cfg=cfg,
        policy=policy,
        device=torch.device("cpu"),
        world_size=1,
        dp_group=None,
        update_tokens=cfg.update_token_budget,
    )


def _update_grads(policy, parts, cb, old, adv):
    """(ppo_update's metrics, the gradients it hands to the optimizer step), the step itself replaced."""
    params = [p for p in policy.model.parameters() if p.requires_grad]
    policy.zero_grad()
    captured = {}
    orig_step = policy.optimizer_step

    def capture(max_norm):
        captured["g"] = [p.grad.clone() for p in params]
        policy.zero_grad()
        return {"grad_norm": 1.0, "skipped": False, "lr": 0.0}

    policy.optimizer_step = capture
    try:
        out = ppo_update(parts, cb, old, None, adv, [])
    finally:
        policy.optimizer_step = orig_step
    return out, captured["g"]


def _old_logp(policy, cb):
    return policy.response_logprobs(cb.input_ids(), cb.attention_mask(), cb.response_length)[0]


def _groups(outcome, valid):
    """A TurnBatch of two tasks of three rollouts with the given outcomes and validity flags."""
    return dataclasses.replace(
        _batch(), outcome=torch.tensor(outcome, dtype=torch.float32), action_valid=torch.tensor(valid)
    )


def _core_advantage(cb, cfg):
    """GRPO's token advantage from the core's formulas (outcome advantage plus the invalid residual)."""
    from alignopsd.advantage import grpo_advantage, invalid_action_residual

    a = cfg.algorithm
    A = grpo_advantage(cb.outcome, cb.task, cb.rollout, scope=a.grpo_scope, norm_by_std=a.norm_by_std)
    return A + invalid_action_residual(
        cb.outcome, ~cb.action_valid, cb.task, penalty=a.invalid_penalty, norm_by_std=a.norm_by_std
    )


def test_no_signal_is_decided_once_before_any_model_pass_and_exactly():
    """``trainer.ppo.skip_no_signal`` is decided by the step (engine/step/recipe.py) from the rollout alone; it skips
    exactly the batches whose advantages the core makes zero, the all-invalid group's residual included (once the
    reason for a second, tolerance-based check inside the update)."""
    from alignopsd.engine.step.recipe import no_signal

    from alignopsd.estimators import get_estimator

    cfg = load_config(TINY, ["algorithm.estimator=grpo", "algorithm.use_invalid_penalty=true"])
    grpo = get_estimator("grpo")
    same = _groups([0, 0, 0, 1, 1, 1], [False, False, False, True, True, True])  # task 0 all invalid
    assert no_signal(cfg, grpo, same)
    # zero up to rounding: the residual of the all-invalid group is float noise, which a check of the advantages
    # the update sees could only tell from a signal with a tolerance; decided from the rollout it is exact
    assert float(_core_advantage(same, cfg).abs().max()) < 1e-9
    for outcome, valid in (
        ([0, 0, 1, 1, 1, 1], [True] * 6),
        ([0, 0, 0, 1, 1, 1], [False, True, True, True, True, True]),
    ):
        cb = _groups(outcome, valid)  # a task whose outcomes, or validity, differ: a signal, not skipped
        assert not no_signal(cfg, grpo, cb)
        assert float(_core_advantage(cb, cfg).abs().max()) > 0.1
    # an auxiliary term, or an advantage that is not the outcome advantage scaled, moves weights: never skipped
    assert not no_signal(cfg, get_estimator("sdar"), same) and not no_signal(cfg, get_estimator("opsd"), same)


def test_update_trains_on_what_it_is_given(tiny_policy):
    """The update makes no skip decision of its own: zero advantages still step the optimizer (the entropy term
    moves the weights), whatever ``trainer.ppo.skip_no_signal`` says."""
    cb = _batch()
    parts = _parts(tiny_policy, **{"trainer.ppo.skip_no_signal": "true", "algorithm.entropy_coef": "0.5"})
    out, grads = _update_grads(tiny_policy, parts, cb, _old_logp(tiny_policy, cb), torch.zeros(6, 4))
    assert out["update/optimizer_steps"] == 1.0 and out["update/skipped"] == 0.0
    assert max(float(g.abs().max()) for g in grads) > 0.0


@pytest.mark.parametrize("fused", [True, False])
def test_nonfinite_loss_skips_update_weights_unchanged(tiny_policy, monkeypatch, caplog, fused):
    cb = _batch()
    old = _old_logp(tiny_policy, cb)
    before = {k: v.clone() for k, v in tiny_policy.model.state_dict().items()}
    orig, orig_fused = tiny_policy.response_logprobs, tiny_policy.response_loss

    def poisoned(*a, **k):
        lp, ent = orig(*a, **k)
        return lp * float("nan"), ent

    def poisoned_fused(*a, **k):
        lp, ent, carrier = orig_fused(*a, **k)
        return lp * float("nan"), ent, carrier

    monkeypatch.setattr(tiny_policy, "response_logprobs", poisoned)
    monkeypatch.setattr(tiny_policy, "response_loss", poisoned_fused)
    adv = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    out = ppo_update(_parts(tiny_policy, **{"trainer.ppo.fused_head_loss": str(fused).lower()}), cb, old, None, adv, [])
    assert out["update/skipped"] == 1.0 and out["update/nonfinite_loss"] >= 1
    after = tiny_policy.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert "non-finite" in caplog.text


@pytest.mark.parametrize("fused", [True, False])
def test_update_moves_weights_and_global_token_mean(tiny_policy, fused):
    """Splitting into micro-batches does not change the gradient (exact global token-mean, §3.12); the fused
    head loss gives the gradient of autograd through the whole batch."""
    from alignopsd.losses import ppo_loss

    cb = _batch()
    cb.response_mask[0, 2:] = 0  # ragged rows: micro-batches hold different token counts
    cb.response_mask[4, 1:] = 0
    old = _old_logp(tiny_policy, cb)
    adv = torch.randn(6, 4, generator=torch.Generator().manual_seed(2)) * cb.response_mask
    params = [p for p in tiny_policy.model.parameters() if p.requires_grad]
    # reference gradient of the whole batch in one piece
    tiny_policy.zero_grad()
    lp, _ = tiny_policy.response_logprobs(cb.input_ids(), cb.attention_mask(), 4, grad=True)
    loss, _ = ppo_loss(lp, old, adv, cb.response_mask)
    loss.backward()
    ref = [p.grad.clone() for p in params]
    over = {"trainer.ppo.micro_batch_size": 4, "algorithm.entropy_coef": 0.0}
    parts = _parts(tiny_policy, **over, **{"trainer.ppo.fused_head_loss": str(fused).lower()})
    out, grads = _update_grads(tiny_policy, parts, cb, old, adv)
    assert out["update/optimizer_steps"] == 1 and out["update/fused_head_loss"] == float(fused)
    for a, b in zip(ref, grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_failing_envs_and_malformed_outputs_are_counted(tmp_path, faulty_env):
    """A raising environment and the random model's malformed responses: counted, the step completes."""
    from alignopsd.engine.run.trainer import Trainer
    from alignopsd.engine.step.recipe import run_step

    ov = ["env.name=codeword_faulty", "algorithm.estimator=grpo", "algorithm.kl_coef=0.0", "env.max_turns=2",
          "generation.max_response_length=8", "trainer.ppo.skip_no_signal=true", f"output_dir={tmp_path}"]  # fmt: skip
    cfg = load_config(TINY, ov)
    tr = Trainer(cfg)
    tr.parts = replace(
        tr.parts,
        train_tasks=faulty_env.tasks("raise", at_step=0, n=1) + faulty_env.tasks(None, at_step=0, n=1),
    )
    out = run_step(tr.parts, 0)
    m = out.metrics
    assert m.get("regions/errors", 0.0) == 0.0
    assert m["env/failed_episodes"] == 4  # the 4 siblings of the raising task
    assert m["episode/valid_action_rate"] == 0.0 and m["env/invalid_actions"] > 0  # malformed responses
    assert m["update/skipped"] == 1.0 and m["update/zero_advantage"] == 1.0  # no learnable signal: skipped
    assert m["time/old_logprob"] == 0.0 and m["time/update"] == 0.0  # ... cheaply: no model pass after the rollout
    tr.parts.close()


def test_tasks_for_step_is_deterministic_and_split_by_rank():
    tasks = list(range(10))
    a = [tasks_for_step(tasks, s, 4, seed=3) for s in range(5)]
    assert a == [tasks_for_step(tasks, s, 4, seed=3) for s in range(5)]
    flat = [t for s in a for t in s]
    assert sorted(flat[:10]) == tasks  # one epoch covers every task once
    assert (
        tasks_for_step(tasks, 2, 4, 3, rank=0, world_size=2) + tasks_for_step(tasks, 2, 4, 3, rank=1, world_size=2)
        == a[2]
    )
    with pytest.raises(ValueError, match="tasks"):
        tasks_for_step([], 0, 4, 0)


def _separable(loss_fn, fill: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether ``loss_fn(logp, ent)`` acts as a sum of per-token terms: the gradient at every other masked token
    does not move when the remaining masked tokens' log-probs and entropies move."""
    flat = mask.bool().reshape(-1)
    idx = flat.nonzero().squeeze(1)
    probe, other = torch.zeros_like(flat), torch.zeros_like(flat)
    probe[idx[0::2]], other[idx[1::2]] = True, True
    shift = 0.37 * torch.cos(torch.arange(flat.numel(), dtype=torch.float32)) * other

    def grads(lp_flat, ent_flat):
        leaves = [x.reshape(fill.shape).clone().requires_grad_(True) for x in (lp_flat, ent_flat)]
        gs = torch.autograd.grad(loss_fn(*leaves), leaves, allow_unused=True)
        return [(g if g is not None else torch.zeros_like(x)).reshape(-1)[probe] for g, x in zip(gs, leaves)]

    base = fill.reshape(-1)
    before, after = grads(base, torch.zeros_like(base)), grads(base + shift, shift.abs())
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-8) for x, y in zip(before, after))


@pytest.mark.parametrize("is_weight", [False, True])
@pytest.mark.parametrize("aux_kind", [None, "alignment", "sdar"])
def test_declared_separable_losses_are_separable(aux_kind, is_weight):
    """Every registered estimator declares its loss per-token separable, and the actor loss it can make (PPO with
    the KL, entropy, rollout IS weights and each auxiliary kind) is; the probe catches a sequence-level ratio."""
    from alignopsd.estimators import ESTIMATORS
    from alignopsd.losses import AuxTerm, actor_loss

    assert all(spec.loss_separable for spec in ESTIMATORS.values())
    g = torch.Generator().manual_seed(0)
    old, adv = torch.randn(3, 5, generator=g) - 2.0, torch.randn(3, 5, generator=g)
    ref, teacher, gap = (torch.randn(3, 5, generator=g) - 2.0 for _ in range(3))
    mask = torch.ones(3, 5)
    mask[1, 3:] = 0
    aux = [] if aux_kind is None else [AuxTerm(aux_kind, teacher, coef=0.1, beta=5.0, gate_gap_ML=gap)]
    w = torch.rand(3, 5, generator=g) + 0.5 if is_weight else None

    def loss(lp, ent):
        return actor_loss(lp, old, adv, mask, entropy=ent, entropy_coef=0.01, ref_logp=ref, kl_coef=0.1, aux=aux,
                          is_weight=w)[0]  # fmt: skip

    def sequence_ratio(lp, ent):  # GSPO-like: one ratio per row from the mean log-ratio over its tokens
        return -(torch.exp(((lp - old) * mask).sum(1) / mask.sum(1)) * adv[:, 0]).mean()

    assert _separable(loss, old, mask)
    assert not _separable(sequence_ratio, old, mask)


def test_coupled_loss_falls_back_to_autograd(tiny_policy, monkeypatch, caplog):
    """An estimator that declares a coupled loss trains through autograd (and says so), not the fused head."""
    import dataclasses

    import alignopsd.estimators as estimators

    cb = _batch()
    old = _old_logp(tiny_policy, cb)
    adv = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    parts = _parts(tiny_policy)
    name = parts.cfg.algorithm.estimator
    spec = dataclasses.replace(estimators.ESTIMATORS[name], loss_separable=False)
    monkeypatch.setitem(estimators.ESTIMATORS, name, spec)
    calls = []
    orig = tiny_policy.response_loss
    monkeypatch.setattr(tiny_policy, "response_loss", lambda *a, **k: calls.append(1) or orig(*a, **k))
    monkeypatch.setattr(tiny_policy, "optimizer_step", lambda max_norm: {"grad_norm": 1.0, "skipped": False})
    try:
        out = ppo_update(parts, cb, old, None, adv, [])
    finally:
        tiny_policy.zero_grad()
    assert not calls and out["update/fused_head_loss"] == 0.0
    assert "couples tokens" in caplog.text
    monkeypatch.setitem(estimators.ESTIMATORS, name, dataclasses.replace(spec, loss_separable=True))
    try:
        out = ppo_update(parts, cb, old, None, adv, [])
    finally:
        tiny_policy.zero_grad()
    assert calls and out["update/fused_head_loss"] == 1.0


def test_backend_scorer_equals_the_rescorer(tiny_policy):
    """A Rescorer with a row scorer (what the Megatron backend gets) has the policy backend score the old log-probs
    and the teacher rows (diagonal and cross pairs), in row chunks, and agrees with the Hugging Face scoring paths."""
    import functools

    from alignopsd.engine.policy.row_scoring import backend_row_logprobs
    from alignopsd.engine.step.rescoring import Rescorer

    cb = _batch()
    cb.response_mask[2, 3:] = 0
    g = torch.Generator().manual_seed(7)
    cb.teacher_prompt_ids = torch.randint(3, 1000, (6, 7), generator=g)
    cb.teacher_prompt_mask = torch.ones(6, 7, dtype=torch.long)
    cb.teacher_prompt_mask[4, :3] = 0  # left padding
    pairs = torch.tensor([[1, 0], [2, 0], [0, 4], [5, 3]])
    calls = []

    def scorer(*args):
        calls.append(int(args[2].numel()))
        # 9-11 token positions per row: max_tokens=20 gives chunks of 1-2 rows
        return backend_row_logprobs(tiny_policy, *args, temperature=0.8, device=torch.device("cpu"), max_tokens=20)

    for mode in ("plain", "shared_prefix"):
        ours = Rescorer(tiny_policy.model, mode=mode, temperature=0.8, scorer=scorer)
        ref = Rescorer(tiny_policy.model, mode=mode, temperature=0.8)
        a = ours(cb, pairs, student=True, teacher=True, with_entropy=True)
        b = ref(cb, pairs, student=True, teacher=True, with_entropy=True)
        torch.testing.assert_close(a.old_logp, b.old_logp, atol=1e-5, rtol=0)
        torch.testing.assert_close(a.entropy * cb.response_mask, b.entropy * cb.response_mask, atol=1e-5, rtol=0)
        torch.testing.assert_close(a.diag, b.diag, atol=1e-5, rtol=0)
        torch.testing.assert_close(a.cross, b.cross, atol=1e-5, rtol=0)
        assert bool((a.old_logp[2, 3:] == 0).all()) and bool((a.diag[2, 3:] == 0).all())
    assert calls == [6, 10, 6, 10]  # student rows, then diagonal + cross rows in one pass, per mode
    assert functools.partial(backend_row_logprobs, tiny_policy, temperature=1.0, device="cpu")  # the trainer's form
    with pytest.raises(ValueError, match="scorer"):
        Rescorer(tiny_policy.model, scorer=3)


@pytest.mark.parametrize("mode", ["token_mask", "token_truncate"])
def test_rollout_correction_in_the_update(tiny_policy, mode):
    """trainer.ppo.rollout_is: the update's gradient is the PPO token-mean with the importance weights, rejected tokens
    out of the numerator and the denominator (hand-built reference through autograd on the whole batch)."""
    from alignopsd.losses import ppo_loss

    cb = _batch()
    old = _old_logp(tiny_policy, cb)
    roll = old.clone()
    roll[0, 1] -= 2.0  # ratio e^2 > 2: masked (token_mask) or truncated to 2 (token_truncate)
    roll[3, 2] += 1.5  # ratio e^-1.5 < 1/2: masked (token_mask); 0.22 kept as is (token_truncate)
    cb.rollout_logp = roll
    adv = torch.randn(6, 4, generator=torch.Generator().manual_seed(4))
    ratio = torch.exp(old - roll)
    if mode == "token_mask":
        keep = (ratio >= 0.5) & (ratio <= 2.0)
        weight = ratio
    else:
        keep = torch.ones_like(ratio, dtype=torch.bool)
        weight = ratio.clamp(max=2.0)
    params = [p for p in tiny_policy.model.parameters() if p.requires_grad]
    tiny_policy.zero_grad()
    lp, _ = tiny_policy.response_logprobs(cb.input_ids(), cb.attention_mask(), 4, grad=True)
    loss, _ = ppo_loss(lp, old, adv * keep, cb.response_mask * keep, is_weight=weight)
    loss.backward()
    ref = [p.grad.clone() for p in params]
    over = {"trainer.ppo.rollout_is": mode, "algorithm.entropy_coef": 0.0, "trainer.ppo.micro_batch_size": 4}
    out, grads = _update_grads(tiny_policy, _parts(tiny_policy, **over), cb, old, adv)
    assert (out["rollout_is/rejected_frac"] > 0) == (mode == "token_mask")
    assert (out["rollout_is/truncated_frac"] > 0) == (mode == "token_truncate")
    for a, b in zip(ref, grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
