"""The fused RMSNorm, SwiGLU and rotary (kernels/fused_ops.py), compiled as a run takes them, against the stock
Hugging Face code: values and gradients, fp32 to 1e-5, bf16 to its rounding; the trial's choice and its refusal."""

from __future__ import annotations

import pytest
import torch
from alignopsd.kernels import native_choice
from alignopsd.kernels.fused_ops import fwd_bwd, measure_op, rms_norm, rotary, swiglu
from alignopsd.kernels.native_choice import RMS_NORM, SWIGLU, recorded
from torch.func import functional_call
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from alignopsd.testing import forget_kernel_choices

# (rtol, atol) of the fused op against the stock code in the same dtype
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def _grads(fn, inputs, grads):
    """(outputs, input gradients) of ``fn`` on fresh leaf copies of ``inputs``, backward against ``grads``."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, grads)
    return [o.detach() for o in outs], [t.grad for t in leaves]


def _close(got, want, dtype):
    rtol, atol = TOL[dtype]
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g.float(), w.float(), rtol=rtol, atol=atol)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_the_stock_module(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 37, 48, generator=g) * 3).to(dtype)
    stock = LlamaRMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        stock.weight.copy_(torch.randn(48, generator=g))
    grad = torch.randn(3, 37, 48, generator=g).to(dtype)
    want = _grads(lambda x, w: functional_call(stock, {"weight": w}, (x,)), [x, stock.weight], [grad])
    got = _grads(lambda x, w: rms_norm(x, w, stock.variance_epsilon), [x, stock.weight], [grad])
    _close(got[0] + got[1], want[0] + want[1], dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_silu_times_up(dtype):
    g = torch.Generator().manual_seed(1)
    gate, up, grad = (torch.randn(2, 29, 40, generator=g).mul(4).to(dtype) for _ in range(3))
    want = _grads(lambda a, b: torch.nn.functional.silu(a) * b, [gate, up], [grad])
    got = _grads(swiglu, [gate, up], [grad])
    _close(got[0] + got[1], want[0] + want[1], dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_apply_rotary_pos_emb_on_the_models_strides(dtype):
    g = torch.Generator().manual_seed(2)
    b, t, d = 2, 23, 16
    q = torch.randn(b, t, 4, d, generator=g).to(dtype).transpose(1, 2)  # [B, H, T, D] as the attention's view
    k = torch.randn(b, t, 2, d, generator=g).to(dtype).transpose(1, 2)
    angles = torch.arange(t)[:, None] * torch.rand(d // 2, generator=g)
    emb = torch.cat((angles, angles), -1).expand(b, t, d)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    grads = [torch.randn(b, 4, t, d, generator=g).to(dtype), torch.randn(b, 2, t, d, generator=g).to(dtype)]
    want = _grads(lambda q, k: apply_rotary_pos_emb(q, k, cos, sin), [q, k], grads)
    got = _grads(lambda q, k: rotary(q, k, cos, sin), [q, k], grads)
    _close(got[0] + got[1], want[0] + want[1], dtype)


def test_bad_operands_are_refused_naming_them():
    with pytest.raises(ValueError, match="rms_norm: x's last dimension 8"):
        rms_norm(torch.randn(2, 8), torch.ones(6), 1e-6)
    with pytest.raises(ValueError, match="swiglu: gate"):
        swiglu(torch.randn(2, 8), torch.randn(2, 6))
    cos = torch.randn(1, 3, 8, requires_grad=True)
    with pytest.raises(ValueError, match="rotary: cos and sin"):
        rotary(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), cos, cos)


@pytest.fixture
def measured(monkeypatch):
    """The suite's pin to the stock paths lifted; the fused ops' choices forgotten before and after."""
    monkeypatch.delenv(native_choice.PIN_ENV, raising=False)
    forget_kernel_choices()
    yield
    forget_kernel_choices()


def test_the_trial_takes_the_fused_op_only_where_faster(measured):
    x = torch.randn(4, 32, requires_grad=True)
    w = torch.ones(32, requires_grad=True)
    fused, stock = fwd_bwd(lambda x: rms_norm(x, w, 1e-6), x), fwd_bwd(lambda x: x * w, x)
    assert not measure_op(RMS_NORM, fused, stock, "[4, 32]", timer={fused: 2.0, stock: 1.0}.get).native
    choice = measure_op(RMS_NORM, fused, stock, "[4, 32]", timer={fused: 1.0, stock: 2.0}.get)
    assert choice.native and recorded(RMS_NORM) is choice
    assert choice.describe().startswith("fused RMSNorm: compiled (1000.0 ms) over stock module (2000.0 ms)")


def test_a_compiler_failure_leaves_the_stock_path_saying_why(measured):
    def broken():
        raise RuntimeError("no C++ compiler")

    choice = measure_op(SWIGLU, broken, lambda: None, "[4, 32]")
    assert not choice.native and "torch.compile failed: RuntimeError: no C++ compiler" in choice.describe()


def test_pinned_torch_paths_measure_nothing(monkeypatch):
    monkeypatch.setenv(native_choice.PIN_ENV, "torch")

    def never():
        raise AssertionError("a pinned process must not run the fused op")

    assert measure_op(SWIGLU, never, lambda: None, "[4, 32]").why == "ALIGNOPSD_CPU_PATHS=torch"
