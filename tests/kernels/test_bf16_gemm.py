"""The LM head's GEMMs on bf16 operands with fp32 results (kernels/head/bf16_gemm.py), taken by measured speed.

Legend: N = tokens, H = hidden size, V = vocabulary size. The exactness tests compare against float64 products of the
same bf16 values: every bf16 product is exact in fp32, so what is left is the fp32 sum's rounding (bounded by
K * 2^-24 * sum |a| |b|). The choice tests inject times (a timer that reads them from a table) and assert which path
the head's real dispatch (the fused loss, the tiled log-prob forward and backward) took.
"""

from __future__ import annotations

import pytest
import torch
from alignopsd.kernels import logprob_loss_and_grad, logprob_ref, native_choice
from alignopsd.kernels.head import bf16_gemm
from alignopsd.kernels.head.bf16_gemm import mm_bf16
from alignopsd.kernels.head.gemm_choice import measure_head_gemm, takes_bf16_gemm
from alignopsd.kernels.head.torch_tiles import torch_backward, torch_partials
from alignopsd.kernels.native_choice import HEAD_GEMM, recorded

from alignopsd.testing import KernelChoice, record_kernel_choice

needs_gemm = pytest.mark.skipif(not bf16_gemm.gemm_ready(), reason=bf16_gemm.why_no_gemm() or "ready")
N, H, V = 37, 72, 1031


def _bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The fp32 summation's error bound of a @ b (exact products): K * 2^-24 * |a| @ |b|, plus a denormal floor."""
    return a.shape[1] * 2.0**-24 * (a.double().abs() @ b.double().abs()) + 1e-30


