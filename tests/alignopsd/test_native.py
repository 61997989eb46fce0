"""The C++ paths (alignopsd._C): bit-identical to the Python paths, input checks, impl resolution."""

from __future__ import annotations

import importlib.util
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from alignopsd import _native
from alignopsd.credit import CreditConfig, allocate_credit
from alignopsd.projection import project_batch
from alignopsd.segmentation import segment_batch

HAS_CPP = importlib.util.find_spec("alignopsd._C") is not None
needs_cpp = pytest.mark.skipif(not HAS_CPP, reason="C++ extension alignopsd._C not built")
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------------------------------------ impl switch


def test_resolve_impl_names():
    assert _native.resolve_impl("python") == "python"
    with pytest.raises(ValueError, match="impl"):
        _native.resolve_impl("triton")
    if HAS_CPP:
        assert _native.resolve_impl("auto") == "cpp" and _native.resolve_impl("cpp") == "cpp"


def test_missing_extension_warns_once_and_cpp_is_an_error(monkeypatch):
    monkeypatch.setattr(_native, "_ext", None)
    monkeypatch.setattr(_native, "_import_error", "simulated")
    monkeypatch.setattr(_native, "_warned", False)
    with pytest.warns(RuntimeWarning, match="slower Python path"):
        assert _native.resolve_impl("auto") == "python"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _native.resolve_impl("auto") == "python"  # no second warning
    with pytest.raises(ValueError, match="impl"):
        _native.resolve_impl("cpp")
    # the whole mechanism still runs on the Python path
    b = _small_batch(0)
    c = allocate_credit(**b)
    assert c.token_advantage.shape == b["gap"].shape


# ------------------------------------------------------------------------------------------------ bit identity


@st.composite
def segment_inputs(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    lengths = draw(st.lists(st.integers(0, 30), min_size=1, max_size=8))
    k = sum(lengths)
    levels = draw(st.sampled_from([4, 50, 10**6]))  # few levels -> many exact ties
    d = (rng.integers(0, levels, size=k) / levels).astype(np.float32)
    valid = rng.random(k) < draw(st.sampled_from([0.3, 0.8, 1.0]))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    min_len = draw(st.integers(1, 4))
    max_len = draw(st.integers(2 * min_len - 1, 2 * min_len + 6))
    tau = draw(st.sampled_from([float("inf"), 0.0, 0.25, 0.5])) if k == 0 else float(rng.choice(d))
    tau_min = draw(st.sampled_from([0.0, 0.01, 0.25]))
    return d, valid, offsets, tau, min_len, max_len, tau_min


@needs_cpp
@settings(max_examples=150, **SETTINGS)
@given(segment_inputs())
def test_segment_batch_cpp_equals_python(args):
    d, valid, offsets, tau, min_len, max_len, tau_min = args
    py = segment_batch(
        torch.from_numpy(d),
        torch.from_numpy(valid),
        torch.from_numpy(offsets),
        tau,
        min_len,
        max_len,
        tau_min,
        "python",
    )
    cpp = segment_batch(
        torch.from_numpy(d), torch.from_numpy(valid), torch.from_numpy(offsets), tau, min_len, max_len, tau_min, "cpp"
    )
    for a, b in zip(py, cpp):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # spans partition each trajectory and respect the length rules
    pos, kinds, bo = py
    for j in range(len(offsets) - 1):
        n = int(offsets[j + 1] - offsets[j])
        edges = [0] + pos[bo[j] : bo[j + 1]].tolist() + [n]
        lens = [e - s for s, e in zip(edges[:-1], edges[1:])] if n else []
        assert all(x > 0 for x in lens)
        assert all(x <= max_len for x in lens)
        if n >= min_len:
            assert all(x >= min_len for x in lens)


@st.composite
def projection_inputs(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=6))
    h_parts, c_parts = [], []
    spread = draw(st.sampled_from([0.1, 1.0, 4.0, 12.0]))
    for n in lengths:
        counts = rng.integers(1, 513, size=n).astype(np.float64)
        logits = rng.normal(size=n) * spread
        q = np.exp(logits - logits.max())
        q /= q.sum()
        h_parts.append(counts.sum() * q / counts)
        c_parts.append(counts)
    box = draw(st.sampled_from([(0.0, 4.0), (0.0, 1.5), (0.8, 1.2), (0.9, 1.1), (1.0, 1.2), (0.5, 1.0), (0.0, 1e3)]))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return np.concatenate(h_parts), np.concatenate(c_parts), offsets, box


