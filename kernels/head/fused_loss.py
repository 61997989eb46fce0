"""Log-probabilities, a per-token loss and its gradients in one sweep over token chunks.

Legend: N = tokens (flattened), H = hidden size, V = vocabulary size, n = tokens of one chunk.

Why a second entry beside :func:`alignopsd.kernels.head.logprob`
----------------------------------------------------------------
``logprob`` is an autograd function: its forward cannot know the gradient that will arrive
for each token, so its backward must recompute every logits tile. That is four
[N, H] x [H, V]-sized matmuls per training forward+backward where plain autograd runs three
(and pays for it with [N, V] buffers). When the loss is a sum of per-token terms, each
token's gradient ``dL/dlogp_i`` (and ``dL/dent_i``) is known as soon as that token's
log-probability is, so the gradients can be formed while the token's logits are still at
hand -- the approach of fused linear cross-entropy kernels. Per chunk of n tokens:

    z_Vn   = (W_VH @ h_nH.T + b_V) / T            one matmul (chunk buffer, fp32)
    logp_n, ent_n from z (max, exp, sum)           elementwise on the chunk
    g_lp_n, g_ent_n = d token_loss / d (logp, ent) autograd on n numbers
    gz_Vn  = (g_lp (onehot - p) - g_ent p (log p + ent)) / T   in place
    grad_h_nH  = gz.T @ W                          second matmul
    grad_W_VH += gz @ h                            third matmul, accumulated in place

Three matmuls, no recomputation, and at most a chunk of logits alive at a time. The weight
gradient is accumulated straight into a caller's buffer when one is given (``grad_weight=``,
e.g. the parameter's existing ``.grad`` or a data-parallel ``main_grad``), which removes the
[V, H] temporary that an autograd backward allocates before adding it into ``.grad``.

Requirement: the loss must be *separable*: a sum over tokens of terms that each depend on one
token's log-probability and entropy (token-mean PPO/GRPO losses with fixed denominators,
entropy bonuses, per-token KL to fixed reference log-probs, advantage-weighted terms). The
closure is evaluated once per chunk and only the chunk's tokens are live variables; a loss
that couples tokens (a sequence-level ratio, a normaliser computed from log-probs) gets a
wrong gradient here and must use :func:`logprob` instead.

Chunk size: ``tile_bytes`` bounds the fp32 chunk buffer of logits:
default ``max(64 MiB, 4 N H)`` on a CPU and ``max(512 MiB, 4 N H)`` on CUDA, capped at 1 GiB, i.e.
at least the size of the hidden states (the rule of fused cross-entropy kernels). Each chunk
reads and rewrites the [V, H] weight gradient once, so on a GPU, where that traffic is what
bounds small chunks, the chunks are larger; on a CPU the matmuls dominate and small chunks
keep the memory low. On a CPU the elementwise passes (max, exp, sums, the
logits gradient) run over ~1 MiB vocabulary slices of the chunk so that they stay in cache; with
entropy the exponentials are recomputed in the gradient pass instead of kept in a second buffer.
Non-fp32 weights are upcast in vocabulary blocks of at most 32 MiB ("fp32 tiles"); for bf16 CPU operands without
a bias the three matmuls run instead as bf16 GEMMs with fp32 results (``bf16_gemm.py``: exact bf16 products, fp32
sums, the logits gradient rounded to bf16 for the two backward GEMMs) wherever that was measured faster here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from alignopsd.kernels.head.checks import check_lm_head_inputs, check_target_range
from alignopsd.kernels.head.fused_chunk import accumulate_grads, combine_partials, exp_sums, fill_logits, logits_grad
from alignopsd.kernels.head.gemm_choice import takes_bf16_gemm
from torch import Tensor

__all__ = ["FusedTokenLoss", "fused_token_loss", "logprob_loss_and_grad"]

_TILE_MIN = 64 * 2**20
_TILE_MIN_CUDA = 512 * 2**20
_TILE_MAX = 2**30
_UPCAST_BYTES = 32 * 2**20
_BLOCK_BYTES = 2**20  # CPU: elementwise passes over [block, n] slices of ~1 MiB (cache-resident)

TokenLoss = Callable[[Tensor, Tensor | None, Tensor], Tensor]


class FusedTokenLoss(NamedTuple):
    """Result of :func:`logprob_loss_and_grad`.

    loss: fp32 scalar, the sum of the per-token losses. logp / entropy: [...] fp32, detached
    (entropy None unless asked). grad_hidden: [..., H] in hidden's dtype (None if not asked).
    grad_weight: [V, H], the buffer that was accumulated into (or a new fp32 tensor; None if not
    asked). grad_bias: [V] likewise (None without a bias).
    """

    loss: Tensor
    logp: Tensor
    entropy: Tensor | None
    grad_hidden: Tensor | None
    grad_weight: Tensor | None
    grad_bias: Tensor | None


def _check_buffer(buf: Tensor | None, name: str, shape: tuple[int, ...], device: torch.device) -> None:
    if buf is None:
        return
    if not isinstance(buf, Tensor) or tuple(buf.shape) != shape:
        raise ValueError(f"{name}: expected a tensor of shape {shape}, got {getattr(buf, 'shape', buf)}")
    if not buf.is_floating_point():
        raise ValueError(f"{name}: expected a floating tensor, got {buf.dtype}")
    if buf.device != device:
        raise ValueError(f"{name}: expected device {device}, got {buf.device}")
    if not buf.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (it is accumulated into in place)")


def _chunk_rows(n_tokens: int, hidden_size: int, vocab: int, tile_bytes: int | None, on_cuda: bool = False) -> int:
    """Tokens per chunk: the fp32 chunk buffer of logits fits ``tile_bytes``; chunks are balanced."""
    if tile_bytes is None:
        floor = _TILE_MIN_CUDA if on_cuda else _TILE_MIN
        tile_bytes = min(_TILE_MAX, max(floor, 4 * n_tokens * hidden_size))
    rows = max(1, int(tile_bytes) // (4 * max(1, vocab)))
    n_chunks = max(1, math.ceil(n_tokens / rows))
    return max(1, math.ceil(n_tokens / n_chunks))


def _token_grads(
    token_loss: TokenLoss, logp: Tensor, ent: Tensor | None, index: Tensor
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Evaluate ``token_loss`` on the chunk's (logp, ent) as leaves; return (loss, g_lp, g_ent)."""
    lp = logp.detach().requires_grad_(True)
    en = ent.detach().requires_grad_(True) if ent is not None else None
    with torch.enable_grad():
        out = token_loss(lp, en, index)
        if not isinstance(out, Tensor) or not out.is_floating_point():
            raise ValueError(f"token_loss: must return a floating tensor, got {type(out).__name__}")
        if out.dim() > 0 and tuple(out.shape) != tuple(lp.shape):
            raise ValueError(f"token_loss: expected a scalar or shape {tuple(lp.shape)}, got {tuple(out.shape)}")
        total = out.sum()
        if not total.requires_grad:  # the loss does not depend on this chunk
            return total.detach().float(), torch.zeros_like(lp), (torch.zeros_like(en) if en is not None else None)
        inputs = (lp,) if en is None else (lp, en)
        grads = torch.autograd.grad(total, inputs, allow_unused=True)
    g_lp = grads[0] if grads[0] is not None else torch.zeros_like(lp)
    g_ent = None
    if en is not None:
        g_ent = grads[1] if grads[1] is not None else torch.zeros_like(en)
    return total.detach().float(), g_lp.float(), (g_ent.float() if g_ent is not None else None)


