"""The per-chunk arithmetic of :func:`alignopsd.kernels.head.fused_loss.logprob_loss_and_grad`.

Legend: V = vocabulary size (or the local shard's size), H = hidden size, n = tokens of one chunk. A chunk's
logits live transposed, as z [V, n] fp32; the helpers below fill it, reduce it to per-token statistics (combined
across vocabulary shards when a group is given), turn it into the logits gradient in place, and push that
gradient into the hidden, weight and bias gradients. The algorithm is described in ``fused_loss.py``'s docstring.
"""

from __future__ import annotations

import torch
from alignopsd.kernels.head.bf16_gemm import mm_bf16
from alignopsd.kernels.head.partials import all_reduce_partials
from torch import Tensor

__all__ = ["accumulate_grads", "combine_partials", "exp_sums", "fill_logits", "logits_grad"]


def fill_logits(
    z: Tensor,
    w: Tensor,
    hs_T: Tensor | None,
    b32: Tensor | None,
    vb: int,
    *,
    h_bf16: Tensor | None = None,
    inv_t: float = 1.0,
) -> None:
    """z[v, i] = w[v] . hs[:, i] (+ bias[v] / T), in vocabulary blocks of ``vb`` rows (fp32 upcast per block); with
    ``h_bf16`` (the chunk's bf16 hidden states [n, H], bf16 ``w``, no bias), ``(w @ h_bf16.T) / T`` in one bf16
    GEMM with fp32 results (``bf16_gemm.mm_bf16``) and ``hs_T`` unused."""
    if h_bf16 is not None:
        mm_bf16(w, h_bf16.T, z, alpha=inv_t)
        return
    V = w.shape[0]
    fp32_w = w.dtype == torch.float32
    for v0 in range(0, V, vb):  # one block for fp32 weights
        v1 = min(V, v0 + vb)
        w_c = w[v0:v1] if fp32_w else w[v0:v1].float()
        if b32 is None:
            torch.mm(w_c, hs_T, out=z[v0:v1])
        else:
            torch.addmm(b32[v0:v1, None], w_c, hs_T, out=z[v0:v1])


def exp_sums(z: Tensor, m: Tensor, blk: int, with_entropy: bool) -> tuple[Tensor, Tensor]:
    """s = sum_v exp(z - m) and u = sum_v exp(z - m) (z - m) per token, in vocabulary blocks of ``blk`` rows that
    stay in cache. z becomes z - m (with entropy) or exp(z - m) (without)."""
    V, n = z.shape
    s = torch.zeros(n, dtype=torch.float32, device=z.device)
    u = torch.zeros(n, dtype=torch.float32, device=z.device)
    for b0 in range(0, V, blk):
        zb = z[b0 : b0 + blk].sub_(m)  # z - max (this shard's max)
        if with_entropy:
            eb = torch.exp(zb)
            s += eb.sum(0)
            u += eb.mul_(zb).sum(0)
        else:
            s += zb.exp_().sum(0)  # z now holds e = exp(z - max)
    return s, u


def accumulate_grads(
    gz: Tensor,
    w: Tensor,
    h_c: Tensor | None,
    vb: int,
    dH_n: Tensor | None,
    dW: Tensor | None,
    dB: Tensor | None,
    *,
    h_bf16: Tensor | None = None,
) -> None:
    """From the chunk's logits gradient gz [V, n]: dH_n = gz.T @ W (written), dW += gz @ h, dB += gz.sum(1), in
    vocabulary blocks of ``vb`` rows of fp32 tiles; with ``h_bf16`` (the chunk's bf16 hidden states, bf16 ``w``, no
    bias), the two GEMMs on bf16 operands (gz rounded to bf16) with fp32 sums, ``h_c`` unused."""
    if h_bf16 is not None:
        _bf16_grads(gz, w, h_bf16, dH_n, dW)
        return
    V = w.shape[0]
    fp32_w = w.dtype == torch.float32
    for v0 in range(0, V, vb):
        v1 = min(V, v0 + vb)
        w_c = w[v0:v1] if fp32_w else w[v0:v1].float()
        g_blk = gz[v0:v1]
        if dH_n is not None:
            part = g_blk.T @ w_c  # [n, H]
            if v0 == 0:
                dH_n.copy_(part)
            else:
                dH_n += part
        if dW is not None:
            if dW.dtype == torch.float32:
                dW[v0:v1].addmm_(g_blk, h_c)
            else:
                dW[v0:v1] += (g_blk @ h_c).to(dW.dtype)
        if dB is not None:
            dB[v0:v1] += g_blk.sum(1).to(dB.dtype)


def _bf16_grads(gz: Tensor, w: Tensor, h_bf16: Tensor, dH_n: Tensor | None, dW: Tensor | None) -> None:
    gz_b = gz.to(torch.bfloat16)
    if dH_n is not None:
        mm_bf16(gz_b.T, w, dH_n)
    if dW is not None:
        if dW.dtype == torch.float32 and dW.stride(1) == 1:
            mm_bf16(gz_b, h_bf16, dW, beta=1.0)
        else:
            dW += mm_bf16(gz_b, h_bf16, torch.empty(dW.shape, dtype=torch.float32)).to(dW.dtype)


def combine_partials(m, s, u, tz, hit, group, with_entropy: bool):
    """(lse, c with p = exp(z - m) * c, entropy or None, target logit) of a chunk's partial statistics,
    combined across the vocabulary shards of ``group`` when given."""
    if group is None:
        lse = m + torch.log(s)
        c = 1.0 / s  # p = e * c
        m_g, s_g, u_g, tz_g = m, s, u, tz
    else:
        m_g, s_g, u_g, tz_g, hits = all_reduce_partials(m, s, u, tz, hit, group)
        if not bool((hits == 1).all()):
            raise ValueError(
                "targets: some ids fall in no vocabulary shard (or in several); check vocab_start and shard sizes"
            )
        lse = m_g + torch.log(s_g)
        c = torch.exp(m - lse)
    ent_c = (torch.log(s_g) - u_g / s_g).clamp_min(0.0) if with_entropy else None
    return lse, c, ent_c, tz_g


def logits_grad(z, m, lse, c, ent_c, g_lp, g_ent, inv_t: float, blk: int) -> Tensor:
    """gz = -p (g_lp + g_ent (log p + ent)) / T in place of z (log p = (z - m) + m - lse, p = exp(z - m) * c;
    z holds z - m with entropy, exp(z - m) without); the target term is added by the caller."""
    V = z.shape[0]
    if ent_c is not None:
        shift, scale = m - lse + ent_c, -inv_t * c
        for b0 in range(0, V, blk):
            zb = z[b0 : b0 + blk]
            eb = torch.exp(zb)
            zb.add_(shift).mul_(g_ent).add_(g_lp).mul_(eb).mul_(scale)
    else:
        z.mul_(-inv_t * g_lp * c)
    return z
