"""The LM head's forward partials in C++ for bf16 hidden states and weights on x86 CPUs with AVX512-BF16.

Legend: N = tokens, H = hidden size, V = vocabulary size (or the local shard's size).

torch's CPU matmul has no bf16-input / fp32-output kernel, so the torch path (``lse_partials.torch_partials``)
upcasts each weight chunk and multiplies in fp32, at about a third of the CPU's bf16 GEMM rate; rounding the
logits to bf16 instead would move the log-probs. ``alignopsd._C.head_partials_bf16`` (csrc/lm_head_bf16.cpp)
multiplies the bf16 values with ``vdpbf16ps`` (every product exact in fp32, fp32 accumulation), never stores the
[N, V] logits and returns the same online partials (m, s, u, tz), equal to the torch path's up to floating-point
reassociation (tests/kernels/test_lse_native.py). On a 2-core AVX512-BF16 CPU, [3800, 576] x [49152, 576]:
~410 GFLOP/s against ~125 for the torch path.

``lse_partials.cpu_partials``, the CPU forward of the fused log-prob (``logprob.py``), takes this path when
:func:`native_applies` and the kernel was measured faster than the torch path on this CPU, dtype and shape
(``native_choice.py``: on a Xeon with AMX it is not), and the torch path otherwise.
"""

from __future__ import annotations

import torch
from alignopsd.kernels.bf16_gemm import bf16_cpu_head
from torch import Tensor

try:  # the C++ extension is optional (a build without a compiler falls back to the torch path)
    from alignopsd import _C
except ImportError:  # pragma: no cover - depends on the build
    _C = None

__all__ = ["elements_from", "native_applies", "native_partials", "native_ready", "why_not_ready"]

_READY: bool | None = None


def native_ready() -> bool:
    """Whether the bf16 kernels (head, attention) can run in this process: the extension was built with them,
    the CPU has AVX512-BF16 (checked by the extension with cpuid) and torch's own CPU code runs at AVX512 (so
    ``ATEN_CPU_CAPABILITY=avx2``, which makes torch behave like an AVX2-only CPU, turns it off too)."""
    global _READY
    if _READY is None:
        _READY = bool(
            _C is not None
            and hasattr(_C, "attention_prefix_bf16")  # a build older than both kernels: torch paths
            and _C.has_avx512_bf16()
            and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
        )
    return _READY


def why_not_ready() -> str:
    """Why the bf16 kernels cannot run in this process ("" when :func:`native_ready`), for the run's log."""
    if native_ready():
        return ""
    if _C is None or not hasattr(_C, "attention_prefix_bf16"):
        return "the C++ extension was built without the bf16 kernels"
    if not _C.has_avx512_bf16():
        return "this CPU has no AVX512-BF16"
    return f"torch's CPU code runs at {torch.backends.cpu.get_cpu_capability()}, below AVX512"


def elements_from(t: Tensor) -> int:
    """The elements of ``t``'s storage from its first element on: all a kernel handed ``t.data_ptr()`` may touch
    (the C++ boundary checks the sizes and strides it is given against it)."""
    return t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()


def native_applies(h_NH: Tensor, w_VH: Tensor, b_V: Tensor | None) -> bool:
    """Whether ``lse_partials.cpu_partials`` takes the C++ path for these operands: bf16 CPU hidden states and
    weight of an even hidden size, no bias, and :func:`native_ready`."""
    return bf16_cpu_head(h_NH, w_VH, b_V) and h_NH.shape[-1] % 2 == 0 and native_ready()


def native_partials(h_NH: Tensor, w_VH: Tensor, t_N: Tensor, inv_t: float, vocab_start: int, need_u: bool = True):
    """(m, s, u, tz) [N] fp32 of ``(h @ w.T) * inv_t`` over the local vocabulary (targets outside it: tz = 0),
    in the C++ kernel. Shapes are checked first (ValueError naming them: hidden [N, H], weight [V, H] of the same H,
    N targets), then that the operands are what :func:`native_applies` requires (ValueError otherwise)."""
    if h_NH.dim() != 2 or w_VH.dim() != 2:
        raise ValueError(
            f"h_NH, w_VH: expected hidden [N, H] and weight [V, H], got {tuple(h_NH.shape)} and {tuple(w_VH.shape)}"
        )
    if w_VH.shape[1] != h_NH.shape[1]:
        raise ValueError(f"w_VH: hidden size {w_VH.shape[1]} does not match h_NH's {h_NH.shape[1]}")
    if t_N.numel() != h_NH.shape[0]:
        raise ValueError(f"t_N: expected {h_NH.shape[0]} targets (one per row of h_NH), got {t_N.numel()}")
    if not native_applies(h_NH, w_VH, None):
        raise ValueError(
            "native_partials: needs bf16 CPU hidden [N, H] and weight [V, H] with H even, and a CPU with AVX512-BF16 "
            f"(got {h_NH.dtype} {tuple(h_NH.shape)} on {h_NH.device}, {w_VH.dtype} {tuple(w_VH.shape)} on "
            f"{w_VH.device}; kernel ready: {native_ready()})"
        )
    h = h_NH.contiguous()
    w = w_VH.contiguous()
    n, hid = h.shape
    local = (t_N.reshape(-1).long() - vocab_start).contiguous()
    m, s, u, tz = torch.empty(4, n, dtype=torch.float32).unbind(0)
    _C.head_partials_bf16(
        h.data_ptr(),
        w.data_ptr(),
        local.data_ptr(),
        m.data_ptr(),
        s.data_ptr(),
        u.data_ptr(),
        tz.data_ptr(),
        n,
        w.shape[0],
        hid,
        float(inv_t),
        bool(need_u),
        torch.get_num_threads(),
        [elements_from(h), elements_from(w), elements_from(local), n],
    )
    return m, s, u, tz
