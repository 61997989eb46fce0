"""Fast paths of the kernels' torch code against the general ones: in the selection, the regular block
layout (every task G rollouts of L turns) and the padded per-rollout view against scatter-reduces; the
boundary sums of the compacted valid rows against the dense entry and the reference; the finiteness check and
selection_lists."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from alignopsd.kernels import (
    DISTANCES,
    boundary_scores,
    boundary_scores_blocks,
    boundary_scores_rows,
    profile_rows,
    selection_lists,
    sibling_topk,
    sibling_topk_from_similarity,
)
from alignopsd.kernels import blocks as layout
from m1_oracle import sibling_topk_ref
from test_sibling_topk import make_batch

import alignopsd
from alignopsd.testing import boundary_scores_ref

# the modules (the package exports functions of the same names)
sibling_mod = importlib.import_module("alignopsd.kernels.sibling_topk")
jsd_mod = importlib.import_module("alignopsd.kernels.jsd_boundary")


def regular_batch(*, tasks=3, rollouts=4, turns=5, dim=8, seed=0, ties=True):
    """Shuffled turns of a regular layout; with ``ties`` the embeddings are copies of three prototypes."""
    g = torch.Generator().manual_seed(seed)
    task = torch.arange(tasks).repeat_interleave(rollouts * turns) * 5 + 2
    roll = torch.arange(rollouts).repeat_interleave(turns).repeat(tasks) * 3 + 1
    turn = torch.arange(turns).repeat(tasks * rollouts) * 2
    M = task.numel()
    perm = torch.randperm(M, generator=g)
    protos = torch.nn.functional.normalize(torch.randn(3, dim, generator=g), dim=1)

    def emb():
        e = protos[torch.randint(0, 3, (M,), generator=g)]
        if not ties:
            e = torch.nn.functional.normalize(e + 0.5 * torch.randn(M, dim, generator=g), dim=1)
        return e

    sv = torch.rand(M, generator=g) > 0.2
    tv = torch.rand(M, generator=g) > 0.2
    return emb(), emb(), task[perm], roll[perm], turn[perm], sv, tv


def _general(blocks):
    return dataclasses.replace(blocks, rollout_len=0)


def test_rollout_len_detects_the_regular_layout():
    _, _, task, roll, turn, _, _ = regular_batch(tasks=2, rollouts=3, turns=4)
    assert layout.task_blocks(task, roll, turn).rollout_len == 4
    # one turn fewer in one rollout, or one task with an extra rollout: general layout
    keep = torch.ones(task.numel(), dtype=torch.bool)
    keep[((task == task[0]) & (roll == roll[0]) & (turn == turn.max())).nonzero()[0]] = False
    assert layout.task_blocks(task[keep], roll[keep], turn[keep]).rollout_len == 0
    more = torch.arange(4) * 2
    t2 = torch.cat([task, torch.full((4,), int(task[0]))])
    r2 = torch.cat([roll, torch.full((4,), 99)])
    assert layout.task_blocks(t2, r2, torch.cat([turn, more])).rollout_len == 0
    # all rollouts L long but tasks of different rollout counts: not regular either
    t3 = torch.cat([task, torch.full((4,), 1000)])
    assert (
        layout.task_blocks(t3, torch.cat([roll, torch.zeros(4, dtype=torch.long)]), torch.cat([turn, more])).rollout_len
        == 0
    )
    assert layout.task_blocks(torch.tensor([0, 0]), torch.tensor([0, 1]), torch.tensor([0, 0])).rollout_len == 1


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("top_k", [1, 2, 6])
@pytest.mark.parametrize("ties", [True, False])
def test_regular_fast_path_equals_general_path_and_reference(monkeypatch, seed, top_k, ties):
    te, st, task, roll, turn, sv, tv = regular_batch(seed=seed, ties=ties)
    kw = dict(gamma=0.1, top_k=top_k, profile_temperature=0.1, impl="torch")
    fast = sibling_topk(te, st, task, roll, turn, sv, tv, **kw)
    assert fast.blocks.rollout_len == 5
    real = layout.task_blocks
    monkeypatch.setattr(sibling_mod, "task_blocks", lambda *a: _general(real(*a)))
    slow = sibling_topk(te, st, task, roll, turn, sv, tv, **kw)
    assert slow.blocks.rollout_len == 0
    for name in ("selected", "profile_valid", "H_BTS", "E_BTS", "P_BTS"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name
    if ties:
        vals = fast.H[fast.eligible & (fast.H >= 0.1)]
        assert vals.numel() > vals.unique().numel()
    ref = sibling_topk_ref(te, st, task, roll, turn, sv, tv, gamma=0.1, top_k=top_k)
    assert torch.equal(fast.selected, ref.selected)
    assert torch.equal(fast.profile_valid, ref.profile_valid)
    torch.testing.assert_close(fast.P, ref.P, atol=1e-6, rtol=1e-5)
    core = alignopsd.select_sources(fast.H, fast.eligible, task, roll, turn, gamma=0.1, top_k=top_k)
    assert fast.selected_lists() == core
    # from a precomputed similarity: both layouts, with and without profiles
    for profiles in (True, False):
        got = []
        for blocks_fn in (real, lambda *a: _general(real(*a))):
            monkeypatch.setattr(sibling_mod, "task_blocks", blocks_fn)
            got.append(
                sibling_topk_from_similarity(
                    fast.H, fast.eligible, task, roll, turn, gamma=0.1, top_k=top_k, profiles=profiles, impl="torch"
                )
            )
        assert [g.blocks.rollout_len for g in got] == [5, 0]
        for g in got:
            assert torch.equal(g.selected, fast.selected) and torch.equal(g.profile_valid, fast.profile_valid)
            if profiles:
                assert torch.equal(g.P_BTS, fast.P_BTS)


@pytest.mark.parametrize("seed", [2, 3, 4])
@pytest.mark.parametrize("top_k", [1, 3, 7])
@pytest.mark.parametrize("ties", [True, False])
def test_uneven_padded_path_equals_scatter_path_and_reference(monkeypatch, seed, top_k, ties):
    """Uneven rollouts and task sizes: per-rollout maxima on the padded [G, Lp] view against scatter-reduces."""
    te, st, task, roll, turn, sv, tv = make_batch(seed=seed, ties=ties, tasks=3, rollouts=5, turns=6)
    kw = dict(gamma=0.2, top_k=top_k, profile_temperature=0.1, impl="torch")
    got = {}
    for path, pad_max in (("padded", 2.0), ("scatter", 0.0)):
        monkeypatch.setattr(sibling_mod, "_PAD_MAX", pad_max)
        assert (sibling_mod._rollout_layout(layout.task_blocks(task, roll, turn)).pad_idx is not None) == (
            path == "padded"
        )
        got[path] = [
            sibling_topk(te, st, task, roll, turn, sv, tv, **kw),
            sibling_topk_from_similarity(
                *(lambda r: (r.H, r.eligible))(sibling_topk(te, st, task, roll, turn, sv, tv, **kw)),
                task, roll, turn, gamma=0.2, top_k=top_k, impl="torch",
            ),
        ]  # fmt: skip
    for a, b in zip(got["padded"], got["scatter"]):
        for name in ("selected", "profile_valid", "H_BTS", "E_BTS", "P_BTS"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    out = got["padded"][0]
    assert out.blocks.rollout_len == 0 and bool((~out.blocks.member_TN).any())  # uneven and padded blocks
    if ties:
        vals = out.H[out.eligible & (out.H >= 0.2)]
        assert vals.numel() > vals.unique().numel()
    ref = sibling_topk_ref(te, st, task, roll, turn, sv, tv, gamma=0.2, top_k=top_k)
    assert torch.equal(out.selected, ref.selected) and torch.equal(out.profile_valid, ref.profile_valid)
    assert out.selected_lists() == alignopsd.select_sources(
        out.H, out.eligible, task, roll, turn, gamma=0.2, top_k=top_k
    )


@pytest.mark.parametrize("distance", DISTANCES)
@pytest.mark.parametrize("layout", ["regular", "uneven"])
def test_boundary_rows_path_equals_blocks_path(monkeypatch, distance, layout):
    """The torch path scores the valid rows: from the dense blocks (boundary_scores_blocks, compacted or on all
    rows) and from profile_rows with its log-softmax sum p log p (boundary_scores_rows, the allocator's call) it
    agrees with the dense entry and the loop reference, also where a changed eligibility row removes boundaries."""
    if layout == "regular":
        te, st, task, roll, turn, sv, tv = regular_batch(seed=3, ties=False, tasks=2, rollouts=3, turns=6)
    else:
        te, st, task, roll, turn, sv, tv = make_batch(seed=3, ties=False, tasks=3, rollouts=4, turns=5)
    out = sibling_topk(te, st, task, roll, turn, sv, tv, gamma=0.1, top_k=2, impl="torch")
    assert (out.blocks.rollout_len > 0) == (layout == "regular")
    assert bool((~out.profile_valid).any())  # some rows are left out of the compacted profiles
    pr = profile_rows(out.H_BTS, out.E_BTS, gamma=0.1, temperature=0.1, impl="torch")
    valid_R = pr.valid_BT.reshape(-1)
    assert torch.equal(pr.valid_BT[out.blocks.block_M, out.blocks.slot_M], out.profile_valid)
    N = out.P_BTS.shape[1]
    assert torch.equal(pr.P_VN, out.P_BTS.reshape(-1, N)[valid_R])
    torch.testing.assert_close(pr.negent_V, torch.special.xlogy(pr.P_VN, pr.P_VN).sum(1), atol=2e-6, rtol=0)
    E2 = out.E_BTS.clone()
    b, t = 0, 1  # slot 1 of block 0 (rollout 0, turn 1) and its neighbours: not boundaries once its row differs
    E2[b, t] = ~E2[b, t]
    got = {}
    for E in (out.E_BTS, E2):
        monkeypatch.setattr(jsd_mod, "_COMPACT_BELOW", 0.0)  # all rows, as views
        d_all, bv_all = boundary_scores_blocks(out.P_BTS, E, out.profile_valid, out.blocks, distance=distance)
        monkeypatch.setattr(jsd_mod, "_COMPACT_BELOW", 2.0)  # the valid rows, compacted
        d, bv = boundary_scores_blocks(out.P_BTS, E, out.profile_valid, out.blocks, distance=distance, impl="torch")
        assert torch.equal(bv, bv_all) and torch.equal(d, d_all)
        d_r, bv_r = boundary_scores_rows(
            pr.P_VN, pr.valid_BT, E, out.blocks, negent_V=pr.negent_V, distance=distance, impl="torch"
        )
        assert torch.equal(bv, bv_r)
        torch.testing.assert_close(d, d_r, atol=1e-6, rtol=0)
        got[E is E2] = d, bv
    (d, bv), (_, bv2) = got[False], got[True]
    assert bv.sum() > 3
    d_dense, bv_dense = boundary_scores(out.P, out.profile_valid, out.eligible, task, roll, turn, distance=distance)
    assert torch.equal(bv, bv_dense)
    torch.testing.assert_close(d, d_dense, atol=1e-7, rtol=0)
    d_ref, bv_ref = boundary_scores_ref(out.P, out.profile_valid, out.eligible, task, roll, turn, distance=distance)
    assert torch.equal(bv, bv_ref)
    torch.testing.assert_close(d, d_ref, atol=2e-6, rtol=0)
    assert not bv2[out.blocks.idx_TN[b, t]] and not bv2[out.blocks.idx_TN[b, t + 1]]
    assert not (bv2 & ~bv).any()  # the changed row only removes boundaries
    with pytest.raises(ValueError, match="P_VN"):
        boundary_scores_rows(pr.P_VN[1:], pr.valid_BT, out.E_BTS, out.blocks, distance=distance, impl="torch")


def test_all_finite_sum_shortcut_and_fallback():
    big = torch.full((4,), 3.0e38)  # finite entries whose sum overflows: the elementwise fallback decides
    assert layout.all_finite(big) and layout.all_finite(torch.zeros(0)) and layout.all_finite(torch.ones(3, 2))
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.ones(5, 3)
        x[2, 1] = bad
        assert not layout.all_finite(x) and not layout.all_finite(x.bfloat16())
    x = torch.tensor([float("inf"), -float("inf")])  # sum NaN
    assert not layout.all_finite(x)


def test_regular_single_turn_rollouts_have_no_boundaries():
    te, st, task, roll, turn, sv, tv = regular_batch(seed=4, tasks=2, rollouts=3, turns=1)
    out = sibling_topk(te, st, task, roll, turn, sv, tv, gamma=0.1, top_k=2, impl="torch")
    assert out.blocks.rollout_len == 1
    for distance in DISTANCES:
        d, bv = boundary_scores_blocks(out.P_BTS, out.E_BTS, out.profile_valid, out.blocks, distance=distance)
        assert not bv.any() and not d.any()


def test_selection_lists_trailing_and_inner_padding():
    sel = torch.tensor([[4, 2, -1], [-1, -1, -1], [7, 8, 9], [3, -1, 5]])
    assert selection_lists(sel) == [[4, 2], [], [7, 8, 9], [3, 5]]
    assert selection_lists(sel[:3]) == [[4, 2], [], [7, 8, 9]]
    assert selection_lists(sel[:, :1]) == [[4], [], [7], [3]]
    assert selection_lists(torch.zeros(0, 2, dtype=torch.long)) == []
