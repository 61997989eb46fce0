"""select_pairs (§2.2-2.5 in the step): the fused sibling top-K kernel entry on kernel devices, the core on CPU."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch
from alignopsd.kernels import HAS_TRITON

from alignopsd.testing import force_kernels

TP = importlib.import_module("alignopsd.engine.step.teacher_pass")


def _inputs(seed=0, tasks=3, rollouts=4, turns=5, D=24):
    g = torch.Generator().manual_seed(seed)
    M = tasks * rollouts * turns
    task = torch.arange(tasks).repeat_interleave(rollouts * turns)
    roll = torch.arange(rollouts).repeat_interleave(turns).repeat(tasks)
    turn = torch.arange(turns).repeat(tasks * rollouts)
    proto = torch.nn.functional.normalize(torch.randn(tasks, 3, D, generator=g), dim=-1)
    phase = torch.randint(0, 3, (M,), generator=g)
    te = torch.nn.functional.normalize(proto[task, phase] + 0.3 * torch.randn(M, D, generator=g), dim=-1)
    st = torch.nn.functional.normalize(proto[task, phase] + 0.3 * torch.randn(M, D, generator=g), dim=-1)
    sv, tv = torch.rand(M, generator=g) > 0.1, torch.rand(M, generator=g) > 0.1
    perm = torch.randperm(M, generator=g)
    cb = SimpleNamespace(task=task[perm], rollout=roll[perm], turn=turn[perm])
    enc = TP.Encoded(student=st[perm], teacher=te[perm], student_valid=tv[perm], teacher_valid=sv[perm])
    rc = SimpleNamespace(gamma=0.2, top_k=2, action_threshold=0.5)
    parts = SimpleNamespace(cfg=SimpleNamespace(algorithm=SimpleNamespace(rectify=rc), env=SimpleNamespace(name="x")))
    return parts, cb, enc


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_select_pairs_runs_the_fused_kernel_entry_and_equals_the_core(monkeypatch):
    """Where the core would use the kernels (CUDA; here the interpreter under force_kernels) the step calls the
    fused sibling_topk entry once, with the same pairs, eligibility and eligible similarities as the core."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    parts, cb, enc = _inputs()
    H0, B0, pairs0, _ = TP.select_pairs(parts, cb, enc)  # CPU: the core
    calls = []
    original = TP.sibling_topk

    def counting(*args, **kwargs):
        calls.append(kwargs.get("impl"))
        return original(*args, **kwargs)

    monkeypatch.setattr(TP, "sibling_topk", counting)
    with force_kernels():
        H1, B1, pairs1, _ = TP.select_pairs(parts, cb, enc)
    assert calls == ["triton"]
    assert pairs0.shape[0] > 0 and torch.equal(pairs1, pairs0)
    assert torch.equal(B1, B0)
    torch.testing.assert_close(H1[B0], H0[B0], rtol=0, atol=1e-6)
    valid_cells = enc.teacher_valid[:, None] & enc.student_valid[None, :]
    torch.testing.assert_close(H1[valid_cells], H0[valid_cells], rtol=0, atol=1e-6)
    assert bool((H1[~valid_cells] == 0).all())  # the kernel's H: 0 where a side is invalid
