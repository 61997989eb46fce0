"""Mechanism 2 numeric cases of ALGORITHM.md §6 (23-35, 38-40, 42-44) and bad input."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from alignopsd import credit
from alignopsd.credit import CreditConfig, allocate_credit
from alignopsd.profiles import boundary_scores, correspondence_profiles, segmentation_threshold
from alignopsd.projection import project_batch, project_to_box
from alignopsd.segmentation import segment, segment_random

T = torch.tensor
IMPLS = ["python", "cpp"] if importlib.util.find_spec("alignopsd._C") is not None else ["python"]


def make_batch(lengths, *, L=4, tasks=None, gap=None, mask=None, outcome=None, seed=0):
    """Turns of trajectories with ``lengths[i]`` turns; trajectory i is (tasks[i], i). Identity order."""
    g = torch.Generator().manual_seed(seed)
    tasks = tasks or [0] * len(lengths)
    task, roll, turn = [], [], []
    for i, (n, t) in enumerate(zip(lengths, tasks)):
        task += [t] * n
        roll += [i] * n
        turn += list(range(n))
    m = len(task)
    task, roll, turn = T(task), T(roll), T(turn)
    if outcome is None:
        outcome = torch.cat([torch.full((n,), float(i % 2)) for i, n in enumerate(lengths)])
    if mask is None:
        mask = torch.ones(m, L, dtype=torch.bool)
    if gap is None:
        gap = torch.randn(m, L, generator=g)
    H = (torch.rand(m, m, generator=g) * 2 - 1) * (task[:, None] == task[None, :])
    E = (task[:, None] == task[None, :]) & (roll[:, None] != roll[None, :])
    return dict(gap=gap, mask=mask, outcome=outcome, task=task, rollout=roll, turn=turn, H=H, eligible=E)


def traj_sums(values, batch):
    key = batch["task"] * 1000 + batch["rollout"]
    out = {}
    for k in key.unique().tolist():
        out[k] = values[key == k]
    return out


# ------------------------------------------------------------------------------------------------ case 23, 35


def test_case23_profiles():
    H = torch.zeros(3, 3)
    H[:, 2] = T([0.6, 0.9, 0.0])
    E = torch.zeros(3, 3, dtype=torch.bool)
    E[0, 2] = E[1, 2] = True
    P, valid = correspondence_profiles(H, E, gamma=0.7)
    assert torch.allclose(P[2], T([0.04743, 0.95257, 0.0]), atol=1e-5)
    assert P[2, 2] == 0.0
    assert torch.equal(P[:2], torch.zeros(2, 3))
    assert valid.tolist() == [False, False, True]


def test_case23_profiles_exist_but_invalid():
    H = T([[0.0, 0.3], [0.4, 0.0]])
    E = T([[False, True], [True, False]])
    P, valid = correspondence_profiles(H, E, gamma=0.7)
    assert torch.equal(P, T([[0.0, 1.0], [1.0, 0.0]]))
    assert valid.tolist() == [False, False]


def test_profile_gamma_never_truncates():
    # a source below gamma keeps its mass; gamma only decides validity (inclusive)
    H = torch.zeros(3, 3)
    H[0, 1], H[2, 1] = 0.7, 0.1  # H[source, target]
    E = torch.zeros(3, 3, dtype=torch.bool)
    E[0, 1] = E[2, 1] = True
    P, valid = correspondence_profiles(H, E, gamma=0.7)
    expected_row1 = torch.zeros(3)
    expected_row1[[0, 2]] = torch.softmax(T([0.7, 0.1]) / 0.1, 0)
    assert torch.allclose(P[1], expected_row1, atol=1e-6)
    assert valid.tolist() == [False, True, False]


def test_case35_single_turn_rollouts():
    H = T([[0.0, 0.8], [0.8, 0.0]])
    E = T([[False, True], [True, False]])
    P, valid = correspondence_profiles(H, E, gamma=0.7)
    assert torch.equal(P, T([[0.0, 1.0], [1.0, 0.0]]))
    assert valid.tolist() == [True, True]
    b = make_batch([1, 1])
    b["H"] = H
    c = allocate_credit(**b, config=CreditConfig(gamma=0.7))
    assert c.profile_valid.tolist() == [True, True]
    assert not bool(c.boundary_valid.any())


# ------------------------------------------------------------------------------------------------ case 24, 25


def _two_turn_distance(p, q, distance):
    m = p.shape[0]
    P = torch.zeros(m, m)
    P[0], P[1] = p, q
    E = torch.ones(m, m, dtype=torch.bool)
    valid = torch.ones(m, dtype=torch.bool)
    ids = dict(task=torch.zeros(m, dtype=torch.long), rollout=torch.zeros(m, dtype=torch.long), turn=torch.arange(m))
    d, bv = boundary_scores(P, valid, E, **ids, distance=distance)
    assert bool(bv[1])
    return float(d[1])


def test_case24_distances():
    p = T([0.1, 0.2, 0.3, 0.4])
    q = T([0.4, 0.4, 0.1, 0.1])
    assert _two_turn_distance(p, p, "jsd") == 0.0
    assert _two_turn_distance(p, q, "jsd") == pytest.approx(_two_turn_distance(q, p, "jsd"), abs=1e-7)
    assert _two_turn_distance(T([0.5, 0.5, 0, 0]), T([0, 0, 0.5, 0.5]), "jsd") == pytest.approx(1.0, abs=1e-6)
    assert _two_turn_distance(torch.full((4,), 0.25), T([1.0, 0, 0, 0]), "entropy") == pytest.approx(1.0, abs=1e-6)
    assert _two_turn_distance(T([1.0, 0, 0, 0]), T([0, 1.0, 0, 0]), "cosine") == pytest.approx(1.0, abs=1e-7)
    # a JSD value in between, against the textbook formula
    m = (p + q) / 2
    kl = lambda a, b: float((a * (a / b).log()).sum())  # noqa: E731
    assert _two_turn_distance(p, q, "jsd") == pytest.approx(0.5 * (kl(p, m) + kl(q, m)) / math.log(2), abs=1e-6)


def test_first_turn_never_a_boundary_and_structural_mask_rule():
    m = 4
    P = torch.softmax(torch.randn(m, m), 1)
    valid = torch.ones(m, dtype=torch.bool)
    E = torch.ones(m, m, dtype=torch.bool)
    E[0, 2] = False  # the eligible column of row 2 differs from those of rows 1 and 3
    d, bv = boundary_scores(P, valid, E, T([0, 0, 0, 0]), T([0, 0, 0, 0]), T([3, 0, 1, 2]), distance="jsd")
    # identity order: turn ids 0, 1, 2, 3 are rows 1, 2, 3, 0; only the pair (row 3, row 0) keeps its column
    assert bv.tolist() == [True, False, False, False]
    assert d[1] == 0.0 and d[2] == 0.0 and d[3] == 0.0 and d[0] > 0


def test_case25_one_hot_profiles_identity_mask():
    # identity structural mask: each target's only source is itself -> one-hot profiles; validity [T, T, F]
    b = make_batch([3, 3])
    m = 6
    b["eligible"] = torch.eye(m, dtype=torch.bool)
    b["H"] = torch.diag(T([0.9, 0.9, 0.5, 0.9, 0.9, 0.9]))
    c = allocate_credit(**b, config=CreditConfig(gamma=0.8))
    assert c.profile_valid.tolist() == [True, True, False, True, True, True]
    assert not bool(c.boundary_valid.any())
    assert c.metrics["m2/structural_mask_change_rate"] == 1.0
    assert c.metrics["m2/valid_jsd_sample_count"] == 0.0
    assert c.metrics["m2/segmentation_threshold"] == -1.0 and c.threshold == math.inf
    P, valid = correspondence_profiles(b["H"], b["eligible"], gamma=0.8)
    assert torch.equal(P, torch.eye(m))
    d, bv = boundary_scores(P, valid, b["eligible"], b["task"], b["rollout"], b["turn"])
    assert not bool(bv.any()) and torch.equal(d, torch.zeros(m))


# ------------------------------------------------------------------------------------------------ case 26-28


def test_case26_threshold():
    d = T([0.0, 0.001, 0.5, 0.9])
    v = T([False, True, True, True])
    assert segmentation_threshold(d, v, quantile=0.5) == pytest.approx(0.10)
    assert segmentation_threshold(T([0.0, 0.02, 0.03]), T([True, True, True]), quantile=0.5) == pytest.approx(0.02)
    assert segmentation_threshold(T([0.001, 0.002]), T([True, True]), quantile=0.5) == pytest.approx(0.01)
    assert segmentation_threshold(d, torch.zeros(4, dtype=torch.bool)) == math.inf


@pytest.mark.parametrize("impl", IMPLS)
def test_case27_segmentation_kinds(impl):
    d = torch.zeros(12)
    d[3], d[7] = 0.9, 0.4
    s = segment(d, torch.ones(12, dtype=torch.bool), tau=0.5, min_len=2, max_len=4, tau_min=0.1, impl=impl)
    assert s.semantic == [3] and s.guided == [7] and s.forced == [9]
    assert s.spans == [(0, 3), (3, 7), (7, 9), (9, 12)]


@pytest.mark.parametrize("impl", IMPLS)
def test_case28_strongest_first(impl):
    d = torch.zeros(12)
    d[2], d[3] = 0.6, 0.9
    s = segment(d, torch.ones(12, dtype=torch.bool), tau=0.5, min_len=2, max_len=12, impl=impl)
    assert s.semantic == [3] and s.spans == [(0, 3), (3, 12)]


@pytest.mark.parametrize("impl", IMPLS)
def test_segmentation_rules(impl):
    ones = torch.ones(10, dtype=torch.bool)
    # strict d > tau for candidates
    d = torch.zeros(10)
    d[5] = 0.5
    assert segment(d, ones, tau=0.5, max_len=10, impl=impl).semantic == []
    # invalid positions are never candidates, nor guided fallbacks
    d[5] = 0.9
    v = ones.clone()
    v[5] = False
    s = segment(d, v, tau=0.5, min_len=2, max_len=4, tau_min=0.01, impl=impl)
    assert s.semantic == [] and s.guided == [] and 5 not in s.guided
    # ties: equal d -> smaller position first
    d = torch.zeros(10)
    d[4] = d[5] = 0.7
    assert segment(d, ones, tau=0.5, max_len=10, impl=impl).semantic == [4]
    # guided fallback uses d >= tau_min (inclusive) and takes the largest d
    d = torch.zeros(10)
    d[3], d[6] = 0.25, 0.25
    s = segment(d, ones, tau=math.inf, min_len=2, max_len=8, tau_min=0.25, impl=impl)
    assert s.guided == [3] and s.forced == []
    # short trajectory stays one short span; empty trajectory has no span
    assert segment(torch.zeros(1), torch.ones(1, dtype=torch.bool), tau=0.1, impl=impl).spans == [(0, 1)]
    assert segment(torch.zeros(0), torch.ones(0, dtype=torch.bool), tau=0.1, impl=impl).spans == []


def test_segment_random_exact_shuffle():
    import random

    n, lmin = 13, 2
    positions = list(range(lmin, n - lmin + 1))
    random.Random(5).shuffle(positions)
    bounds = [0, n]
    expected = []
    for p in positions:
        left = max(b for b in bounds if b < p)
        right = min(b for b in bounds if b > p)
        if p - left >= lmin and right - p >= lmin:
            bounds.append(p)
            expected.append(p)
    s = segment_random(n, min_len=lmin, max_len=3, seed=5)
    assert s.random == sorted(expected) and s.semantic == [] and s.guided == [] and s.forced == []
    assert all(e - b <= 2 * lmin - 1 for b, e in s.spans)
    assert segment_random(n, min_len=lmin, max_len=3, seed=5) == s


# ------------------------------------------------------------------------------------------------ case 29-34


def test_case29_turn_gap_is_a_masked_mean():
    gap = T([[1.0, 3, 100], [-2, 2, 9]])
    mask = T([[True, True, False], [True, True, False]])
    b = make_batch([1, 1], L=3, gap=gap, mask=mask)
    c = allocate_credit(**b)
    assert c.turn_gap.tolist() == [2.0, 0.0]
    mask[1] = False
    with pytest.raises(ValueError, match="mask"):
        allocate_credit(**make_batch([1, 1], L=3, gap=gap, mask=mask))


@pytest.mark.parametrize("impl", IMPLS)
def test_case30_projection_keeps_budget(impl):
    h = T([5.0, 5.0 / 9.0], dtype=torch.float64)
    counts = T([1.0, 9.0])
    x = project_to_box(h, counts, lo=0.0, hi=2.0, impl=impl)
    assert torch.allclose(x, T([2.0, 8.0 / 9.0]), atol=1e-6)
    assert float((counts * x).sum()) == pytest.approx(10.0, abs=1e-5)
    assert float((counts * h.float().clamp(0, 2)).sum()) == pytest.approx(7.0)  # plain clamping loses budget


@pytest.mark.parametrize("impl", IMPLS)
def test_projection_special_cases(impl):
    h = T([0.5, 1.5], dtype=torch.float64)
    c = T([1.0, 1.0])
    assert torch.equal(project_to_box(h, c, lo=1.0, hi=2.0, impl=impl), torch.ones(2))
    assert torch.equal(project_to_box(h, c, lo=0.0, hi=2.0, impl=impl), h.float())  # inside: unchanged
    with pytest.raises(ValueError, match="h"):
        project_to_box(T([2.0, 2.0]), c, lo=0.0, hi=4.0, impl=impl)  # raw budget 4 != 2


def test_case31_uniform_evidence_is_grpo():
    mask = torch.zeros(6, 5, dtype=torch.bool)
    for u, n in enumerate([1, 5, 3, 2, 4, 5]):
        mask[u, :n] = True
    b = make_batch([3, 3], L=5, gap=torch.full((6, 5), 0.37), mask=mask, outcome=T([1.0, 1, 1, 0, 0, 0]))
    cfg = CreditConfig(min_span_turns=1, max_span_turns=2, mixing=0.75)
    c = allocate_credit(**b, config=cfg)
    assert torch.equal(c.turn_weight, torch.ones(6))
    assert torch.equal(c.token_advantage, mask * c.advantage[:, None])


def test_case32_scores_and_weights():
    gap = T([[3.0], [0.0], [3.0], [0.0]])
    b = make_batch([2, 2], L=1, gap=gap, outcome=T([1.0, 1, -1, -1]))
    cfg = CreditConfig(mixing=1.0, credit_temperature=1.0)
    c = allocate_credit(**b, config=cfg)
    assert c.score.tolist() == [3.0, 0.0, -3.0, 0.0]
    hi = 2 * math.exp(3) / (math.exp(3) + 1)
    assert torch.allclose(c.turn_weight, T([hi, 2 - hi, 2 - hi, hi]), atol=1e-6)
    assert c.turn_weight.tolist()[0] == pytest.approx(1.905, abs=1e-3)
    assert float(c.turn_weight[:2].sum()) == pytest.approx(2.0) and float(c.turn_weight[2:].sum()) == pytest.approx(2.0)


def test_case33_zero_advantage():
    b = make_batch([3, 2], outcome=torch.full((5,), 0.5))
    c = allocate_credit(**b)
    assert torch.equal(c.advantage, torch.zeros(5))
    assert torch.equal(c.turn_weight, torch.ones(5))
    assert torch.equal(c.token_advantage, torch.zeros(5, 4))


def test_case34_projection_activation():
    gap = torch.where(torch.arange(8)[:, None] % 2 == 0, 20.0, -20.0).expand(8, 3).contiguous().requires_grad_(True)
    b = make_batch([4, 4], L=3, gap=gap, outcome=T([1.0] * 4 + [0.0] * 4))
    c = allocate_credit(**b, config=CreditConfig(density_upper_bound=1.5, mixing=0.5))
    assert c.metrics["m2/projection_activation_rate"] == 1.0
    assert float(c.turn_weight.min()) >= 0.5 - 1e-6 and float(c.turn_weight.max()) <= 1.25 + 1e-6
    assert float(c.turn_weight.max()) == pytest.approx(1.25, abs=1e-6)
    for t in (c.token_advantage, c.turn_weight, c.advantage, c.turn_gap):
        assert not t.requires_grad and t.dtype == torch.float32


# ------------------------------------------------------------------------------------------------ case 38-40


def test_case38_turn_scope_composes_with_m2():
    b = make_batch([3, 5, 2, 4], L=6, tasks=[0, 0, 1, 1], outcome=T([1.0] * 3 + [0.0] * 5 + [2.0] * 2 + [0.5] * 4))
    b["mask"] = torch.rand(14, 6, generator=torch.Generator().manual_seed(1)) < 0.7
    b["mask"][:, 0] = True
    c = allocate_credit(**b, config=CreditConfig(grpo_scope="turn", invalid_penalty=0.0))
    key = b["task"] * 100 + b["rollout"]
    for k in key.unique():
        sel = key == k
        n_tau = float(b["mask"][sel].sum())
        assert float(c.token_advantage[sel].sum()) == pytest.approx(float(c.advantage[sel][0]) * n_tau, abs=1e-4)


@pytest.mark.parametrize("band, eta", [(0.2, 0.5), (0.0, 0.5), (0.2, 0.0), (0.2, 1.0)])
def test_case39_bounded_mode(band, eta):
    g = torch.Generator().manual_seed(3)
    b = make_batch(
        [5, 6, 4], L=5, gap=torch.randn(15, 5, generator=g) * 3, outcome=T([1.0] * 5 + [0.0] * 6 + [3.0] * 4)
    )
    cfg = CreditConfig(weighting="bounded", multiplier_band=band, mixing=eta, invalid_penalty=0.0)
    c = allocate_credit(**b, config=cfg)
    w = c.turn_weight
    assert float(w.min()) >= 1 - band * eta - 1e-6 and float(w.max()) <= 1 + band * eta + 1e-6
    assert torch.equal(torch.sign(c.token_advantage), torch.sign(c.advantage)[:, None].expand(15, 5))
    key = b["rollout"]
    for k in key.unique():
        sel = key == k
        assert float(w[sel].sum()) == pytest.approx(float(sel.sum()), abs=1e-5)  # N_u equal: sum w = n
    assert bool((w == 1).all()) == (band * eta == 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_case40_random_projections(impl):
    g = torch.Generator().manual_seed(40)
    for _ in range(40):
        counts = torch.randint(1, 513, (17,), generator=g).double()
        q = torch.softmax(torch.randn(17, generator=g, dtype=torch.float64) * 2, 0)
        h = counts.sum() * q / counts
        x = project_batch(h, counts, T([0, 17]), 0.8, 1.2, 1e-5, impl)
        assert float(x.min()) >= 0.8 and float(x.max()) <= 1.2
        assert float((counts * x).sum()) == pytest.approx(float(counts.sum()), rel=1e-6)


# ------------------------------------------------------------------------------------------------ case 42-44


def test_case42_gaps_and_outcomes_never_change_structure():
    g = torch.Generator().manual_seed(42)
    b = make_batch([9, 7, 8], L=4)
    b["H"] = (torch.rand(24, 24, generator=g) * 0.4 + 0.6) * (b["task"][:, None] == b["task"][None, :])
    cfg = CreditConfig(gamma=0.7, min_span_turns=2, max_span_turns=4)
    c1 = allocate_credit(**b, config=cfg)
    b2 = dict(b, gap=torch.randn(24, 4, generator=g) * 10, outcome=T([3.0] * 9 + [-1.0] * 7 + [0.2] * 8))
    c2 = allocate_credit(**b2, config=cfg)
    for f in ("segment_index", "profile_valid", "boundary_distance", "boundary_valid", "boundary_kind"):
        assert torch.equal(getattr(c1, f), getattr(c2, f)), f
    assert c1.threshold == c2.threshold
    assert not torch.equal(c1.turn_weight, c2.turn_weight)


def test_case43_token_mode_bounded():
    # alternating gaps inside each turn: token weights vary, turn means stay near 1
    gap = torch.where(torch.arange(4) % 2 == 0, 1.0, -1.0).repeat(6, 1)
    b = make_batch([3, 3], L=4, gap=gap, outcome=T([1.0] * 3 + [0.0] * 3))
    c = allocate_credit(**b, config=CreditConfig(mode="token", weighting="bounded", invalid_penalty=0.0))
    tw = c.token_weight
    assert float(tw.max() - tw.min()) > 0.1
    assert float(c.turn_weight.min()) >= 0.9 and float(c.turn_weight.max()) <= 1.1
    assert torch.equal(c.segment_index, torch.full((6,), -1))
    assert torch.allclose(c.token_advantage, c.advantage[:, None] * tw)
    # no eta mixing: in legacy mode token weights use the whole box [0, 4]
    gap = torch.zeros(6, 4)
    gap[0, 0] = 10.0
    b = make_batch([3, 3], L=4, gap=gap, outcome=T([1.0] * 3 + [0.0] * 3))
    c = allocate_credit(**b, config=CreditConfig(mode="token", mixing=0.5))
    assert float(c.token_weight.max()) == pytest.approx(4.0)
    assert float(c.token_weight[:3].sum()) == pytest.approx(12.0, abs=1e-4)


@pytest.mark.parametrize("weighting", ["legacy", "bounded"])
def test_case44_flat_turn_mode(weighting, monkeypatch):
    n = 12
    lengths = [n, n, n]
    mask = torch.zeros(3 * n, 4, dtype=torch.bool)
    for u in range(3 * n):
        mask[u, : (u % 4) + 1] = True
    gap = torch.linspace(-1, 1, 3 * n)[:, None].expand(3 * n, 4).contiguous()
    for i in range(3):  # gaps increasing inside every trajectory
        gap[i * n : (i + 1) * n] = torch.linspace(-1, 1, n)[:, None]
    b = make_batch(lengths, L=4, gap=gap, mask=mask, outcome=T([1.0] * n + [-1.0] * n + [0.0] * n))

    def boom(*a, **k):
        raise AssertionError("segmentation must not run in mode 'turn'")

    monkeypatch.setattr(credit, "segment_trajectories", boom)
    monkeypatch.setattr(credit, "batch_distances", boom)
    tc = 0.5
    cfgs = [CreditConfig(mode="turn", weighting=weighting, max_span_turns=m, credit_temperature=tc) for m in (3, 8)]
    c, c_other = (allocate_credit(**b, config=cfg) for cfg in cfgs)
    assert torch.equal(c.turn_weight, c_other.turn_weight) and torch.equal(c.token_advantage, c_other.token_advantage)
    assert torch.equal(c.segment_index, torch.full((3 * n,), -1))
    w = c.turn_weight
    assert w[11] > w[0] and w[23] < w[12]
    assert torch.equal(w[24:], torch.ones(n))
    nu = mask.sum(1).double()
    for i in range(3):
        sl = slice(i * n, (i + 1) * n)
        assert float((nu[sl] * w[sl].double()).sum()) == pytest.approx(float(nu[sl].sum()), rel=1e-6)
    # q closed form: q_u = N_u exp(s_u / T_c) / sum, h_u = N_tau q_u / N_u
    s = c.score[:n].double()
    q = nu[:n] * torch.exp(s / tc)
    q = q / q.sum()
    h = nu[:n].sum() * q / nu[:n]
    assert torch.allclose(c.raw_density[:n].double(), h, atol=1e-5)


# ------------------------------------------------------------------------------------------------ invalid residual


def test_residual_added_after_allocation():
    b = make_batch([3, 3], L=2, outcome=T([1.0] * 3 + [0.0] * 3))
    invalid = T([False, True, False, False, False, False])
    base = allocate_credit(**b, config=CreditConfig(invalid_penalty=0.0), invalid=invalid)
    c = allocate_credit(**b, config=CreditConfig(invalid_penalty=0.1), invalid=invalid)
    assert torch.equal(c.turn_weight, base.turn_weight)  # outside budget conservation
    assert bool((c.residual != 0).all())
    expected = (c.advantage * c.turn_weight + c.residual)[:, None] * b["mask"]
    assert torch.allclose(c.token_advantage, expected, atol=1e-6)
    assert c.metrics["m2/invalid_residual_abs_mean"] > 0
    assert c.metrics["episode/valid_action_ratio"] == pytest.approx(5 / 6)


def test_advantage_exactly_zero_outside_mask():
    mask = torch.zeros(6, 5, dtype=torch.bool)
    mask[:, :2] = True
    b = make_batch([3, 3], L=5, mask=mask, outcome=T([1.0] * 3 + [-1.0] * 3))
    c = allocate_credit(**b, invalid=torch.ones(6, dtype=torch.bool))
    out = c.token_advantage[~mask]
    assert bool((out == 0).all()) and not bool(torch.signbit(out).any())


# ------------------------------------------------------------------------------------------------ metrics


def test_metrics_are_floats_and_cover_m2_list():
    b = make_batch([6, 6, 5], L=4)
    c = allocate_credit(**b, invalid=torch.zeros(17, dtype=torch.bool))
    assert all(isinstance(v, float) and math.isfinite(v) for v in c.metrics.values())
    for key in [
        "m2/segmentation_threshold",
        "m2/segmentation_threshold_available",
        "m2/valid_jsd_sample_count",
        "m2/near_zero_jsd_rate",
        "m2/normalized_jsd_p80",
        "m2/adjacent_pair_count",
        "m2/adjacent_profiles_valid_rate",
        "m2/structural_mask_change_rate",
        "m2/valid_jsd_pair_rate",
        "m2/profile_entropy_mean",
        "m2/profile_max_prob_mean",
        "m2/profile_top3_mass_mean",
        "m2/profile_effective_support_mean",
        "m2/raw_semantic_candidate_count",
        "m2/accepted_semantic_boundary_count",
        "m2/semantic_boundary_count",
        "m2/correspondence_guided_fallback_boundary_count",
        "m2/forced_max_boundary_count",
        "m2/segment_count",
        "m2/segment_length_mean",
        "m2/segment_length_std",
        "m2/segment_length_min",
        "m2/segment_length_max",
        "m2/segment_budget_entropy_mean",
        "m2/within_segment_turn_entropy_mean",
        "m2/raw_density_over_cap_rate",
        "m2/raw_density_under_floor_rate",
        "m2/projection_activation_rate",
        "m2/projection_mean_absolute_change",
        "m2/credit_conservation_error_max",
        "m2/mixed_credit_conservation_error_max",
        "m2/turn_gap_p95",
        "m2/outcome_aligned_score_mean",
        "m2/raw_density_std",
        "m2/projected_density_max",
        "m2/turn_weight_p95",
        "m2/turn_weight_corr_num_tokens",
        "m2/turn_weight_corr_turn_gap",
        "m2/turn_weight_corr_abs_turn_gap",
        "m2/turn_weight_corr_score",
        "m2/positive_outcome_alignment_rate",
        "m2/trajectory_advantage_mean",
        "m2/trajectory_advantage_std",
        "m2/trajectory_advantage_abs_mean",
        "m2/invalid_residual_abs_mean",
        "m2/grpo_normalization_turn",
        "episode/unique_trajectory_count",
        "episode/outcome_mean",
        "episode/outcome_std",
        "episode/outcome_positive_rate",
        "episode/outcome_perfect_rate",
        "episode/trajectory_length_mean",
        "episode/trajectory_length_max",
        "episode/valid_action_ratio",
    ]:
        assert key in c.metrics, key
    m = c.metrics
    assert m["m2/segment_count"] == float(c.segment_index.max() + 1)
    assert m["episode/unique_trajectory_count"] == 3.0 and m["episode/trajectory_length_max"] == 6.0
    assert m["m2/segment_length_mean"] == pytest.approx(17 / m["m2/segment_count"])
    n_kinds = sum(
        m[k]
        for k in (
            "m2/semantic_boundary_count",
            "m2/correspondence_guided_fallback_boundary_count",
            "m2/forced_max_boundary_count",
        )
    )
    assert m["m2/segment_count"] == 3 + n_kinds


# ------------------------------------------------------------------------------------------------ bad input


def _bad(**changes):
    b = make_batch([2, 2], L=3)
    b.update(changes)
    return b


@pytest.mark.parametrize(
    "changes, name",
    [
        (dict(gap=torch.zeros(4, 2)), "mask"),
        (dict(gap=torch.zeros(3, 3)), "gap"),
        (dict(mask=torch.ones(4, 2, dtype=torch.bool)), "mask"),
        (dict(gap=torch.zeros(4, 3).index_put((T([1]), T([2])), T(float("nan")))), "gap"),
        (dict(gap=torch.zeros(4, 3).index_put((T([0]), T([0])), T(float("inf")))), "gap"),
        (dict(H=torch.zeros(4, 4).index_put((T([0]), T([2])), T(float("nan")))), "H"),
        (dict(H=torch.zeros(4, 3)), "H"),
        (dict(eligible=torch.ones(4, 4)), "eligible"),
        (dict(outcome=T([1.0, 0.0, 0.0, 0.0])), "outcome"),
        (dict(outcome=T([1.0, 1.0, float("nan"), float("nan")])), "outcome"),
        (dict(outcome=T([1.0, 1.0, 0.0])), "outcome"),
        (dict(turn=T([0, 0, 0, 1])), "turn"),
        (dict(rollout=T([0, 0, 0, 0]), turn=T([0, 1, 2, 3])), "rollout"),
        (dict(task=T([0, 0, 1, 1])), "rollout"),
        (dict(mask=torch.ones(4, 3, dtype=torch.bool).index_put((T([2]),), T(False))), "mask"),
        (dict(mask=torch.full((4, 3), 0.5)), "mask"),
        (dict(turn=T([0.0, 1.0, 0.0, 1.0])), "turn"),
    ],
)
def test_allocate_credit_bad_input(changes, name):
    with pytest.raises(ValueError, match=name):
        allocate_credit(**_bad(**changes))


def test_invalid_flag_bad_input():
    with pytest.raises(ValueError, match="invalid"):
        allocate_credit(**_bad(), invalid=T([True, False]))
    with pytest.raises(ValueError, match="config"):
        allocate_credit(**_bad(), config={"mode": "adaptive"})


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(mode="flat"), "mode"),
        (dict(weighting="soft"), "weighting"),
        (dict(distance="kl"), "distance"),
        (dict(grpo_scope="batch"), "grpo_scope"),
        (dict(impl="cuda"), "impl"),
        (dict(credit_temperature=0.0), "credit_temperature"),
        (dict(mixing=1.5), "mixing"),
        (dict(density_upper_bound=0.5), "density_upper_bound"),
        (dict(multiplier_band=-0.1), "multiplier_band"),
        (dict(profile_temperature=0.0), "profile_temperature"),
        (dict(quantile=1.2), "quantile"),
        (dict(tau_min=0.2, tau_max=0.1), "tau_max"),
        (dict(min_span_turns=0), "min_span_turns"),
        (dict(min_span_turns=3, max_span_turns=4), "max_span_turns"),
        (dict(min_span_turns=2.0), "min_span_turns"),
        (dict(gamma=float("nan")), "gamma"),
        (dict(norm_by_std=1), "norm_by_std"),
        (dict(invalid_penalty=-1.0), "invalid_penalty"),
        (dict(seed="0"), "seed"),
    ],
)
def test_config_validation(kwargs, name):
    with pytest.raises(ValueError, match=name):
        CreditConfig(**kwargs)


def test_public_function_bad_input():
    with pytest.raises(ValueError, match="H"):
        correspondence_profiles(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), gamma=0.7)
    with pytest.raises(ValueError, match="H"):
        correspondence_profiles(T([[0.0, float("inf")], [0.0, 0.0]]), torch.ones(2, 2, dtype=torch.bool), gamma=0.7)
    with pytest.raises(ValueError, match="distance"):
        boundary_scores(
            torch.eye(2),
            torch.ones(2, dtype=torch.bool),
            torch.ones(2, 2, dtype=torch.bool),
            T([0, 0]),
            T([0, 0]),
            T([0, 1]),
            distance="kl",
        )
    with pytest.raises(ValueError, match="turn"):
        boundary_scores(
            torch.eye(2),
            torch.ones(2, dtype=torch.bool),
            torch.ones(2, 2, dtype=torch.bool),
            T([0, 0]),
            T([0, 0]),
            T([1, 1]),
        )
    with pytest.raises(ValueError, match="d"):
        segmentation_threshold(T([0.1, float("nan")]), T([True, True]))
    with pytest.raises(ValueError, match="boundary_valid"):
        segment(torch.zeros(4), torch.ones(3, dtype=torch.bool), tau=0.1)
    with pytest.raises(ValueError, match="max_len"):
        segment(torch.zeros(4), torch.ones(4, dtype=torch.bool), tau=0.1, min_len=3, max_len=4)
    with pytest.raises(ValueError, match="seed"):
        segment_random(5, seed=1.5)
    with pytest.raises(ValueError, match="counts"):
        project_to_box(T([1.0, 1.0]), T([1.0]), lo=0.0, hi=2.0)
    with pytest.raises(ValueError, match="counts"):
        project_to_box(T([1.0, 1.0]), T([1.0, 0.0]), lo=0.0, hi=2.0, impl="python")
    with pytest.raises(ValueError, match="lo"):
        project_to_box(T([1.0, 1.0]), T([1.0, 1.0]), lo=1.5, hi=2.0)
    with pytest.raises(ValueError, match="hi"):
        project_to_box(T([1.0, 1.0]), T([1.0, 1.0]), lo=0.0, hi=0.5)
    with pytest.raises(ValueError, match="impl"):
        project_to_box(T([1.0, 1.0]), T([1.0, 1.0]), lo=0.0, hi=2.0, impl="gpu")


def test_sorted_equal_task_blocks_fast_path_matches_reference_and_gather_path():
    # identity order with equal task sizes takes the strided-view path; a permutation takes the gather path
    g = torch.Generator().manual_seed(11)
    b = make_batch([7, 7, 7, 7, 7, 7], L=5, tasks=[0, 0, 0, 1, 1, 1], outcome=T([1.0] * 14 + [0.0] * 7 + [2.0] * 21))
    emb = torch.nn.functional.normalize(torch.randn(42, 6, generator=g) + torch.randn(1, 6, generator=g), dim=-1)
    b["H"] = (emb @ emb.T) * (b["task"][:, None] == b["task"][None, :])
    cfg = CreditConfig(gamma=0.5, min_span_turns=2, max_span_turns=3)
    from alignopsd.testing import allocate_credit_ref

    c = allocate_credit(**b, config=cfg)
    r = allocate_credit_ref(**b, config=cfg)
    assert torch.equal(c.segment_index, r.segment_index)
    assert torch.allclose(c.token_advantage, r.token_advantage, atol=1e-5)
    perm = torch.randperm(42, generator=g)
    pb = {k: (v[perm][:, perm] if k in ("H", "eligible") else v[perm]) for k, v in b.items()}
    cp = allocate_credit(**pb, config=cfg)
    assert torch.equal(c.token_advantage[perm], cp.token_advantage)
    assert torch.equal(c.segment_index[perm], cp.segment_index)


def test_metric_values_against_direct_recomputation():
    g = torch.Generator().manual_seed(5)
    b = make_batch([6, 5, 7, 4], L=6, tasks=[0, 0, 1, 1], outcome=T([1.0] * 6 + [0.0] * 5 + [0.0] * 7 + [2.0] * 4))
    b["H"] = (torch.rand(22, 22, generator=g) * 0.5 + 0.5) * (b["task"][:, None] == b["task"][None, :])
    b["mask"] = torch.rand(22, 6, generator=g) < 0.6
    b["mask"][:, 0] = True
    invalid = torch.rand(22, generator=g) < 0.3
    cfg = CreditConfig(gamma=0.8, min_span_turns=2, max_span_turns=3, density_upper_bound=1.3)
    c = allocate_credit(**b, config=cfg, invalid=invalid)
    m = c.metrics
    n_u = b["mask"].sum(1).double()
    assert m["m2/profile_valid_rate"] == pytest.approx(float(c.profile_valid.double().mean()))
    assert m["m2/adjacent_pair_count"] == 22 - 4
    assert m["m2/valid_jsd_sample_count"] == float(c.boundary_valid.sum())
    assert m["m2/valid_jsd_pair_rate"] == pytest.approx(float(c.boundary_valid.sum()) / 18)
    d = c.boundary_distance[c.boundary_valid].double()
    assert m["m2/normalized_jsd_mean"] == pytest.approx(float(d.mean()))
    assert m["m2/normalized_jsd_max"] == pytest.approx(float(d.max()))
    assert m["m2/normalized_jsd_p80"] == pytest.approx(float(torch.quantile(d, 0.8)))
    tau = c.threshold
    assert m["m2/segmentation_threshold"] == pytest.approx(tau)
    assert m["m2/raw_semantic_candidate_count"] == float(
        (c.boundary_valid & (c.boundary_distance.double() > tau)).sum()
    )
    kinds = c.boundary_kind
    assert m["m2/semantic_boundary_count"] == float((kinds == 1).sum())
    assert m["m2/correspondence_guided_fallback_boundary_count"] == float((kinds == 2).sum())
    assert m["m2/forced_max_boundary_count"] == float((kinds == 3).sum())
    seg_len = torch.bincount(c.segment_index).double()
    assert m["m2/segment_count"] == float(seg_len.numel())
    assert m["m2/segment_length_mean"] == pytest.approx(float(seg_len.mean()))
    assert m["m2/segment_length_max"] == float(seg_len.max()) and m["m2/segment_length_min"] == float(seg_len.min())
    assert float(seg_len.max()) <= 3
    h, x = c.raw_density.double(), c.density.double()
    assert m["m2/raw_density_over_cap_rate"] == pytest.approx(float((h > 1.3).double().mean()))
    key = b["task"] * 100 + b["rollout"]
    left = [bool(((h[key == k] > 1.3) | (h[key == k] < 0)).any()) for k in key.unique()]
    assert m["m2/projection_activation_rate"] == pytest.approx(sum(left) / 4)
    assert m["m2/projection_mean_absolute_change"] == pytest.approx(float((x - h).abs().mean()), abs=1e-6)
    assert m["m2/credit_conservation_error_max"] < 1e-9 and m["m2/mixed_credit_conservation_error_max"] < 1e-9
    w = c.turn_weight.double()
    assert m["m2/turn_weight_mean"] == pytest.approx(float(w.mean()))
    assert m["m2/turn_weight_p95"] == pytest.approx(float(torch.quantile(w, 0.95)), abs=1e-6)
    assert m["m2/turn_weight_corr_num_tokens"] == pytest.approx(
        float(torch.corrcoef(torch.stack([w, n_u]))[0, 1]), abs=1e-6
    )
    assert m["m2/turn_weight_corr_score"] == pytest.approx(
        float(torch.corrcoef(torch.stack([w, c.score.double()]))[0, 1]), abs=1e-5
    )
    assert m["m2/positive_outcome_alignment_rate"] == pytest.approx(float((c.score > 0).double().mean()))
    a_traj = torch.stack([c.advantage[key == k][0] for k in key.unique()]).double()
    assert m["m2/trajectory_advantage_abs_mean"] == pytest.approx(float(a_traj.abs().mean()), abs=1e-6)
    assert m["m2/invalid_residual_abs_mean"] == pytest.approx(float(c.residual.double().abs().mean()), abs=1e-6)
    assert m["episode/valid_action_ratio"] == pytest.approx(float((~invalid).double().mean()))
    assert m["episode/outcome_perfect_rate"] == pytest.approx(0.5) and m["episode/outcome_positive_rate"] == 0.5
    assert m["episode/trajectory_length_mean"] == pytest.approx(5.5)


def test_random_spans_use_seed_plus_sorted_trajectory_index():
    lengths = [11, 6, 9, 13]
    b = make_batch(lengths, L=3, tasks=[5, 5, 2, 2])  # sorted (task, rollout): (2,2), (2,3), (5,0), (5,1)
    perm = torch.randperm(39, generator=torch.Generator().manual_seed(3))
    pb = {k: (v[perm][:, perm] if k in ("H", "eligible") else v[perm]) for k, v in b.items()}
    cfg = CreditConfig(mode="random", seed=17, min_span_turns=2, max_span_turns=3)
    c = allocate_credit(**pb, config=cfg)
    key = pb["task"] * 100 + pb["rollout"]
    starts = []
    for j, k in enumerate(sorted(key.unique().tolist())):
        sel = torch.nonzero(key == k).flatten()
        sel = sel[torch.argsort(pb["turn"][sel])]
        seg = c.segment_index[sel]
        cuts = [p for p in range(1, sel.numel()) if seg[p] != seg[p - 1]]
        expected = segment_random(sel.numel(), min_len=2, max_len=3, seed=17 + j)
        assert cuts == expected.random, (j, cuts, expected.random)
        assert bool((c.boundary_kind[sel[cuts]] == 4).all())
        starts.append(int(seg[0]))
    assert starts == sorted(starts) and starts[0] == 0  # global indices in sorted (task, rollout) order
    assert c.metrics["m2/semantic_boundary_count"] == 0.0 and c.metrics["m2/random_boundary_count"] > 0
