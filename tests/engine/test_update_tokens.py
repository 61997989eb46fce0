"""Micro-batches by tokens (trainer.ppo.max_token_len_per_gpu): the plan, its padding accounting against the
positions the policy really pushes, and the same update (loss, gradients of every optimiser step) as the
fixed-row micro-batches."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from alignopsd.engine.config.schema import load_config
from alignopsd.engine.policy.lm_head import score_rows
from alignopsd.engine.step.batch import TurnBatch
from alignopsd.engine.step.micro_batches import (
    Footprint,
    RowGeometry,
    pack_by_tokens,
    plan_footprint,
    plan_update,
)
from alignopsd.engine.step.update import ppo_update

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"


def _masks(prompt_lens, resp_lens, lp, lr):
    """Left-padded prompt and right-padded response masks of the given lengths."""
    pm = torch.zeros(len(prompt_lens), lp, dtype=torch.long)
    rm = torch.zeros(len(resp_lens), lr, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        pm[i, lp - p :] = 1
        rm[i, :r] = 1
    return pm, rm


def _batch(prompt_lens, resp_lens, lp=32, lr=20, seed=0):
    m = len(prompt_lens)
    g = torch.Generator().manual_seed(seed)
    pm, rm = _masks(prompt_lens, resp_lens, lp, lr)
    return TurnBatch(
        task=torch.arange(m) // 2,
        rollout=torch.arange(m) % 2,
        turn=torch.zeros(m, dtype=torch.long),
        prompt_ids=torch.randint(3, 1000, (m, lp), generator=g) * pm,
        prompt_mask=pm,
        response_ids=torch.randint(3, 1000, (m, lr), generator=g) * rm,
        response_mask=rm,
        outcome=torch.zeros(m),
        action_valid=torch.ones(m, dtype=torch.bool),
    )


# the same rows with very different lengths: a first turn against a turn with a long history
PROMPTS = [30, 3, 25, 2, 12, 4, 28, 6]
RESPONSES = [18, 2, 1, 20, 7, 3, 15, 1]


def test_geometry_and_footprint_exact_on_a_constructed_batch():
    pm, rm = _masks([8, 2, 8, 2], [6, 1, 6, 1], 8, 6)
    geo = RowGeometry.of(pm, rm)
    assert geo.prompt == [8, 2, 8, 2] and geo.response == [6, 1, 6, 1]
    rows = Footprint()
    for mc in ([0, 1], [2, 3]):  # fixed rows of 2 in batch order: each forward 2 x (8 + 6 - 1), 16 carry a token
        rows.add(geo, mc)
    assert (rows.computed, rows.real) == (52, 32) and rows.padding_fraction == pytest.approx(20 / 52)
    micros = pack_by_tokens([0, 1, 2, 3], geo, budget=28)
    assert micros == [[0, 2], [1, 3]]  # the long rows together, the short ones together
    toks = Footprint()
    for mc in micros:
        toks.add(geo, mc)
    assert (toks.computed, toks.real) == (26 + 4, 26 + 4) and toks.padding_fraction == 0.0


def test_pack_by_tokens_respects_the_budget_and_keeps_every_row_once():
    pm, rm = _masks(PROMPTS, RESPONSES, 32, 20)
    geo = RowGeometry.of(pm, rm)
    for budget in (1, 40, 64, 100, 10_000):
        micros = pack_by_tokens(list(range(8)), geo, budget)
        assert sorted(r for mc in micros for r in mc) == list(range(8))
        assert all(len(mc) == 1 or geo.cost(mc) <= budget for mc in micros)
        lengths = [geo.length(r) for mc in micros for r in mc]
        assert lengths == sorted(lengths, reverse=True)  # longest first
    assert len(pack_by_tokens(list(range(8)), geo, 1)) == 8  # every row over the budget: one each
    assert len(pack_by_tokens(list(range(8)), geo, 10_000)) == 1


def test_footprint_counts_what_the_policy_pushes():
    """Footprint.computed equals score_rows' own count of pushed positions, and .real the attended ones among them."""
    from alignopsd.engine.models.loading import build_tiny_model

    model = build_tiny_model()
    cb = _batch(PROMPTS, RESPONSES)
    geo = RowGeometry.of(cb.prompt_mask, cb.response_mask)
    for mc in ([0, 1, 2], [3, 5], [4], [1, 7]):
        fp = Footprint()
        fp.add(geo, mc)
        with torch.no_grad():
            _, _, pushed = score_rows(model, cb.prompt_ids[mc], cb.prompt_mask[mc], cb.response_ids[mc],
                                      cb.response_mask[mc])  # fmt: skip
        assert fp.computed == pushed
        p_w, r_w = max(geo.prompt[r] for r in mc), max(geo.response[r] for r in mc)
        attended = cb.attention_mask()[mc][:, 32 - p_w : 32 + r_w - 1]
        assert fp.real == int(attended.sum())


