"""Mechanism 2's whole-batch statistics under data parallelism (ALGORITHM.md §3.3-§3.5, §3.11 D).

Each data-parallel rank holds whole tasks of the step's batch (``episodes.tasks_for_step``; task ids
``rank * per + i``), so its turns are one share of the batch in identity order. Everything of §3 that is per
task, trajectory or turn (outcome advantage, residual, profiles, distances, budgets, projection, weights) needs
nothing from the other ranks; what §3 takes over the whole batch is gathered here and passed into the core as
``alignopsd.credit_config.WholeBatch`` (``EstimatorInputs.whole_batch`` -> ``allocate_credit(whole_batch=)``):

    turns, block width, trajectory offset   one all-gather of the shares' sizes (and task ranges, checked)
    threshold tau (§3.4)                    the shares' valid distances (``profiles.valid_distances``, the
                                            allocator's own path), all-gathered; ``segmentation_threshold``
                                            of their concatenation (the quantile of a multiset: order-free)
    global span indices (§3.5)              after allocation, shifted by the span count of the lower ranks

With them each rank gets exactly (bit for bit) the spans, budgets and token advantages its turns get when the
whole batch is allocated on one rank. Single-process runs gather nothing and pass nothing (DP = 1 unchanged).
"""

from __future__ import annotations

import dataclasses

import torch
from alignopsd.engine.parallel.collectives import all_gather_tensors

from alignopsd.advantage import build_turn_index
from alignopsd.credit_config import CreditConfig, WholeBatch
from alignopsd.estimators import EstimatorInputs
from alignopsd.profiles import segmentation_threshold, valid_distances

__all__ = ["globalise_spans", "whole_batch"]


def whole_batch(
    inputs: EstimatorInputs, cfg: CreditConfig, rank: int, world_size: int, group=None
) -> WholeBatch | None:
    """The whole batch's statistics for this rank's share ``inputs`` (collectives over the ``group`` ranks; every
    rank must call it); None when single-process. RuntimeError when the shares are not whole tasks in rank order
    (a task on two ranks, or a lower rank holding a larger task id)."""
    if world_size <= 1:
        return None
    index = build_turn_index(inputs.task, inputs.rollout, inputs.turn)
    mine = [index.num_turns, index.num_trajectories, index.largest_task_turns]
    mine += [int(inputs.task.min()), int(inputs.task.max())]
    sizes = torch.cat(all_gather_tensors(torch.tensor([mine], dtype=torch.int64), world_size, group)).tolist()
    for r in range(1, world_size):
        if sizes[r - 1][4] >= sizes[r][3]:
            raise RuntimeError(
                f"data-parallel shares: rank {r - 1} holds tasks {sizes[r - 1][3]}..{sizes[r - 1][4]} and rank {r} "
                f"tasks {sizes[r][3]}..{sizes[r][4]}; Mechanism 2 needs whole tasks in rank order"
            )
    whole = WholeBatch(
        turns=sum(s[0] for s in sizes),
        block_width=max(s[2] for s in sizes),
        trajectory_offset=sum(s[1] for s in sizes[:rank]),
    )
    if not cfg.uses_distances:
        return whole
    inputs.require("H", "eligible")
    local = valid_distances(
        inputs.task,
        inputs.rollout,
        inputs.turn,
        inputs.H,
        inputs.eligible,
        cfg,
        whole_batch=whole,  # type: ignore[arg-type]
    )
    pool = torch.cat(all_gather_tensors(local, world_size, group))
    tau = segmentation_threshold(
        pool, torch.ones_like(pool, dtype=torch.bool), quantile=cfg.quantile, tau_min=cfg.tau_min, tau_max=cfg.tau_max
    )
    return dataclasses.replace(whole, threshold=tau)


def globalise_spans(credit, cfg: CreditConfig, rank: int, world_size: int, group=None) -> None:
    """Shift the share's span indices (``Credit.segment_index``, from 0 in the share) by the span count of the
    lower ranks: the whole batch's global indices in sorted (task, rollout) order (§3.5). Collective in the modes
    that segment; a no-op single-process."""
    if world_size <= 1 or not cfg.uses_distances:
        return
    seg = credit.segment_index if credit is not None else None
    count = int(seg.max()) + 1 if seg is not None and seg.numel() else 0
    counts = torch.cat(all_gather_tensors(torch.tensor([max(count, 0)]), world_size, group)).tolist()
    offset = sum(counts[:rank])
    if seg is not None and offset:
        credit.segment_index = torch.where(seg >= 0, seg + offset, seg)