@needs_gemm
@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_products_are_exact_and_sums_fp32(ta, tb):
    """Transposed views are read as they lie; alpha scales the product, beta keeps that much of ``out``."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(29, 300, generator=g).bfloat16()
    b = torch.randn(300, 45, generator=g).bfloat16()
    a_in = a.T.contiguous().T if ta else a
    b_in = b.T.contiguous().T if tb else b
    out = torch.full((29, 45), float("nan"))
    mm_bf16(a_in, b_in, out)
    exact = a.double() @ b.double()
    assert bool(((out.double() - exact).abs() <= _bound(a, b)).all())
    prev = torch.randn(29, 45, generator=g)
    acc = prev.clone()
    mm_bf16(a_in, b_in, acc, alpha=0.5, beta=1.0)
    assert bool(((acc.double() - (0.5 * exact + prev.double())).abs() <= _bound(a, b) + 1e-6).all())
    view = torch.zeros(29, 60)[:, 5:50]  # rows of unit stride inside a wider buffer
    mm_bf16(a, b, view)
    torch.testing.assert_close(view, out, rtol=0, atol=0)


@needs_gemm
def test_bad_operands_name_the_culprit():
    a, b = torch.zeros(3, 4).bfloat16(), torch.zeros(4, 5).bfloat16()
    with pytest.raises(ValueError, match="expected bf16 a, b and fp32 out"):
        mm_bf16(a.float(), b, torch.zeros(3, 5))
    with pytest.raises(ValueError, match=r"shapes \(3, 4\) @ \(4, 5\) do not give \(3, 4\)"):
        mm_bf16(a, b, torch.zeros(3, 4))
    with pytest.raises(ValueError, match="rows of unit stride"):
        mm_bf16(a, b, torch.zeros(5, 3).T)
    assert bool((mm_bf16(a[:, :0], b[:0], torch.ones(3, 5)) == 0).all())  # K = 0: an empty sum


def _ppo(old, adv):
    def token_loss(lp, ent, idx):
        r = torch.exp(lp - old[idx])
        clipped = -torch.minimum(r * adv[idx], r.clamp(0.8, 1.28) * adv[idx])
        return clipped if ent is None else clipped - 0.01 * ent

    return token_loss


@pytest.fixture
def head_inputs():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g).bfloat16()
    w = (torch.randn(V, H, generator=g) * 0.3).bfloat16()
    t = torch.randint(0, V, (N,), generator=g)
    return h, w, t, torch.randn(N, generator=g) - 6.0, torch.randn(N, generator=g)


def _choose(native: bool) -> None:
    record_kernel_choice(KernelChoice(HEAD_GEMM, native, None, None, "chosen by the test"))


@needs_gemm
def test_fused_loss_on_bf16_gemms_matches_fp32_tiles(head_inputs, monkeypatch):
    """The update's head (fused loss, several chunks) with the bf16 GEMMs: the same log-probs as the fp32 tiles up to
    fp32 rounding (the products are the same), and gradients within the bf16 rounding of the logits gradient; the
    GEMM is what ran (three calls a chunk)."""
    h, w, t, old, adv = head_inputs
    calls = []
    real = bf16_gemm.mm_bf16

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    _choose(False)
    tiles = logprob_loss_and_grad(h, w, t, _ppo(old, adv), temperature=0.7, with_entropy=True, tile_bytes=4 * V * 10)
    _choose(True)
    import alignopsd.kernels.head.fused_chunk as fc

    monkeypatch.setattr(fc, "mm_bf16", spy)
    gemm = logprob_loss_and_grad(h, w, t, _ppo(old, adv), temperature=0.7, with_entropy=True, tile_bytes=4 * V * 10)
    assert len(calls) == 3 * 4  # chunks of 10 tokens: 4 chunks, three GEMMs each
    torch.testing.assert_close(gemm.logp, tiles.logp, atol=2e-5, rtol=0)
    torch.testing.assert_close(gemm.entropy, tiles.entropy, atol=2e-5, rtol=0)
    torch.testing.assert_close(gemm.loss, tiles.loss, atol=1e-5, rtol=1e-5)
    # the reference: autograd in float64 through the same bf16 values
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    lp, ent = logprob_ref(h64, w64, t, temperature=0.7, with_entropy=True)
    _ppo(old.double(), adv.double())(lp, ent, torch.arange(N)).sum().backward()
    scale_w, scale_h = w64.grad.abs().max().item(), h64.grad.abs().max().item()
    err_w = (gemm.grad_weight.double() - w64.grad).abs().max().item()
    err_h = (gemm.grad_hidden.double() - h64.grad).abs().max().item()
    assert err_w <= 2**-8 * scale_w and err_h <= 2**-7 * scale_h  # gz rounded to bf16; dH also returned in bf16
    assert (tiles.grad_weight.double() - w64.grad).abs().max().item() <= err_w  # fp32 tiles: no gz rounding


@needs_gemm
def test_logprob_tiles_forward_and_backward_take_the_gemm(head_inputs):
    """The scoring passes' tiled forward (partials) and the log-prob's backward with the bf16 GEMMs."""
    h, w, t, _, _ = head_inputs
    _choose(False)
    ref = torch_partials(h, w, None, t, 1 / 0.7, 0)
    _choose(True)
    got = torch_partials(h, w, None, t, 1 / 0.7, 0)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    m, s, u, tz = ref
    lse, ent = m + torch.log(s), torch.log(s) - u / s
    g = torch.Generator().manual_seed(3)
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    args = (h, w, None, t, 1 / 0.7, 0, lse, ent, g_lp, g_ent, True, True, False)
    dh, dw, _ = torch_backward(*args)
    _choose(False)
    dh32, dw32, _ = torch_backward(*args)
    assert (dh - dh32).abs().max() <= 2**-8 * dh32.abs().max()
    assert (dw - dw32).abs().max() <= 2**-8 * dw32.abs().max()
    assert (dh - dh32).abs().max() > 0  # the rounded logits gradient: another path really ran


@needs_gemm
def test_first_use_measures_and_a_pinned_process_keeps_fp32_tiles(head_inputs, monkeypatch):
    """Nothing recorded: the first head call measures both paths on its operands (times injected) and takes the
    faster; ``ALIGNOPSD_CPU_PATHS=torch`` (the suite's pin): fp32 tiles, nothing timed."""
    h, w, t, old, adv = head_inputs
    native_choice.forget(HEAD_GEMM)
    timed = []

    def timer(fn):
        fn()
        timed.append(fn.__name__)
        return {"native": 0.5, "torch_path": 1.0}[fn.__name__]

    monkeypatch.setattr(native_choice, "best_seconds", timer)
    monkeypatch.delenv(native_choice.PIN_ENV, raising=False)
    logprob_loss_and_grad(h, w, t, _ppo(old, adv))
    assert timed == ["native", "torch_path"] and recorded(HEAD_GEMM).native
    assert recorded(HEAD_GEMM).shape == f"[{N}, {H}] x [{V}, {H}] bfloat16, forward and backward"
    native_choice.forget(HEAD_GEMM)
    monkeypatch.setenv(native_choice.PIN_ENV, "torch")
    assert not measure_head_gemm(h, w).native and recorded(HEAD_GEMM).why == "ALIGNOPSD_CPU_PATHS=torch"
    assert timed == ["native", "torch_path"]
    slower = measure_head_gemm(h, w, timer=lambda fn: {"native": 2.0, "torch_path": 1.0}[fn.__name__])
    assert not slower.native  # pinned: not even timed
    monkeypatch.delenv(native_choice.PIN_ENV)
    slower = measure_head_gemm(h, w, timer=lambda fn: {"native": 2.0, "torch_path": 1.0}[fn.__name__])
    assert not slower.native and slower.describe().startswith("head GEMMs: fp32 tiles (1000.0 ms")


def test_operands_it_cannot_take_keep_fp32_tiles():
    """fp32 or biased heads are never routed to the bf16 GEMM, whatever was recorded."""
    _choose(True)
    h, w = torch.zeros(4, 8), torch.zeros(16, 8)
    assert not takes_bf16_gemm(h, w)
    assert not takes_bf16_gemm(h.bfloat16(), w.bfloat16(), torch.zeros(16).bfloat16())
