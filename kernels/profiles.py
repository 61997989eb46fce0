"""Correspondence profiles from precomputed similarity blocks (§3.2): the Triton kernel's entry and the torch path.

Legend: T = tasks, N = slots of the largest task block, V = valid profile rows. Block tensors are target-major:
x_BTS[b, t, s] (see ``blocks.py``); P_VN: the valid rows of the flattened [T*N, N] blocks, in row order.

P[t, :] = softmax over eligible s of H[s, t] / T_p (0 without an eligible source); valid[t] = some eligible
source and max eligible H[s, t] >= gamma. :func:`profiles_blocks` returns the dense blocks; :func:`profile_rows`
only the valid rows and their sum p log p (what adjacent distances and profile diagnostics read). Both run the
one torch path below on CPU (a group of blocks of ~512 KiB at a time: mask, validity, softmax while the group is
in cache) and the Triton profile kernel (``sibling_topk_triton``) on CUDA. The loop oracle is
``tests/m1_oracle.py`` / ``alignopsd.testing``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from alignopsd.kernels._dispatch import resolve_impl
from alignopsd.kernels.blocks import (
    MASKED_LOGIT,
    all_finite,
    block_groups,
    check_eligible_finite,
    check_params,
    packed_rows,
)
from alignopsd.kernels.sibling_topk_triton import profiles_triton
from torch import Tensor

__all__ = ["ProfileRows", "profile_rows", "profiles_blocks"]


def _profiles_torch(
    H_BTS: Tensor, E_BTS: Tensor, gamma: float, temperature: float, *, valid_rows: bool = False
) -> tuple[Tensor, Tensor | None, Tensor]:
    """The torch path of the profiles (§3.2), group by group of blocks on cache-resident temporaries:
    X = H on eligible cells, ``MASKED_LOGIT`` elsewhere; valid = some eligible source and max X >= gamma;
    P = softmax(X / T_p) (the masked cells get exactly 0).

    Dense (default): P [T*N, N] of every row, 0 without an eligible source; None. ``valid_rows``: P [V, N] of the
    valid rows only (row order, the only rows distances and diagnostics read) and their sum p log p [V], taken
    from the log-softmax (the masked cells are finite there and contribute 0). Also returns valid [T, N]; an
    eligible NaN/inf raises ValueError naming ``H`` (checked on the group's X: the fills sum finitely).
    """
    T, N, _ = H_BTS.shape
    P = torch.empty(T * N, N, device=H_BTS.device)
    negent = torch.empty(T * N, device=H_BTS.device) if valid_rows else None
    valid = torch.zeros(T * N, dtype=torch.bool, device=H_BTS.device)
    has = torch.zeros(T * N, dtype=torch.bool, device=H_BTS.device)
    v = 0
    for b0, b1 in block_groups(T, N):
        E = E_BTS[b0:b1]
        X = torch.where(E, H_BTS[b0:b1].float(), MASKED_LOGIT).view(-1, N)
        if not all_finite(X):
            raise ValueError("H: contains NaN or inf at eligible cells")
        r0, r1 = b0 * N, b1 * N
        # some eligible source: the flags are bytes 0/1, so a packed word is >= 0, and > 0 iff one of its flags is set
        torch.gt(packed_rows(E.reshape(-1, N)).amax(1), 0, out=has[r0:r1])
        ok = torch.logical_and(has[r0:r1], X.amax(1) >= gamma, out=valid[r0:r1])
        if valid_rows and not bool(ok.all()):
            X = X.index_select(0, ok.nonzero().view(-1))
        out = P[v : v + X.shape[0]] if valid_rows else P[r0:r1]
        torch._softmax(X.div_(temperature), 1, False, out=out)  # torch.softmax's op, written in place: no copy
        if valid_rows:
            negent[v : v + X.shape[0]] = (out * torch.log_softmax(X, 1)).sum(1)
            v += X.shape[0]
    if valid_rows:
        return P[:v], negent[:v], valid.view(T, N)
    P.index_fill_(0, (~has).nonzero().view(-1), 0.0)
    return P.view(T, N, N), None, valid.view(T, N)


def _check_profile_inputs(H_BTS, E_BTS, gamma, temperature, impl: str) -> tuple[str, Tensor]:
    check_params(gamma, None, temperature, "temperature")
    for name, x in (("H", H_BTS), ("eligible", E_BTS)):
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[1] != x.shape[2]:
            raise ValueError(f"{name}: expected a [T, N, N] tensor, got {tuple(getattr(x, 'shape', ()))}")
    if E_BTS.shape != H_BTS.shape:
        raise ValueError(f"eligible: expected shape {tuple(H_BTS.shape)} like H, got {tuple(E_BTS.shape)}")
    if not H_BTS.is_floating_point():
        raise ValueError(f"H: expected a floating tensor, got {H_BTS.dtype}")
    if E_BTS.dtype != torch.bool:
        raise ValueError(f"eligible: expected a bool tensor, got {E_BTS.dtype}")
    impl = resolve_impl(impl, H_BTS)
    E_BTS = E_BTS.to(H_BTS.device)
    if impl == "triton":
        check_eligible_finite(H_BTS, E_BTS)  # the torch path checks each group of blocks as it goes
    return impl, E_BTS


@torch.no_grad()
def profiles_blocks(
    H_BTS: Tensor, E_BTS: Tensor, *, gamma: float, temperature: float = 0.1, impl: str = "auto"
) -> tuple[Tensor, Tensor]:
    """Correspondence profiles and their validity (§3.2) from precomputed target-major blocks.

    H_BTS [T, N, N] float: H_BTS[b, t, s] = H[s, t] of the block's slots; E_BTS [T, N, N] bool, the
    eligibility in the same layout (False on padding slots). Only eligible cells are read; they must be
    finite (ValueError naming ``H``). gamma: validity threshold; temperature: T_p >= 1e-6.
    impl: "auto" | "triton" | "torch".
    Returns P_BTS [T, N, N] float32 (softmax over eligible s of H[s, t] / T_p; a row without an
    eligible source is 0) and valid_BT [T, N] bool (some eligible source with H >= gamma).
    """
    impl, E_BTS = _check_profile_inputs(H_BTS, E_BTS, gamma, temperature, impl)
    if impl == "triton":
        return profiles_triton(H_BTS, E_BTS, float(gamma), float(temperature))
    P, _, valid = _profiles_torch(H_BTS, E_BTS, float(gamma), float(temperature))
    return P, valid


class ProfileRows(NamedTuple):
    """Profiles of the valid rows only (:func:`profile_rows`): P_VN [V, N] float32 (the rows r of the flattened
    [T*N, N] blocks with valid_BT.view(-1)[r], in row order), negent_V [V] (sum p log p of each), valid_BT [T, N]."""

    P_VN: Tensor
    negent_V: Tensor
    valid_BT: Tensor


@torch.no_grad()
def profile_rows(
    H_BTS: Tensor, E_BTS: Tensor, *, gamma: float, temperature: float = 0.1, impl: str = "auto"
) -> ProfileRows:
    """:func:`profiles_blocks` keeping only the valid profiles, with their sum p log p (:class:`ProfileRows`): what
    adjacent distances (``jsd_boundary.boundary_scores_rows``) and profile diagnostics read. Same inputs and
    checks. The torch path computes only the valid rows' softmax and takes sum p log p from their log-softmax;
    the Triton path compacts the kernel's blocks."""
    impl, E_BTS = _check_profile_inputs(H_BTS, E_BTS, gamma, temperature, impl)
    if impl == "triton":
        P, valid = profiles_triton(H_BTS, E_BTS, float(gamma), float(temperature))
        P_VN = P.view(-1, P.shape[2])[valid.view(-1)]
        return ProfileRows(P_VN, torch.special.xlogy(P_VN, P_VN).sum(1), valid)
    return ProfileRows(*_profiles_torch(H_BTS, E_BTS, float(gamma), float(temperature), valid_rows=True))