def test_plan_by_tokens_keeps_mini_batches_and_scales():
    pm, rm = _masks(PROMPTS, RESPONSES, 32, 20)
    geo = RowGeometry.of(pm, rm)
    mask = rm.float()
    rows = plan_update(mask, 4, 2, 1)
    toks = plan_update(mask, 4, 2, 1, geometry=geo, token_budget=80)
    for a, b in zip(rows, toks):  # the same rows per optimiser step, the scales summing to its token share
        assert sorted(r for mb in a for r in mb.rows) == sorted(r for mb in b for r in mb.rows)
        assert sum(mb.scale for mb in b) == pytest.approx(1.0)
        total = float(mask[[r for mb in b for r in mb.rows]].sum())
        assert all(mb.scale == pytest.approx(float(mask[mb.rows].sum()) / total) for mb in b)
    assert plan_footprint(toks, geo).padding_fraction < plan_footprint(rows, geo).padding_fraction
    with pytest.raises(ValueError, match="geometry"):
        plan_update(mask, 4, 2, 1, token_budget=80)


def test_config_budget_rule():
    cfg = load_config(TINY, [])
    assert cfg.update_token_budget == cfg.trainer.ppo.micro_batch_size * (
        cfg.env.max_prompt_length + cfg.generation.max_response_length
    )
    assert load_config(TINY, ["trainer.ppo.max_token_len_per_gpu=0"]).update_token_budget == 0
    assert load_config(TINY, ["trainer.ppo.max_token_len_per_gpu=null"]).update_token_budget == 0
    assert load_config(TINY, ["trainer.ppo.max_token_len_per_gpu=4096"]).update_token_budget == 4096
    with pytest.raises(Exception, match="trainer.ppo.max_token_len_per_gpu"):
        load_config(TINY, ["trainer.ppo.max_token_len_per_gpu=-1"])


def _update(policy, cb, old, adv, **over):
    """(ppo_update's metrics, the gradients of each optimiser step), the step itself replaced."""
    cfg = load_config(TINY, [f"{k}={v}" for k, v in over.items()])
    parts = SimpleNamespace(
        cfg=cfg,
        policy=policy,
        device=torch.device("cpu"),
        world_size=1,
        dp_group=None,
        update_tokens=cfg.update_token_budget,
    )
    params = [p for p in policy.model.parameters() if p.requires_grad]
    policy.zero_grad()
    steps = []

    def capture(max_norm):
        steps.append([p.grad.clone() for p in params])
        policy.zero_grad()
        return {"grad_norm": 1.0, "skipped": False, "lr": 0.0}

    orig = policy.optimizer_step
    policy.optimizer_step = capture
    try:
        out = ppo_update(parts, cb, old, None, adv, [])
    finally:
        policy.optimizer_step = orig
    return out, steps


