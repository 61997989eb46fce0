"""The LM head's forward partials on the CPU: the C++ bf16 kernel where it applies and was measured faster, else the
torch tiles.

Legend: N = tokens, H = hidden size, V = vocabulary size (or the local shard's size).

torch's CPU matmul has no bf16-input / fp32-output kernel, so the torch path (``torch_tiles.torch_partials``)
upcasts each weight chunk and multiplies in fp32, at about a third of the CPU's bf16 GEMM rate; rounding the
logits to bf16 instead would move the log-probs. ``alignopsd._C.head_partials_bf16`` (csrc/lm_head_bf16.cpp)
multiplies the bf16 values with ``vdpbf16ps`` (every product exact in fp32, fp32 accumulation), never stores the
[N, V] logits and returns the same online partials (m, s, u, tz), equal to the torch path's up to floating-point
reassociation (tests/kernels/test_lse_native.py). On a 2-core AVX512-BF16 CPU, [3800, 576] x [49152, 576]:
~410 GFLOP/s against ~125 for the torch path.

The CPU forward of the fused log-prob (``logprob.py``, :func:`cpu_partials`) takes this path where the kernels'
routing says so (``_dispatch.resolve_impl`` with :func:`head_native`): under ``impl="auto"``, when
:func:`native_applies` and the kernel was measured faster than the torch path on this CPU, dtype and shape
(:func:`measure_head`, ``native_choice.HEAD``: on a Xeon with AMX it is not); under ``impl="cpp"`` wherever it
applies; the torch path otherwise.
"""

from __future__ import annotations

import torch
from alignopsd.kernels._dispatch import NativePath
from alignopsd.kernels.cpp import elements_from, native_ready, why_not_ready
from alignopsd.kernels.head.bf16_gemm import bf16_cpu_head
from alignopsd.kernels.head.torch_tiles import torch_partials
from alignopsd.kernels.native_choice import HEAD, KernelChoice, measure
from torch import Tensor

try:  # the C++ extension is optional (a build without a compiler falls back to the torch path)
    from alignopsd import _C
except ImportError:  # pragma: no cover - depends on the build
    _C = None

__all__ = ["cpu_partials", "head_native", "measure_head", "native_applies", "native_partials"]

_NOT_APPLIED = "the operands are not bf16 CPU tensors of an even hidden size without a bias"


def head_native(h_NH, w_VH, b_V, t_N, inv_t, vocab_start) -> NativePath:
    """The C++ forward as the routing sees it for these operands (``_dispatch.resolve_impl``): it applies where
    :func:`native_applies`, and ``"auto"`` takes it where the measured choice ``native_choice.HEAD`` says it is faster
    (measured on these operands by :func:`measure_head` when nothing was recorded)."""
    why = why_not_ready() or _NOT_APPLIED
    return NativePath(
        native_applies(h_NH, w_VH, b_V),
        HEAD,
        lambda: measure_head(h_NH, w_VH, b_V, t_N, inv_t, vocab_start),
        why,
    )


def cpu_partials(path, h_NH, w_VH, b_V, t_N, inv_t, vocab_start, need_u=True):
    """The forward partials on the CPU path the routing resolved for them (``"cpp"``: the C++ bf16 kernel, bf16
    products with fp32 accumulation; ``"torch"``: ``torch_tiles.torch_partials``, fp32 products of upcast tiles)."""
    if path == "cpp":
        return native_partials(h_NH, w_VH, t_N, inv_t, vocab_start, need_u=need_u)
    return torch_partials(h_NH, w_VH, b_V, t_N, inv_t, vocab_start, need_u=need_u)


@torch.no_grad()
def measure_head(h_NH, w_VH, b_V, t_N, inv_t=1.0, vocab_start=0, *, timer=None) -> KernelChoice:
    """Time the C++ head kernel and ``torch_tiles.torch_partials`` on these operands and record which the CPU forward
    takes (``native_choice.measure``; ``timer`` replaces its clock). Operands the kernel cannot take, or a process
    where it cannot run, record the torch path with the reason."""
    n, hid, v = h_NH.shape[0], h_NH.shape[1], w_VH.shape[0]
    shape = f"[{n}, {hid}] x [{v}, {hid}] {str(h_NH.dtype).removeprefix('torch.')}"

    def torch_path():
        return torch_partials(h_NH, w_VH, b_V, t_N, inv_t, vocab_start)

    native = None
    if native_applies(h_NH, w_VH, b_V):

        def native():
            return native_partials(h_NH, w_VH, t_N, inv_t, vocab_start)

    why = why_not_ready() or _NOT_APPLIED
    return measure(HEAD, native, torch_path, shape, flops=2.0 * n * hid * v, why=why, timer=timer)


def native_applies(h_NH: Tensor, w_VH: Tensor, b_V: Tensor | None) -> bool:
    """Whether :func:`cpu_partials` may take the C++ path for these operands: bf16 CPU hidden states and
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
