"""Sibling top-K: against the loop reference, the core's select_sources / correspondence_profiles, spec cases.

Legend: M = turns, D = embedding size (33: odd on purpose), K = top_k.
"""

from __future__ import annotations

import math

import pytest
import torch
from alignopsd.kernels import selection_lists, sibling_topk
from kernel_helpers import IMPLS, assert_three_way
from m1_oracle import sibling_topk_ref

import alignopsd

D = 33


def make_batch(*, tasks=3, rollouts=4, turns=5, dim=D, ties=True, seed=0, dtype=torch.float32):
    """Shuffled turns of several tasks of different sizes; rollouts of uneven length; some invalid thinking.

    With ``ties`` many embeddings are exact copies of a few prototypes, so equal H values occur
    within and across rollouts (the identity tie-break decides).
    """
    g = torch.Generator().manual_seed(seed)
    task, roll, turn = [], [], []
    for a in range(tasks):
        for r in range(rollouts - (a % 2)):  # tasks of different sizes: padded blocks
            for u in range(turns - (r % 2)):
                task.append(10 * a + 7)
                roll.append(3 * r + (a % 2))
                turn.append(u)
    M = len(task)
    perm = torch.randperm(M, generator=g)
    ids = [torch.tensor(x)[perm] for x in (task, roll, turn)]
    protos = torch.randn(4, dim, generator=g)
    noise = 0.0 if ties else 1.0

    def emb():
        e = protos[torch.randint(0, 4, (M,), generator=g)]
        jitter = torch.randn(M, dim, generator=g) * 0.4
        keep = (torch.rand(M, 1, generator=g) < 0.5) if ties else torch.ones(M, 1, dtype=torch.bool)
        e = e + jitter * keep * (1 if ties else noise)
        return (e / e.norm(dim=1, keepdim=True)).to(dtype)

    te, st = emb(), emb()
    sv = torch.rand(M, generator=g) > 0.15
    tv = torch.rand(M, generator=g) > 0.15
    return te, st, *ids, sv, tv


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_three_way(impl, dtype):
    te, st, task, roll, turn, sv, tv = make_batch(dtype=dtype, seed=1)
    out = sibling_topk(te, st, task, roll, turn, sv, tv, gamma=0.3, top_k=3, profile_temperature=0.1, impl=impl)
    ref = sibling_topk_ref(te.float(), st.float(), task, roll, turn, sv, tv, gamma=0.3, top_k=3)
    # plain torch in the inputs' dtype: the same-dtype leg of the three-way check
    plain_H = (te @ st.T).clamp(-1, 1).float() * (task[:, None] == task[None, :]) * (sv[:, None] & tv[None, :])
    assert_three_way(out.H, plain_H, ref.H, atol=1e-6, name="H")
    assert torch.equal(out.eligible, ref.eligible)
    assert out.selected.shape == (te.shape[0], 3) and out.selected.dtype == torch.long
    # selections and profiles follow the kernel's own H exactly: compare against the core on that H
    assert out.selected_lists() == alignopsd.select_sources(out.H, out.eligible, task, roll, turn, gamma=0.3, top_k=3)
    P_core, valid_core = alignopsd.correspondence_profiles(out.H, out.eligible, gamma=0.3, temperature=0.1)
    torch.testing.assert_close(out.P, P_core, atol=1e-6, rtol=1e-5)
    assert torch.equal(out.profile_valid, valid_core)
    if dtype == torch.float32:
        assert torch.equal(out.selected, ref.selected)
        torch.testing.assert_close(out.P, ref.P, atol=1e-6, rtol=1e-5)
        assert torch.equal(out.profile_valid, ref.profile_valid)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed", [2, 3])
@pytest.mark.parametrize("top_k", [1, 2, 5])
def test_selection_equals_core_select_sources_with_ties(impl, seed, top_k):
    te, st, task, roll, turn, sv, tv = make_batch(seed=seed, ties=True, tasks=2, rollouts=5, turns=4)
    out = sibling_topk(te, st, task, roll, turn, sv, tv, gamma=0.2, top_k=top_k, impl=impl)
    H = out.H
    # ties really occur among eligible candidates
    vals = H[out.eligible & (H >= 0.2)]
    assert vals.numel() > vals.unique().numel()
    core = alignopsd.select_sources(H, out.eligible, task, roll, turn, gamma=0.2, top_k=top_k)
    assert out.selected_lists() == core
    assert selection_lists(out.selected) == core


@pytest.mark.parametrize("impl", IMPLS)
def test_spec_case9_selection(impl):
    """§6 case 9: sources (a,0) .80, (a,1) .95, (b,0) .90, (c,0) .90 for target 3 -> (1, 2)."""
    hs = [0.80, 0.95, 0.90, 0.90]
    te = torch.tensor([[h, math.sqrt(1 - h * h)] for h in hs] + [[1.0, 0.0]])
    st = torch.tensor([[0.0, 1.0]] * 3 + [[1.0, 0.0]] + [[0.0, 1.0]])
    task = torch.zeros(5, dtype=torch.long)
    roll = torch.tensor([0, 0, 1, 2, 3])  # rollouts a, a, b, c, d
    turn = torch.tensor([0, 1, 0, 0, 0])
    valid = torch.tensor([True, True, True, True, False])  # turn 4's teacher thinking is invalid
    out = sibling_topk(te, st, task, roll, turn, valid, torch.ones(5, dtype=torch.bool), gamma=0.7, top_k=2, impl=impl)
    assert out.selected_lists()[3] == [1, 2]
    # turn 3 is in rollout c: its own rollout is excluded
    assert not out.eligible[3, 3] and out.eligible[2, 3] and not out.eligible[4, 3]