@needs_cpp
@settings(max_examples=150, **SETTINGS)
@given(projection_inputs())
def test_project_batch_cpp_equals_python(args):
    h, c, offsets, (lo, hi) = args
    th, tcnt, toff = torch.from_numpy(h), torch.from_numpy(c), torch.from_numpy(offsets)
    py = project_batch(th, tcnt, toff, lo, hi, 1e-5, "python")
    cpp = project_batch(th, tcnt, toff, lo, hi, 1e-5, "cpp")
    assert py.dtype == cpp.dtype == torch.float64
    assert torch.equal(py, cpp)
    assert float(py.min()) >= lo and float(py.max()) <= hi
    for j in range(len(offsets) - 1):
        s, e = int(offsets[j]), int(offsets[j + 1])
        assert float((tcnt[s:e] * py[s:e]).sum()) == pytest.approx(float(tcnt[s:e].sum()), rel=5e-5)


def _small_batch(seed: int, n_tasks: int = 2, roll: int = 3, turns: int = 9, L: int = 5):
    g = torch.Generator().manual_seed(seed)
    task = torch.arange(n_tasks).repeat_interleave(roll * turns)
    rollout = torch.arange(roll).repeat_interleave(turns).repeat(n_tasks)
    turn = torch.arange(turns).repeat(n_tasks * roll)
    m = task.shape[0]
    emb = torch.nn.functional.normalize(torch.randn(n_tasks, 3, 6, generator=g), dim=-1)
    phase = (turn * 3) // turns
    x = torch.nn.functional.normalize(emb[task, phase] + 0.3 * torch.randn(m, 6, generator=g), dim=-1)
    H = (x @ x.T) * (task[:, None] == task[None, :])
    E = (task[:, None] == task[None, :]) & (rollout[:, None] != rollout[None, :])
    mask = torch.arange(L)[None, :] < torch.randint(1, L + 1, (m,), generator=g)[:, None]
    gap = torch.randn(m, L, generator=g) * 3
    outcome = torch.randint(0, 2, (n_tasks * roll,), generator=g).float().repeat_interleave(turns)
    return dict(gap=gap, mask=mask, outcome=outcome, task=task, rollout=rollout, turn=turn, H=H, eligible=E)


