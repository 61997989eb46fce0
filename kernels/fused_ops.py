"""The work between a Llama layer's GEMMs as one pass each: RMSNorm, SwiGLU and rotary, forward and backward.

A Llama/Qwen2 layer's element-wise work runs, in the stock modules, as a chain of small torch ops, each one pass over
memory with its own output (RMSNorm: cast, square, mean, rsqrt, two products; SwiGLU: ``silu`` then a product, the
``silu`` output kept for the backward; rotary: two slices, a negation, a concatenation, two products and a sum for
each of the queries and keys), and autograd's backward adds as many again. Here each is one :class:`torch.autograd.
Function` whose forward and backward are each one function of plain torch, compiled once with ``torch.compile
(dynamic=True)`` (the CPU backend fuses each into one loop; ``dynamic=True``: one compilation serves every number of
rows and positions, where a static one would compile again for every new micro-batch shape):

- :func:`rms_norm`: ``weight * (x * rsqrt(mean(x², -1) + eps))`` with the statistics in fp32, as the stock module;
  saves ``x`` and the per-row ``rsqrt`` (not the normalised rows);
- :func:`swiglu`: ``silu(gate) * up``; saves ``gate`` and ``up`` (not ``silu(gate)``);
- :func:`rotary`: ``q * cos + rotate_half(q) * sin`` for the queries and the keys in one call; saves nothing but
  ``cos`` and ``sin`` (which take no gradient: the model's rotary embedding computes them without one).

Their values and gradients equal the stock modules' (fp32 to 1e-5; bf16 to its rounding:
tests/kernels/test_fused_ops.py). Being compiled is not being faster: a caller takes them only where a trial on its
own shapes measured them faster (:func:`measure_op` with ``native_choice.measure``), and states it
(engine/policy/fused_layers.py swaps them into the Hugging Face modules). :func:`compile_seconds` says what the
compilation cost this process (a run pays it; the compiled code is cached on disk for the next process).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from alignopsd.kernels.native_choice import FUSED_OPS, KernelChoice, best_seconds, measure, pinned
from torch import Tensor


def rms_norm_forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(``weight * normalised x`` in the stock module's dtypes, the fp32 per-row ``rsqrt`` of the mean square)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (xf * rstd).to(x.dtype), rstd


def rms_norm_backward(grad: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """(gradient of ``x``, gradient of ``weight`` summed over the rows, in fp32) of :func:`rms_norm_forward`."""
    xhat = x.float() * rstd
    gw = (grad.float() * xhat.to(x.dtype).float()).reshape(-1, x.shape[-1]).sum(0)
    gn = (grad * weight).float()
    gx = rstd * (gn - xhat * (gn * xhat).mean(-1, keepdim=True))
    return gx.to(x.dtype), gw


def swiglu_forward(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def swiglu_backward(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """(gradient of ``gate``, gradient of ``up``) of ``silu(gate) * up``, computed in fp32 per element."""
    g, gf, uf = grad.float(), gate.float(), up.float()
    sig = torch.sigmoid(gf)
    d_gate = g * uf * sig * (1 + gf * (1 - sig))
    return d_gate.to(gate.dtype), (g * gf * sig).to(up.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, sign: float) -> Tensor:
    """``x * cos + rotate_half(x) * sin`` (sign 1: the forward) or its transpose (sign -1: the backward's)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    if sign > 0:
        return torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1)
    return torch.cat((x1 * c1 + x2 * s2, x2 * c2 - x1 * s1), dim=-1)


def rotary_forward(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """``q``, ``k`` rotated by ``cos``/``sin`` broadcast to them (the caller unsqueezes the head dimension)."""
    return _rotate(q, cos, sin, 1.0), _rotate(k, cos, sin, 1.0)


def rotary_backward(gq: Tensor, gk: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return _rotate(gq, cos, sin, -1.0), _rotate(gk, cos, sin, -1.0)


_EAGER: dict[str, Callable] = {
    "rms_norm_forward": rms_norm_forward,
    "rms_norm_backward": rms_norm_backward,
    "swiglu_forward": swiglu_forward,
    "swiglu_backward": swiglu_backward,
    "rotary_forward": rotary_forward,
    "rotary_backward": rotary_backward,
}
_COMPILED: dict[str, Callable] = {}
_COMPILE_S: dict[str, float] = {}  # seconds the first call of each compiled function took (its compilation)


def _kernel(name: str) -> Callable:
    """The compiled ``name`` of :data:`_EAGER` (compiled on its first call, with dynamic shapes)."""
    fn = _COMPILED.get(name)
    if fn is None:
        compiled = torch.compile(_EAGER[name], dynamic=True)

        def first_call(*args):
            t = time.perf_counter()
            out = compiled(*args)
            _COMPILE_S[name] = time.perf_counter() - t
            _COMPILED[name] = compiled
            return out

        fn = first_call
    return fn


def compile_seconds(op: str) -> float:
    """Seconds this process spent compiling ``op``'s forward and backward (their first calls)."""
    return sum(s for name, s in _COMPILE_S.items() if name.startswith(_PREFIX[op]))


# The compiled functions see operands of one rank and layout whatever the caller's batch (rows of [N, width];
# rotary: [N, heads, D] against [N, 1, D]), so padded rows and a packed [1, N] sequence share one compiled graph.


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y, rstd = _kernel("rms_norm_forward")(rows, weight, eps)
        ctx.save_for_backward(rows, weight, rstd)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad: Tensor):
        rows, weight, rstd = ctx.saved_tensors
        gx, gw = _kernel("rms_norm_backward")(grad.reshape(rows.shape), rows, weight, rstd)
        return gx.view(grad.shape), gw.to(weight.dtype), None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        gate2, up2 = gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])
        ctx.save_for_backward(gate2, up2)
        return _kernel("swiglu_forward")(gate2, up2).view(gate.shape)

    @staticmethod
    def backward(ctx, grad: Tensor):
        gate, up = ctx.saved_tensors
        d_gate, d_up = _kernel("swiglu_backward")(grad.reshape(gate.shape), gate, up)
        return d_gate.view(grad.shape), d_up.view(grad.shape)


