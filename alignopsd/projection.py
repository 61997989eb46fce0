"""Box projection of the span densities (ALGORITHM.md §3.8).

The Python path (:func:`project_one`) is the rule as written; the C++ path ``alignopsd._C.project_batch`` is
bit-identical and runs the whole batch (:func:`project_batch`). Everything is float64.
"""

from __future__ import annotations

import torch
from torch import Tensor

from alignopsd import _native
from alignopsd._checks import as_tensor, check_ndim, check_offsets, check_real

__all__ = ["PROJECTION_TOL", "project_batch", "project_one", "project_to_box"]

PROJECTION_TOL = 1e-5  # tol of §3.8 and the conservation check of §3.9 (violations > 1e-5 * N_tau)
_FLT_EPS = float(torch.finfo(torch.float32).eps)


def _seqsum(x: Tensor) -> float:
    """Left-to-right float64 sum starting at 0.0 (a sequential cumulative sum; matches the C++ loop)."""
    if x.numel() == 0:
        return 0.0
    return float(torch.cumsum(x, 0)[-1])


def project_one(h: Tensor, c: Tensor, lo: float, hi: float, tol: float) -> tuple[Tensor | None, str]:
    """§3.8 on one float64 vector; returns (x, "") or (None, error message)."""
    n = int(h.shape[0])
    total = _seqsum(c)
    budget = _seqsum(c * h)
    allowed = max(max(tol * total, 32.0 * _FLT_EPS * total * float(n)), 1e-5)
    if abs(budget - total) > allowed:
        return None, (
            f"raw budget sum(counts*h) = {budget!r} differs from sum(counts) = {total!r} by more than {allowed!r}"
        )
    if lo == 1.0 or hi == 1.0:
        return torch.ones_like(h), ""
    if bool(((h >= lo) & (h <= hi)).all()):
        return h.clone(), ""
    a = float((h - hi).min())
    b = float((h - lo).max())
    stop = 1e-7 * max(total, 1.0)
    mid = 0.5 * (a + b)
    for _ in range(100):
        mid = 0.5 * (a + b)
        e = _seqsum(c * torch.clamp(h - mid, lo, hi)) - total
        if abs(e) <= stop:
            break
        if e > 0.0:
            a = mid
        else:
            b = mid
    x = torch.clamp(h - mid, lo, hi)
    for _ in range(3):
        free = (x > lo) & (x < hi)
        denom = _seqsum(c[free])
        if not denom > 0.0:
            break
        step = (total - _seqsum(c * x)) / denom
        x = torch.where(free, x + step, x)
    x = torch.clamp(x, lo, hi)
    s = _seqsum(c * x)
    if abs(s - total) > 5.0 * tol * total:
        return None, f"projection lost the budget: sum(counts*x) = {s!r} vs {total!r}"
    return x, ""


def _check_box(lo, hi, tol) -> tuple[float, float, float]:
    lo = check_real(lo, "lo", lo=0.0, hi=1.0)
    hi = check_real(hi, "hi", lo=1.0)
    tol = check_real(tol, "tol")
    if tol <= 0:
        raise ValueError(f"tol: must be > 0, got {tol}")
    return lo, hi, tol


def project_batch(h_K: Tensor, c_K: Tensor, offsets: Tensor, lo: float, hi: float, tol: float, impl: str) -> Tensor:
    """Project every trajectory's slice of the flat float64 h (counts c, int64 offsets [T+1]); float64 x."""
    dev = h_K.device
    h_c = h_K.detach().to("cpu", torch.float64).contiguous()
    c_c = c_K.detach().to("cpu", torch.float64).contiguous()
    o_c = offsets.detach().to("cpu", torch.int64).contiguous()
    if impl == "cpp":
        x = _native.native().project_batch(h_c.numpy(), c_c.numpy(), o_c.numpy(), lo, hi, tol)
        return torch.from_numpy(x).to(dev)
    check_offsets(o_c, int(h_c.shape[0]))
    if int(c_c.shape[0]) != int(h_c.shape[0]):
        raise ValueError(f"counts: expected length {int(h_c.shape[0])} like h, got {int(c_c.shape[0])}")
    if not bool(torch.isfinite(h_c).all()) or bool((h_c < 0).any()):
        i = int(torch.nonzero(~torch.isfinite(h_c) | (h_c < 0))[0, 0])
        raise ValueError(f"h: must be finite and >= 0; got {float(h_c[i])} at flat position {i}")
    if not bool(torch.isfinite(c_c).all()) or not bool((c_c > 0).all()):
        i = int(torch.nonzero(~torch.isfinite(c_c) | ~(c_c > 0))[0, 0])
        raise ValueError(f"counts: must be finite and > 0; got {float(c_c[i])} at flat position {i}")
    out = torch.empty_like(h_c)
    o_l = o_c.tolist()
    for j in range(len(o_l) - 1):
        s, e = o_l[j], o_l[j + 1]
        if e == s:
            continue
        x, err = project_one(h_c[s:e], c_c[s:e], lo, hi, tol)
        if x is None:
            raise ValueError(f"h: trajectory {j}: {err}")
        out[s:e] = x
    return out.to(dev)


def project_to_box(h: Tensor, counts: Tensor, *, lo: float, hi: float, tol: float = 1e-5, impl: str = "auto") -> Tensor:
    """argmin sum counts*(x-h)^2 s.t. lo <= x <= hi and sum counts*x = sum counts (§3.8, one trajectory).

    Preconditions (else ValueError): h finite and >= 0, counts > 0, lo in [0, 1], hi >= 1, and the raw
    budget sum counts*h within max(tol*N, 32*eps_fp32*N*n, 1e-5) of N = sum counts. lo = 1 or hi = 1 gives
    all ones; h inside the box is returned unchanged; otherwise bisection on lambda of x = clip(h - lambda)
    (100 iterations, stop at |budget - N| <= 1e-7 max(N, 1)), 3 correction passes on the free
    coordinates, final clamp. Computed in float64 (C++ or Python, bit-identical); returned as float32.

    Args:
        h: [n] raw densities. counts: [n] positive weights (token counts).
    """
    impl_r = _native.resolve_impl(impl)
    lo, hi, tol = _check_box(lo, hi, tol)
    ht = as_tensor(h, "h")
    check_ndim(ht, "h", 1)
    ct = as_tensor(counts, "counts")
    check_ndim(ct, "counts", 1)
    if ct.shape != ht.shape:
        raise ValueError(f"counts: expected shape {tuple(ht.shape)} like h, got {tuple(ct.shape)}")
    offsets = torch.tensor([0, int(ht.shape[0])], dtype=torch.int64)
    return project_batch(ht.double(), ct.double(), offsets, lo, hi, tol, impl_r).float()
