"""Mechanism 1: ALGORITHM.md §6 cases 7–16 and 20–22, properties and loop references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from m1_oracle import action_filter_ref, eligibility_ref, rectify_ref, select_sources_ref

from alignopsd.rectification import (
    action_filter,
    cross_inputs,
    eligibility,
    pairs_from_selection,
    parse_webshop_action,
    policy_mask,
    rectify,
    select_sources,
    similarity_matrix,
    webshop_actions_agree,
)

# ------------------------------------------------------------------------------------------------ case 7, 8


def test_case7_structural_mask():
    task = torch.tensor([0, 0, 0, 1])  # a, a, a, b
    rollout = torch.tensor([1, 1, 2, 3])
    src_valid = torch.ones(4, dtype=torch.bool)
    tgt_valid = torch.tensor([True, True, True, False])
    B = eligibility(task, rollout, src_valid, tgt_valid)
    for s, t in ((2, 0), (2, 1), (0, 2), (1, 2)):
        assert B[s, t]
    assert not B[0, 1]
    assert not B[:, 3].any()
    assert not B[3, :].any()
    assert not B.diagonal().any()
    assert torch.equal(B, eligibility_ref(task, rollout, src_valid, tgt_valid))


def test_case8_task_block_similarity():
    g = torch.Generator().manual_seed(0)
    T = torch.nn.functional.normalize(torch.randn(6, 5, generator=g), dim=1)
    S = torch.nn.functional.normalize(torch.randn(6, 5, generator=g), dim=1)
    S[4] = 0.0  # invalid student thinking
    task = torch.tensor([0, 0, 1, 1, 1, 2])
    H = similarity_matrix(T, S, task)
    dense = T @ S.T
    same = task[:, None] == task[None, :]
    torch.testing.assert_close(H[same], dense[same].clamp(-1, 1))
    assert (H[~same] == 0).all()
    assert (H[:, 4] == 0).all()
    assert not torch.allclose(H, H.T)  # not symmetric


# ------------------------------------------------------------------------------------------------ case 9


def _case9():
    # sources (a,0) .80, (a,1) .95, (b,0) .90, (c,0) .90, target 4 in rollout d
    task = torch.zeros(5, dtype=torch.long)
    rollout = torch.tensor([0, 0, 1, 2, 3])
    turn = torch.tensor([0, 1, 0, 0, 0])
    H = torch.zeros(5, 5)
    H[:4, 4] = torch.tensor([0.80, 0.95, 0.90, 0.90])
    E = torch.zeros(5, 5, dtype=torch.bool)
    E[:4, 4] = True
    return H, E, task, rollout, turn


def test_case9_selection():
    H, E, task, rollout, turn = _case9()
    sel = select_sources(H, E, task, rollout, turn, gamma=0.7, top_k=2)
    assert sel[4] == [1, 2]
    assert sel[:4] == [[], [], [], []]
    assert select_sources(H, E, task, rollout, turn, gamma=0.7, top_k=3)[4] == [1, 2, 3]
    # gamma is inclusive
    assert select_sources(H, E, task, rollout, turn, gamma=0.95, top_k=3)[4] == [1]
    # input order does not matter: permute the turns
    perm = torch.tensor([3, 0, 4, 2, 1])
    inv = torch.argsort(perm)
    sel_p = select_sources(
        H[perm][:, perm], E[perm][:, perm], task[perm], rollout[perm], turn[perm], gamma=0.7, top_k=2
    )
    assert [int(perm[i]) for i in sel_p[int(inv[4])]] == [1, 2]


# ------------------------------------------------------------------------------------------------ case 10, 13


def test_case10_no_sources_is_exact_fallback():
    g = torch.Generator().manual_seed(1)
    diag = torch.randn(3, 4, generator=g) - 2
    old = torch.randn(3, 4, generator=g) - 2
    r = rectify(
        diag, torch.zeros(0, 4), torch.zeros(0, 2, dtype=torch.long), torch.zeros(3, 3), gamma=0.7, alpha_max=0.8
    )
    assert torch.equal(r.corrected, diag)
    d_diag, d_corr = r.gaps(old)
    assert torch.equal(d_corr, diag - old)
    assert torch.equal(d_diag, diag - old)
    assert (r.alpha == 0).all() and (r.rho == 0).all()
    assert all(w.numel() == 0 for w in r.weights)
    assert not r.matched.any()


def test_case13_log_mean():
    H = torch.zeros(3, 3)
    H[0, 2], H[1, 2] = 0.8, 0.9
    diag = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-3.0, -3.0]])
    cross = torch.tensor([[-1.0, -3.0], [-3.0, -1.0]])
    pairs = torch.tensor([[0, 2], [1, 2]])
    r = rectify(diag, cross, pairs, H, gamma=0.7, alpha_max=0.2, temperature=0.1, mode="log_mean")
    torch.testing.assert_close(r.weights[2], torch.tensor([0.26894, 0.73106]), atol=1e-5, rtol=0)
    torch.testing.assert_close(r.cross_score[2], torch.tensor([-2.46212, -1.53788]), atol=1e-5, rtol=0)
    assert r.rho[2].item() == pytest.approx(0.57702, abs=1e-5)
    assert r.alpha[2].item() == pytest.approx(0.11540, abs=1e-5)
    torch.testing.assert_close(r.corrected[2], torch.tensor([-2.93793, -2.83127]), atol=1e-5, rtol=0)
    assert torch.equal(r.corrected[:2], diag[:2])


# ------------------------------------------------------------------------------------------------ case 11, 12


def test_case11_cross_inputs():
    prompts = torch.tensor([[10, 11], [20, 21], [30, 31]])
    responses = torch.tensor([[100, 101, 0], [200, 201, 202], [300, 0, 0]])
    ids, mask, pos = cross_inputs(
        prompts, torch.ones_like(prompts), responses, (responses != 0).long(), [[2, 0], [0, 1]]
    )
    assert ids.tolist() == [[30, 31, 100, 101, 0], [10, 11, 200, 201, 202]]
    assert mask.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert pos.tolist() == [[0, 1, 2, 3, 3], [0, 1, 2, 3, 4]]


def test_case22_cross_builder_left_padded():
    ids, mask, pos = cross_inputs([[0, 10, 11]], [[0, 1, 1]], [[40, 41]], [[1, 1]], [[0, 0]])
    assert ids.tolist() == [[0, 10, 11, 40, 41]]
    assert pos.tolist() == [[0, 0, 1, 2, 3]]


def test_case12_policy_mask():
    att = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    assert policy_mask(att, 3).tolist() == [[1, 1, 0], [1, 1, 1]]
    loss = torch.tensor([[0, 0, 1, 0, 0], [0, 0, 0, 1, 1]])
    assert policy_mask(att, 3, loss_mask=loss).tolist() == [[1, 0, 0], [0, 1, 1]]
    with pytest.raises(ValueError, match="response_length"):
        policy_mask(att, 0)


# ------------------------------------------------------------------------------------------------ case 15


def _case15(mode: str):
    p = torch.tensor([[0.70, 0.80, 0.95], [0.10, 0.30, 0.90], [0.50, 0.70, 0.80]], dtype=torch.float64)
    w = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    H = torch.zeros(4, 4)
    H[:3, 3] = (0.95 + 0.1 * torch.log(w)).float()
    diag = torch.log(torch.tensor([[0.38, 0.75, 0.92]] * 4))
    pairs = torch.tensor([[0, 3], [1, 3], [2, 3]])
    return rectify(diag, torch.log(p).float(), pairs, H, gamma=0.7, alpha_max=0.2, mode=mode), p, w


def test_case15_probability_mixture():
    r, p, w = _case15("probability_mixture")
    torch.testing.assert_close(r.weights[3].double(), w, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        torch.exp(r.cross_score[3]).double(), torch.tensor([0.48, 0.63, 0.905]).double(), atol=1e-5, rtol=0
    )
    student = torch.log(torch.tensor([0.40, 0.80, 0.90]))
    assert r.diag[3, 0] - student[0] < 0
    assert r.cross_score[3, 0] - student[0] > 0
    assert r.rho[3].item() == pytest.approx(0.49012, abs=1e-5)
    assert r.alpha[3].item() == pytest.approx(0.09802, abs=1e-5)


def test_case15_log_mean_shares_weights():
    rp, _, _ = _case15("probability_mixture")
    rl, _, _ = _case15("log_mean")
    assert math.exp(rl.cross_score[3, 0].item()) == pytest.approx(0.36504216, abs=1e-6)
    torch.testing.assert_close(rl.weights[3], rp.weights[3])
    assert torch.equal(rl.rho, rp.rho) and torch.equal(rl.alpha, rp.alpha)


# ------------------------------------------------------------------------------------------------ case 16


def test_case16_dtypes_and_detached():
    H = torch.zeros(3, 3)
    H[0, 2], H[1, 2] = 0.8, 0.9
    diag = torch.randn(3, 5, requires_grad=True)
    cross = torch.randn(2, 5).bfloat16()
    r = rectify(diag.bfloat16(), cross, [[0, 2], [1, 2]], H, gamma=0.7, alpha_max=0.8)
    for t in (r.corrected, r.rho, r.alpha, r.cross_score):
        assert t.dtype == torch.float32 and not t.requires_grad and torch.isfinite(t).all()
    r32 = rectify(diag, cross.float(), [[0, 2], [1, 2]], H, gamma=0.7, alpha_max=0.8)
    assert not r32.corrected.requires_grad


def test_case16_identical_sources_and_extremes():
    H = torch.zeros(4, 4)
    H[:3, 3] = torch.tensor([0.9, 0.8, 0.75])
    src = torch.tensor([-2.0, -10000.0])
    diag = torch.full((4, 2), -1.0)
    pairs = [[0, 3], [1, 3], [2, 3]]
    r = rectify(diag, src.expand(3, 2).clone(), pairs, H, gamma=0.7, alpha_max=1.0)
    assert torch.equal(r.cross_score[3], src)
    # extreme scores at a tiny temperature stay finite
    cross = torch.tensor([[-1e4, 0.0], [0.0, -1e4], [-50.0, -50.0]])
    r = rectify(diag, cross, pairs, H, gamma=0.7, alpha_max=0.8, temperature=1e-5)
    assert torch.isfinite(r.corrected).all() and torch.isfinite(r.cross_score).all()
    torch.testing.assert_close(r.weights[3], torch.tensor([1.0, 0.0, 0.0]))


def test_case16_mixture_sums_to_one_over_vocabulary():
    g = torch.Generator().manual_seed(3)
    V, k = 11, 3
    logits = torch.randn(k, V, generator=g, dtype=torch.float64)
    logp = torch.log_softmax(logits, dim=1)  # each source's distribution over the vocabulary
    # one target per vocabulary token, each scored by the same k sources
    M = k + V
    H = torch.zeros(M, M)
    H[:k, k:] = torch.tensor([0.9, 0.85, 0.72])[:, None]
    pairs = [[s, k + v] for v in range(V) for s in range(k)]
    cross = torch.stack([logp[s, v] for v in range(V) for s in range(k)]).float()[:, None]
    r = rectify(torch.zeros(M, 1), cross, pairs, H, gamma=0.7, alpha_max=1.0)
    total = torch.exp(r.cross_score[k:, 0].double()).sum()
    assert total.item() == pytest.approx(1.0, abs=1e-6)


def test_case16_alpha_extremes_and_bad_mode():
    H = torch.ones(3, 3)
    diag = torch.tensor([[-1.0, -2.0]] * 3)
    cross = torch.tensor([[-3.0, -0.5], [-0.7, -4.0]])
    pairs = [[0, 2], [1, 2]]
    r0 = rectify(diag, cross, pairs, H, gamma=0.7, alpha_max=0.0)
    assert torch.equal(r0.corrected, diag)
    r1 = rectify(diag, cross, pairs, H, gamma=0.7, alpha_max=1.0)
    assert r1.alpha[2].item() == 1.0
    assert torch.equal(r1.corrected[2], r1.cross_score[2])
    with pytest.raises(ValueError, match="mode"):
        rectify(diag, cross, pairs, H, gamma=0.7, alpha_max=0.5, mode="geometric")


@settings(max_examples=15, deadline=None)
@given(
    k=st.integers(1, 4),
    L=st.integers(1, 6),
    seed=st.integers(0, 10_000),
    temp=st.sampled_from([1e-3, 0.1, 1.0]),
)
def test_property_mixture_bounds(k, L, seed, temp):
    g = torch.Generator().manual_seed(seed)
    M = k + 1
    H = torch.zeros(M, M)
    H[:k, k] = torch.rand(k, generator=g) * 0.3 + 0.7
    cross = -torch.rand(k, L, generator=g) * 20
    diag = -torch.rand(M, L, generator=g) * 5
    pairs = [[s, k] for s in range(k)]
    rp = rectify(diag, cross, pairs, H, gamma=0.7, alpha_max=0.8, temperature=temp)
    rl = rectify(diag, cross, pairs, H, gamma=0.7, alpha_max=0.8, temperature=temp, mode="log_mean")
    c = rp.cross_score[k]
    assert (c <= cross.max(0).values).all() and (c >= cross.min(0).values).all()
    assert (c >= rl.cross_score[k] - 1e-5).all()
    assert rp.weights[k].sum().item() == pytest.approx(1.0, abs=1e-6)
    assert 0 <= rp.rho[k] <= 1 and 0 <= rp.alpha[k] <= 0.8


# ------------------------------------------------------------------------------------------------ loop references


def _random_batch(seed: int, tasks: int = 2, rollouts: int = 3, turns: int = 3):
    g = torch.Generator().manual_seed(seed)
    ids = [
        (t, r, u)
        for t in range(tasks)
        for r in range(rollouts)
        for u in range(int(torch.randint(1, turns + 1, (1,), generator=g)))
    ]
    perm = torch.randperm(len(ids), generator=g).tolist()
    ids = [ids[i] for i in perm]
    task = torch.tensor([i[0] for i in ids]) * 7 + 3
    rollout = torch.tensor([i[1] for i in ids]) * 5 + 1
    turn = torch.tensor([i[2] for i in ids])
    M = len(ids)
    # quantised similarities so that exact ties occur
    H = torch.round(torch.rand(M, M, generator=g) * 8) / 8
    H = torch.where(task[:, None] == task[None, :], H, torch.zeros(()))
    sv = torch.rand(M, generator=g) > 0.15
    tv = torch.rand(M, generator=g) > 0.15
    return task, rollout, turn, H, sv, tv, g


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 100_000), gamma=st.sampled_from([0.0, 0.5, 0.75]), top_k=st.integers(1, 3))
def test_property_selection_and_rectify_equal_loop_reference(seed, gamma, top_k):
    task, rollout, turn, H, sv, tv, g = _random_batch(seed)
    B = eligibility(task, rollout, sv, tv)
    assert torch.equal(B, eligibility_ref(task, rollout, sv, tv))
    sel = select_sources(H, B, task, rollout, turn, gamma=gamma, top_k=top_k)
    assert sel == select_sources_ref(H, B, task, rollout, turn, gamma=gamma, top_k=top_k)
    for t, srcs in enumerate(sel):
        assert len({int(rollout[s]) for s in srcs}) == len(srcs) <= top_k
        assert all(bool(B[s, t]) and H[s, t] >= gamma for s in srcs)
    # action filter vs reference
    A = torch.rand(H.shape, generator=g) * 2 - 1
    A[0, :] = float("nan")
    av = torch.rand(len(task), generator=g) > 0.2
    kept = action_filter(sel, A, av, av, threshold=-0.2)
    assert kept == action_filter_ref(sel, A, av, av, threshold=-0.2)
    assert all(set(k) <= set(s) for k, s in zip(kept, sel))
    # rectify vs reference
    M, L = len(task), 4
    pairs = pairs_from_selection(kept)
    diag = -torch.rand(M, L, generator=g) * 4
    cross = -torch.rand(pairs.shape[0], L, generator=g) * 4
    for mode in ("probability_mixture", "log_mean"):
        r = rectify(diag, cross, pairs, H, gamma=min(gamma, 0.9), alpha_max=0.6, mode=mode)
        c_ref, rho_ref, a_ref, w_ref, cs_ref = rectify_ref(
            diag, cross, pairs, H, gamma=min(gamma, 0.9), alpha_max=0.6, mode=mode
        )
        torch.testing.assert_close(r.corrected.double(), c_ref, atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(r.cross_score.double(), cs_ref, atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(r.rho.double(), rho_ref, atol=1e-6, rtol=0)
        torch.testing.assert_close(r.alpha.double(), a_ref, atol=1e-6, rtol=0)
        for w, wr in zip(r.weights, w_ref):
            torch.testing.assert_close(w.double(), wr, atol=1e-6, rtol=0)
        unmatched = ~r.matched
        assert torch.equal(r.corrected[unmatched], diag[unmatched])


def test_selection_order_invariance():
    task, rollout, turn, H, sv, tv, _ = _random_batch(7, tasks=3, rollouts=4, turns=4)
    B = eligibility(task, rollout, sv, tv)
    sel = select_sources(H, B, task, rollout, turn, gamma=0.25, top_k=3)
    perm = torch.randperm(len(task), generator=torch.Generator().manual_seed(1))
    sel_p = select_sources(
        H[perm][:, perm], B[perm][:, perm], task[perm], rollout[perm], turn[perm], gamma=0.25, top_k=3
    )
    for new_t, old_t in enumerate(perm.tolist()):
        assert [int(perm[s]) for s in sel_p[new_t]] == sel[old_t]


# ------------------------------------------------------------------------------------------------ case 20, 21, 22


def test_case20_webshop_action_filter():
    teacher = ["click[A]", "search[red shoes]", "click[B]", None, "click[Buy Now]"]
    student = ["click[A]", "search[crimson shoes]", "click[B]", "search[blue hat]", "click[Buy Now]"]
    A = torch.ones(5, 5)
    A[1, 1], A[1, 3] = 0.85, 0.79
    sv = torch.tensor([True, True, True, False, True])
    tv = torch.ones(5, dtype=torch.bool)
    everything = [list(range(5)) for _ in range(5)]
    kept = action_filter(
        everything, A, sv, tv, threshold=0.8, source_actions=teacher, target_actions=student, webshop=True
    )
    pairs = {(s, t) for t, srcs in enumerate(kept) for s in srcs}
    assert pairs == {(0, 0), (1, 1), (2, 2), (4, 4)}
    assert kept == action_filter_ref(
        everything, A, sv, tv, threshold=0.8, source_actions=teacher, target_actions=student, webshop=True
    )
    # marking index 1 invalid clears row 1 and column 1
    for sv2, tv2 in ((sv & (torch.arange(5) != 1), tv), (sv, tv & (torch.arange(5) != 1))):
        kept2 = action_filter(everything, A, sv2, tv2, source_actions=teacher, target_actions=student, webshop=True)
        pairs2 = {(s, t) for t, srcs in enumerate(kept2) for s in srcs}
        assert pairs2 == {(0, 0), (2, 2), (4, 4)}


def test_case21_no_backfill():
    task = torch.zeros(4, dtype=torch.long)
    rollout = torch.tensor([0, 1, 2, 3])
    turn = torch.zeros(4, dtype=torch.long)
    H = torch.zeros(4, 4)
    H[:, 3] = torch.tensor([0.99, 0.9, 0.8, 0.0])
    B = eligibility(task, rollout, torch.ones(4, dtype=torch.bool), torch.ones(4, dtype=torch.bool))
    sel = select_sources(H, B, task, rollout, turn, gamma=0.7, top_k=2)
    assert sel[3] == [0, 1]
    teacher = ["click[wrong]", "click[right]", "click[right]", "click[x]"]
    student = ["click[a]", "click[b]", "click[c]", "click[right]"]
    kept = action_filter(
        sel,
        torch.ones(4, 4),
        torch.ones(4, dtype=torch.bool),
        torch.ones(4, dtype=torch.bool),
        source_actions=teacher,
        target_actions=student,
        webshop=True,
    )
    assert kept[3] == [1]
    diag = torch.full((4, 2), -2.0)
    r = rectify(diag, torch.tensor([[-1.0, -4.0]]), pairs_from_selection(kept), H, gamma=0.7, alpha_max=0.2)
    torch.testing.assert_close(r.weights[3], torch.tensor([1.0]))
    assert r.rho[3].item() == pytest.approx(2 / 3, abs=1e-6)
    assert r.alpha[3].item() == pytest.approx(0.1333, abs=1e-4)
    torch.testing.assert_close(r.corrected[3], torch.tensor([-1.8667, -2.2667]), atol=1e-4, rtol=0)
    assert r.corrected[3, 1] < diag[3, 1]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.1, 1.1, True, "0.8"])
def test_case22_bad_thresholds(bad):
    with pytest.raises(ValueError, match="threshold"):
        action_filter(
            [[0]], torch.ones(1, 1), torch.ones(1, dtype=torch.bool), torch.ones(1, dtype=torch.bool), threshold=bad
        )
    from alignopsd.config import RectifyConfig

    with pytest.raises(ValueError, match="action_threshold"):
        RectifyConfig(action_threshold=bad)


def test_case22_nonfinite_similarity_empty_pool_and_defaults():
    A = torch.tensor([[float("nan"), float("inf")], [1.0, 1.0]])
    ok = torch.ones(2, dtype=torch.bool)
    assert action_filter([[0], [0]], A, ok, ok, threshold=0.5) == [[], []]
    assert action_filter([[], []], A, ok, ok) == [[], []]
    from alignopsd.config import RectifyConfig

    assert RectifyConfig().action_filter is False
    assert parse_webshop_action("  click[A]  ") == ("click", "A")
    kept = action_filter(
        [[0]],
        torch.ones(1, 1),
        ok[:1],
        ok[:1],
        source_actions=["  click[A]  "],
        target_actions=["  click[A]  "],
        webshop=True,
    )
    assert kept == [[0]]
    kept = action_filter([[0]], torch.ones(1, 1), ok[:1], ok[:1], source_actions=["   "], target_actions=["   "])
    assert kept == [[]]
    assert parse_webshop_action("Click[A]") is None  # verbs are case-sensitive
    assert parse_webshop_action("click[  ]") is None
    assert parse_webshop_action("search[a] now") is None


# ------------------------------------------------------------------------------------------------ bad input


def test_bad_inputs_name_the_argument():
    H, E, task, rollout, turn = _case9()
    with pytest.raises(ValueError, match="^H"):
        select_sources(H[:, :4], E, task, rollout, turn, gamma=0.7, top_k=2)
    Hn = H.clone()
    Hn[0, 0] = float("nan")
    with pytest.raises(ValueError, match="^H"):
        select_sources(Hn, E, task, rollout, turn, gamma=0.7, top_k=2)
    with pytest.raises(ValueError, match="eligible"):
        select_sources(H, E.float(), task, rollout, turn, gamma=0.7, top_k=2)
    with pytest.raises(ValueError, match="top_k"):
        select_sources(H, E, task, rollout, turn, gamma=0.7, top_k=0)
    with pytest.raises(ValueError, match="gamma"):
        select_sources(H, E, task, rollout, turn, gamma=1.0, top_k=1)
    with pytest.raises(ValueError, match="turn"):
        select_sources(H, E, task, rollout, turn[:3], gamma=0.7, top_k=1)
    cross_task = E.clone()
    with pytest.raises(ValueError, match="eligible"):
        select_sources(
            H, cross_task, task.clone().index_fill_(0, torch.tensor([0]), 9), rollout, turn, gamma=0.7, top_k=2
        )
    diag = torch.zeros(5, 3)
    with pytest.raises(ValueError, match="cross"):
        rectify(diag, torch.zeros(2, 4), [[0, 4], [1, 4]], H, gamma=0.7, alpha_max=0.5)
    with pytest.raises(ValueError, match="cross"):
        rectify(diag, torch.full((2, 3), float("inf")), [[0, 4], [1, 4]], H, gamma=0.7, alpha_max=0.5)
    with pytest.raises(ValueError, match="diag"):
        rectify(torch.full((5, 3), float("nan")), torch.zeros(2, 3), [[0, 4], [1, 4]], H, gamma=0.7, alpha_max=0.5)
    with pytest.raises(ValueError, match="pairs"):
        rectify(diag, torch.zeros(2, 3), [[0, 4], [1, 7]], H, gamma=0.7, alpha_max=0.5)
    with pytest.raises(ValueError, match="pairs"):
        rectify(diag, torch.zeros(3, 3), [[0, 4], [1, 3], [2, 4]], H, gamma=0.7, alpha_max=0.5)
    with pytest.raises(ValueError, match="pairs"):
        rectify(diag, torch.zeros(2, 3), [[0, 4], [0, 4]], H, gamma=0.7, alpha_max=0.5)
    with pytest.raises(ValueError, match="alpha_max"):
        rectify(diag, torch.zeros(2, 3), [[0, 4], [1, 4]], H, gamma=0.7, alpha_max=1.5)
    with pytest.raises(ValueError, match="temperature"):
        rectify(diag, torch.zeros(2, 3), [[0, 4], [1, 4]], H, gamma=0.7, alpha_max=0.5, temperature=0.0)
    with pytest.raises(ValueError, match="source_action_valid"):
        action_filter([[0]], torch.ones(1, 1), torch.ones(2, dtype=torch.bool), torch.ones(1, dtype=torch.bool))
    with pytest.raises(ValueError, match="source_actions"):
        action_filter(
            [[0]], torch.ones(1, 1), torch.ones(1, dtype=torch.bool), torch.ones(1, dtype=torch.bool), webshop=True
        )
    with pytest.raises(ValueError, match="target_valid"):
        eligibility(task, rollout, torch.ones(5, dtype=torch.bool), torch.ones(4, dtype=torch.bool))


# ------------------------------------------------------------------------------------------------ case 14


def test_case14_source_target_layout_gamma_and_rows():
    """The per-step M1 record keeps H in the source x target layout, gamma, and row_to_canonical = (0, 1, 0);
    per-row values are the canonical turn's (expanded through row_to_canonical)."""
    from alignopsd.canonical import canonicalize

    can = canonicalize(["u"] * 3, ["a", "b", "a"], [0, 0, 0])
    assert can.row_to_canonical.tolist() == [0, 1, 0]
    H = torch.tensor([[0.0, 0.9], [0.4, 0.0]])  # asymmetric: H[source, target]
    B = eligibility(can.task, can.rollout, torch.ones(2, dtype=torch.bool), torch.ones(2, dtype=torch.bool))
    sel = select_sources(H, B, can.task, can.rollout, can.turn, gamma=0.7, top_k=3)
    assert sel == [[], [0]]  # H[1, 0] = 0.4 < gamma; H[0, 1] = 0.9 selects source 0 for target 1
    diag = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
    r = rectify(diag, torch.tensor([[-0.5, -0.5]]), pairs_from_selection(sel), H, gamma=0.7, alpha_max=0.8)
    assert r.gamma == 0.7 and r.alpha_max == 0.8 and r.pairs.tolist() == [[0, 1]]
    old = torch.full((2, 2), -2.0)
    _, gap = r.gaps(old)
    assert torch.equal(gap[can.row_to_canonical], (r.corrected - old)[[0, 1, 0]])


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 100_000))
def test_property_rectify_invariant_to_turn_order(seed):
    task, rollout, turn, H, sv, tv, g = _random_batch(seed)
    B = eligibility(task, rollout, sv, tv)
    sel = select_sources(H, B, task, rollout, turn, gamma=0.25, top_k=3)
    M, L = len(task), 3
    pairs = pairs_from_selection(sel)
    diag = -torch.rand(M, L, generator=g) * 4
    cross = -torch.rand(pairs.shape[0], L, generator=g) * 4
    r = rectify(diag, cross, pairs, H, gamma=0.25, alpha_max=0.7)
    perm = torch.randperm(M, generator=g)
    inv = torch.argsort(perm)  # new index of old turn i
    sel_p = select_sources(
        H[perm][:, perm], B[perm][:, perm], task[perm], rollout[perm], turn[perm], gamma=0.25, top_k=3
    )
    pairs_p = pairs_from_selection(sel_p)
    # cross rows of the permuted batch: look up the same (source, target) pair in the original order
    index = {(int(s), int(t)): j for j, (s, t) in enumerate(pairs.tolist())}
    rows = [index[(int(perm[s]), int(perm[t]))] for s, t in pairs_p.tolist()]
    r_p = rectify(diag[perm], cross[rows], pairs_p, H[perm][:, perm], gamma=0.25, alpha_max=0.7)
    torch.testing.assert_close(r_p.corrected[inv], r.corrected)
    torch.testing.assert_close(r_p.alpha[inv], r.alpha)


