"""A batch allocated in shares (whole tasks each, as data-parallel ranks hold them) with the whole batch's
statistics (``WholeBatch``) gets exactly the spans, budgets and token advantages of the whole batch (§3.3-§3.5,
§3.11 D); the share's threshold population comes from ``valid_distances``."""

from __future__ import annotations

import math

import pytest
import torch
from alignopsd.kernels import boundary_scores_rows
from alignopsd.kernels.blocks import blocks_from_order
from test_credit import make_batch

from alignopsd.advantage import build_turn_index
from alignopsd.credit import CreditConfig, WholeBatch, allocate_credit
from alignopsd.profiles import segmentation_threshold, valid_distances

FIELDS = ("token_advantage", "segment_index", "boundary_kind", "boundary_distance", "boundary_valid", "raw_density",
          "density", "turn_weight", "advantage", "residual")  # fmt: skip


def _batch(seed: int):
    """12 trajectories of 1-29 turns, 3 per task, tasks 0-3; H in [0, 1] inside a task."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 30, (12,), generator=g).tolist()
    b = make_batch(lengths, tasks=[i // 3 for i in range(12)], seed=seed)
    b["H"] = b["H"] * 0.5 + 0.5 * (b["task"][:, None] == b["task"][None, :])
    b["invalid"] = torch.rand(b["task"].numel(), generator=g) < 0.2
    return b


def _shares(b, groups):
    out = []
    for tasks in groups:
        idx = torch.nonzero(torch.isin(b["task"], torch.tensor(tasks))).flatten()
        out.append((idx, {k: (v[idx][:, idx] if k in ("H", "eligible") else v[idx]) for k, v in b.items()}))
    return out


def _whole_batch_of(b, shares, cfg):
    """One WholeBatch per share, as the engine gathers it: sizes, then the threshold of the pooled distances."""
    m = b["task"].numel()
    width = build_turn_index(b["task"], b["rollout"]).largest_task_turns
    firsts = [0]
    for _, s in shares[:-1]:
        firsts.append(firsts[-1] + build_turn_index(s["task"], s["rollout"]).num_trajectories)
    keys = ("task", "rollout", "turn", "H", "eligible")
    pool = torch.cat([valid_distances(*(s[k] for k in keys), cfg, whole_batch=WholeBatch(m, width)) for _, s in shares])
    ones = torch.ones_like(pool, dtype=torch.bool)
    tau = segmentation_threshold(pool, ones, quantile=cfg.quantile, tau_min=cfg.tau_min, tau_max=cfg.tau_max)
    return [WholeBatch(m, width, first, tau) for first in firsts]


@pytest.mark.parametrize(
    "mode, distance", [("adaptive", "jsd"), ("adaptive", "entropy"), ("adaptive", "cosine"), ("random", "jsd")]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_shares_with_whole_batch_statistics_equal_the_whole_batch(mode, distance, seed):
    b = _batch(seed)
    cfg = CreditConfig(mode=mode, distance=distance, gamma=0.7, seed=5, tau_max=1.0)
    whole = allocate_credit(**b, config=cfg)
    shares = _shares(b, ([0, 1], [2], [3]))
    spans = 0
    for (idx, s), wb in zip(shares, _whole_batch_of(b, shares, cfg)):
        assert wb.threshold == whole.threshold
        part = allocate_credit(**s, config=cfg, whole_batch=wb)
        assert part.threshold == whole.threshold and part.metrics["m2/segmentation_threshold"] == whole.threshold
        part.segment_index += spans  # span indices count from 0 in a share
        spans = int(part.segment_index.max()) + 1
        for name in FIELDS:
            assert torch.equal(getattr(part, name), getattr(whole, name)[idx]), name


def test_each_statistic_matters():
    """Without the whole batch's block width the distances move in the last bits; without its M the entropy
    distances scale; without the trajectory offset the random spans change; alone the threshold differs."""
    cfg = CreditConfig(gamma=0.7, tau_max=1.0)
    width_moves = False
    for seed in range(4):
        b = _batch(seed)
        whole = allocate_credit(**b, config=cfg)
        shares = _shares(b, ([0, 1], [2, 3]))
        for (idx, s), wb in zip(shares, _whole_batch_of(b, shares, cfg)):
            local = build_turn_index(s["task"], s["rollout"]).largest_task_turns
            narrow = allocate_credit(**s, config=cfg, whole_batch=WholeBatch(wb.turns, local, 0, wb.threshold))
            width_moves |= not torch.equal(narrow.boundary_distance, whole.boundary_distance[idx])
    assert width_moves

    b = _batch(0)
    shares = _shares(b, ([0, 1], [2, 3]))
    wb = _whole_batch_of(b, shares, cfg)[0]
    idx, s = shares[0]
    assert allocate_credit(**s, config=cfg).threshold != wb.threshold
    ent = CreditConfig(gamma=0.7, distance="entropy", tau_max=1.0)
    d_whole = allocate_credit(**s, config=ent, whole_batch=WholeBatch(wb.turns, wb.block_width, 0, 0.05))
    d_share = allocate_credit(**s, config=ent, whole_batch=WholeBatch(idx.numel(), wb.block_width, 0, 0.05))
    ratio = d_share.boundary_distance[d_share.boundary_valid] / d_whole.boundary_distance[d_whole.boundary_valid]
    assert torch.allclose(ratio, torch.full_like(ratio, math.log(wb.turns) / math.log(idx.numel())))
    rnd = CreditConfig(gamma=0.7, mode="random", min_span_turns=2, max_span_turns=3)
    first = allocate_credit(**s, config=rnd, whole_batch=WholeBatch(wb.turns, wb.block_width, 0, 0.05))
    later = allocate_credit(**s, config=rnd, whole_batch=WholeBatch(wb.turns, wb.block_width, 7, 0.05))
    assert not torch.equal(first.boundary_kind, later.boundary_kind)


def test_whole_batch_bad_input():
    b = _batch(0)
    s = _shares(b, ([0], [1, 2, 3]))[0][1]
    m = s["task"].numel()
    for kwargs, name in [
        (dict(turns=0, block_width=1), "whole_batch.turns"),
        (dict(turns=5, block_width=6), "whole_batch.block_width"),
        (dict(turns=5, block_width=2, trajectory_offset=-1), "whole_batch.trajectory_offset"),
        (dict(turns=5, block_width=2, threshold=math.nan), "whole_batch.threshold"),
        (dict(turns=True, block_width=2), "whole_batch.turns"),
    ]:
        with pytest.raises(ValueError, match=name):
            WholeBatch(**kwargs)
    cfg = CreditConfig(gamma=0.7)
    for wb, name in [
        (WholeBatch(m - 1, 1, 0, 0.05), "whole_batch.turns"),
        (WholeBatch(2 * m, 1, 0, 0.05), "whole_batch.block_width"),
        (WholeBatch(2 * m, m, 0, None), "whole_batch.threshold"),
        (WholeBatch(2 * m, m, 0, 0.5), "whole_batch.threshold"),
        (WholeBatch(2 * m, m, 0, -math.inf), "whole_batch.threshold"),
    ]:
        with pytest.raises(ValueError, match=name):
            allocate_credit(**s, config=cfg, whole_batch=wb)
    with pytest.raises(ValueError, match="whole_batch: expected a WholeBatch"):
        allocate_credit(**s, config=cfg, whole_batch={"turns": 2 * m})
    keys = ("task", "rollout", "turn", "H", "eligible")
    with pytest.raises(ValueError, match="whole_batch.block_width"):
        valid_distances(*(s[k] for k in keys), cfg, whole_batch=WholeBatch(2 * m, 1))
    # mode "turn" computes no distances: no threshold needed
    allocate_credit(**s, config=CreditConfig(mode="turn"), whole_batch=WholeBatch(2 * m, m))
    idx = build_turn_index(s["task"], s["rollout"], s["turn"])
    with pytest.raises(ValueError, match="width"):
        blocks_from_order(idx.order_M, idx.task_M, idx.traj_M, width=1)
    blocks = blocks_from_order(idx.order_M, idx.task_M, idx.traj_M)
    n = idx.largest_task_turns
    E = torch.zeros(1, n, n, dtype=torch.bool)
    with pytest.raises(ValueError, match="num_turns"):
        boundary_scores_rows(torch.zeros(0, n), torch.zeros(1, n, dtype=torch.bool), E, blocks, num_turns=m - 1)
