"""Fused token log-probabilities (and entropy) from hidden states and an LM-head weight.

Legend: N = tokens (flattened), H = hidden size, V = vocabulary size (or the local shard's
size in the vocab-parallel variant), S = vocabulary splits of the Triton forward grid.

    z_NV   = (hidden_NH @ weight_VH.T + bias_V) / temperature        (never materialised)
    logp_N = z[n, target_n] - logsumexp_v z[n, v]
    ent_N  = -sum_v p[n, v] log p[n, v],  p = softmax(z)

Design
------
The [N, V] logits are never stored. Both paths sweep the vocabulary in tiles and keep per
row an online maximum ``m``, the rescaled sum ``s = sum exp(z - m)``, the rescaled first
moment ``u = sum exp(z - m) (z - m)`` and the target logit ``tz``. From these,
``lse = m + log s``, ``logp = tz - lse`` and ``entropy = log s - u / s``; keeping ``u``
relative to the running maximum avoids the cancellation of ``lse - E[z]`` at large logits.
Partials over disjoint vocabulary ranges (Triton's vocabulary splits, or tensor-parallel
shards) combine exactly: ``m = max m_i``, ``s = sum s_i a_i``, ``u = sum a_i (u_i + s_i (m_i - m))``
with ``a_i = exp(m_i - m)``.

The backward recomputes each logits tile and forms the logits gradient in place

    gz = (g_logp * (onehot(target) - p) - g_ent * p * (z - lse + ent)) / temperature

then ``d hidden += gz @ W_tile``, ``d W_tile += gz.T @ hidden``, ``d bias_tile += gz.sum(0)``.
Cost: one matmul in the forward and three in the backward (plain autograd needs one and two,
but keeps [N, V] buffers alive between them).

Paths
-----
- Triton (CUDA; CPU under ``TRITON_INTERPRET=1``; kernels and launchers in ``logprob_triton.py``): forward
  grid (row tiles x vocabulary splits) writing partials [S, N], combined in torch; backward grid (row tiles x
  vocabulary tiles) with fp32 atomic adds into d hidden / d W / d bias (not bitwise deterministic).
  Operands go to ``tl.dot`` in their own dtype with fp32 accumulation (exact fp32 for fp32
  inputs, like torch's default matmul); in interpreter mode they are cast to fp32 first.
- torch (CPU default, in ``torch_tiles.py``): the same algorithm in tiles of up to ``_TORCH_ROWS`` rows x
  ``_vocab_chunk(...)`` vocabulary entries, vocabulary outermost so every weight chunk is read (and, for bf16,
  upcast) once per sweep; peak extra memory is a few chunk-sized fp32 tiles. Its forward, for bf16 hidden
  states and weight without a bias on a CPU with AVX512-BF16, runs in C++ instead where that was measured faster
  (``cpu_partials.py``, csrc/lm_head_bf16.cpp: bf16 products with fp32 accumulation, ~3x the fp32 tiles' rate);
  the backward stays on the torch tiles.
- Which path a call takes is the kernels' one routing rule (``_dispatch.resolve_impl``, with the C++ forward as the
  call's ``NativePath``).
- ``logprob_ref``: plain fp32 torch (materialises the logits), the test oracle.

Tuning constants. Torch path: tiles of up to 512 rows and clamp(N V / 32, 2^18, 2^21) fp32
elements (1-8 MiB), see ``torch_tiles._vocab_chunk``. On a 2-core x86 CPU, fp32 matmuls of [rows, H] x [H, v]
ran at 8-15 GFLOP/s for 256 x 1024 tiles and 20-30 GFLOP/s from 512 x 4096 up (H=576 and 3584); larger tiles
gained nothing measurable and cost memory, smaller ones lost up to 2x.
Triton: the configurations per GPU architecture, their autotuning and their roofline bounds are in
``kernels/tuning.py``; ``python -m bench.kernel_compile`` checks that none spills registers on sm_80 / sm_90.

Vocab-parallel (tensor parallel over the vocabulary, Megatron's
``vocab_parallel_cross_entropy`` convention): see :func:`logprob_vocab_parallel`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from alignopsd.kernels._dispatch import resolve_impl
from alignopsd.kernels.head.checks import check_lm_head_inputs, check_target_range
from alignopsd.kernels.head.cpu_partials import cpu_partials, head_native
from alignopsd.kernels.head.logprob_triton import triton_backward, triton_partials
from alignopsd.kernels.head.partials import all_reduce_partials, finish_partials
from alignopsd.kernels.head.torch_tiles import torch_backward
from torch import Tensor

__all__ = [
    "logprob",
    "logprob_ref",
    "logprob_rescore",
    "logprob_vocab_parallel",
]


# --------------------------------------------------------------------------------------
# reference
# --------------------------------------------------------------------------------------
def logprob_ref(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Plain fp32 torch: ``log_softmax((h @ W.T + b) / T).gather(target)``. Materialises [N, V].

    hidden[..., H], weight[V, H], targets[...] -> logp[...] fp32 (and entropy[...] if asked).
    Differentiable (autograd through the full logits); the oracle of the tests.
    """
    inv_t = check_lm_head_inputs(hidden, weight, targets, bias, temperature)
    check_target_range(targets, 0, weight.shape[0])
    z = hidden.float() @ weight.float().T
    if bias is not None:
        z = z + bias.float()
    logp_all = torch.log_softmax(z * inv_t, dim=-1)
    logp = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent


