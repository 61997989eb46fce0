"""Micro-batches by tokens under ``torchrun --nproc_per_node=2`` (gloo on CPU): ranks whose rows differ in number
and length get the same number of micro-batches, and the averaged gradient is the exact global token-mean."""

from __future__ import annotations

import os

import pytest
import torch
from alignopsd.engine.step.micro_batches import RowGeometry, plan_footprint, plan_update
from test_update_tokens import _masks

# rank 0: few long rows; rank 1: many short rows and one long one (its micro-batches differ in number by tokens)
SHARES = {
    0: ([30, 28, 25], [18, 15, 12]),
    1: ([3, 2, 4, 6, 2, 3, 30], [2, 1, 3, 1, 2, 2, 19]),
}


def _token_loss(w: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A token-mean of per-token terms ``w * value`` (what actor_loss is, for one parameter)."""
    return (w * values * mask).sum() / mask.sum().clamp(min=1)


@pytest.mark.distributed
@pytest.mark.parametrize("budget", [60, 200, 1])
def test_token_plan_lock_step_and_global_mean(budget):
    if os.environ.get("WORLD_SIZE") != "2":
        pytest.skip("run under torchrun --nproc_per_node=2")
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    prompts, resps = SHARES[rank]
    pm, rm = _masks(prompts, resps, 32, 20)
    geo = RowGeometry.of(pm, rm)
    mask = rm.float()
    values = torch.arange(mask.numel(), dtype=torch.float32).reshape(mask.shape).sin() + 1.0 + rank
    plan = plan_update(mask, 8, 2, world, geometry=geo, token_budget=budget)
    counts = [None, None]
    dist.all_gather_object(counts, [len(mbs) for mbs in plan])
    assert counts[0] == counts[1]  # lock-step: as many micro-batches (and mini-batches) on every rank
    w = torch.ones((), requires_grad=True)
    for mbs in plan:
        for mb in mbs:
            (_token_loss(w, values[mb.rows], mask[mb.rows]) * mb.scale).backward()
    grad = w.grad.clone()
    dist.all_reduce(grad)
    grad /= world  # data-parallel averaging
    both = [None, None]
    dist.all_gather_object(both, ((values * mask).sum().item(), mask.sum().item()))
    exact = sum(s for s, _ in both) / sum(n for _, n in both)  # the global token-mean's gradient
    assert float(grad) == pytest.approx(exact, rel=1e-6)
    fp = plan_footprint(plan, geo)
    assert 0.0 <= fp.padding_fraction < 1.0
    dummies = sum(mb.dummy for mbs in plan for mb in mbs)
    if budget == 60:  # rank 0 halves its micro-batches to match rank 1's count instead of computing dummies
        assert dummies == 0
    if budget == 1:  # one row each: rank 0 (3 rows) pads to rank 1's 7 micro-batches with zero-scale dummies
        assert dummies == (4 if rank == 0 else 0)


@pytest.mark.distributed
def test_packing_trial_takes_one_choice_on_every_rank(monkeypatch):
    """``use_remove_padding`` auto on CPU ranks: each rank times its own micro-batches (injected: rank 0 finds packed
    rows a little faster, rank 1 much slower), the seconds are summed over the ranks, and both take the same rows;
    the DDP update (the trial's halves included) all-reduces the same gradients as a padded-only one."""
    if os.environ.get("WORLD_SIZE") != "2":
        pytest.skip("run under torchrun --nproc_per_node=2")
    from types import SimpleNamespace

    import torch.distributed as dist
    from alignopsd.engine.config.schema import load_config
    from alignopsd.engine.models.loading import build_tiny_model
    from alignopsd.engine.policy.hf import HFPolicy
    from alignopsd.engine.step import packing_trial
    from alignopsd.engine.step.update import ppo_update
    from alignopsd.kernels import native_choice
    from test_update_tokens import PROMPTS, RESPONSES, TINY, _batch

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    monkeypatch.delenv(native_choice.PIN_ENV, raising=False)
    seconds = {0: (0.9, 1.0), 1: (3.0, 1.0)}[rank]  # (packed, padded) per timed call: summed, padded wins
    cfg = load_config(TINY, ["trainer.ppo.mini_batch_size=8", "trainer.ppo.micro_batch_size=2"])
    cb = _batch(PROMPTS, RESPONSES, seed=rank)
    adv = torch.randn(8, 20, generator=torch.Generator().manual_seed(1 + rank))
    weights = {}
    for packed in (None, False):
        torch.manual_seed(0)
        policy = HFPolicy(build_tiny_model(), lr=1e-3, weight_decay=0.0, packed=packed)
        now = [0.0]

        def clock(policy=policy, now=now):
            now[0] += seconds[0] if policy.rows.packs() else seconds[1]
            return now[0]

        monkeypatch.setattr(packing_trial, "clock", clock)
        old = policy.response_logprobs(cb.input_ids(), cb.attention_mask(), cb.response_length)[0].detach()
        parts = SimpleNamespace(
            cfg=cfg,
            policy=policy,
            device=torch.device("cpu"),
            world_size=2,
            dp_group=None,
            update_tokens=cfg.update_token_budget,
        )
        steps = []

        def capture(max_norm, policy=policy, steps=steps):  # the all-reduced gradients of each optimiser step
            steps.append(torch.cat([p.grad.reshape(-1) for p in policy.model.parameters() if p.grad is not None]))
            policy.zero_grad()
            return {"grad_norm": 1.0, "skipped": False, "lr": 0.0}

        policy.optimizer_step = capture
        ppo_update(parts, cb, old + 0.05 * cb.response_mask, None, adv, [])
        weights[packed] = steps
        if packed is None:
            chose = policy.rows.choice
    assert chose is not None and not chose.packed and (chose.packed_s, chose.padded_s) == pytest.approx((7.8, 4.0))
    assert len(weights[None]) == len(weights[False]) == 2
    for a, b in zip(weights[None], weights[False]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    both = [None, None]
    dist.all_gather_object(both, (chose.packed, [float(g.sum()) for g in weights[None]]))
    assert both[0] == both[1]  # one choice, one gradient on every rank