@pytest.mark.parametrize("fused", [True, False])
def test_update_by_tokens_equals_fixed_rows(fused):
    """The same batch (rows of very different lengths) gives the same loss and gradients per optimiser step
    (two mini-batches) by tokens as by fixed rows, with fewer padded positions."""
    from alignopsd.engine.models.loading import build_tiny_model
    from alignopsd.engine.policy.hf import HFPolicy

    torch.manual_seed(0)
    policy = HFPolicy(build_tiny_model(), lr=1e-3, weight_decay=0.0)
    cb = _batch(PROMPTS, RESPONSES)
    old = policy.response_logprobs(cb.input_ids(), cb.attention_mask(), cb.response_length)[0].detach()
    old = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(2)) * cb.response_mask
    adv = torch.randn(8, 20, generator=torch.Generator().manual_seed(1))
    common = {"trainer.ppo.mini_batch_size": 4, "trainer.ppo.micro_batch_size": 2, "algorithm.entropy_coef": 0.01,
              "trainer.ppo.fused_head_loss": str(fused).lower()}  # fmt: skip
    a, ga = _update(policy, cb, old, adv, **common, **{"trainer.ppo.max_token_len_per_gpu": 0})
    b, gb = _update(policy, cb, old, adv, **common, **{"trainer.ppo.max_token_len_per_gpu": 90})
    assert len(ga) == len(gb) == 2
    for sa, sb in zip(ga, gb):
        for x, y in zip(sa, sb):
            torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)
    for k, v in a.items():
        if k.startswith("actor/") and k not in ("actor/padding_fraction", "actor/lr"):
            assert float(b[k]) == pytest.approx(float(v), abs=1e-5), k
    assert 0.0 <= float(b["actor/padding_fraction"]) < float(a["actor/padding_fraction"])


@pytest.mark.parametrize("mode", ["plain", "shared_prefix"])
def test_passes_by_length_same_logprobs_less_padding(mode):
    """The old log-prob / reference passes with rows longest first: the same log-probs and entropies in batch
    order, exact ``real_tokens``, and fewer padded positions than in batch order."""
    from alignopsd.engine.models.loading import build_tiny_model
    from alignopsd.engine.step.rescoring import Rescorer

    torch.manual_seed(0)
    model = build_tiny_model()
    prompts = [30, 30, 30, 30, *PROMPTS[4:]]  # four sibling rows share their prompt (pushed once in shared_prefix)
    cb = _batch(prompts, RESPONSES)
    cb.prompt_ids[1:4] = cb.prompt_ids[0]
    got = {}
    for by_length in (False, True):
        sc = Rescorer(model, mode=mode, max_tokens=100, by_length=by_length)
        lp, en, st = sc.student_logprobs(cb, with_entropy=True)
        got[by_length] = (lp, en, st)
    (lp0, en0, st0), (lp1, en1, st1) = got[False], got[True]
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(en1, en0, atol=1e-5, rtol=1e-5)
    for st in (st0, st1):
        assert 0 < st["real_tokens"] <= st["token_forwards"]
    assert st1["token_forwards"] - st1["real_tokens"] < st0["token_forwards"] - st0["real_tokens"]
    if mode == "plain":  # every row's attended positions, less its response's last token where it is the longest
        lo, hi = sum(p + r - 1 for p, r in zip(prompts, RESPONSES)), sum(p + r for p, r in zip(prompts, RESPONSES))
        assert all(lo <= st["real_tokens"] < hi for st in (st0, st1))


def test_padding_fraction_metric_of_a_pass():
    from alignopsd.engine.step.recipe import padding_fraction

    assert padding_fraction({"student/token_forwards": 200, "student/real_tokens": 150}, "x") == {"x": 0.25}
    assert padding_fraction({"student/token_forwards": 0}, "x") == {}


