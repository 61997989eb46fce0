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
