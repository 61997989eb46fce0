"""The algorithm core routes through the Triton kernels (CUDA, or ``force_kernels()`` here) with the torch answers.

Under the Triton interpreter (conftest), ``force_kernels()`` makes the core treat CPU tensors as it treats
CUDA tensors. Every test counts the kernel entries or launches it expects, so removing the dispatch
fails them, and compares against the core's own torch path on the same inputs: selections exactly
(ties included), segments exactly, values within fp tolerance.

Legend: M = turns, H[source, target] similarity, B[source, target] eligibility, P[target, source] profiles.
"""

from __future__ import annotations

import importlib
import math
from collections import Counter

import pytest
import torch
from alignopsd.kernels import HAS_TRITON, core_uses_kernels
from test_sibling_topk import make_batch

import alignopsd
from alignopsd.credit import CreditConfig, allocate_credit
from alignopsd.rectification import eligibility, similarity_matrix
from alignopsd.testing import force_kernels

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")

STK = importlib.import_module("alignopsd.kernels.sibling_topk")
JSD = importlib.import_module("alignopsd.kernels.jsd_boundary")
STK_TRITON = importlib.import_module("alignopsd.kernels.sibling_topk_triton")  # the launchers of sibling_topk


@pytest.fixture
def launches(monkeypatch):
    """Counter of Triton kernel launches (by kernel function name) in the two alignment-kernel modules."""
    seen: Counter[str] = Counter()
    for mod in (STK_TRITON, JSD):
        original = mod.launch_tuned

        def counting(fn, grid, device, *args, _original=original, **kwargs):
            seen[fn.__name__] += 1
            return _original(fn, grid, device, *args, **kwargs)

        monkeypatch.setattr(mod, "launch_tuned", counting)
    return seen


def _similarity(seed, *, ties, tasks=3, rollouts=4, turns=5):
    te, st, task, roll, turn, sv, tv = make_batch(seed=seed, ties=ties, tasks=tasks, rollouts=rollouts, turns=turns)
    return similarity_matrix(te, st, task), eligibility(task, roll, sv, tv), task, roll, turn


def test_force_kernels_is_scoped_and_needs_the_interpreter(monkeypatch):
    x = torch.zeros(2)
    assert not core_uses_kernels(x)
    with force_kernels():
        with force_kernels():
            assert core_uses_kernels(x)
        assert core_uses_kernels(x)
    assert not core_uses_kernels(x)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        with force_kernels():
            pass
    assert not core_uses_kernels(x)


@pytest.mark.parametrize("top_k", [1, 3])
@pytest.mark.parametrize("sub_eligibility", [False, True])
def test_select_sources_routes_through_sibling_topk_with_ties(monkeypatch, top_k, sub_eligibility):
    H, B, task, roll, turn = _similarity(seed=2, ties=True, tasks=2, rollouts=5, turns=4)
    if sub_eligibility:  # any within-task mask, not only the structural one
        B = B & (torch.rand(B.shape, generator=torch.Generator().manual_seed(7)) < 0.7)
    vals = H[B & (H >= 0.2)]
    assert vals.numel() > vals.unique().numel()  # ties among candidates really occur
    expected = alignopsd.select_sources(H, B, task, roll, turn, gamma=0.2, top_k=top_k)
    calls = []
    original = STK.sibling_topk_from_similarity

    def counting(*args, **kwargs):
        calls.append(kwargs["impl"])
        return original(*args, **kwargs)

    monkeypatch.setattr(importlib.import_module("alignopsd.selection"), "sibling_topk_from_similarity", counting)
    with force_kernels():
        got = alignopsd.select_sources(H, B, task, roll, turn, gamma=0.2, top_k=top_k)
    assert calls == ["triton"]
    assert got == expected
    assert sum(map(len, got)) > 0