# ------------------------------------------------------------------------------------------------ audit additions


def test_select_sources_rejects_duplicate_identity():
    # API: duplicate turn ids in a trajectory are bad input (the identity tie-break needs unique identities)
    H = torch.zeros(3, 3)
    H[0, 2] = H[1, 2] = 0.9
    E = torch.zeros(3, 3, dtype=torch.bool)
    E[0, 2] = E[1, 2] = True
    task, rollout, turn = torch.tensor([0, 0, 0]), torch.tensor([0, 0, 1]), torch.tensor([0, 0, 0])
    with pytest.raises(ValueError, match="turn"):
        select_sources(H, E, task, rollout, turn, gamma=0.7, top_k=3)


def test_similarity_matrix_orientation_and_integer_task_ids():
    T = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # teacher thinking embeddings (sources)
    S = torch.tensor([[0.6, 0.8], [1.0, 0.0]])  # student thinking embeddings (targets)
    H = similarity_matrix(T, S, torch.tensor([0, 0]))
    torch.testing.assert_close(H, torch.tensor([[0.6, 1.0], [0.8, 0.0]]))  # H[s, t] = <T_s, S_t>
    with pytest.raises(ValueError, match="task"):
        similarity_matrix(T, S, torch.tensor([0.0, 0.0]))
    with pytest.raises(ValueError, match="task"):
        similarity_matrix(T, S, torch.tensor([0, 0, 0]))