@needs_cpp
@pytest.mark.parametrize("mode", ["adaptive", "turn", "token", "random"])
@pytest.mark.parametrize("weighting", ["legacy", "bounded"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_allocate_credit_cpp_equals_python(mode, weighting, seed):
    b = _small_batch(seed)
    inv = torch.rand(b["task"].shape[0], generator=torch.Generator().manual_seed(seed)) < 0.2
    kw = dict(mode=mode, weighting=weighting, gamma=0.5, min_span_turns=2, max_span_turns=3, density_upper_bound=1.5)
    c_py = allocate_credit(**b, config=CreditConfig(impl="python", **kw), invalid=inv)
    c_cpp = allocate_credit(**b, config=CreditConfig(impl="cpp", **kw), invalid=inv)
    for f in ("turn_weight", "token_advantage", "segment_index", "density", "boundary_kind"):
        assert torch.equal(getattr(c_py, f), getattr(c_cpp, f)), f
    assert c_py.metrics == c_cpp.metrics
    if mode != "turn":
        assert c_py.metrics["m2/projection_activation_rate"] > 0  # the projection really ran


# ------------------------------------------------------------------------------------------------ C++ input checks


def _seg_args(**kw):
    args = dict(
        d=np.zeros(4, np.float32),
        boundary_valid=np.ones(4, bool),
        offsets=np.array([0, 4], np.int64),
        tau=0.5,
        min_len=2,
        max_len=4,
        tau_min=0.01,
    )
    args.update(kw)
    return args


@needs_cpp
@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(d=np.zeros(4, np.float64)), "d"),
        (dict(d=[0.0, 0.0, 0.0, 0.0]), "d"),
        (dict(d=np.zeros((2, 2), np.float32)), "d"),
        (dict(d=np.zeros(8, np.float32)[::2]), "d"),
        (dict(d=np.array([0, np.nan, 0, 0], np.float32)), "d"),
        (dict(boundary_valid=np.ones(3, bool)), "boundary_valid"),
        (dict(boundary_valid=np.ones(4, np.int32)), "boundary_valid"),
        (dict(offsets=np.array([0, 3], np.int64)), "offsets"),
        (dict(offsets=np.array([1, 4], np.int64)), "offsets"),
        (dict(offsets=np.array([0, 3, 2, 4], np.int64)), "offsets"),
        (dict(offsets=np.array([0, 4], np.int32)), "offsets"),
        (dict(tau=float("nan")), "tau"),
        (dict(min_len=0), "min_len"),
        (dict(max_len=2), "max_len"),
        (dict(tau_min=float("inf")), "tau_min"),
    ],
)
def test_cpp_segment_checks_inputs(kw, name):
    with pytest.raises(ValueError, match=name):
        _native.native().segment_batch(**_seg_args(**kw))


def _proj_args(**kw):
    args = dict(
        h=np.array([1.5, 0.5]),
        counts=np.array([1.0, 1.0]),
        offsets=np.array([0, 2], np.int64),
        lo=0.0,
        hi=4.0,
        tol=1e-5,
    )
    args.update(kw)
    return args


@needs_cpp
@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(h=np.array([1.5, 0.5], np.float32)), "h"),
        (dict(h=np.array([1.5, np.inf])), "h"),
        (dict(h=np.array([2.5, -0.5])), "h"),
        (dict(h=np.array([3.0, 3.0])), "h"),  # raw budget 6 != 2
        (dict(counts=np.array([1.0, 0.0])), "counts"),
        (dict(counts=np.array([1.0])), "counts"),
        (dict(offsets=np.array([0, 1], np.int64)), "offsets"),
        (dict(lo=1.5), "lo"),
        (dict(lo=-0.1), "lo"),
        (dict(hi=0.5), "hi"),
        (dict(hi=float("inf")), "hi"),
        (dict(tol=0.0), "tol"),
    ],
)
def test_cpp_projection_checks_inputs(kw, name):
    with pytest.raises(ValueError, match=name):
        _native.native().project_batch(**_proj_args(**kw))


@pytest.mark.parametrize("impl", ["python"] + (["cpp"] if HAS_CPP else []))
def test_budget_error_names_trajectory(impl):
    h = torch.tensor([1.0, 1.0, 3.0, 3.0], dtype=torch.float64)
    with pytest.raises(ValueError, match="trajectory 1"):
        project_batch(h, torch.ones(4, dtype=torch.float64), torch.tensor([0, 2, 4]), 0.0, 4.0, 1e-5, impl)


@needs_cpp
@pytest.mark.parametrize("box", [(0.0, 4.0), (0.8, 1.2)])
def test_long_token_level_projection_bit_identical(box):
    # token-level projection (ablation B) runs over thousands of coordinates with counts 1
    g = torch.Generator().manual_seed(9)
    lengths = [5000, 1, 2300]
    parts = []
    for n in lengths:
        q = torch.softmax(torch.randn(n, generator=g, dtype=torch.float64) * 2.5, 0)
        parts.append(n * q)
    h = torch.cat(parts)
    counts = torch.ones_like(h)
    offsets = torch.tensor([0, 5000, 5001, 7301])
    py = project_batch(h, counts, offsets, *box, 1e-5, "python")
    cpp = project_batch(h, counts, offsets, *box, 1e-5, "cpp")
    assert torch.equal(py, cpp)
    assert not torch.equal(py, h)  # the projection was active
