"""Fused log-prob + separable loss + gradients (``logprob_loss_and_grad``) against autograd through the reference.

Legend: N = tokens, H = hidden size, V = vocabulary size.
"""

from __future__ import annotations

import pytest
import torch
from alignopsd.kernels import logprob_loss_and_grad, logprob_ref

N, H, V = 37, 72, 1031
TEMP = 0.7


def _inputs(dtype=torch.float32, *, bias: bool, seed: int = 0, lead=(N,)):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*lead, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.3).to(dtype)
    b = (torch.randn(V, generator=g) * 0.5).to(dtype) if bias else None
    t = torch.randint(0, V, lead, generator=g)
    n = t.numel()
    old = torch.randn(n, generator=g) - 6.0
    adv = torch.randn(n, generator=g)
    return h, w, b, t, old, adv


def _ppo_loss(old, adv, ent_coef=0.0):
    """A PPO-clip token loss with an entropy bonus: separable, nonlinear in logp, clipped on both sides."""

    def token_loss(lp, ent, idx):
        r = torch.exp(lp - old[idx])
        a = adv[idx]
        out = -torch.minimum(r * a, r.clamp(0.8, 1.28) * a)
        if ent is not None:
            out = out - ent_coef * ent
        return out

    return token_loss


def _reference(h, w, b, t, token_loss, *, with_entropy):
    h32 = h.detach().float().requires_grad_()
    w32 = w.detach().float().requires_grad_()
    b32 = b.detach().float().requires_grad_() if b is not None else None
    out = logprob_ref(h32, w32, t, bias=b32, temperature=TEMP, with_entropy=with_entropy)
    lp, ent = out if with_entropy else (out, None)
    loss = token_loss(lp.reshape(-1), ent.reshape(-1) if ent is not None else None, torch.arange(t.numel())).sum()
    loss.backward()
    return loss.detach(), lp.detach(), (ent.detach() if ent is not None else None), h32.grad, w32.grad, b32


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tile_bytes", [None, 4 * V * 5])  # one chunk / chunks of ~5 tokens
def test_matches_autograd_through_reference(with_entropy, bias, tile_bytes):
    h, w, b, t, old, adv = _inputs(bias=bias)
    tl = _ppo_loss(old, adv, ent_coef=0.05)
    r = logprob_loss_and_grad(
        h, w, t, tl, bias=b, temperature=TEMP, with_entropy=with_entropy, tile_bytes=tile_bytes
    )  # fmt: skip
    loss, lp, ent, gh, gw, b32 = _reference(h, w, b, t, tl, with_entropy=with_entropy)
    torch.testing.assert_close(r.loss, loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r.logp, lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(r.grad_hidden, gh, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(r.grad_weight, gw, atol=1e-5, rtol=1e-4)
    if with_entropy:
        torch.testing.assert_close(r.entropy, ent, atol=2e-5, rtol=0)
    else:
        assert r.entropy is None
    if bias:
        torch.testing.assert_close(r.grad_bias, b32.grad, atol=1e-5, rtol=1e-4)
    else:
        assert r.grad_bias is None
    assert float(gh.abs().max()) > 1e-3  # the loss has a real gradient: the comparison is not vacuous


def test_leading_dims_and_indices():
    """targets [B, L]: token_loss sees positions into targets.reshape(-1); outputs keep the leading shape."""
    h, w, b, t, old, adv = _inputs(bias=False, lead=(4, 9))
    seen = []

    def tl(lp, ent, idx):
        seen.append(idx.clone())
        return _ppo_loss(old, adv)(lp, ent, idx)

    r = logprob_loss_and_grad(h, w, t, tl, temperature=TEMP, tile_bytes=4 * V * 7)
    assert torch.equal(torch.cat(seen), torch.arange(36))
    assert len(seen) == 6  # 36 tokens in balanced chunks of 6 (7 fit, ceil(36 / 7) = 6 chunks)
    assert r.logp.shape == (4, 9) and r.grad_hidden.shape == (4, 9, H)
    _, lp, _, gh, gw, _ = _reference(h, w, None, t, _ppo_loss(old, adv), with_entropy=False)
    torch.testing.assert_close(r.logp, lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(r.grad_hidden, gh, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(r.grad_weight, gw, atol=1e-5, rtol=1e-4)


def test_accumulates_into_buffers_in_place():
    h, w, b, t, old, adv = _inputs(bias=True)
    tl = _ppo_loss(old, adv)
    g = torch.Generator().manual_seed(5)
    start_w, start_b = torch.randn(V, H, generator=g), torch.randn(V, generator=g)
    buf_w, buf_b = start_w.clone(), start_b.clone()
    r = logprob_loss_and_grad(h, w, t, tl, bias=b, temperature=TEMP, grad_weight=buf_w, grad_bias=buf_b)
    assert r.grad_weight is buf_w and r.grad_bias is buf_b
    _, _, _, _, gw, b32 = _reference(h, w, b, t, tl, with_entropy=False)
    torch.testing.assert_close(buf_w - start_w, gw, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(buf_b - start_b, b32.grad, atol=1e-5, rtol=1e-4)


def test_bf16_inputs_follow_fp32_math():
    """bf16 hidden/weight: fp32 math on the exact bf16 values (weight upcast in vocabulary blocks)."""
    h, w, b, t, old, adv = _inputs(torch.bfloat16, bias=False)
    tl = _ppo_loss(old, adv)
    r = logprob_loss_and_grad(h, w, t, tl, temperature=TEMP, with_entropy=True)
    assert r.grad_hidden.dtype == torch.bfloat16 and r.grad_weight.dtype == torch.float32
    _, lp, ent, gh, gw, _ = _reference(h, w, None, t, tl, with_entropy=True)
    torch.testing.assert_close(r.logp, lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(r.entropy, ent, atol=2e-5, rtol=0)
    torch.testing.assert_close(r.grad_weight, gw, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(r.grad_hidden.float(), gh, atol=1e-2, rtol=1e-2)  # rounded to bf16 at the end


def test_bf16_weight_blocks(monkeypatch):
    """Several upcast blocks over the vocabulary give the same result as one."""
    import alignopsd.kernels.head.fused_loss as fl

    h, w, b, t, old, adv = _inputs(torch.bfloat16, bias=True)
    tl = _ppo_loss(old, adv)
    one = fl.logprob_loss_and_grad(h, w, t, tl, bias=b, temperature=TEMP)
    monkeypatch.setattr(fl, "_UPCAST_BYTES", 4 * H * 100)  # blocks of 100 vocabulary rows
    many = fl.logprob_loss_and_grad(h, w, t, tl, bias=b, temperature=TEMP)
    torch.testing.assert_close(many.logp, one.logp, atol=1e-6, rtol=0)
    torch.testing.assert_close(many.grad_weight, one.grad_weight, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(many.grad_bias, one.grad_bias, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(many.grad_hidden.float(), one.grad_hidden.float(), atol=1e-2, rtol=1e-2)


def test_optional_gradients_and_constant_loss():
    h, w, b, t, old, adv = _inputs(bias=True)
    r = logprob_loss_and_grad(
        h, w, t, _ppo_loss(old, adv), bias=b, temperature=TEMP, need_weight_grad=False, need_hidden_grad=False
    )
    assert r.grad_weight is None and r.grad_hidden is None and r.grad_bias is None
    # a scalar per chunk, independent of the log-probs: 4 chunks (37 tokens, 10 fit) sum to 4, no gradient
    const = logprob_loss_and_grad(h, w, t, lambda lp, ent, idx: torch.ones(()), temperature=TEMP, tile_bytes=4 * V * 10)
    assert float(const.loss) == 4.0
    assert float(const.grad_weight.abs().max()) == 0.0 and float(const.grad_hidden.abs().max()) == 0.0


def test_empty_batch():
    h = torch.zeros(0, H)
    w = torch.randn(V, H)
    r = logprob_loss_and_grad(h, w, torch.zeros(0, dtype=torch.long), lambda lp, ent, idx: lp)
    assert r.logp.shape == (0,) and float(r.loss) == 0.0 and float(r.grad_weight.abs().sum()) == 0.0


def test_validation_names_the_argument():
    h, w, b, t, old, adv = _inputs(bias=False)
    tl = _ppo_loss(old, adv)
    with pytest.raises(ValueError, match="token_loss"):
        logprob_loss_and_grad(h, w, t, "not callable")
    with pytest.raises(ValueError, match="token_loss"):
        logprob_loss_and_grad(h, w, t, lambda lp, ent, idx: lp[:3])
    with pytest.raises(ValueError, match="token_loss"):
        logprob_loss_and_grad(h, w, t, lambda lp, ent, idx: 1.0)
    with pytest.raises(ValueError, match="grad_weight"):
        logprob_loss_and_grad(h, w, t, tl, grad_weight=torch.zeros(V, H + 1))
    with pytest.raises(ValueError, match="grad_weight"):
        logprob_loss_and_grad(h, w, t, tl, grad_weight=torch.zeros(H, V).T)
    with pytest.raises(ValueError, match="grad_bias"):
        logprob_loss_and_grad(h, w, t, tl, grad_bias=torch.zeros(V))
    with pytest.raises(ValueError, match="targets"):
        logprob_loss_and_grad(h, w, t + V, tl)
    with pytest.raises(ValueError, match="tile_bytes"):
        logprob_loss_and_grad(h, w, t, tl, tile_bytes=0)
    with pytest.raises(ValueError, match="temperature"):
        logprob_loss_and_grad(h, w, t, tl, temperature=0.0)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_autograd_form_scales_by_incoming_gradient(with_entropy):
    """fused_token_loss: (2.5 * loss).backward() gives 2.5x the reference gradients, through a tied use of W."""
    from alignopsd.kernels import fused_token_loss

    h, w, b, t, old, adv = _inputs(bias=True)
    tl = _ppo_loss(old, adv, ent_coef=0.1)
    hh, ww, bb = (x.clone().requires_grad_() for x in (h, w, b))
    loss, lp, ent = fused_token_loss(hh, ww, t, tl, bias=bb, temperature=TEMP, with_entropy=with_entropy)
    assert not lp.requires_grad and (ent is None) != with_entropy
    (2.5 * loss + ww.sum()).backward()  # ww is also used elsewhere: its gradients add up
    ref_loss, ref_lp, _, gh, gw, b32 = _reference(h, w, b, t, tl, with_entropy=with_entropy)
    torch.testing.assert_close(loss.detach(), ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lp, ref_lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(hh.grad, 2.5 * gh, atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(ww.grad, 2.5 * gw + 1.0, atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(bb.grad, 2.5 * b32.grad, atol=3e-5, rtol=1e-4)


def test_autograd_form_frozen_weight():
    from alignopsd.kernels import fused_token_loss

    h, w, _, t, old, adv = _inputs(bias=False)
    hh = h.clone().requires_grad_()
    loss, _, _ = fused_token_loss(hh, w, t, _ppo_loss(old, adv), temperature=TEMP)
    loss.backward()
    _, _, _, gh, _, _ = _reference(h, w, None, t, _ppo_loss(old, adv), with_entropy=False)
    torch.testing.assert_close(hh.grad, gh, atol=1e-5, rtol=1e-4)
    assert w.grad is None
