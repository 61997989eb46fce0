"""Adjacent profile distances and the batch threshold: reference, core, spec cases 24-26.

Legend: M = turns, P[target, source] profiles, B[source, target] eligibility.
"""

from __future__ import annotations

import math

import pytest
import torch
from alignopsd.kernels import (
    DISTANCES,
    batch_threshold,
    boundary_scores,
    boundary_scores_blocks,
    sibling_topk,
)
from kernel_helpers import IMPLS, assert_three_way
from test_sibling_topk import make_batch

import alignopsd
from alignopsd.testing import boundary_scores_ref


def _profiles(seed=0, gamma=0.3, dtype=torch.float32):
    te, st, task, roll, turn, sv, tv = make_batch(seed=seed, tasks=2, rollouts=4, turns=5, dtype=dtype)
    out = sibling_topk(te, st, task, roll, turn, sv, tv, gamma=gamma, top_k=3, impl="torch")
    return out, task, roll, turn


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("distance", DISTANCES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_and_core(impl, distance, dtype):
    out, task, roll, turn = _profiles(seed=1)
    P = out.P.to(dtype)
    d, bv = boundary_scores(P, out.profile_valid, out.eligible, task, roll, turn, distance=distance, impl=impl)
    d_ref, bv_ref = boundary_scores_ref(P.float(), out.profile_valid, out.eligible, task, roll, turn, distance=distance)
    assert bv.sum() > 3 and torch.equal(bv, bv_ref)
    assert d.dtype == torch.float32 and (d[~bv] == 0).all()
    # plain torch on the same-dtype rows (the straightforward formula, evaluated in `dtype`)
    plain = torch.zeros_like(d)
    for k in bv.nonzero().flatten().tolist():
        prev = ((task == task[k]) & (roll == roll[k]) & (turn < turn[k])).nonzero().flatten()
        p, q = P[prev[turn[prev].argmax()]], P[k]
        if distance == "jsd":
            m = (p + q) / 2
            t = torch.special.xlogy(p, p).sum() + torch.special.xlogy(q, q).sum()
            plain[k] = ((0.5 * t - torch.special.xlogy(m, m).sum()) / math.log(2)).clamp(0, 1).float()
        elif distance == "entropy":
            diff = torch.special.xlogy(p, p).sum() - torch.special.xlogy(q, q).sum()
            plain[k] = (diff.abs() / math.log(len(task))).float()
        else:
            plain[k] = (1 - (p @ q) / (p.norm() * q.norm())).clamp(0, 1).float()
    assert_three_way(d, plain, d_ref, atol=2e-6, name=distance)
    d_core, bv_core = alignopsd.boundary_scores(
        P.float(), out.profile_valid, out.eligible, task, roll, turn, distance=distance
    )
    assert torch.equal(bv, bv_core)
    torch.testing.assert_close(d, d_core, atol=2e-6, rtol=1e-5)
    # the block fast path gives the same numbers
    d_b, bv_b = boundary_scores_blocks(
        out.P_BTS.to(dtype), out.E_BTS, out.profile_valid, out.blocks, distance=distance, impl=impl
    )
    assert torch.equal(bv_b, bv)
    torch.testing.assert_close(d_b, d, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_spec_case24_distance_values(impl):
    """§6 case 24: JSD 0 on equal, 1 on disjoint, symmetric; entropy uniform(4) vs spike = 1; cosine = 1."""
    task = torch.zeros(4, dtype=torch.long)
    roll = torch.zeros(4, dtype=torch.long)
    turn = torch.arange(4)
    E = torch.zeros(4, 4, dtype=torch.bool)
    valid = torch.ones(4, dtype=torch.bool)
    P = torch.tensor([[0.25] * 4, [0.25] * 4, [1.0, 0, 0, 0], [0, 1.0, 0, 0]])
    d, bv = boundary_scores(P, valid, E, task, roll, turn, distance="jsd", impl=impl)
    assert bv.tolist() == [False, True, True, True]
    assert d[1] == 0 and abs(float(d[3]) - 1.0) < 1e-6
    # uniform(4) vs spike: JSD = (H(m) - (H(p) + H(q)) / 2) / ln 2 with m = (5/8, 1/8, 1/8, 1/8)
    h_m = -(5 / 8) * math.log(5 / 8) - 3 * (1 / 8) * math.log(1 / 8)
    assert abs(float(d[2]) - (h_m - 0.5 * math.log(4)) / math.log(2)) < 1e-6
    d_rev, _ = boundary_scores(P.flip(0), valid, E, task, roll, turn, distance="jsd", impl=impl)
    d_fwd, _ = boundary_scores(P, valid, E, task, roll, turn, distance="jsd", impl=impl)
    torch.testing.assert_close(d_rev[1:].flip(0), d_fwd[1:])  # symmetric
    d_ent, _ = boundary_scores(P, valid, E, task, roll, turn, distance="entropy", impl=impl)
    assert abs(float(d_ent[2]) - 1.0) < 1e-6  # ln 4 / ln M with M = 4
    d_cos, _ = boundary_scores(P, valid, E, task, roll, turn, distance="cosine", impl=impl)
    assert abs(float(d_cos[3]) - 1.0) < 1e-6


@pytest.mark.parametrize("impl", IMPLS)
def test_spec_case25_structural_change_blocks_boundaries(impl):
    """§6 case 25: one-hot profiles, validity [T, T, F], identity structural mask -> no valid boundary."""
    P = torch.eye(3)
    d, bv = boundary_scores(
        P, torch.tensor([True, True, False]), torch.eye(3, dtype=torch.bool),
        torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), torch.arange(3), impl=impl,
    )  # fmt: skip
    assert not bv.any() and (d == 0).all()


def test_spec_case26_threshold():
    d = torch.tensor([0.0, 0.001, 0.5, 0.9])
    bv = torch.tensor([False, True, True, True])
    assert batch_threshold(d, bv, quantile=0.5) == pytest.approx(0.10)
    assert batch_threshold(d, torch.zeros(4, dtype=torch.bool)) == math.inf
    # interpolation inside the clip range
    d2 = torch.tensor([0.02, 0.04, 0.06, 0.08])
    assert batch_threshold(d2, torch.ones(4, dtype=torch.bool), quantile=0.5) == pytest.approx(0.05)
    out, task, roll, turn = _profiles(seed=2)
    dd, vv = boundary_scores(out.P, out.profile_valid, out.eligible, task, roll, turn)
    for q in (0.2, 0.8):
        assert batch_threshold(dd, vv, quantile=q, tau_min=0.0, tau_max=1.0) == pytest.approx(
            alignopsd.segmentation_threshold(dd, vv, quantile=q, tau_min=0.0, tau_max=1.0)
        )


def test_first_turn_is_never_a_boundary_and_order_invariance():
    out, task, roll, turn = _profiles(seed=3)
    d, bv = boundary_scores(out.P, out.profile_valid, out.eligible, task, roll, turn)
    first = turn == 0
    assert not bv[first].any()
    perm = torch.randperm(task.numel(), generator=torch.Generator().manual_seed(0))
    d2, bv2 = boundary_scores(
        out.P[perm][:, perm], out.profile_valid[perm], out.eligible[perm][:, perm], task[perm], roll[perm], turn[perm]
    )
    assert torch.equal(bv2, bv[perm])
    torch.testing.assert_close(d2, d[perm])


def test_validation():
    out, task, roll, turn = _profiles(seed=4)
    args = (out.P, out.profile_valid, out.eligible, task, roll, turn)
    with pytest.raises(ValueError, match="distance"):
        boundary_scores(*args, distance="kl")
    with pytest.raises(ValueError, match="P"):
        boundary_scores(out.P[:-1], *args[1:])
    bad = out.P.clone()
    i = int((task != task[0]).nonzero()[0, 0])
    bad[0, i] = 0.5
    with pytest.raises(ValueError, match="P"):
        boundary_scores(bad, *args[1:])
    with pytest.raises(ValueError, match="profile_valid"):
        boundary_scores(out.P, out.profile_valid.long(), *args[2:])
    dup = turn.clone()
    same = ((task == task[0]) & (roll == roll[0])).nonzero().flatten()
    dup[same[1]] = dup[same[0]]
    with pytest.raises(ValueError, match="turn"):
        boundary_scores(*args[:5], dup)
    with pytest.raises(ValueError, match="tau_max"):
        batch_threshold(torch.zeros(3), torch.ones(3, dtype=torch.bool), tau_min=0.5, tau_max=0.1)
    with pytest.raises(ValueError, match="quantile"):
        batch_threshold(torch.zeros(3), torch.ones(3, dtype=torch.bool), quantile=1.5)