def test_rectify_empty_cross_must_match_the_response_width():
    diag = torch.zeros(2, 2)
    empty_pairs = torch.zeros(0, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="cross"):
        rectify(diag, torch.zeros(0, 3), empty_pairs, torch.zeros(2, 2), gamma=0.7, alpha_max=0.2)
    r = rectify(diag, torch.zeros(0, 2), empty_pairs, torch.zeros(2, 2), gamma=0.7, alpha_max=0.2)
    assert torch.equal(r.corrected, diag)


def test_public_rectify_is_the_function_in_any_import_order():
    # the API function `alignopsd.rectify` lives in the submodule `alignopsd.rectification` (no module shares its
    # name, so no module has to make itself callable); importing the submodule first must not shadow it
    import importlib.util
    import types

    import alignopsd
    import alignopsd.rectification as mod

    assert importlib.util.find_spec("alignopsd.rectify") is None
    lazy = alignopsd.__getattr__("rectify")  # what `from alignopsd import rectify` resolves to on a fresh import
    assert lazy is mod.rectify and alignopsd.rectify is mod.rectify and alignopsd.Rectified is mod.Rectified
    assert not isinstance(alignopsd.rectify, types.ModuleType)
    args = (torch.zeros(2, 1), torch.zeros(0, 1), torch.zeros(0, 2, dtype=torch.long), torch.zeros(2, 2))
    assert type(alignopsd.rectify(*args, gamma=0.7, alpha_max=0.2)).__name__ == "Rectified"


