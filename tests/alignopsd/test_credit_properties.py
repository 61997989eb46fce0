"""Property tests of Mechanism 2 over random batches (hypothesis).

Conservation, bounds, sign preservation, invariance to the order of turns, uniform evidence = GRPO,
zero advantage = zero token advantage, and every vectorised function against its loop reference.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from alignopsd.credit import CreditConfig, allocate_credit
from alignopsd.profiles import boundary_scores, correspondence_profiles, segmentation_threshold
from alignopsd.testing import (
    allocate_credit_ref,
    boundary_scores_ref,
    correspondence_profiles_ref,
    segmentation_threshold_ref,
)

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
# the float64 loop references may break a near-tie of float32 distances differently; a fixed example
# set keeps CI reproducible for those comparisons (the exact invariants below explore freely)
REF_SETTINGS = dict(SETTINGS, derandomize=True)
MODES = ["adaptive", "turn", "token", "random"]


@st.composite
def batches(draw, max_tasks: int = 3, max_turns: int = 9):
    """A random batch with task/rollout structure: phased embeddings make profiles and boundaries non-trivial."""
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    n_tasks = draw(st.integers(1, max_tasks))
    L = draw(st.integers(1, 6))
    dim, phases = 8, 3
    rows = []  # (task id, rollout id, turn id, phase)
    outcome_of = {}
    for t in range(n_tasks):
        task_id = 3 * t + int(torch.randint(0, 3, (1,), generator=g))
        proto_phase = torch.randint(0, phases, (1,), generator=g)
        for r in range(draw(st.integers(2, 4))):
            roll_id = 5 * r + int(torch.randint(0, 5, (1,), generator=g))
            n = draw(st.integers(1, max_turns))
            turn_ids = torch.sort(torch.randperm(2 * n, generator=g)[:n]).values.tolist()
            outcome_of[(task_id, roll_id)] = float(torch.randint(0, 4, (1,), generator=g)) * 0.5
            for k, tid in enumerate(turn_ids):
                rows.append((task_id, roll_id, tid, (int(proto_phase) + (k * phases) // n) % phases))
    m = len(rows)
    perm = torch.randperm(m, generator=g).tolist()
    rows = [rows[i] for i in perm]
    task = torch.tensor([x[0] for x in rows])
    roll = torch.tensor([x[1] for x in rows])
    turn = torch.tensor([x[2] for x in rows])
    phase = torch.tensor([x[3] for x in rows])
    proto = torch.nn.functional.normalize(torch.randn(max(task.tolist()) + 1, phases, dim, generator=g), dim=-1)
    base = proto[task, phase]
    noise = draw(st.sampled_from([0.2, 0.5, 1.0]))
    teacher = torch.nn.functional.normalize(base + noise * torch.randn(m, dim, generator=g) / math.sqrt(dim), dim=-1)
    student = torch.nn.functional.normalize(base + noise * torch.randn(m, dim, generator=g) / math.sqrt(dim), dim=-1)
    same = task[:, None] == task[None, :]
    H = (teacher @ student.T).clamp(-1, 1) * same
    valid_t = torch.rand(m, generator=g) > 0.15
    valid_s = torch.rand(m, generator=g) > 0.15
    E = same & (roll[:, None] != roll[None, :]) & valid_t[:, None] & valid_s[None, :]
    lens = torch.randint(1, L + 1, (m,), generator=g)
    mask = torch.arange(L)[None, :] < lens[:, None]
    gap = torch.randn(m, L, generator=g) * float(draw(st.sampled_from([0.1, 1.0, 5.0])))
    outcome = torch.tensor([outcome_of[(int(a), int(b))] for a, b in zip(task, roll)])
    invalid = torch.rand(m, generator=g) < 0.2
    gamma = float(draw(st.sampled_from([0.3, 0.6, 0.9])))
    return (
        dict(gap=gap, mask=mask, outcome=outcome, task=task, rollout=roll, turn=turn, H=H, eligible=E),
        invalid,
        gamma,
    )


def _config(mode, weighting, gamma, **kw):
    return CreditConfig(mode=mode, weighting=weighting, gamma=gamma, min_span_turns=2, max_span_turns=4, **kw)


def _traj_keys(b):
    return b["task"] * 1000 + b["rollout"]


@settings(max_examples=30, **REF_SETTINGS)
@given(batches(), st.sampled_from(MODES), st.sampled_from(["legacy", "bounded"]), st.booleans())
def test_allocate_credit_matches_loop_reference(data, mode, weighting, with_invalid):
    b, invalid, gamma = data
    cfg = _config(mode, weighting, gamma, seed=7)
    inv = invalid if with_invalid else None
    c = allocate_credit(**b, config=cfg, invalid=inv)
    r = allocate_credit_ref(**b, config=cfg, invalid=inv)
    assert torch.equal(c.profile_valid, r.profile_valid)
    assert torch.equal(c.boundary_valid, r.boundary_valid)
    assert torch.allclose(c.boundary_distance, r.boundary_distance, atol=1e-5)
    assert torch.equal(c.segment_index, r.segment_index)
    if math.isinf(r.threshold):
        assert math.isinf(c.threshold)
    else:
        assert c.threshold == pytest.approx(r.threshold, abs=1e-5)
    for f in ("advantage", "turn_gap", "score", "raw_density", "density", "turn_weight", "residual"):
        assert torch.allclose(getattr(c, f), getattr(r, f), atol=2e-5, rtol=1e-5), f
    assert torch.allclose(c.token_advantage, r.token_advantage, atol=2e-5, rtol=1e-5)


@settings(max_examples=25, **REF_SETTINGS)
@given(batches(), st.sampled_from(["jsd", "entropy", "cosine"]), st.sampled_from([0.5, 0.8, 1.0]))
def test_profiles_distances_threshold_match_loop_reference(data, distance, q):
    b, _, gamma = data
    P, valid = correspondence_profiles(b["H"], b["eligible"], gamma=gamma, temperature=0.1)
    P_ref, valid_ref = correspondence_profiles_ref(b["H"], b["eligible"], gamma=gamma, temperature=0.1)
    assert torch.equal(valid, valid_ref)
    assert torch.allclose(P, P_ref, atol=1e-6)
    ids = (b["task"], b["rollout"], b["turn"])
    d, bv = boundary_scores(P, valid, b["eligible"], *ids, distance=distance)
    d_ref, bv_ref = boundary_scores_ref(P, valid, b["eligible"], *ids, distance=distance)
    assert torch.equal(bv, bv_ref)
    assert torch.allclose(d, d_ref, atol=1e-5)
    tau = segmentation_threshold(d, bv, quantile=q, tau_min=0.01, tau_max=0.1)
    tau_ref = segmentation_threshold_ref(d, bv, quantile=q, tau_min=0.01, tau_max=0.1)
    assert (math.isinf(tau) and math.isinf(tau_ref)) or tau == pytest.approx(tau_ref, abs=1e-7)


@settings(max_examples=40, **SETTINGS)
@given(
    batches(),
    st.sampled_from(MODES),
    st.sampled_from(["legacy", "bounded"]),
    st.sampled_from([0.0, 0.3, 0.5, 1.0]),
    st.sampled_from([0.1, 0.5, 2.0]),
)
def test_conservation_bounds_sign(data, mode, weighting, eta, tc):
    b, _, gamma = data
    cfg = _config(mode, weighting, gamma, mixing=eta, credit_temperature=tc)
    c = allocate_credit(**b, config=cfg)
    lo, hi = cfg.box
    mask = b["mask"]
    n_u = mask.sum(1).double()
    key = _traj_keys(b)
    for k in key.unique():
        sel = key == k
        n_tau = float(n_u[sel].sum())
        # sum_u N_u w_u = N_tau (token mode: sum of token weights = N_tau)
        if mode == "token":
            total = float(c.token_weight[sel].double().sum())
        else:
            total = float((n_u[sel] * c.turn_weight[sel].double()).sum())
        assert total == pytest.approx(n_tau, rel=1e-5)
        a = float(c.advantage[sel][0])
        assert float(c.token_advantage[sel].double().sum()) == pytest.approx(a * n_tau, rel=1e-4, abs=1e-4)
    if mode == "token":
        tw = c.token_weight[mask]
        assert float(tw.min()) >= lo - 1e-6 and float(tw.max()) <= hi + 1e-6
    else:
        w = c.turn_weight
        assert float(w.min()) >= (1 - eta) + eta * lo - 1e-6
        assert float(w.max()) <= (1 - eta) + eta * hi + 1e-6
    # sign preservation: the token advantage never opposes the outcome advantage
    sign = torch.sign(c.advantage)[:, None]
    assert bool((torch.sign(c.token_advantage) * sign >= 0).all())
    if mode != "token" and not (lo == 0 and eta == 1):
        assert torch.equal(torch.sign(c.token_advantage), sign * mask)
    assert bool((c.token_advantage[~mask] == 0).all())


@settings(max_examples=25, **SETTINGS)
@given(batches(), st.sampled_from(MODES), st.integers(0, 2**31 - 1))
def test_invariance_to_turn_order(data, mode, perm_seed):
    b, invalid, gamma = data
    cfg = _config(mode, "legacy", gamma)
    m = b["task"].shape[0]
    perm = torch.randperm(m, generator=torch.Generator().manual_seed(perm_seed))
    pb = {k: (v[perm][:, perm] if k in ("H", "eligible") else v[perm]) for k, v in b.items()}
    c = allocate_credit(**b, config=cfg, invalid=invalid)
    cp = allocate_credit(**pb, config=cfg, invalid=invalid[perm])
    for f in (
        "advantage",
        "turn_weight",
        "token_advantage",
        "segment_index",
        "turn_gap",
        "raw_density",
        "density",
        "residual",
        "boundary_kind",
        "boundary_distance",
        "profile_valid",
    ):
        assert torch.equal(getattr(c, f)[perm], getattr(cp, f)), f
    assert c.threshold == cp.threshold
    assert c.metrics == cp.metrics


@settings(max_examples=25, **SETTINGS)
@given(batches(), st.sampled_from(MODES), st.sampled_from(["legacy", "bounded"]), st.floats(-3, 3))
def test_uniform_evidence_is_exactly_grpo(data, mode, weighting, value):
    b, _, gamma = data
    b = dict(b, gap=torch.full_like(b["gap"], value))
    cfg = _config(mode, weighting, gamma, mixing=0.75)
    c = allocate_credit(**b, config=cfg)
    assert torch.equal(c.turn_weight, torch.ones_like(c.turn_weight))
    assert torch.equal(c.token_advantage, b["mask"] * c.advantage[:, None])


@settings(max_examples=20, **SETTINGS)
@given(batches(), st.sampled_from(MODES))
def test_zero_advantage_gives_zero_token_advantage(data, mode):
    b, _, gamma = data
    b = dict(b, outcome=torch.full_like(b["outcome"], 0.5))
    c = allocate_credit(**b, config=_config(mode, "legacy", gamma))
    assert torch.equal(c.advantage, torch.zeros_like(c.advantage))
    assert torch.equal(c.token_advantage, torch.zeros_like(c.token_advantage))
    assert torch.equal(c.turn_weight, torch.ones_like(c.turn_weight))