def _tokens_first(x: Tensor, heads_dim: int) -> Tensor:
    """``x`` as ``[tokens, heads, D]`` (``heads_dim``: where its heads are; the tokens are the other leading dims)."""
    x = x.movedim(heads_dim, -2)
    return x.reshape(-1, *x.shape[-2:])


def _heads_back(y: Tensor, like: Tensor, heads_dim: int) -> Tensor:
    """The inverse of :func:`_tokens_first`: ``y`` ``[tokens, heads, D]`` laid out as ``like``."""
    shape = list(like.movedim(heads_dim, -2).shape)
    return y.view(shape).movedim(-2, heads_dim)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, heads_dim: int) -> tuple[Tensor, Tensor]:
        per_token = [*q.shape[:-1], q.shape[-1]]
        per_token[heads_dim] = 1  # one cos/sin row per token, shared by the heads
        cos2, sin2 = (_tokens_first(t.expand(per_token), heads_dim).contiguous() for t in (cos, sin))
        ctx.save_for_backward(cos2, sin2)
        ctx.heads_dim = heads_dim
        qe, ke = _kernel("rotary_forward")(_tokens_first(q, heads_dim), _tokens_first(k, heads_dim), cos2, sin2)
        return _heads_back(qe, q, heads_dim), _heads_back(ke, k, heads_dim)

    @staticmethod
    def backward(ctx, gq: Tensor, gk: Tensor):
        cos, sin = ctx.saved_tensors
        h = ctx.heads_dim
        dq, dk = _kernel("rotary_backward")(_tokens_first(gq, h), _tokens_first(gk, h), cos, sin)
        return _heads_back(dq, gq, h), _heads_back(dk, gk, h), None, None, None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The stock Llama/Qwen2 RMSNorm of ``x`` over its last dimension, in one pass forward and one backward."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"rms_norm: x's last dimension {x.shape[-1]} is not the weight's {tuple(weight.shape)}")
    return _RMSNorm.apply(x, weight, eps)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` in one pass forward and one backward."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    return _SwiGLU.apply(gate, up)


def rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor]:
    """The stock ``apply_rotary_pos_emb`` (``cos``/``sin`` ``[B, T, D]``, unsqueezed at ``unsqueeze_dim`` to
    broadcast over the heads), for queries and keys in one pass each way. ``cos``/``sin`` take no gradient."""
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("rotary: cos and sin must not require a gradient (the fused backward gives them none)")
    if q.shape[-1] % 2 or q.shape[-1] != cos.shape[-1]:
        raise ValueError(f"rotary: head dim of q {tuple(q.shape)} must be even and equal cos's {tuple(cos.shape)}")
    heads_dim = unsqueeze_dim % q.dim()
    return _Rotary.apply(q, k, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim), heads_dim)


_PREFIX = dict(zip(FUSED_OPS, ("rms_norm_", "swiglu_", "rotary_")))


def fwd_bwd(fn: Callable[..., Tensor | tuple[Tensor, ...]], *inputs: Tensor) -> Callable[[], None]:
    """A trial call of ``fn`` on ``inputs``: forward, then backward of every output against ones, gradients of the
    inputs that require one dropped before each call."""

    def call() -> None:
        for t in inputs:
            t.grad = None
        out = fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    return call


def measure_op(
    op: str,
    fused: Callable[[], None],
    stock: Callable[[], None],
    shape: str,
    timer: Callable[[Callable[[], None]], float] | None = None,
) -> KernelChoice:
    """Time one fused op against the stock path it replaces (``fused``/``stock``: forward and backward on the same
    operands, :func:`fwd_bwd`; ``timer`` replaces the clock) and record which this process takes
    (``native_choice.measure``: the fused op only where strictly faster). Its compilation runs first and is stated,
    not timed as a call; a compilation that fails (no C++ compiler) leaves the stock path, saying why."""
    if pinned():
        return measure(op, None, stock, shape)
    try:
        fused()
    except Exception as exc:  # noqa: BLE001 (any failure of the compiler: the stock path stays, with the reason)
        return measure(op, None, stock, shape, why=f"torch.compile failed: {type(exc).__name__}: {exc}"[:200])
    return measure(op, fused, stock, shape, timer=timer or (lambda fn: best_seconds(fn, reps=3, min_time=0.3)))
