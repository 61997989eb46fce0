"""Triton kernels of the fused LM-head log-prob (``logprob.py``, whose docstring describes the algorithm): the
forward kernel (partial online-logsumexp statistics per row tile and vocabulary split) and the backward kernel
(recomputed logits tile, gradient shares added atomically), with their launchers.

Legend: N = tokens (flattened), H = hidden size, V = vocabulary size (or the local shard's size), S = vocabulary
splits of the forward grid. Launch configurations per GPU architecture, autotuning and roofline bounds:
``kernels/tuning.py``.
"""

from __future__ import annotations

import math

import torch
from alignopsd.kernels._dispatch import HAS_TRITON, dot_precision, upcast_dots
from alignopsd.kernels.head.partials import combine_splits
from alignopsd.kernels.head.torch_tiles import torch_partials
from alignopsd.kernels.tuning import arch_of, default_config, launch_tuned, max_meta
from torch import Tensor

if HAS_TRITON:
    import triton
    import triton.language as tl
else:  # pragma: no cover - the torch paths do not need triton
    triton = None
    tl = None

__all__ = ["triton_backward", "triton_partials"]


# --------------------------------------------------------------------------------------
# Triton kernels (plain functions; decorated lazily by _dispatch.jit)
# --------------------------------------------------------------------------------------
def _lp_fwd_kernel(
    h_ptr,
    w_ptr,
    b_ptr,
    t_ptr,
    m_ptr,
    s_ptr,
    u_ptr,
    tz_ptr,
    N,
    V,
    H,
    stride_hn,
    stride_wv,
    inv_t,
    vocab_start,
    v_per_split,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Program (row tile, vocabulary split): partial (m, s, u, tz) of its rows over its split."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    tgt = tl.load(t_ptr + rows, mask=row_mask, other=-1).to(tl.int64) - vocab_start
    m = tl.full((BLOCK_N,), -1.0e30, dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    tz = tl.zeros((BLOCK_N,), dtype=tl.float32)
    v_lo = pid_s * v_per_split
    v_hi = tl.minimum(v_lo + v_per_split, V)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols < v_hi
        acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_H):
            ks = k0 + tl.arange(0, BLOCK_H)
            k_mask = ks < H
            h = tl.load(
                h_ptr + rows[:, None].to(tl.int64) * stride_hn + ks[None, :],
                mask=row_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            w = tl.load(
                w_ptr + cols[:, None].to(tl.int64) * stride_wv + ks[None, :],
                mask=col_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            if UPCAST:
                h = h.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(h, tl.trans(w), acc, input_precision=DOT_PREC)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        z = acc * inv_t
        tz += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
        z = tl.where(col_mask[None, :], z, -float("inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        a = tl.exp(m - m_new)
        zs = tl.where(col_mask[None, :], z - m_new[:, None], 0.0)
        e = tl.where(col_mask[None, :], tl.exp(zs), 0.0)
        u = a * (u + s * (m - m_new)) + tl.sum(e * zs, axis=1)
        s = s * a + tl.sum(e, axis=1)
        m = m_new
    out = pid_s * N + rows
    tl.store(m_ptr + out, m, mask=row_mask)
    tl.store(s_ptr + out, s, mask=row_mask)
    tl.store(u_ptr + out, u, mask=row_mask)
    tl.store(tz_ptr + out, tz, mask=row_mask)


def _lp_bwd_kernel(
    h_ptr,
    w_ptr,
    b_ptr,
    t_ptr,
    lse_ptr,
    ent_ptr,
    glp_ptr,
    gent_ptr,
    dh_ptr,
    dw_ptr,
    db_ptr,
    N,
    V,
    H,
    stride_hn,
    stride_wv,
    inv_t,
    vocab_start,
    HAS_BIAS: tl.constexpr,
    HAS_GENT: tl.constexpr,
    NEED_H: tl.constexpr,
    NEED_W: tl.constexpr,
    NEED_B: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Program (row tile, vocabulary tile): recompute z, form gz, atomically add its gradient shares."""
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < V
    tgt = tl.load(t_ptr + rows, mask=row_mask, other=-1).to(tl.int64) - vocab_start
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_mask = ks < H
        h = tl.load(
            h_ptr + rows[:, None].to(tl.int64) * stride_hn + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols[:, None].to(tl.int64) * stride_wv + ks[None, :],
            mask=col_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        if UPCAST:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=DOT_PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    glp = tl.load(glp_ptr + rows, mask=row_mask, other=0.0)
    logp = acc * inv_t - lse[:, None]
    valid = row_mask[:, None] & col_mask[None, :]
    p = tl.where(valid, tl.exp(logp), 0.0)
    coef = glp[:, None] + tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    if HAS_GENT:
        ent = tl.load(ent_ptr + rows, mask=row_mask, other=0.0)
        gent = tl.load(gent_ptr + rows, mask=row_mask, other=0.0)
        coef += gent[:, None] * (tl.where(valid, logp, 0.0) + ent[:, None])
    gz = -p * coef
    gz += tl.where((cols[None, :] == tgt[:, None]) & valid, glp[:, None], 0.0)
    gz = gz * inv_t
    if NEED_B:
        tl.atomic_add(db_ptr + cols, tl.sum(gz, axis=0), mask=col_mask)
    for k0 in range(0, H, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_mask = ks < H
        if NEED_H:
            w = tl.load(
                w_ptr + cols[:, None].to(tl.int64) * stride_wv + ks[None, :],
                mask=col_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            if UPCAST:
                dh = tl.dot(gz, w.to(tl.float32), input_precision=DOT_PREC)
            else:
                dh = tl.dot(gz.to(w.dtype), w, input_precision=DOT_PREC)
            tl.atomic_add(
                dh_ptr + rows[:, None].to(tl.int64) * H + ks[None, :],
                dh,
                mask=row_mask[:, None] & k_mask[None, :],
            )
        if NEED_W:
            h = tl.load(
                h_ptr + rows[:, None].to(tl.int64) * stride_hn + ks[None, :],
                mask=row_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            if UPCAST:
                dw = tl.dot(tl.trans(gz), h.to(tl.float32), input_precision=DOT_PREC)
            else:
                dw = tl.dot(tl.trans(gz).to(h.dtype), h, input_precision=DOT_PREC)
            tl.atomic_add(
                dw_ptr + cols[:, None].to(tl.int64) * H + ks[None, :],
                dw,
                mask=col_mask[:, None] & k_mask[None, :],
            )


def _num_splits(n_row_tiles: int, V: int, device: torch.device) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        want = max(1, math.ceil(2 * sms / max(1, n_row_tiles)))
    else:  # interpreter: a couple of splits, so the split-combine path is exercised
        want = 2
    return max(1, min(want, triton.cdiv(V, max_meta("_lp_fwd_kernel", "BLOCK_V"))))


def triton_partials(h_NH, w_VH, b_V, t_N, inv_t, vocab_start):
    N, H = h_NH.shape
    V = w_VH.shape[0]
    if N == 0 or V == 0:  # nothing to launch
        return torch_partials(h_NH, w_VH, b_V, t_N, inv_t, vocab_start)
    h_NH = h_NH.contiguous()
    w_VH = w_VH.contiguous()
    # the vocabulary splits are fixed before the configuration is: a multiple of every configuration's BLOCK_V
    BV = max_meta("_lp_fwd_kernel", "BLOCK_V")
    row_tiles = triton.cdiv(N, default_config("_lp_fwd_kernel", arch_of(h_NH.device)).meta["BLOCK_N"])
    S = _num_splits(row_tiles, V, h_NH.device)
    v_per_split = triton.cdiv(triton.cdiv(V, S), BV) * BV
    S = triton.cdiv(V, v_per_split)
    parts = torch.empty(4, S, N, dtype=torch.float32, device=h_NH.device)
    launch_tuned(
        _lp_fwd_kernel,
        lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), S),
        h_NH.device,
        h_NH,
        w_VH,
        b_V if b_V is not None else h_NH,
        t_N.contiguous(),
        parts[0],
        parts[1],
        parts[2],
        parts[3],
        N,
        V,
        H,
        h_NH.stride(0),
        w_VH.stride(0),
        inv_t,
        vocab_start,
        v_per_split,
        HAS_BIAS=b_V is not None,
        UPCAST=upcast_dots(h_NH),
        DOT_PREC=dot_precision(h_NH.dtype),
    )
    m, s, u = combine_splits(parts[0], parts[1], parts[2])
    return m, s, u, parts[3].sum(0)


def triton_backward(h_NH, w_VH, b_V, t_N, inv_t, vocab_start, lse, ent, g_lp, g_ent, need_h, need_w, need_b):
    N, H = h_NH.shape
    V = w_VH.shape[0]
    dev = h_NH.device
    h_NH = h_NH.contiguous()
    w_VH = w_VH.contiguous()
    dh = torch.zeros(N, H, dtype=torch.float32, device=dev) if need_h else None
    dw = torch.zeros(V, H, dtype=torch.float32, device=dev) if need_w else None
    db = torch.zeros(V, dtype=torch.float32, device=dev) if need_b else None
    if N == 0 or V == 0:
        return dh, dw, db
    glp = g_lp.float().contiguous() if g_lp is not None else torch.zeros(N, device=dev)
    dummy = lse

    # unused gradient outputs point at spare buffers of their own: the autotuner zeroes the gradient arguments
    # between its benchmark runs (RESET_TO_ZERO), which must not reach lse or any other argument
    def spare() -> Tensor:
        return torch.zeros(1, dtype=torch.float32, device=dev)

    launch_tuned(
        _lp_bwd_kernel,
        lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(V, meta["BLOCK_V"])),
        dev,
        h_NH,
        w_VH,
        b_V if b_V is not None else h_NH,
        t_N.contiguous(),
        lse.contiguous(),
        ent.contiguous(),
        glp,
        g_ent.float().contiguous() if g_ent is not None else dummy,
        dh if dh is not None else spare(),
        dw if dw is not None else spare(),
        db if db is not None else spare(),
        N,
        V,
        H,
        h_NH.stride(0),
        w_VH.stride(0),
        inv_t,
        vocab_start,
        HAS_BIAS=b_V is not None,
        HAS_GENT=g_ent is not None,
        NEED_H=need_h,
        NEED_W=need_w,
        NEED_B=need_b,
        UPCAST=upcast_dots(h_NH),
        DOT_PREC=dot_precision(h_NH.dtype),
    )
    return dh, dw, db
