"""Triton kernels of the sibling top-K (``sibling_topk.py``, whose docstring describes the design): the fused
block kernel (H, B, P and validity from embeddings) and the profile kernel (P and validity from precomputed
H and B), with their launchers.

Legend: T = tasks, N = slots of the largest task block, D = embedding size. Block tensors are target-major
x_BTS[b, t, s]. Launch configurations per GPU architecture, autotuning and roofline bounds: ``tuning.py``.
"""

from __future__ import annotations

import torch
from alignopsd.kernels._dispatch import HAS_TRITON, dot_precision, upcast_dots
from alignopsd.kernels.tuning import launch_tuned
from torch import Tensor

if HAS_TRITON:
    import triton
    import triton.language as tl
else:  # pragma: no cover
    triton = None
    tl = None

__all__ = ["blocks_triton", "profiles_triton"]


def _sibling_kernel(
    t_ptr,
    s_ptr,
    srcok_ptr,
    tgtok_ptr,
    roll_ptr,
    h_ptr,
    e_ptr,
    p_ptr,
    valid_ptr,
    N,
    D,
    inv_temp,
    gamma,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (block b, target tile): H, B and P rows of BLOCK_T targets against all sources of block b."""
    b = tl.program_id(0)
    pid_t = tl.program_id(1)
    tg = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tg_in = tg < N
    base = b.to(tl.int64) * N
    tgt_ok = tl.load(tgtok_ptr + base + tg, mask=tg_in, other=0) != 0
    tgt_roll = tl.load(roll_ptr + base + tg, mask=tg_in, other=-1)
    m = tl.full((BLOCK_T,), -1.0e30, dtype=tl.float32)
    ssum = tl.zeros((BLOCK_T,), dtype=tl.float32)
    hmax = tl.full((BLOCK_T,), -1.0e30, dtype=tl.float32)
    has = tl.zeros((BLOCK_T,), dtype=tl.int32)
    for pass_id in tl.static_range(2):
        for s0 in range(0, N, BLOCK_S):
            sr = s0 + tl.arange(0, BLOCK_S)
            sr_in = sr < N
            src_ok = tl.load(srcok_ptr + base + sr, mask=sr_in, other=0) != 0
            src_roll = tl.load(roll_ptr + base + sr, mask=sr_in, other=-2)
            acc = tl.zeros((BLOCK_T, BLOCK_S), dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                ds = d0 + tl.arange(0, BLOCK_D)
                d_in = ds < D
                st = tl.load(
                    s_ptr + (base + tg[:, None]) * D + ds[None, :], mask=tg_in[:, None] & d_in[None, :], other=0.0
                )
                te = tl.load(
                    t_ptr + (base + sr[:, None]) * D + ds[None, :], mask=sr_in[:, None] & d_in[None, :], other=0.0
                )
                if UPCAST:
                    st = st.to(tl.float32)
                    te = te.to(tl.float32)
                acc = tl.dot(st, tl.trans(te), acc, input_precision=DOT_PREC)
            ok = tgt_ok[:, None] & src_ok[None, :]
            h = tl.where(ok, tl.minimum(tl.maximum(acc, -1.0), 1.0), 0.0)
            elig = ok & (tgt_roll[:, None] != src_roll[None, :])
            x = tl.where(elig, h, -1.0e30)
            if pass_id == 0:
                hmax = tl.maximum(hmax, tl.max(x, axis=1))
                has = tl.maximum(has, tl.max(elig.to(tl.int32), axis=1))
                xs = x * inv_temp
                m_new = tl.maximum(m, tl.max(xs, axis=1))
                ssum = ssum * tl.exp(m - m_new) + tl.sum(tl.where(elig, tl.exp(xs - m_new[:, None]), 0.0), axis=1)
                m = m_new
            else:
                denom = tl.where(ssum > 0, ssum, 1.0)
                p = tl.where(elig, tl.exp(x * inv_temp - m[:, None]) / denom[:, None], 0.0)
                out = (base + tg[:, None]) * N + sr[None, :]
                omask = tg_in[:, None] & sr_in[None, :]
                tl.store(h_ptr + out, h, mask=omask)
                tl.store(e_ptr + out, elig.to(tl.int8), mask=omask)
                tl.store(p_ptr + out, p, mask=omask)
    valid = (has > 0) & (hmax >= gamma)
    tl.store(valid_ptr + base + tg, valid.to(tl.int8), mask=tg_in)


def blocks_triton(Tb, Sb, src_ok, tgt_ok, lroll, gamma, temperature):
    """H, B, P and validity of every block from the blocks' embeddings (Tb, Sb [T, N, D]), validity masks and
    rollout slots [T, N]."""
    T, N, D = Tb.shape
    dev = Tb.device
    H = torch.empty(T, N, N, dtype=torch.float32, device=dev)
    E = torch.empty(T, N, N, dtype=torch.int8, device=dev)
    P = torch.empty(T, N, N, dtype=torch.float32, device=dev)
    valid = torch.empty(T, N, dtype=torch.int8, device=dev)
    if T and N:
        launch_tuned(
            _sibling_kernel,
            lambda meta: (T, triton.cdiv(N, meta["BLOCK_T"])),
            dev,
            Tb.contiguous(),
            Sb.contiguous(),
            src_ok.to(torch.int8).contiguous(),
            tgt_ok.to(torch.int8).contiguous(),
            lroll.to(torch.int32).contiguous(),
            H,
            E,
            P,
            valid,
            N,
            D,
            1.0 / temperature,
            float(gamma),
            UPCAST=upcast_dots(Tb),
            DOT_PREC=dot_precision(Tb.dtype),
        )
    return H, E.bool(), P, valid.bool()


def _profiles_kernel(
    h_ptr,
    e_ptr,
    p_ptr,
    valid_ptr,
    N,
    inv_temp,
    gamma,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Program (block b, target tile): P rows and validity of BLOCK_T targets from precomputed H and B tiles."""
    b = tl.program_id(0)
    pid_t = tl.program_id(1)
    tg = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tg_in = tg < N
    base = b.to(tl.int64) * N
    m = tl.full((BLOCK_T,), -1.0e30, dtype=tl.float32)
    ssum = tl.zeros((BLOCK_T,), dtype=tl.float32)
    hmax = tl.full((BLOCK_T,), -1.0e30, dtype=tl.float32)
    has = tl.zeros((BLOCK_T,), dtype=tl.int32)
    for pass_id in tl.static_range(2):
        for s0 in range(0, N, BLOCK_S):
            sr = s0 + tl.arange(0, BLOCK_S)
            cell = (base + tg[:, None]) * N + sr[None, :]
            cmask = tg_in[:, None] & (sr < N)[None, :]
            h = tl.load(h_ptr + cell, mask=cmask, other=0.0)
            elig = tl.load(e_ptr + cell, mask=cmask, other=0) != 0
            x = tl.where(elig, h, -1.0e30)
            if pass_id == 0:
                hmax = tl.maximum(hmax, tl.max(x, axis=1))
                has = tl.maximum(has, tl.max(elig.to(tl.int32), axis=1))
                xs = x * inv_temp
                m_new = tl.maximum(m, tl.max(xs, axis=1))
                ssum = ssum * tl.exp(m - m_new) + tl.sum(tl.where(elig, tl.exp(xs - m_new[:, None]), 0.0), axis=1)
                m = m_new
            else:
                denom = tl.where(ssum > 0, ssum, 1.0)
                p = tl.where(elig, tl.exp(x * inv_temp - m[:, None]) / denom[:, None], 0.0)
                tl.store(p_ptr + cell, p, mask=cmask)
    valid = (has > 0) & (hmax >= gamma)
    tl.store(valid_ptr + base + tg, valid.to(tl.int8), mask=tg_in)


def profiles_triton(H_BTS: Tensor, E_BTS: Tensor, gamma: float, temperature: float) -> tuple[Tensor, Tensor]:
    """P [T, N, N] and validity [T, N] from precomputed target-major H and B blocks."""
    T, N, _ = H_BTS.shape
    dev = H_BTS.device
    P = torch.empty(T, N, N, dtype=torch.float32, device=dev)
    valid = torch.empty(T, N, dtype=torch.int8, device=dev)
    if T and N:
        launch_tuned(
            _profiles_kernel,
            lambda meta: (T, triton.cdiv(N, meta["BLOCK_T"])),
            dev,
            H_BTS.float().contiguous(),
            E_BTS.to(torch.int8).contiguous(),
            P,
            valid,
            N,
            1.0 / temperature,
            float(gamma),
        )
    return P, valid.bool()