@pytest.mark.parametrize("impl", IMPLS)
def test_spec_case7_structural_mask(impl):
    """§6 case 7: identities (a,1,0), (a,1,1), (a,2,0), (b,3,0); student validity [1,1,1,0]."""
    task = torch.tensor([0, 0, 0, 1])
    roll = torch.tensor([1, 1, 2, 3])
    turn = torch.tensor([0, 1, 0, 0])
    e = torch.nn.functional.normalize(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), dim=1)
    tv = torch.tensor([True, True, True, False])
    B = sibling_topk(
        e, e, task, roll, turn, torch.ones(4, dtype=torch.bool), tv, gamma=0.5, top_k=2, impl=impl
    ).eligible
    assert B[2, 0] and B[2, 1] and B[0, 2] and B[1, 2]
    assert not B[0, 1]
    assert not B[:, 3].any() and not B[3].any()


@pytest.mark.parametrize("impl", IMPLS)
def test_spec_case23_and_35_profiles(impl):
    """§6 case 23: H column 2 = [.6, .9, 0] -> P[2] = [0.04743, 0.95257, 0], valid [F, F, T]; case 35."""
    te = torch.tensor([[0.6, 0.8, 0.0], [0.9, math.sqrt(1 - 0.81), 0.0], [0.0, 1.0, 0.0]])
    st = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])  # H = 0 outside column 2
    task = torch.zeros(3, dtype=torch.long)
    roll = torch.tensor([0, 1, 2])
    turn = torch.zeros(3, dtype=torch.long)
    ok = torch.ones(3, dtype=torch.bool)
    out = sibling_topk(te, st, task, roll, turn, ok, ok, gamma=0.7, top_k=3, impl=impl)
    torch.testing.assert_close(out.P[2], torch.tensor([0.04743, 0.95257, 0.0]), atol=1e-5, rtol=0)
    assert out.profile_valid.tolist() == [False, False, True]
    # case 35: two single-turn rollouts with off-diagonal H = .8
    te2 = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    st2 = torch.tensor([[0.8, 0.6], [0.8, 0.6]])
    out2 = sibling_topk(
        te2, st2, torch.zeros(2, dtype=torch.long), torch.tensor([0, 1]), torch.zeros(2, dtype=torch.long),
        ok[:2], ok[:2], gamma=0.7, top_k=1, impl=impl,
    )  # fmt: skip
    torch.testing.assert_close(out2.H, torch.full((2, 2), 0.8), atol=1e-6, rtol=0)
    torch.testing.assert_close(out2.P, torch.tensor([[0.0, 1.0], [1.0, 0.0]]))


def test_invalid_embeddings_give_zero_similarity():
    te, st, task, roll, turn, sv, tv = make_batch(seed=4)
    out = sibling_topk(te, st, task, roll, turn, sv, tv, gamma=0.3, top_k=2, impl="torch")
    assert (out.H[~sv] == 0).all() and (out.H[:, ~tv] == 0).all()
    assert (out.H[task[:, None] != task[None, :]] == 0).all()
    assert (out.P[~tv] == 0).all()


def test_validation_names_the_argument():
    te, st, task, roll, turn, sv, tv = make_batch(seed=5)
    kw = dict(gamma=0.5, top_k=2)
    with pytest.raises(ValueError, match="top_k"):
        sibling_topk(te, st, task, roll, turn, sv, tv, gamma=0.5, top_k=0)
    with pytest.raises(ValueError, match="gamma"):
        sibling_topk(te, st, task, roll, turn, sv, tv, gamma=float("nan"), top_k=2)
    with pytest.raises(ValueError, match="student_emb"):
        sibling_topk(te, st[:, :5], task, roll, turn, sv, tv, **kw)
    with pytest.raises(ValueError, match="source_valid"):
        sibling_topk(te, st, task, roll, turn, sv.long(), tv, **kw)
    with pytest.raises(ValueError, match="turn"):
        dup = turn.clone()
        same = ((task == task[0]) & (roll == roll[0])).nonzero().flatten()
        dup[same[1]] = dup[same[0]]
        sibling_topk(te, st, task, roll, dup, sv, tv, **kw)
    with pytest.raises(ValueError, match="teacher_emb"):
        bad = te.clone()
        bad[0, 0] = float("nan")
        sibling_topk(bad, st, task, roll, turn, sv, tv, **kw)
    with pytest.raises(ValueError, match="profile_temperature"):
        sibling_topk(te, st, task, roll, turn, sv, tv, profile_temperature=0.0, **kw)