def _check_args(
    hidden, weight, targets, token_loss, bias, temperature, grad_weight, grad_bias, tile_bytes, group, vocab_start
) -> float:
    """Validate the arguments of :func:`logprob_loss_and_grad` (ValueError naming the culprit); returns 1 / T."""
    inv_t = check_lm_head_inputs(hidden, weight, targets, bias, temperature)
    if group is None:
        if vocab_start != 0:
            raise ValueError(f"vocab_start: only meaningful with a group, got {vocab_start!r}")
        check_target_range(targets, 0, weight.shape[0])
    else:
        if isinstance(vocab_start, bool) or not isinstance(vocab_start, int) or vocab_start < 0:
            raise ValueError(f"vocab_start: expected a non-negative int, got {vocab_start!r}")
        check_target_range(targets, 0, 2**62)
    if not callable(token_loss):
        raise ValueError(f"token_loss: expected a callable, got {type(token_loss).__name__}")
    V, H = weight.shape
    dev = hidden.device
    _check_buffer(grad_weight, "grad_weight", (V, H), dev)
    _check_buffer(grad_bias, "grad_bias", (V,), dev)
    if grad_bias is not None and bias is None:
        raise ValueError("grad_bias: given without a bias")
    if tile_bytes is not None and (isinstance(tile_bytes, bool) or not isinstance(tile_bytes, int) or tile_bytes <= 0):
        raise ValueError(f"tile_bytes: expected a positive int, got {tile_bytes!r}")

    return inv_t


