"""The LM head's GEMMs on bf16 operands with fp32 results, on the CPU: no fp32 copy of the weight.

Legend: N = tokens, H = hidden size, V = vocabulary size (or the local shard's size), n = tokens of one chunk.

torch's CPU matmul has no bf16-input / fp32-output entry (``torch.mm(..., out_dtype=)`` is CUDA-only, a bf16
``torch.mm`` rounds its result to bf16, which would move the log-probs), so the head's torch paths upcast every
weight block to fp32 and multiply in fp32 ("fp32 tiles"): a copy of the block per use and the fp32 GEMM rate, a
quarter of a bf16 GEMM's on a CPU with AMX. The BLAS that torch's x86 CPU builds carry has that entry,
``cblas_gemm_bf16bf16f32`` (bf16 A and B, fp32 C; its AVX2, AVX512-BF16 and AMX code paths multiply the bf16 values
exactly and sum in fp32, the exactness of the C++ head kernel, ``cpu_partials.py``). :func:`mm_bf16` calls it on
torch tensors; the head uses it for

- the forward's logits tiles, ``z = W @ h.T`` (``fused_chunk.fill_logits``, ``torch_tiles.torch_partials``): the
  same bf16 products as the fp32 tiles, summed in another order, so the log-probs move by fp32 rounding only;
- the backward's two GEMMs, ``dH = gz.T @ W`` and ``dW += gz @ h`` (``fused_chunk.accumulate_grads``,
  ``torch_tiles.torch_backward``), with the logits gradient ``gz`` rounded to bf16 (the operand type of the
  GEMM, as a bf16 autograd backward of the logits has it) and the weight gradient accumulated in fp32.

The path is taken only where it was measured faster than the fp32 tiles, on this CPU, at the run's shapes
(``gemm_choice.measure_head_gemm``, ``native_choice.HEAD_GEMM``; a training run measures it before its first step),
never because of a CPU flag; ``ALIGNOPSD_CPU_PATHS=torch`` keeps the fp32 tiles.
:func:`gemm_ready` says whether it can run at all (torch built with that BLAS, a first call checked against an exact
reference).
"""

from __future__ import annotations

import ctypes
import os

import torch
from torch import Tensor

__all__ = ["bf16_cpu_head", "gemm_applies", "gemm_ready", "mm_bf16", "why_no_gemm"]

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_INT_MAX = 2**31 - 1
_FN = None  # the BLAS entry, once found
_WHY: str | None = None  # "" when ready, else why not


def _find() -> str:
    """Find ``cblas_gemm_bf16bf16f32`` in torch's CPU library and check one small product against float64: "" when
    it can run, else why not."""
    global _FN
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        lib = ctypes.CDLL(path)
        fn = lib.cblas_gemm_bf16bf16f32
    except (OSError, AttributeError):
        return "torch's CPU library has no bf16 x bf16 -> fp32 GEMM (cblas_gemm_bf16bf16f32)"
    i, p, f = ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    fn.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
    fn.restype = None
    _FN = fn
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 24, generator=g).bfloat16()
    b = torch.randn(24, 7, generator=g).bfloat16()
    out = torch.full((5, 7), float("nan"))
    _call(a, b, out, 1.0, 0.0)
    exact = a.double() @ b.double()
    if not bool(((out.double() - exact).abs() <= 1e-5 * (a.double().abs() @ b.double().abs()) + 1e-30).all()):
        _FN = None
        return "the bf16 x bf16 -> fp32 GEMM of torch's CPU library failed its check against an exact product"
    return ""


def why_no_gemm() -> str:
    """Why :func:`mm_bf16` cannot run in this process ("" when it can)."""
    global _WHY
    if _WHY is None:
        _WHY = _find()
    return _WHY


def gemm_ready() -> bool:
    """Whether :func:`mm_bf16` can run in this process."""
    return why_no_gemm() == ""