def test_correspondence_profiles_route_through_the_profile_kernel(launches):
    H, B, *_ = _similarity(seed=3, ties=False)
    P_ref, valid_ref = alignopsd.correspondence_profiles(H, B, gamma=0.3, temperature=0.1)
    assert not launches
    with force_kernels():
        P, valid = alignopsd.correspondence_profiles(H, B, gamma=0.3, temperature=0.1)
    assert launches == {"_profiles_kernel": 1}
    assert torch.equal(valid, valid_ref) and 0 < int(valid.sum()) < valid.numel()
    torch.testing.assert_close(P, P_ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("distance", ["jsd", "cosine"])
def test_boundary_scores_route_through_the_pair_kernel(launches, distance):
    H, B, task, roll, turn = _similarity(seed=4, ties=False)
    P, valid = alignopsd.correspondence_profiles(H, B, gamma=0.3, temperature=0.1)
    d_ref, bv_ref = alignopsd.boundary_scores(P, valid, B, task, roll, turn, distance=distance)
    with force_kernels():
        d, bv = alignopsd.boundary_scores(P, valid, B, task, roll, turn, distance=distance)
    assert launches == {"_pair_kernel": 1}
    assert torch.equal(bv, bv_ref) and int(bv.sum()) > 3
    torch.testing.assert_close(d, d_ref, atol=1e-5, rtol=0)


def _credit_batch(seed, *, sorted_equal=False):
    """Shuffled turns, tasks of different sizes, uneven rollouts, some invalid thinking; 8-turn rollouts."""
    if sorted_equal:  # identity order and equal task sizes: the core's strided-view fast path
        tasks, rollouts, turns = 2, 4, 8
        task = torch.arange(tasks).repeat_interleave(rollouts * turns)
        roll = torch.arange(rollouts).repeat_interleave(turns).repeat(tasks)
        turn = torch.arange(turns).repeat(tasks * rollouts)
        g = torch.Generator().manual_seed(seed)
        m = task.numel()
        te = torch.nn.functional.normalize(torch.randn(m, 16, generator=g), dim=1)
        st = torch.nn.functional.normalize(torch.randn(m, 16, generator=g), dim=1)
        sv = torch.rand(m, generator=g) > 0.1
        tv = torch.rand(m, generator=g) > 0.1
    else:
        te, st, task, roll, turn, sv, tv = make_batch(seed=seed, ties=False, tasks=3, rollouts=4, turns=9)
    m = task.numel()
    g = torch.Generator().manual_seed(seed + 100)
    L = 6
    mask = torch.rand(m, L, generator=g) < 0.8
    mask[:, 0] = True
    outcome = ((roll // 3 + task) % 2).float()  # equal on every turn of a trajectory, varying within tasks
    return dict(
        gap=torch.randn(m, L, generator=g),
        mask=mask,
        outcome=outcome,
        task=task,
        rollout=roll,
        turn=turn,
        H=similarity_matrix(te, st, task),
        eligible=eligibility(task, roll, sv, tv),
    )


def _assert_same_credit(got, ref):
    for name in ("segment_index", "boundary_kind", "profile_valid", "boundary_valid"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert math.isclose(got.threshold, ref.threshold, rel_tol=0, abs_tol=1e-6) or got.threshold == ref.threshold
    for name in ("boundary_distance", "advantage", "turn_weight", "token_advantage", "density", "raw_density"):
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), atol=1e-5, rtol=0, msg=name)
    assert got.metrics.keys() == ref.metrics.keys()
    for key, v in ref.metrics.items():
        assert math.isclose(got.metrics[key], v, rel_tol=1e-4, abs_tol=1e-5), (key, got.metrics[key], v)


@pytest.mark.parametrize(
    "cfg, sorted_equal",
    [
        (dict(distance="jsd"), False),
        (dict(distance="jsd", tau_max=1.0, quantile=0.5), True),  # unclipped threshold, fast block path
        (dict(distance="entropy", tau_max=1.0, weighting="bounded"), False),
        (dict(distance="cosine", mode="random", seed=3), False),
    ],
)
def test_allocate_credit_routes_through_the_kernels(launches, cfg, sorted_equal):
    batch = _credit_batch(seed=5, sorted_equal=sorted_equal)
    config = CreditConfig(gamma=0.2, **cfg)
    ref = allocate_credit(**batch, config=config)
    assert not launches
    with force_kernels():
        got = allocate_credit(**batch, config=config)
    assert launches == {"_profiles_kernel": 1, "_pair_kernel": 1}
    # a non-trivial structure: valid and invalid profiles and boundaries, trajectories split into spans
    assert 0 < int(ref.profile_valid.sum()) < ref.profile_valid.numel()
    assert int(ref.boundary_valid.sum()) > 10
    assert int(ref.segment_index.max()) + 1 > len(set(zip(batch["task"].tolist(), batch["rollout"].tolist())))
    assert ref.advantage.abs().max() > 0.5
    _assert_same_credit(got, ref)


def test_turn_and_token_modes_read_no_profiles(launches):
    batch = _credit_batch(seed=6)
    with force_kernels():
        for mode in ("turn", "token"):
            allocate_credit(**batch, config=CreditConfig(mode=mode))
    assert not launches


def test_kernel_path_bad_input_names_the_argument():
    H, B, task, roll, turn = _similarity(seed=8, ties=False)
    cross = B.clone()
    i, j = (task[:, None] != task[None, :]).nonzero()[0].tolist()
    cross[i, j] = True
    nan_H = H.clone()
    s, t = B.nonzero()[0].tolist()
    nan_H[s, t] = float("nan")
    dup = turn.clone()
    same = ((task == task[0]) & (roll == roll[0])).nonzero().flatten()
    dup[same[1]] = dup[same[0]]
    batch = _credit_batch(seed=9)
    bad = batch["H"].clone()
    s2, t2 = batch["eligible"].nonzero()[0].tolist()
    bad[s2, t2] = float("inf")
    with force_kernels():
        with pytest.raises(ValueError, match="^eligible"):
            alignopsd.select_sources(H, cross, task, roll, turn, gamma=0.2, top_k=2)
        with pytest.raises(ValueError, match="^turn"):
            alignopsd.select_sources(H, B, task, roll, dup, gamma=0.2, top_k=2)
        with pytest.raises(ValueError, match="^H"):
            alignopsd.select_sources(nan_H, B, task, roll, turn, gamma=0.2, top_k=2)
        with pytest.raises(ValueError, match="^H"):
            alignopsd.correspondence_profiles(nan_H, B, gamma=0.2)
        with pytest.raises(ValueError, match="^H"):
            allocate_credit(**{**batch, "H": bad})
        with pytest.raises(ValueError, match="^gamma"):
            alignopsd.select_sources(H, B, task, roll, turn, gamma=float("nan"), top_k=2)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_sibling_topk_from_similarity_matches_the_core(impl):
    H, B, task, roll, turn = _similarity(seed=10, ties=True)
    out = STK.sibling_topk_from_similarity(H, B, task, roll, turn, gamma=0.25, top_k=2, impl=impl)
    assert out.selected_lists() == alignopsd.select_sources(H, B, task, roll, turn, gamma=0.25, top_k=2)
    P, valid = alignopsd.correspondence_profiles(H, B, gamma=0.25, temperature=0.1)
    torch.testing.assert_close(out.P, P, atol=1e-6, rtol=1e-5)
    assert torch.equal(out.profile_valid, valid)
    lean = STK.sibling_topk_from_similarity(H, B, task, roll, turn, gamma=0.25, top_k=2, profiles=False, impl=impl)
    assert torch.equal(lean.selected, out.selected) and torch.equal(lean.profile_valid, valid)
    with pytest.raises(ValueError, match="^P"):
        lean.P  # noqa: B018
