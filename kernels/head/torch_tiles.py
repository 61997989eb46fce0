"""The LM head's torch path: online-logsumexp partials (forward) and the gradients (backward) in tiles.

Legend: N = tokens (flattened), H = hidden size, V = vocabulary size (or the local shard's size).

The [N, V] logits are never stored: both sweeps take tiles of up to ``_TORCH_ROWS`` rows x ``_vocab_chunk(...)``
vocabulary entries, vocabulary outermost so every weight chunk is read (and, for bf16, upcast) once per sweep; peak
extra memory is a few chunk-sized fp32 tiles. :func:`torch_partials` is the forward of the fused log-prob on the
CPU (where the C++ kernel is not taken, ``cpu_partials.py``) and the reference of the Triton forward's launches;
:func:`torch_backward` its backward on the CPU. On bf16 CPU operands without a bias the tiles' GEMMs take bf16
operands with fp32 results where that was measured faster (``gemm_choice.takes_bf16_gemm``, ``bf16_gemm.py``).
The algorithm and the tuning measurements are described in ``logprob.py``'s docstring.
"""

from __future__ import annotations

import torch
from alignopsd.kernels.head.bf16_gemm import mm_bf16
from alignopsd.kernels.head.gemm_choice import takes_bf16_gemm
from alignopsd.kernels.head.partials import merge_partials
from torch import Tensor

__all__ = ["torch_backward", "torch_partials"]

_NEG_INIT = -1.0e30  # finite "minus infinity" for the running max: keeps 0 * (m - m') at 0
_TORCH_ROWS = 512
_TORCH_TILE = 2**21  # max fp32 elements of one logits tile (8 MiB): vocab chunk = elements // rows
_TORCH_TILE_MIN = 2**18  # min elements of a tile (1 MiB)
_UPCAST_BYTES = 32 * 2**20  # bf16/fp16 weight chunks are upcast to fp32 in at most this many bytes


