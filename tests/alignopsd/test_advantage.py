"""Outcome advantage and invalid-action residual: ALGORITHM.md §3.1, §3.10; §6 cases 36, 37, 41."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from alignopsd.advantage import grpo_advantage, invalid_action_residual
from alignopsd.testing import grpo_advantage_ref, invalid_action_residual_ref

T = torch.tensor


def test_case37_trajectory_scope():
    # rollouts of 3 and 1 turns, R = [1, 1, 1, -1]: trajectory values [1, -1], mean 0, unbiased std sqrt(2)
    a = grpo_advantage(T([1.0, 1, 1, -1]), T([0, 0, 0, 0]), T([0, 0, 0, 1]))
    expected = 1.0 / (math.sqrt(2.0) + 1e-6)
    assert torch.allclose(a, T([expected, expected, expected, -expected]), atol=1e-7)
    assert a.dtype == torch.float32


def test_case37_turn_scope_with_and_without_std():
    out, task, roll = T([1.0, 0, 0, 0]), T([0, 0, 0, 0]), T([0, 1, 1, 1])
    a = grpo_advantage(out, task, roll, scope="turn")
    assert torch.allclose(a, T([1.5, -0.5, -0.5, -0.5]), atol=1e-5)
    a = grpo_advantage(out, task, roll, scope="turn", norm_by_std=False)
    assert torch.allclose(a, T([0.75, -0.25, -0.25, -0.25]), atol=1e-7)


def test_case37_constant_outcome_gives_exact_zero():
    for scope in ("trajectory", "turn"):
        a = grpo_advantage(T([0.1, 0.1, 0.1, 0.1]), T([0, 0, 0, 0]), T([0, 1, 2, 2]), scope=scope)
        assert torch.equal(a, torch.zeros(4))


def test_case37_invalid_scope_rejected():
    with pytest.raises(ValueError, match="scope"):
        grpo_advantage(T([1.0, 0]), T([0, 0]), T([0, 1]), scope="batch")


def test_case36_advantage_varying_inside_trajectory_rejected():
    with pytest.raises(ValueError, match="outcome"):
        grpo_advantage(T([1.0, 0.0, 1.0]), T([0, 0, 0]), T([0, 0, 1]))


def test_tasks_are_normalised_separately_and_order_is_free():
    out = T([1.0, 0.0, 5.0, 3.0, 1.0, 3.0])
    task = T([7, 7, 2, 2, 7, 2])
    roll = T([0, 1, 4, 5, 0, 5])
    a = grpo_advantage(out, task, roll)
    s7 = 0.5 / (math.sqrt(0.5) + 1e-6)  # task 7: R = [1, 0]
    s2 = 1.0 / (math.sqrt(2.0) + 1e-6)  # task 2: R = [5, 3]
    assert torch.allclose(a, T([s7, -s7, s2, -s2, s7, -s2]), atol=1e-7)


def test_fewer_than_two_rollouts_rejected():
    with pytest.raises(ValueError, match="rollout"):
        grpo_advantage(T([1.0, 1.0, 0.0, 2.0]), T([0, 0, 1, 1]), T([0, 0, 0, 1]))


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(outcome=T([1.0, float("nan")]), task=T([0, 0]), rollout=T([0, 1])), "outcome"),
        (dict(outcome=T([1.0, float("inf")]), task=T([0, 0]), rollout=T([0, 1])), "outcome"),
        (dict(outcome=T([1.0, 0.0, 2.0]), task=T([0, 0]), rollout=T([0, 1])), "outcome"),
        (dict(outcome=T([1.0, 0.0]), task=T([0, 0, 0]), rollout=T([0, 1])), "rollout"),
        (dict(outcome=T([1.0, 0.0]), task=T([0.0, 0.0]), rollout=T([0, 1])), "task"),
    ],
)
def test_grpo_bad_input(kwargs, name):
    with pytest.raises(ValueError, match=name):
        grpo_advantage(**kwargs)


def test_case41_invalid_residual():
    r, task = T([1.0, 1, -1, -1]), T([0, 0, 0, 0])
    zero = invalid_action_residual(r, T([False] * 4), task, penalty=0.1)
    assert torch.equal(zero, torch.zeros(4))
    res = invalid_action_residual(r, T([False, True, False, False]), task, penalty=0.1)
    assert torch.allclose(res, T([0.0438, -0.0450, 0.0006, 0.0006]), atol=5e-5)
    # one invalid turn shifts every turn of its task, and no other task
    res2 = invalid_action_residual(
        T([1.0, 1, -1, -1, 3, 4]), T([False, True, False, False, False, False]), T([0, 0, 0, 0, 1, 1]), penalty=0.1
    )
    assert torch.allclose(res2[:4], res, atol=1e-7)
    assert torch.equal(res2[4:], torch.zeros(2))


def test_invalid_residual_without_std_normalisation_centres_only():
    """grpo_normalize_by_std false: both normalisations subtract the task mean only (§3.10)."""
    r, task, inv = T([1.0, 1, -1, -1]), T([0, 0, 0, 0]), T([False, True, False, False])
    res = invalid_action_residual(r, inv, task, penalty=0.1, norm_by_std=False)
    # (R - c*inv) - mean(R - c*inv) - (R - mean R) = -c*inv + c/4
    assert torch.allclose(res, T([0.025, -0.075, 0.025, 0.025]), atol=1e-7)
    assert not torch.allclose(res, invalid_action_residual(r, inv, task, penalty=0.1), atol=1e-3)
    with pytest.raises(ValueError, match="norm_by_std"):
        invalid_action_residual(r, inv, task, penalty=0.1, norm_by_std="no")


def test_invalid_residual_single_turn_task_uses_mean0_std1():
    res = invalid_action_residual(T([2.0]), T([True]), T([3]), penalty=0.25)
    assert torch.allclose(res, T([-0.25]))


@pytest.mark.parametrize(
    "args, kwargs, name",
    [
        ((T([1.0, 0.0]), T([True]), T([0, 0])), dict(penalty=0.1), "invalid"),
        ((T([1.0, 0.0]), T([0.5, 0.0]), T([0, 0])), dict(penalty=0.1), "invalid"),
        ((T([1.0, float("nan")]), T([True, False]), T([0, 0])), dict(penalty=0.1), "outcome"),
        ((T([1.0, 0.0]), T([True, False]), T([0, 0])), dict(penalty=-0.1), "penalty"),
        ((T([1.0, 0.0]), T([True, False]), T([0, 0])), dict(penalty=float("nan")), "penalty"),
    ],
)
def test_invalid_residual_bad_input(args, kwargs, name):
    with pytest.raises(ValueError, match=name):
        invalid_action_residual(*args, **kwargs)


@st.composite
def _groups(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    tasks = draw(st.integers(1, 3))
    rows = []
    for t in range(tasks):
        n_roll = draw(st.integers(2, 4))
        for r in range(n_roll):
            value = float(torch.randint(-2, 3, (1,), generator=g)) * 0.5
            for _ in range(draw(st.integers(1, 4))):
                rows.append((t * 10 + 3, r * 7 + 1, value))
    perm = torch.randperm(len(rows), generator=g).tolist()
    rows = [rows[i] for i in perm]
    task = T([x[0] for x in rows])
    roll = T([x[1] for x in rows])
    out = T([x[2] for x in rows])
    invalid = torch.rand(len(rows), generator=g) < 0.3
    return out, task, roll, invalid


@settings(max_examples=40, deadline=None)
@given(_groups(), st.sampled_from(["trajectory", "turn"]), st.booleans())
def test_grpo_matches_loop_reference(batch, scope, norm):
    out, task, roll, _ = batch
    a = grpo_advantage(out, task, roll, scope=scope, norm_by_std=norm)
    ref = grpo_advantage_ref(out, task, roll, scope=scope, norm_by_std=norm)
    assert torch.allclose(a, ref, atol=1e-6, rtol=1e-6)


@settings(max_examples=40, deadline=None)
@given(_groups(), st.sampled_from([0.0, 0.01, 0.1, 1.0]), st.booleans())
def test_residual_matches_loop_reference(batch, penalty, norm):
    out, task, _, invalid = batch
    r = invalid_action_residual(out, invalid, task, penalty=penalty, norm_by_std=norm)
    ref = invalid_action_residual_ref(out, invalid, task, penalty=penalty, norm_by_std=norm)
    assert torch.allclose(r, ref, atol=1e-5, rtol=1e-6)
    if penalty == 0.0 or not bool(invalid.any()):
        assert torch.equal(r, torch.zeros_like(r))