def test_webshop_rule_details():
    ok = torch.ones(4, dtype=torch.bool)
    sel = [[0], [1], [2], [3]]
    teacher = ["click[Buy Now]", "search[red shoes]", "click[a]", "search[x]"]
    student = ["click[buy now]", "search[blue hat]", "click[a]", "click[x]"]
    sim = torch.ones(4, 4)
    kw = dict(source_actions=teacher, target_actions=student)
    # click arguments compare case-sensitively; two searches only need the threshold; verbs must agree
    assert action_filter(sel, sim, ok, ok, webshop=True, **kw) == [[], [1], [2], []]
    # other environments: the embedding threshold only
    assert action_filter(sel, sim, ok, ok, webshop=False, **kw) == sel
    sim2 = sim.clone()
    sim2[1, 1] = 0.7999
    assert action_filter(sel, sim2, ok, ok, threshold=0.8, webshop=True, **kw) == [[], [], [2], []]
    assert parse_webshop_action("click [a]") is None and parse_webshop_action("CLICK[a]") is None
    assert parse_webshop_action(" search[ red  shoes ] ") == ("search", "red  shoes")


def test_an_environment_rule_of_its_own_and_the_webshop_rule_as_one():
    """``rule=`` is a pair rule of the environment; ``webshop=True`` is exactly ``rule=webshop_actions_agree``."""
    ok = torch.ones(4, dtype=torch.bool)
    sel = [[1, 0], [1], [2], [3]]
    teacher = ["click[Buy Now]", "search[red shoes]", "click[a]", None]
    student = ["click[buy now]", "search[blue hat]", "click[a]", "click[x]"]
    kw = dict(source_actions=teacher, target_actions=student)
    sim = torch.ones(4, 4)
    asked = []

    def same_verb(a: str, b: str) -> bool:
        asked.append((a, b))
        return a.split("[")[0] == b.split("[")[0]

    assert action_filter(sel, sim, ok, ok, rule=same_verb, **kw) == [[0], [1], [2], []]
    assert (None, "click[x]") not in asked  # an invalid action is rejected before the rule is asked
    for w in (True, False):
        by_name = action_filter(sel, sim, ok, ok, webshop=w, **kw)
        assert by_name == action_filter(sel, sim, ok, ok, rule=webshop_actions_agree if w else None, **kw)
    assert not webshop_actions_agree("click[A]", "Click[A]") and webshop_actions_agree("search[a]", " search[b] ")
    with pytest.raises(ValueError, match="rule: give webshop=True"):
        action_filter(sel, sim, ok, ok, webshop=True, rule=same_verb, **kw)
    with pytest.raises(ValueError, match="rule: expected a function"):
        action_filter(sel, sim, ok, ok, rule="webshop", **kw)
    with pytest.raises(ValueError, match="source_actions"):
        action_filter(sel, sim, ok, ok, rule=same_verb)
