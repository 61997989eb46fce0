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


def only_right_agrees(source_action, target_action) -> bool:
    """A plugin environment's pair rule (named by its registry row): both actions are ``right``."""
    return source_action == target_action == "right"


def test_select_pairs_applies_the_environments_own_action_rule():
    """The action filter takes the rule of the environment's registry row: none (ALFWorld), the method's WebShop
    rule, or a plugin environment's own, registered with no edit of the core or the engine."""
    from alignopsd.engine.envs.registry import EnvEntry, register_env

    from alignopsd import action_filter, select_sources, similarity_matrix
    from alignopsd.actions import webshop_actions_agree

    register_env(EnvEntry("pairs_rule", "m:f", "m:t", "m:p", action_rule=f"{__name__}:only_right_agrees"), replace=True)
    parts, cb, enc = _inputs()
    m = enc.student.shape[0]
    g = torch.Generator().manual_seed(3)
    words = ["right", "left", "click[a]", "click[A]", "search[b]"]
    enc.teacher_actions = [words[i] for i in torch.randint(0, 5, (m,), generator=g).tolist()]
    enc.student_actions = [words[i] for i in torch.randint(0, 5, (m,), generator=g).tolist()]
    enc.action_sim = torch.ones(m, m)
    enc.teacher_action_valid = enc.student_action_valid = torch.ones(m, dtype=torch.bool)
    H = similarity_matrix(enc.teacher, enc.student, cb.task)
    B = TP.eligibility(cb.task, cb.rollout, enc.teacher_valid, enc.student_valid)
    selected = select_sources(H, B, cb.task, cb.rollout, cb.turn, gamma=0.2, top_k=2)
    kw = dict(threshold=0.5, source_actions=enc.teacher_actions, target_actions=enc.student_actions)
    for env, rule in (("alfworld", None), ("webshop", webshop_actions_agree), ("pairs_rule", only_right_agrees)):
        parts.cfg.env.name = env
        _, _, pairs, _ = TP.select_pairs(parts, cb, enc)
        want = action_filter(selected, enc.action_sim, *(torch.ones(m, dtype=torch.bool),) * 2, rule=rule, **kw)
        assert pairs.tolist() == [[s, t] for t, srcs in enumerate(want) for s in srcs], env
        if rule is not None:
            assert all(rule(enc.teacher_actions[s], enc.student_actions[t]) for s, t in pairs.tolist())
    assert 0 < len(pairs) < sum(map(len, selected))  # the plugin's rule removed some pairs and kept some