def _grad_buffers(N, V, H, dev, has_bias, need_hidden_grad, need_weight_grad, grad_weight, grad_bias):
    """(dH [N, H] or None, dW [V, H] or None, dB [V] or None): the caller's buffers where given, else new fp32."""
    dW = None
    if need_weight_grad:
        dW = grad_weight if grad_weight is not None else torch.zeros(V, H, dtype=torch.float32, device=dev)
    dB = None
    if has_bias and (need_weight_grad or grad_bias is not None):
        dB = grad_bias if grad_bias is not None else torch.zeros(V, dtype=torch.float32, device=dev)
    dH = torch.empty(N, H, dtype=torch.float32, device=dev) if need_hidden_grad else None
    return dH, dW, dB


def _chunk_loss_and_logits_grad(
    z: Tensor,
    h_c: Tensor | None,
    h_b: Tensor | None,
    t_n: Tensor,
    w: Tensor,
    b32: Tensor | None,
    vb: int,
    blk: int,
    token_loss: TokenLoss,
    index: Tensor,
    *,
    inv_t: float,
    vocab_start: int,
    group,
    with_entropy: bool,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """One chunk of :func:`logprob_loss_and_grad`: its logits, log-probs, loss and logits gradient.

    z: [V, n] fp32 buffer, overwritten (it ends as the logits gradient gz, which is returned). h_c: [n, H] fp32
    hidden states, or h_b: the bf16 ones when the logits come from a bf16 GEMM (``bf16_gemm.mm_bf16``); t_n: [n]
    global target ids; index: [n] their positions in ``targets.reshape(-1)``.
    Returns (loss of the chunk, logp [n], entropy [n] or None, gz [V, n]).
    """
    n = z.shape[1]
    V = w.shape[0]
    if h_b is not None:
        fill_logits(z, w, None, None, vb, h_bf16=h_b, inv_t=inv_t)
    else:
        fill_logits(z, w, (h_c * inv_t if inv_t != 1.0 else h_c).T, b32, vb)  # hs_T: [H, n]
    cols = torch.arange(n, device=z.device)
    lt = t_n - vocab_start  # local target row; outside [0, V) on other ranks' shards
    hit = (lt >= 0) & (lt < V)
    lt_in = lt.clamp(0, max(V - 1, 0))
    tz = torch.where(hit, z[lt_in, cols], 0.0)
    m = z.amax(dim=0)
    s, u = exp_sums(z, m, blk, with_entropy)
    lse, c, ent_c, tz_g = combine_partials(m, s, u, tz, hit, group, with_entropy)
    lp_c = tz_g - lse
    loss_c, g_lp, g_ent = _token_grads(token_loss, lp_c, ent_c, index)
    gz = logits_grad(z, m, lse, c, ent_c, g_lp, g_ent, inv_t, blk)  # plus g_lp / T at the target:
    if group is None:
        gz[lt_in, cols] += g_lp * inv_t
    else:
        gz[lt_in[hit], cols[hit]] += g_lp[hit] * inv_t
    return loss_c, lp_c, ent_c, gz


def _sweep_chunks(
    h_NH: Tensor,
    t_N: Tensor,
    w: Tensor,
    bias: Tensor | None,
    token_loss: TokenLoss,
    dH: Tensor | None,
    dW: Tensor | None,
    dB: Tensor | None,
    *,
    inv_t: float,
    vocab_start: int,
    group,
    with_entropy: bool,
    tile_bytes: int | None,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """The chunk loop of :func:`logprob_loss_and_grad`: (logp [N], entropy [N] or None, loss) of all tokens, with
    dH [N, H] written and dW [V, H] / dB [V] accumulated in place (each None when not wanted)."""
    N, H = h_NH.shape
    V = w.shape[0]
    dev = h_NH.device
    logp = torch.empty(N, dtype=torch.float32, device=dev)
    ent = torch.empty(N, dtype=torch.float32, device=dev) if with_entropy else None
    loss = torch.zeros((), dtype=torch.float32, device=dev)
    vb = V if w.dtype == torch.float32 else max(1, min(V, _UPCAST_BYTES // (4 * max(1, H))))
    b32 = bias.detach().float() * inv_t if bias is not None else None
    on_cuda = dev.type == "cuda"
    rows = _chunk_rows(N, H, V, tile_bytes, on_cuda)
    bf16 = not on_cuda and takes_bf16_gemm(h_NH, w, bias)  # measured faster than fp32 tiles (bf16_gemm.py)
    z_buf = torch.empty(V * min(rows, max(N, 1)), dtype=torch.float32, device=dev)
    for n0 in range(0, N, rows):
        n1 = min(N, n0 + rows)
        h_b = h_NH[n0:n1] if bf16 else None
        h_c = None if bf16 else h_NH[n0:n1].float()
        z = z_buf[: V * (n1 - n0)].view(V, n1 - n0)  # z[v, i]: logits of token i, vocabulary entry v
        # elementwise work in vocabulary blocks that stay in cache (one block on CUDA)
        blk = V if on_cuda else max(64, _BLOCK_BYTES // (4 * (n1 - n0)))
        loss_c, lp_c, ent_c, gz = _chunk_loss_and_logits_grad(
            z,
            h_c,
            h_b,
            t_N[n0:n1],
            w,
            b32,
            vb,
            blk,
            token_loss,
            torch.arange(n0, n1, device=dev),
            inv_t=inv_t,
            vocab_start=vocab_start,
            group=group,
            with_entropy=with_entropy,
        )
        logp[n0:n1] = lp_c
        if with_entropy:
            ent[n0:n1] = ent_c
        loss += loss_c
        accumulate_grads(gz, w, h_c, vb, dH[n0:n1] if dH is not None else None, dW, dB, h_bf16=h_b)
    return logp, ent, loss


def logprob_loss_and_grad(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    token_loss: TokenLoss,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    need_hidden_grad: bool = True,
    need_weight_grad: bool = True,
    grad_weight: Tensor | None = None,
    grad_bias: Tensor | None = None,
    tile_bytes: int | None = None,
    group=None,
    vocab_start: int = 0,
    reduce_grad_hidden: bool = True,
) -> FusedTokenLoss:
    """Per-token log-probs (and entropy), a separable loss over them, and its gradients, in one sweep.

    hidden[..., H] (fp32/bf16/fp16), weight[V, H] (same dtype), bias[V] or None, targets[...] ids in [0, V).
    token_loss(logp_n, ent_n or None, index_n) -> per-token losses [n] (or their sum): called once per
    chunk with the chunk's log-probs / entropies as differentiable fp32 leaves and ``index_n``, the
    positions of those tokens in ``targets.reshape(-1)``. It must be separable over tokens (see the module
    docstring). grad_weight / grad_bias: optional contiguous buffers ([V, H] / [V]) the gradients are
    added into in place (any float dtype; fp32 recommended); without them new fp32 tensors are returned.
    tile_bytes: bound on the fp32 chunk buffer (default: see the module docstring).

    Vocab parallel (``group`` given): ``weight``/``bias`` are this rank's rows ``[vocab_start, vocab_start + V)``
    of the head and ``targets`` are global ids, each in exactly one rank's shard; every rank of ``group``
    passes the same hidden states, targets and loss. Per chunk, one MAX and one SUM all-reduce combine the
    shards' partial statistics (as :func:`logprob_vocab_parallel` does), so every rank sees the same log-probs
    and loss gradients; each rank gets its own shard's weight/bias gradient, and the hidden gradient (a sum
    over shards) is all-reduced over ``group`` at the end unless ``reduce_grad_hidden=False``.

    Works on any device (plain matmuls plus elementwise work on the chunk). Gradients equal autograd
    through :func:`logprob_ref` and the same loss, up to fp32 rounding.
    """
    inv_t = _check_args(
        hidden, weight, targets, token_loss, bias, temperature, grad_weight, grad_bias, tile_bytes, group, vocab_start
    )
    V, H = weight.shape
    dev = hidden.device
    lead = hidden.shape[:-1]
    h_NH = hidden.detach().reshape(-1, H)
    t_N = targets.reshape(-1).long()
    N = h_NH.shape[0]
    dH, dW, dB = _grad_buffers(
        N, V, H, dev, bias is not None, need_hidden_grad, need_weight_grad, grad_weight, grad_bias
    )
    logp, ent, loss = _sweep_chunks(
        h_NH,
        t_N,
        weight.detach(),
        bias,
        token_loss,
        dH,
        dW,
        dB,
        inv_t=inv_t,
        vocab_start=vocab_start,
        group=group,
        with_entropy=with_entropy,
        tile_bytes=tile_bytes,
    )
    if dH is not None and group is not None and reduce_grad_hidden:
        dist.all_reduce(dH, op=dist.ReduceOp.SUM, group=group)
    return FusedTokenLoss(
        loss=loss,
        logp=logp.reshape(lead),
        entropy=ent.reshape(lead) if ent is not None else None,
        grad_hidden=dH.to(hidden.dtype).reshape(hidden.shape) if dH is not None else None,
        grad_weight=dW,
        grad_bias=dB,
    )


class _FusedLossFn(torch.autograd.Function):
    """Gradients formed in the forward (three matmuls); the backward scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, token_loss, inv_temperature, with_entropy, tile_bytes, tp):
        group, vocab_start, reduce_grad_hidden = tp
        r = logprob_loss_and_grad(
            hidden,
            weight,
            targets,
            token_loss,
            bias=bias,
            temperature=1.0 / inv_temperature,
            with_entropy=with_entropy,
            need_hidden_grad=ctx.needs_input_grad[0],
            need_weight_grad=ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2]),
            tile_bytes=tile_bytes,
            group=group,
            vocab_start=vocab_start,
            reduce_grad_hidden=reduce_grad_hidden,
        )
        gw = r.grad_weight if ctx.needs_input_grad[1] else None
        gb = r.grad_bias if (bias is not None and ctx.needs_input_grad[2]) else None
        ctx.save_for_backward(r.grad_hidden, gw, gb)
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ent = r.entropy if r.entropy is not None else torch.zeros_like(r.logp)
        ctx.mark_non_differentiable(r.logp, ent)
        return r.loss, r.logp, ent

    @staticmethod
    def backward(ctx, g_loss, _g_lp, _g_ent):
        gh, gw, gb = ctx.saved_tensors
        dt_h, dt_w, dt_b = ctx.dtypes

        def scaled(g, dt):
            # the saved gradients belong to this call alone: scale them in place (no second [V, H] copy)
            if g is None:
                return None
            if g_loss is None:
                return g.zero_().to(dt)
            return g.mul_(g_loss).to(dt)

        return scaled(gh, dt_h), scaled(gw, dt_w), scaled(gb, dt_b), None, None, None, None, None, None


def fused_token_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    token_loss: TokenLoss,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    tile_bytes: int | None = None,
    group=None,
    vocab_start: int = 0,
    reduce_grad_hidden: bool = True,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Autograd form of :func:`logprob_loss_and_grad`: returns (loss, logp, entropy or None).

    ``loss`` (fp32 scalar, the sum of ``token_loss`` over its calls) is differentiable w.r.t. hidden,
    weight and bias; logp / entropy are detached. All gradients are formed during this call (three
    matmuls over token chunks) and kept until ``backward``, which multiplies them by the incoming
    gradient, so autograd hooks (data-parallel reducers, tied embeddings) see an ordinary gradient.
    The fp32 weight gradient is held between forward and backward ([V, H], the size ``.grad`` will have).
    ``token_loss`` must be separable over tokens (see the module docstring). ``group`` / ``vocab_start`` /
    ``reduce_grad_hidden``: vocab parallel, as in :func:`logprob_loss_and_grad`.
    """
    inv_t = check_lm_head_inputs(hidden, weight, targets, bias, temperature)
    tp = (group, vocab_start, reduce_grad_hidden)
    loss, logp, ent = _FusedLossFn.apply(hidden, weight, bias, targets, token_loss, inv_t, with_entropy, tile_bytes, tp)
    return loss, logp, (ent if with_entropy else None)
