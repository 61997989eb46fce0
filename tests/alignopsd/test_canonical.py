"""Canonical turns (ALGORITHM.md §1.2, §6 cases 4–6)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from alignopsd.canonical import canonicalize


def test_case4_grouping_and_expand():
    can = canonicalize(["u"] * 4, ["r1", "r1", "r2", "r1"], [0, 1, 0, 0])
    assert can.num_turns == 3 and can.num_rows == 4
    assert can.identities == [("u", "r1", 0), ("u", "r1", 1), ("u", "r2", 0)]
    assert can.canonical_to_rows[0] == [0, 3]
    assert can.row_to_canonical.tolist() == [0, 1, 2, 0]
    assert can.first_row.tolist() == [0, 1, 2]
    assert can.expand(torch.tensor([[10], [20], [30]])).tolist() == [[10], [20], [30], [10]]
    assert can.expand(["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert can.gather(torch.tensor([5, 6, 7, 5])).tolist() == [5, 6, 7]
    assert can.task.tolist() == [0, 0, 0] and can.rollout.tolist() == [0, 0, 1] and can.turn.tolist() == [0, 1, 0]


def test_case5_multiplicity_weights():
    can = canonicalize(["u", "u", "u"], ["r1", "r2", "r1"], [0, 0, 0])
    torch.testing.assert_close(can.row_weight, torch.tensor([0.5, 1.0, 0.5]))
    # each canonical turn carries exactly one unit of mass
    mass = torch.zeros(can.num_turns).index_add_(0, can.row_to_canonical, can.row_weight)
    torch.testing.assert_close(mass, torch.ones(can.num_turns))


def test_lexicographic_string_and_int_order():
    # task ids are compared as strings, turns as integers
    can = canonicalize([10, 9, 9], ["b", "a", "a"], [0, 10, 2])
    assert can.identities == [("10", "b", 0), ("9", "a", 2), ("9", "a", 10)]
    assert can.task.tolist() == [0, 1, 1] and can.turn.tolist() == [0, 2, 10]


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_case6_identities_independent_of_batch_order(seed):
    g = torch.Generator().manual_seed(seed)
    R = 12
    tasks = [f"t{int(x)}" for x in torch.randint(0, 3, (R,), generator=g)]
    rolls = [f"r{int(x)}" for x in torch.randint(0, 3, (R,), generator=g)]
    turns = torch.randint(0, 3, (R,), generator=g).tolist()
    values = torch.tensor([hash((t, r, u)) % 1000 for t, r, u in zip(tasks, rolls, turns)])
    a = canonicalize(tasks, rolls, turns, fields={"values": values})
    perm = torch.randperm(R, generator=g).tolist()
    b = canonicalize([tasks[i] for i in perm], [rolls[i] for i in perm], [turns[i] for i in perm])
    assert a.identities == b.identities
    assert torch.equal(a.task, b.task) and torch.equal(a.rollout, b.rollout) and torch.equal(a.turn, b.turn)
    assert torch.equal(a.counts, b.counts)
    assert torch.equal(a.gather(values), b.gather(values[perm]))


def test_copy_consistency_names_the_field():
    ids = torch.tensor([[1, 2], [3, 4], [1, 2]])
    canonicalize(["u"] * 3, ["a", "b", "a"], [0, 0, 0], fields={"input_ids": ids, "data_source": ["x", "y", "x"]})
    bad = ids.clone()
    bad[2, 1] = 9
    with pytest.raises(ValueError, match="input_ids"):
        canonicalize(["u"] * 3, ["a", "b", "a"], [0, 0, 0], fields={"input_ids": bad})
    with pytest.raises(ValueError, match="gamefile"):
        canonicalize(["u"] * 3, ["a", "b", "a"], [0, 0, 0], fields={"gamefile": ["g1", "g2", "g3"]})
    with pytest.raises(ValueError, match="episode_rewards"):
        canonicalize(["u"] * 3, ["a", "b", "a"], [0, 0, 0], fields={"episode_rewards": torch.tensor([1.0, 0.0, 0.5])})
    # NaN copies are equal to each other
    canonicalize(["u"] * 2, ["a", "a"], [0, 0], fields={"x": torch.tensor([float("nan"), float("nan")])})


def test_bad_inputs():
    with pytest.raises(ValueError, match="rollout_ids"):
        canonicalize(["u", "u"], ["a"], [0, 1])
    with pytest.raises(ValueError, match="turn_ids"):
        canonicalize(["u"], ["a"], [0.5])
    with pytest.raises(ValueError, match="turn_ids"):
        canonicalize(["u"], ["a"], [True])
    with pytest.raises(ValueError, match="input_ids"):
        canonicalize(["u"], ["a"], [0], fields={"input_ids": torch.zeros(2, 3)})
    can = canonicalize(["u"], ["a"], [0])
    with pytest.raises(ValueError, match="values"):
        can.expand(torch.zeros(2))
