"""Shared-prefix prefill attention of a bf16 model in C++ on x86 CPUs with AVX512-BF16 (csrc/attention_bf16.cpp).

Legend: B = rows, H = query heads, K = key/value heads, S = queries pushed, D = head size, G = prefixes, P = their
width, n = the rows' own positions so far.

A CPU decoding cache (such as the engine's generation cache) keeps prefixes once and each row's own keys apart; its
prefill attention gathered every row's prefix next to its own keys (a copy per row and layer) and ran fp32
scaled-dot-product attention. :func:`prefix_attention` reads the prefix in place and computes the scores as
products of bf16 pairs with fp32 accumulation: the model's queries and keys are bf16 values (the cache stores
them in fp32), so every product is exact, as in fp32; softmax and probabilities x values are fp32. Equal to the
torch path up to floating-point reassociation (tests/kernels/test_attention_native.py). On the quickstart's teacher
forcing (SmolLM2-135M, rows of ~45-56 queries behind ~670-690 kept prompt positions), 2.2-2.5x the torch path.

The cache takes it only where it was measured faster than the torch path it replaces (:func:`torch_prefix_attention`,
the gathered fp32 scaled-dot-product attention) in this process (:func:`measure_attention`, ``native_choice.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from alignopsd.kernels.cpp import elements_from, native_ready, why_not_ready
from alignopsd.kernels.native_choice import ATTENTION, KernelChoice, measure
from torch import Tensor

try:  # the C++ extension is optional (a build without a compiler falls back to the torch path)
    from alignopsd import _C
except ImportError:  # pragma: no cover - depends on the build
    _C = None

__all__ = ["measure_attention", "prefix_attention", "prefix_attention_applies", "torch_prefix_attention"]


def _fp32_rows(t: Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 4 and t.stride(-1) == 1


def prefix_attention_applies(query_BHSD: Tensor, k: Tensor, v: Tensor, pk: Tensor | None, pv: Tensor | None) -> bool:
    """Whether :func:`prefix_attention` can run: bf16 CPU queries whose head size is a multiple of 32 (at most
    256), fp32 keys and values with contiguous head vectors and the same strides, and the C++ kernel built for a CPU
    with AVX512-BF16 (``cpp.native_ready``)."""
    q = query_BHSD
    d = q.shape[-1]
    ok = q.dtype == torch.bfloat16 and q.device.type == "cpu" and q.stride(-1) == 1 and d % 32 == 0 and d <= 256
    ok = ok and _fp32_rows(k) and _fp32_rows(v) and k.stride() == v.stride()
    if pk is not None:
        ok = ok and pv is not None and _fp32_rows(pk) and _fp32_rows(pv) and pk.stride() == pv.stride()
    return bool(ok and native_ready())


def prefix_attention(
    query_BHSD: Tensor,
    k: Tensor,
    v: Tensor,
    pk: Tensor | None,
    pv: Tensor | None,
    row_prefix: Tensor | None,
    bias: Tensor,
    scale: float,
) -> Tensor:
    """``[B, S, H, D]`` fp32 attention of ``query_BHSD`` (bf16) over each row's prefix (``pk``/``pv`` ``[G, K, P,
    D]``, prefix ``row_prefix[b]``, -1 for none; None when there are no prefixes) followed by its own ``k``/``v``
    (``[B, K, n, D]``), with the additive mask ``bias`` ``[B, 1, S, P + n]``. Shapes are checked first (ValueError
    naming them), then that the operands are what :func:`prefix_attention_applies` requires."""
    _check_shapes(query_BHSD, k, v, pk, pv, row_prefix, bias)
    if not prefix_attention_applies(query_BHSD, k, v, pk, pv):
        raise ValueError(
            "prefix_attention: needs bf16 CPU queries with a head size multiple of 32, fp32 keys/values with "
            f"contiguous heads and an AVX512-BF16 CPU (got query {query_BHSD.dtype} {tuple(query_BHSD.shape)}, "
            f"keys {k.dtype}; kernel ready: {native_ready()})"
        )
    b, h, s, d = query_BHSD.shape
    kv, n = k.shape[1], k.shape[2]
    p = 0 if pk is None else pk.shape[2]
    g = 0 if pk is None else pk.shape[0]
    bias = bias.float().contiguous()
    rp = (row_prefix if row_prefix is not None else torch.full((b,), -1)).long().contiguous()
    out = torch.empty(b, s, h, d, dtype=torch.float32)
    _C.attention_prefix_bf16(
        query_BHSD.data_ptr(),
        list(query_BHSD.stride()[:3]),
        k.data_ptr(),
        v.data_ptr(),
        list(k.stride()[:3]),
        pk.data_ptr() if pk is not None else 0,
        pv.data_ptr() if pv is not None else 0,
        list(pk.stride()[:3]) if pk is not None else [0, 0, 0],
        rp.data_ptr(),
        bias.data_ptr(),
        out.data_ptr(),
        b,
        h,
        s,
        d,
        kv,
        n,
        p,
        g,
        float(scale),
        torch.get_num_threads(),
        [elements_from(t) if t is not None else 0 for t in (query_BHSD, k, v, pk, pv, rp, bias, out)],
    )
    return out


def torch_prefix_attention(
    query_BHSD: Tensor,
    k: Tensor,
    v: Tensor,
    pk: Tensor | None,
    pv: Tensor | None,
    row_prefix: Tensor | None,
    bias: Tensor,
    scale: float,
) -> Tensor:
    """The torch path of :func:`prefix_attention` (same arguments, ``[B, S, H, D]`` fp32): each row's prefix
    gathered next to its own keys (a row without one reads prefix 0, masked by ``bias``), fp32 scaled-dot-product
    attention."""
    q = query_BHSD.float()
    if pk is not None:
        idx = row_prefix.clamp_min(0)
        k = torch.cat([pk[idx], k], dim=2)
        v = torch.cat([pv[idx], v], dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=True).transpose(1, 2)


def measure_attention(query_BHSD, k, v, pk, pv, row_prefix, bias, scale, *, timer=None) -> KernelChoice:
    """Time :func:`prefix_attention` and :func:`torch_prefix_attention` on these operands and record which the
    decoding cache takes (``native_choice.measure``; ``timer`` replaces its clock). Operands the kernel cannot take,
    or a process where it cannot run, record the torch path with the reason."""
    b, h, s, d = query_BHSD.shape
    kv, n = k.shape[1], k.shape[2]
    p = 0 if pk is None else pk.shape[2]
    shape = f"{b} rows x {s} queries over {p} prefix + {n} own positions, {h}/{kv} heads of {d}"
    args = (query_BHSD, k, v, pk, pv, row_prefix, bias, scale)
    native = None
    if prefix_attention_applies(query_BHSD, k, v, pk, pv):

        def native():
            return prefix_attention(*args)

    why = why_not_ready() or "the operands are not bf16 queries over fp32 keys with a head size multiple of 32"
    flops = 4.0 * b * h * s * (p + n) * d  # scores and probabilities x values

    def torch_path():
        return torch_prefix_attention(*args)

    return measure(ATTENTION, native, torch_path, shape, flops=flops, why=why, timer=timer)


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, pk, pv, row_prefix, bias: Tensor) -> None:
    """The shapes :func:`prefix_attention` reads, named in a ValueError when they do not fit together: query [B, H, S,
    D], own keys and values [B, K, n, D] with K dividing H, prefix keys and values [G, K, P, D], row_prefix [B] in
    [-1, G), bias [B, 1, S, P + n]."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"query_BHSD, k: expected 4-d [B, H, S, D] and [B, K, n, D], got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    b, h, s, d = q.shape
    kv = k.shape[1]
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k: expected [B={b}, K, n, D={d}] (the query's rows and head size), got {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v: expected the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    if kv < 1 or h % kv:
        raise ValueError(f"heads: query heads {h} must be a multiple of kv heads {kv}")
    p = 0
    if (pk is None) != (pv is None):
        raise ValueError("pk, pv: give both prefix keys and values, or neither")
    if pk is not None:
        if pk.dim() != 4 or pk.shape[1] != kv or pk.shape[3] != d:
            raise ValueError(
                f"pk: expected [G, K={kv}, P, D={d}] (the keys' heads and head size), got {tuple(pk.shape)}"
            )
        if tuple(pv.shape) != tuple(pk.shape):
            raise ValueError(f"pv: expected the shape of pk {tuple(pk.shape)}, got {tuple(pv.shape)}")
        p, g = pk.shape[2], pk.shape[0]
        if row_prefix is None or tuple(row_prefix.shape) != (b,):
            got = None if row_prefix is None else tuple(row_prefix.shape)
            raise ValueError(f"row_prefix: expected shape ({b},) (a prefix or -1 per row), got {got}")
        bad = ((row_prefix < -1) | (row_prefix >= g)).nonzero()
        if bad.numel():
            r = int(bad[0, 0])
            raise ValueError(f"row_prefix: row {r} reads prefix {int(row_prefix[r])} of {g}")
    if tuple(bias.shape) != (b, 1, s, p + k.shape[2]):
        raise ValueError(f"bias: expected shape {(b, 1, s, p + k.shape[2])}, got {tuple(bias.shape)}")