# --------------------------------------------------------------------------------------
# autograd
# --------------------------------------------------------------------------------------
class _LogprobFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, inv_t, vocab_start, impl, group, reduce_grad_hidden, with_entropy):
        if impl == "triton":
            m, s, u, tz = triton_partials(hidden, weight, bias, targets, inv_t, vocab_start)
        else:  # "torch" (the torch tiles) or "cpp" (the C++ bf16 forward); the backward is the torch path's
            m, s, u, tz = cpu_partials(impl, hidden, weight, bias, targets, inv_t, vocab_start, need_u=with_entropy)
        if group is not None:
            local = targets.long() - vocab_start
            hit = (local >= 0) & (local < weight.shape[0])
            m, s, u, tz, hits = all_reduce_partials(m, s, u, tz, hit, group)
            if targets.numel() and not bool((hits == 1).all()):
                raise ValueError(
                    "targets: some ids fall in no vocabulary shard (or in several); check vocab_start and shard sizes"
                )
        logp, lse, ent = finish_partials(m, s, u, tz)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.inv_t = inv_t
        ctx.vocab_start = vocab_start
        ctx.impl = impl
        ctx.group = group
        ctx.reduce_grad_hidden = reduce_grad_hidden
        ctx.with_entropy = with_entropy
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse)
        return logp, ent, lse

    @staticmethod
    def backward(ctx, g_lp, g_ent, _g_lse):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        need_h = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        if g_lp is None and g_ent is None:
            return (None,) * 10
        bwd = triton_backward if ctx.impl == "triton" else torch_backward
        dh, dw, db = bwd(
            hidden,
            weight,
            bias,
            targets,
            ctx.inv_t,
            ctx.vocab_start,
            lse,
            ent,
            g_lp,
            g_ent if ctx.with_entropy else None,
            need_h,
            need_w,
            need_b,
        )
        if dh is not None and ctx.group is not None and ctx.reduce_grad_hidden:
            dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=ctx.group)
        return (
            dh.to(hidden.dtype) if dh is not None else None,
            dw.to(weight.dtype) if dw is not None else None,
            db.to(bias.dtype) if db is not None else None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def _run(hidden, weight, targets, bias, temperature, with_entropy, impl, vocab_start, group, reduce_grad_hidden):
    inv_t = check_lm_head_inputs(hidden, weight, targets, bias, temperature)
    lead = hidden.shape[:-1]
    h_NH = hidden.reshape(-1, hidden.shape[-1])
    t_N = targets.reshape(-1)
    native = head_native(h_NH, weight, bias, t_N, inv_t, vocab_start)
    impl = resolve_impl(impl, hidden, weight, native=native)  # "torch" given: the torch tiles only
    logp, ent, _ = _LogprobFn.apply(
        h_NH, weight, bias, t_N, inv_t, vocab_start, impl, group, reduce_grad_hidden, with_entropy
    )
    logp = logp.reshape(lead)
    if with_entropy:
        return logp, ent.reshape(lead)
    return logp


# --------------------------------------------------------------------------------------
# functional entries
# --------------------------------------------------------------------------------------
def logprob(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    impl: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probability of ``targets`` under ``softmax((hidden @ weight.T + bias) / temperature)``.

    hidden[..., H] (fp32/bf16/fp16), weight[V, H] (same dtype), bias[V] or None, targets[...] ids in [0, V).
    Returns logp[...] fp32, and entropy[...] fp32 when ``with_entropy``. Differentiable w.r.t.
    hidden, weight and bias; the [N, V] logits are never materialised, forward or backward.
    ``impl``: "auto" (Triton on CUDA; elsewhere the torch path, whose forward runs in C++ for bf16 operands on a
    CPU with AVX512-BF16 where that was measured faster) | "triton" | "torch" (the torch tiles only, never the C++
    forward) | "cpp" (the C++ forward, wherever it can run; the backward is the torch path's).
    """
    check_lm_head_inputs(hidden, weight, targets, bias, temperature)
    check_target_range(targets, 0, weight.shape[0])
    return _run(hidden, weight, targets, bias, temperature, with_entropy, impl, 0, None, False)


def logprob_rescore(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    impl: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """No-grad :func:`logprob` for rescoring (teacher forcing, old log-probs): nothing is saved for backward."""
    with torch.no_grad():
        return logprob(
            hidden, weight, targets, bias=bias, temperature=temperature, with_entropy=with_entropy, impl=impl
        )


def logprob_vocab_parallel(
    hidden: Tensor,
    weight_shard: Tensor,
    targets: Tensor,
    *,
    group,
    vocab_start: int,
    bias_shard: Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    all_reduce_grad_hidden: bool = True,
    impl: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """Vocab-parallel :func:`logprob`: this rank holds rows ``[vocab_start, vocab_start + V_shard)`` of the head.

    hidden[..., H]: the same full hidden states on every rank of ``group``; weight_shard[V_shard, H];
    bias_shard[V_shard] or None; targets[...]: GLOBAL ids (each must fall in exactly one rank's shard).
    Returns the full logp[...] (and entropy[...]) on every rank, identical across ranks.

    Forward: each rank computes its partial (max, sum-exp, first moment, target logit) over its
    shard; one MAX and one SUM all-reduce over ``group`` combine them.

    Backward (Megatron ``vocab_parallel_cross_entropy`` convention): every rank must call
    backward with the same incoming gradient (the loss is computed redundantly on every rank,
    as Megatron does). Each rank gets the exact gradient of its own weight/bias shard. The
    gradient w.r.t. ``hidden`` is a sum over shards: with ``all_reduce_grad_hidden=True``
    (default) this function all-reduces it over ``group``, so ``hidden.grad`` is complete on
    every rank; the caller must then NOT all-reduce it again (i.e. do not feed ``hidden``
    through Megatron's ``copy_to_tensor_model_parallel_region``). With ``False`` each rank gets
    its partial sum and the caller reduces it (e.g. hidden came through
    ``copy_to_tensor_model_parallel_region``, whose backward all-reduces).
    """
    if group is None:
        raise ValueError("group: a process group is required (use logprob() without tensor parallelism)")
    if isinstance(vocab_start, bool) or not isinstance(vocab_start, int) or vocab_start < 0:
        raise ValueError(f"vocab_start: expected a non-negative int, got {vocab_start!r}")
    check_lm_head_inputs(hidden, weight_shard, targets, bias_shard, temperature)
    check_target_range(targets, 0, 2**62)
    return _run(
        hidden,
        weight_shard,
        targets,
        bias_shard,
        temperature,
        with_entropy,
        impl,
        vocab_start,
        group,
        all_reduce_grad_hidden,
    )
