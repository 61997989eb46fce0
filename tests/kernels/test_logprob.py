"""Fused log-prob: three-way tolerance against the fp32 reference, gradients, dispatch, validation.

Legend: N = tokens, H = hidden size, V = vocabulary size.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from alignopsd.kernels import logprob, logprob_ref, logprob_rescore
from kernel_helpers import IMPLS, assert_three_way

N, H, V = 37, 72, 1031
TEMP = 0.7


def _inputs(dtype, *, bias: bool, seed: int = 0, lead=(N,)):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*lead, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.3).to(dtype)
    b = (torch.randn(V, generator=g) * 0.5).to(dtype) if bias else None
    t = torch.randint(0, V, lead, generator=g)
    return h, w, b, t


def _plain(h, w, b, t, *, with_entropy):
    """Plain torch in the inputs' dtype (the "same dtype" leg of the three-way check)."""
    z = h @ w.T
    if b is not None:
        z = z + b
    ls = torch.log_softmax(z / TEMP, dim=-1)
    lp = ls.gather(-1, t.unsqueeze(-1)).squeeze(-1)
    if with_entropy:
        return lp, -(ls.exp() * ls).sum(-1)
    return lp


def _fp32_ref(h, w, b, t):
    h32 = h.detach().float().requires_grad_()
    w32 = w.detach().float().requires_grad_()
    b32 = b.detach().float().requires_grad_() if b is not None else None
    lp, ent = logprob_ref(h32, w32, t, bias=b32, temperature=TEMP, with_entropy=True)
    return (h32, w32, b32), lp, ent


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_backward_three_way(impl, dtype, bias):
    h, w, b, t = _inputs(dtype, bias=bias)
    leaves = [h.requires_grad_(), w.requires_grad_()] + ([b.requires_grad_()] if b is not None else [])
    lp, ent = logprob(h, w, t, bias=b, temperature=TEMP, with_entropy=True, impl=impl)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32 and lp.shape == (N,)
    plain_lp, plain_ent = _plain(h, w, b, t, with_entropy=True)
    ref_leaves, ref_lp, ref_ent = _fp32_ref(h, w, b, t)
    atol = 2e-5 if dtype == torch.float32 else 2e-3
    assert_three_way(lp, plain_lp, ref_lp, atol=atol, name="logp")
    assert_three_way(ent, plain_ent, ref_ent, atol=atol, name="entropy")

    g = torch.Generator().manual_seed(1)
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    ours = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), leaves)
    plain = torch.autograd.grad((plain_lp.float() * g_lp).sum() + (plain_ent.float() * g_ent).sum(), leaves)
    ref = torch.autograd.grad((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum(), [x for x in ref_leaves if x is not None])
    for name, o, p, r in zip(["d_hidden", "d_weight", "d_bias"], ours, plain, ref):
        assert o.dtype == dtype and o.shape == r.shape
        scale = float(r.abs().max())
        assert_three_way(o, p, r, atol=(1e-5 if dtype == torch.float32 else 4e-3) * scale, name=name)


@pytest.mark.parametrize("impl", IMPLS)
def test_logp_only_gradient_and_leading_dims(impl):
    """Gradient through logp alone (no entropy); hidden with leading dims [2, 5, H]."""
    h, w, _, t = _inputs(torch.float32, bias=False, seed=3, lead=(2, 5))
    h.requires_grad_()
    w.requires_grad_()
    lp = logprob(h, w, t, temperature=TEMP, impl=impl)
    assert lp.shape == (2, 5)
    gh, gw = torch.autograd.grad(lp.sum(), [h, w])
    (h32, w32, _), ref_lp, _ = _fp32_ref(h, w, None, t)
    rh, rw = torch.autograd.grad(ref_lp.sum(), [h32, w32])
    torch.testing.assert_close(lp, ref_lp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(gh, rh, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(gw, rw, atol=2e-5, rtol=1e-4)


def test_torch_path_many_tiles(monkeypatch):
    """Force tiny tiles so the row and vocabulary loops and the online merge run many times."""
    mod = importlib.import_module("alignopsd.kernels.head.torch_tiles")
    monkeypatch.setattr(mod, "_TORCH_ROWS", 8)
    monkeypatch.setattr(mod, "_TORCH_TILE", 8 * 100)
    h, w, b, t = _inputs(torch.float32, bias=True, seed=5)
    h.requires_grad_()
    w.requires_grad_()
    b.requires_grad_()
    lp, ent = logprob(h, w, t, bias=b, temperature=TEMP, with_entropy=True, impl="torch")
    (h32, w32, b32), ref_lp, ref_ent = _fp32_ref(h, w, b, t)
    torch.testing.assert_close(lp, ref_lp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=2e-5, rtol=1e-5)
    got = torch.autograd.grad((lp + 0.5 * ent).sum(), [h, w, b])
    ref = torch.autograd.grad((ref_lp + 0.5 * ref_ent).sum(), [h32, w32, b32])
    for o, r in zip(got, ref):
        torch.testing.assert_close(o, r, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
def test_extreme_logits_stay_finite(impl):
    """Large logit scale and tiny temperature: the online log-sum-exp stays finite and exact."""
    h, w, _, t = _inputs(torch.float32, bias=False, seed=7)
    lp, ent = logprob(h * 30, w, t, temperature=0.05, with_entropy=True, impl=impl)
    ref_lp, ref_ent = logprob_ref(h * 30, w, t, temperature=0.05, with_entropy=True)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    torch.testing.assert_close(lp, ref_lp, atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-3, rtol=1e-4)


def test_rescore_is_detached():
    h, w, _, t = _inputs(torch.float32, bias=False)
    h.requires_grad_()
    lp = logprob_rescore(h, w, t, temperature=TEMP)
    assert not lp.requires_grad
    torch.testing.assert_close(lp, logprob_ref(h.detach(), w, t, temperature=TEMP), atol=2e-5, rtol=1e-5)


def test_auto_dispatch_on_cpu_uses_torch(monkeypatch):
    from alignopsd.kernels import resolve_impl

    h, w, _, t = _inputs(torch.float32, bias=False)
    assert resolve_impl("auto", h, w) == "torch"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        logprob(h, w, t, impl="triton")
    with pytest.raises(ValueError, match="impl"):
        logprob(h, w, t, impl="cuda")


def test_validation_names_the_argument():
    h, w, b, t = _inputs(torch.float32, bias=True)
    with pytest.raises(ValueError, match="targets"):
        logprob(h, w, torch.full((N,), V))
    with pytest.raises(ValueError, match="targets"):
        logprob(h, w, t.float())
    with pytest.raises(ValueError, match="weight"):
        logprob(h, w.double(), t)
    with pytest.raises(ValueError, match="weight"):
        logprob(h, w[:, :10], t)
    with pytest.raises(ValueError, match="bias"):
        logprob(h, w, t, bias=b[:5])
    with pytest.raises(ValueError, match="temperature"):
        logprob(h, w, t, temperature=0.0)
    with pytest.raises(ValueError, match="temperature"):
        logprob(h, w, t, temperature=True)


@pytest.mark.parametrize("impl", IMPLS)
def test_frozen_head_and_empty_batch(impl):
    """Gradient to hidden only (frozen LM head), and N = 0 tokens."""
    h, w, _, t = _inputs(torch.float32, bias=False, seed=9)
    h.requires_grad_()
    lp = logprob(h, w, t, temperature=TEMP, impl=impl)
    (gh,) = torch.autograd.grad(lp.sum(), [h])
    (h32, _, _), ref_lp, _ = _fp32_ref(h, w, None, t)
    (rh,) = torch.autograd.grad(ref_lp.sum(), [h32])
    torch.testing.assert_close(gh, rh, atol=2e-5, rtol=1e-4)
    e = torch.zeros(0, H, requires_grad=True)
    lp0, ent0 = logprob(e, w, torch.zeros(0, dtype=torch.long), with_entropy=True, impl=impl)
    assert lp0.shape == (0,) and ent0.shape == (0,)
    (g0,) = torch.autograd.grad(lp0.sum(), [e], allow_unused=True)
    assert g0 is None or g0.shape == (0, H)