def _vocab_chunk(weight: Tensor, n_rows: int, *, backward: bool = False) -> int:
    """Vocabulary entries per tile: the tile holds clamp(N * V / 32, 2^18, 2^21) fp32 elements.

    At most 1/32 of the full logits (so the few live tiles stay a small fraction of what plain
    torch allocates), at least 1 MiB (small matmuls lose efficiency on CPU), at most 8 MiB.
    The backward always uses 8 MiB tiles: its peak is dominated by the [V, H] weight gradient
    anyway, and its three matmuls per tile gain from the larger shapes.
    """
    V = weight.shape[0]
    elems = _TORCH_TILE if backward else min(_TORCH_TILE, max(_TORCH_TILE_MIN, n_rows * V // 32))
    vc = max(256, elems // max(1, min(n_rows, _TORCH_ROWS)))
    if weight.dtype != torch.float32:  # the chunk is upcast to fp32: bound that copy too
        vc = min(vc, max(256, _UPCAST_BYTES // (4 * max(1, weight.shape[1]))))
    return vc


def torch_partials(h_NH, w_VH, b_V, t_N, inv_t, vocab_start, need_u=True):
    """Online (m, s, u, tz) over the local vocabulary; tz is 0 for targets outside it.

    Each tile contributes (max, sum exp(z - max), sum exp(z - max) (z - max)) and is merged with
    :func:`merge_partials`; ``u`` (the entropy's first moment) is skipped when ``need_u`` is false.
    """
    N, V = h_NH.shape[0], w_VH.shape[0]
    dev = h_NH.device
    m = torch.full((N,), _NEG_INIT, dtype=torch.float32, device=dev)
    s = torch.zeros(N, dtype=torch.float32, device=dev)
    u = torch.zeros(N, dtype=torch.float32, device=dev)
    tz = torch.zeros(N, dtype=torch.float32, device=dev)
    local_t = t_N.long() - vocab_start
    vc = _vocab_chunk(w_VH, N)
    bf16 = takes_bf16_gemm(h_NH, w_VH, b_V)  # bf16 GEMM with fp32 results where measured faster (bf16_gemm.py)
    for v0 in range(0, V, vc):
        v1 = min(V, v0 + vc)
        w_c = w_VH[v0:v1] if bf16 else w_VH[v0:v1].float()
        b_c = b_V[v0:v1].float() * inv_t if b_V is not None else None
        for n0 in range(0, N, _TORCH_ROWS):
            n1 = min(N, n0 + _TORCH_ROWS)
            z = _tile_logits(h_NH[n0:n1], w_c, b_c, inv_t)
            lt = local_t[n0:n1]
            hit = (lt >= v0) & (lt < v1)  # rows whose target lies in this vocabulary chunk (no host sync)
            picked = z.gather(1, (lt - v0).clamp(0, v1 - v0 - 1).unsqueeze(1)).squeeze(1)
            tz[n0:n1] = torch.where(hit, picked, tz[n0:n1])
            m_t = z.amax(dim=1)
            z.sub_(m_t.unsqueeze(1))  # z - max: keeps u free of the |z| * ulp(lse) error
            e = torch.exp(z)
            s_t = e.sum(1)
            u_t = torch.linalg.vecdot(e, z) if need_u else torch.zeros_like(s_t)
            m[n0:n1], s[n0:n1], u[n0:n1] = merge_partials(m[n0:n1], s[n0:n1], u[n0:n1], m_t, s_t, u_t)
    return m, s, u, tz


def _tile_logits(h_c, w_c, b_c, inv_t):
    """(h_c @ w_c.T + b) * inv_t for one tile, fp32; the temperature is folded into the small h_c. A bf16 ``w_c``
    (no bias) takes the bf16 GEMM with fp32 results on the bf16 ``h_c`` (``bf16_gemm.mm_bf16``)."""
    if w_c.dtype == torch.bfloat16:
        out = torch.empty(h_c.shape[0], w_c.shape[0], dtype=torch.float32, device=h_c.device)
        return mm_bf16(h_c, w_c.T, out, alpha=inv_t)
    h_c = h_c.float()
    if inv_t != 1.0:
        h_c = h_c * inv_t
    return torch.mm(h_c, w_c.T) if b_c is None else torch.addmm(b_c, h_c, w_c.T)


def torch_backward(h_NH, w_VH, b_V, t_N, inv_t, vocab_start, lse, ent, g_lp, g_ent, need_h, need_w, need_b):
    N, H = h_NH.shape
    V = w_VH.shape[0]
    dev = h_NH.device
    dh = torch.zeros(N, H, dtype=torch.float32, device=dev) if need_h else None
    dw = (
        (torch.empty if N else torch.zeros)(V, H, dtype=torch.float32, device=dev) if need_w else None
    )  # row chunk 0 writes it
    db = torch.zeros(V, dtype=torch.float32, device=dev) if need_b else None
    local_t = t_N.long() - vocab_start
    glp = g_lp.float() if g_lp is not None else torch.zeros(N, device=dev)
    h32 = h_NH if h_NH.dtype == torch.float32 else None
    vc = _vocab_chunk(w_VH, N, backward=True)
    bf16 = takes_bf16_gemm(h_NH, w_VH, b_V)  # bf16 GEMMs with fp32 results where measured faster (bf16_gemm.py)
    for v0 in range(0, V, vc):
        v1 = min(V, v0 + vc)
        w_c = w_VH[v0:v1] if bf16 else w_VH[v0:v1].float()
        b_c = b_V[v0:v1].float() * inv_t if b_V is not None else None
        for n0 in range(0, N, _TORCH_ROWS):
            n1 = min(N, n0 + _TORCH_ROWS)
            h_c = h_NH[n0:n1] if bf16 else h32[n0:n1] if h32 is not None else h_NH[n0:n1].float()
            z = _tile_logits(h_c, w_c, b_c, inv_t)
            z.sub_(lse[n0:n1].unsqueeze(1))  # z - lse = log p
            p = torch.exp(z)
            if g_ent is not None:
                # coef = g_lp + g_ent * (log p + ent); gz = -p * coef
                z.add_(ent[n0:n1].unsqueeze(1)).mul_(g_ent[n0:n1].float().unsqueeze(1))
                z.add_(glp[n0:n1].unsqueeze(1))
                gz = z.mul_(p).neg_()
            else:
                gz = p.mul_(glp[n0:n1].unsqueeze(1)).neg_()
            lt = local_t[n0:n1]
            hit = (lt >= v0) & (lt < v1)
            if bool(hit.any()):
                rows = hit.nonzero().squeeze(1)
                gz[rows, lt[rows] - v0] += glp[n0 + rows]
            gz.mul_(inv_t)
            if bf16:
                _bf16_tile_grads(gz, w_c, h_c, dh[n0:n1] if need_h else None, dw[v0:v1] if need_w else None, n0)
            if need_h and not bf16:
                dh[n0:n1].addmm_(gz, w_c)
            if need_w and not bf16:
                if n0 == 0:
                    torch.mm(gz.T, h_c, out=dw[v0:v1])
                else:
                    dw[v0:v1].addmm_(gz.T, h_c)
            if need_b:
                db[v0:v1] += gz.sum(0)
    return dh, dw, db


def _bf16_tile_grads(gz, w_c, h_c, dh_n, dw_v, n0):
    """dh_n += gz @ w_c and dw_v (+)= gz.T @ h_c (written when ``n0`` is 0) on bf16 operands, gz rounded to bf16."""
    gz_b = gz.to(torch.bfloat16)
    if dh_n is not None:
        mm_bf16(gz_b, w_c, dh_n, beta=1.0)
    if dw_v is not None:
        mm_bf16(gz_b.T, h_c, dw_v, beta=0.0 if n0 == 0 else 1.0)