def bf16_cpu_head(h: Tensor, w: Tensor, bias: Tensor | None) -> bool:
    """Whether (hidden ``h``, weight ``w``, ``bias``) is a head the engine's bf16 CPU paths take: bf16 CPU operands
    and no bias (a bias is added to fp32 tiles)."""
    return bias is None and all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in (h, w))


def gemm_applies(h: Tensor, w: Tensor, bias: Tensor | None = None) -> bool:
    """Whether the head's GEMMs on (hidden ``h``, weight ``w``) can take :func:`mm_bf16`: a bf16 CPU head
    (:func:`bf16_cpu_head`) and the GEMM can run here."""
    return bf16_cpu_head(h, w, bias) and gemm_ready()


def _operand(t: Tensor) -> tuple[Tensor, int, int]:
    """(tensor, transpose flag, leading dimension) of a 2-D bf16 operand for a row-major BLAS call."""
    if t.stride(1) == 1 and t.stride(0) >= max(1, t.shape[1]):
        return t, _NO_TRANS, t.stride(0)
    if t.stride(0) == 1 and t.stride(1) >= max(1, t.shape[0]):
        return t, _TRANS, t.stride(1)
    t = t.contiguous()
    return t, _NO_TRANS, max(1, t.shape[1])


def _call(a: Tensor, b: Tensor, out: Tensor, alpha: float, beta: float) -> None:
    (m, k), n = a.shape, b.shape[1]
    a, ta, lda = _operand(a)
    b, tb, ldb = _operand(b)
    _FN(_ROW_MAJOR, ta, tb, m, n, k, alpha, a.data_ptr(), lda, b.data_ptr(), ldb, beta, out.data_ptr(), out.stride(0))


def mm_bf16(a: Tensor, b: Tensor, out: Tensor, *, alpha: float = 1.0, beta: float = 0.0) -> Tensor:
    """``out = alpha * (a @ b) + beta * out`` for bf16 CPU matrices ``a`` [M, K] and ``b`` [K, N] (either may be a
    transposed view) into the fp32 CPU matrix ``out`` [M, N] (rows of unit stride): every product of two bf16 values
    is exact in fp32 and the sums are fp32. ``beta = 0`` overwrites ``out`` (NaNs in it included). Returns ``out``."""
    if a.dim() != 2 or b.dim() != 2 or out.dim() != 2:
        raise ValueError(f"mm_bf16: expected 2-D a, b, out, got {tuple(a.shape)}, {tuple(b.shape)}, {tuple(out.shape)}")
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16 or out.dtype != torch.float32:
        raise ValueError(f"mm_bf16: expected bf16 a, b and fp32 out, got {a.dtype}, {b.dtype}, {out.dtype}")
    if a.shape[1] != b.shape[0] or tuple(out.shape) != (a.shape[0], b.shape[1]):
        raise ValueError(f"mm_bf16: shapes {tuple(a.shape)} @ {tuple(b.shape)} do not give {tuple(out.shape)}")
    if any(t.device.type != "cpu" for t in (a, b, out)):
        raise ValueError("mm_bf16: expected CPU tensors")
    if out.stride(1) != 1 or out.stride(0) < max(1, out.shape[1]):
        raise ValueError(f"mm_bf16: out needs rows of unit stride, got strides {out.stride()}")
    if max(a.numel(), b.numel(), out.numel(), out.stride(0) * max(1, out.shape[0])) > _INT_MAX:
        raise ValueError(f"mm_bf16: operands beyond 32-bit indexing ({tuple(a.shape)} @ {tuple(b.shape)})")
    if not gemm_ready():
        raise RuntimeError(f"mm_bf16: {why_no_gemm()}")
    if out.numel() == 0:
        return out
    if a.shape[1] == 0:
        return out.mul_(beta) if beta != 0.0 else out.zero_()
    _call(a, b, out, float(alpha), float(beta))
    return out