@pytest.mark.parametrize(("packed_s", "padded_s"), [(0.5, 1.0), (1.0, 0.5)])
def test_first_update_times_packed_against_padded_rows(monkeypatch, caplog, packed_s, padded_s):
    """``use_remove_padding`` auto on a CPU (the policy's rows undecided): the first update runs its first two
    micro-batches both ways at half scale (seconds injected through the trial's clock, per the rows being run), sets
    the faster on the policy's ``RowLayout`` and takes it for the rest; every optimiser step's gradients and the
    metrics equal the padded update's, and the counts include the trial's second passes. A second update measures
    nothing."""
    import logging

    from alignopsd.engine.models.loading import build_tiny_model
    from alignopsd.engine.policy import lm_head
    from alignopsd.engine.policy.hf import HFPolicy
    from alignopsd.engine.step import packing_trial
    from alignopsd.kernels import native_choice

    monkeypatch.delenv(native_choice.PIN_ENV, raising=False)
    torch.manual_seed(0)
    model = build_tiny_model()
    policy = HFPolicy(model, lr=1e-3, weight_decay=0.0, packed=None)
    now = [0.0]

    def clock():  # each read advances by the seconds of the rows in use: end - start = one path's seconds
        now[0] += packed_s if policy.rows.packs() else padded_s
        return now[0]

    calls = []
    real = lm_head.packed_forward
    monkeypatch.setattr(packing_trial, "clock", clock)
    monkeypatch.setattr(lm_head, "packed_forward", lambda *a: calls.append(1) or real(*a))
    cb = _batch(PROMPTS, RESPONSES)
    old = policy.response_logprobs(cb.input_ids(), cb.attention_mask(), cb.response_length)[0].detach()
    old = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(2)) * cb.response_mask
    adv = torch.randn(8, 20, generator=torch.Generator().manual_seed(1))
    over = {"trainer.ppo.mini_batch_size": 4, "trainer.ppo.micro_batch_size": 2, "trainer.ppo.max_token_len_per_gpu": 0}
    with caplog.at_level(logging.INFO, logger=packing_trial.__name__):
        a, ga = _update(policy, cb, old, adv, **over)
    chose = policy.rows.choice
    assert chose.packed is (packed_s < padded_s) and (chose.packed_s, chose.padded_s) == (2 * packed_s, 2 * padded_s)
    assert policy.rows.packed is chose.packed and native_choice.choices_state() == {}  # a value, not a global
    assert calls == [1] * (4 if chose.packed else 2)  # the trial's two packed forwards, then the choice's
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"kernels: {chose.describe()}"] and said[0].endswith("(4 rows), forward and backward")
    policy.rows.packed = False  # the same update in padded rows only (the scorer holds the same layout)
    b, gb = _update(policy, cb, old, adv, **over)
    assert len(ga) == len(gb) == 2
    for sa, sb in zip(ga, gb):
        for x, y in zip(sa, sb):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    for k, v in b.items():
        if k.startswith("actor/") and k != "actor/padding_fraction":
            assert float(a[k]) == pytest.approx(float(v), abs=1e-5), k
    # the trial's two micro-batches ran twice; its padded passes computed padding, its packed ones none
    assert float(a["update/micro_batches"]) == float(b["update/micro_batches"]) + 2 == 6
    assert 0.0 < float(a["actor/padding_fraction"]) < float(b["actor/padding_fraction"])
    policy.rows.packed = chose.packed
    calls.clear()
    c, _ = _update(policy, cb, old, adv, **over)
    assert calls == [1] * (4 if chose.packed else 0) and policy.rows.choice is chose
    assert float(c["update/micro_batches"]) == 4


def test_a_bad_micro_batch_of_the_trial_counts_once(monkeypatch):
    """A micro-batch whose loss is not finite counts once in ``update/nonfinite_loss`` though the packing trial ran it
    twice (packed and padded)."""
    from alignopsd.engine.models.loading import build_tiny_model
    from alignopsd.engine.policy.hf import HFPolicy
    from alignopsd.engine.step import update
    from alignopsd.kernels import native_choice

    monkeypatch.delenv(native_choice.PIN_ENV, raising=False)
    torch.manual_seed(0)
    policy = HFPolicy(build_tiny_model(), lr=1e-3, weight_decay=0.0, packed=None)
    real = update.micro_step
    seen = []

    def first_is_bad(parts, inp, mb, *rest):
        seen.append(mb.rows)
        stats, loss = real(parts, inp, mb, *rest)
        return (stats, None) if mb.rows == seen[0] else (stats, loss)

    monkeypatch.setattr(update, "micro_step", first_is_bad)
    cb = _batch(PROMPTS, RESPONSES)
    old = policy.response_logprobs(cb.input_ids(), cb.attention_mask(), cb.response_length)[0].detach()
    adv = torch.randn(8, 20, generator=torch.Generator().manual_seed(1))
    over = {"trainer.ppo.mini_batch_size": 4, "trainer.ppo.micro_batch_size": 2, "trainer.ppo.max_token_len_per_gpu": 0}
    out, _ = _update(policy, cb, old, adv, **over)
    assert seen[0] == seen[1]  # the trial ran the bad micro-batch both ways
    assert float(out["update/nonfinite_loss"]) == 1.0
