"""Whether the LM head's GEMMs take the bf16 GEMM with fp32 results (``bf16_gemm.mm_bf16``): measured, not assumed.

Legend: N = tokens, H = hidden size, V = vocabulary size, n = tokens of one chunk. :func:`measure_head_gemm` times
the three GEMMs of one chunk of the fused loss (:func:`chunk_gemms`: the logits tile and the hidden and weight
gradients, ``fused_chunk``'s own calls) on bf16 operands against fp32 tiles and records the faster as
``native_choice.HEAD_GEMM``; :func:`takes_bf16_gemm` is what the head's torch paths (``fused_loss``,
``torch_tiles``) ask, measuring on first use when nothing was recorded.
"""

from __future__ import annotations

import torch
from alignopsd.kernels._dispatch import NativePath, resolve_impl
from alignopsd.kernels.head.bf16_gemm import gemm_applies, why_no_gemm
from alignopsd.kernels.head.fused_chunk import accumulate_grads, fill_logits
from alignopsd.kernels.native_choice import HEAD_GEMM, KernelChoice, measure
from torch import Tensor

__all__ = ["chunk_gemms", "measure_head_gemm", "takes_bf16_gemm"]


def chunk_gemms(h_nH: Tensor, w_VH: Tensor, z_Vn: Tensor, dH: Tensor, dW: Tensor, bf16: bool) -> None:
    """The three GEMMs of one chunk of the fused loss (``fused_chunk``): the logits tile, then the hidden and weight
    gradients of a logits gradient the size of the tile, on bf16 operands (``bf16``) or fp32 tiles: what
    :func:`measure_head_gemm` times."""
    vb = w_VH.shape[0] if bf16 else max(1, min(w_VH.shape[0], (32 << 20) // (4 * max(1, w_VH.shape[1]))))
    fill_logits(z_Vn, w_VH, h_nH.float().T, None, vb, h_bf16=h_nH if bf16 else None)
    accumulate_grads(z_Vn, w_VH, h_nH.float(), vb, dH, dW, None, h_bf16=h_nH if bf16 else None)


def measure_head_gemm(h_nH: Tensor, w_VH: Tensor, *, timer=None) -> KernelChoice:
    """Time the head's chunk GEMMs (:func:`chunk_gemms`: logits tile, hidden and weight gradients) on bf16 operands
    against fp32 tiles on these operands and record which the head takes (``native_choice.measure``; ``timer``
    replaces its clock). Operands it cannot take, or a process where it cannot run, record the fp32 tiles with the
    reason."""
    n, hid, v = h_nH.shape[0], h_nH.shape[1], w_VH.shape[0]
    shape = f"[{n}, {hid}] x [{v}, {hid}] {str(h_nH.dtype).removeprefix('torch.')}, forward and backward"
    z = torch.empty(v, n)
    dH = torch.empty(n, hid)
    dW = torch.zeros(v, hid)

    def torch_path():
        chunk_gemms(h_nH, w_VH, z, dH, dW, False)

    native = None
    if gemm_applies(h_nH, w_VH):

        def native():
            chunk_gemms(h_nH, w_VH, z, dH, dW, True)

    why = why_no_gemm() or "the operands are not bf16 CPU tensors without a bias"
    return measure(HEAD_GEMM, native, torch_path, shape, flops=3 * 2.0 * n * hid * v, why=why, timer=timer)


def takes_bf16_gemm(h: Tensor, w: Tensor, bias: Tensor | None = None) -> bool:
    """Whether the head's GEMMs on these operands take ``bf16_gemm.mm_bf16``: the kernels' routing
    (``_dispatch.resolve_impl``) picks it where it applies and the recorded choice says it is faster (measured now on
    these operands, at most 256 of their rows, if nothing was recorded). Independent of the entry's ``impl``: the
    torch tiles take it too."""
    gemm = NativePath(
        gemm_applies(h, w, bias), HEAD_GEMM, lambda: measure_head_gemm(h.reshape(-1, h.shape[-1])[:256], w)
    )
    return resolve_impl("auto", native=gemm) == "cpp"
