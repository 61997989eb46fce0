"""Adjacent-turn profile distances (JSD / entropy / cosine) and the batch threshold, for a whole batch.

Legend: M = canonical turns, T = tasks, N = slots of the largest task block, K = adjacent
(previous, current) turn pairs. Dense inputs: P_TS[target, source], B_ST[source, target].
Block tensors are target-major x_BTS[b, t, s] (see ``blocks.py``).

Design
------
Trajectories are the (task, rollout) runs of the identity-sorted turns; every consecutive pair
(prev, cur) of a run is scored (§3.3):

    boundary_valid[cur] = valid[prev] & valid[cur] & (B[:, prev] == B[:, cur])
    jsd     = (0.5 (sum p log p + sum q log q) - sum m log m) / ln 2, m = (p + q)/2, clamped to [0, 1]
    entropy = |H(p) - H(q)| / ln M          (M = the whole batch's turn count)
    cosine  = 1 - <p, q> / (|p| |q|), clamped to [0, 1]
    d[cur]  = distance if boundary_valid[cur] else 0; the first turn of a trajectory is never a boundary

Zero-probability terms contribute 0 (x log x at 0). A profile row is non-zero only inside its
task block, so rows are read from the block layout: K x N work instead of K x M. Dense
inputs are checked for mass or eligibility outside the task blocks (ValueError).

The threshold (§3.4) is the linear-interpolation quantile of the valid distances of the whole
batch, clipped to [tau_min, tau_max]; +inf when there is none.

Paths: the Triton kernel (one program per pair, a loop over the block's source tiles that
accumulates the six row sums and the eligibility mismatch), the torch path (the same sums as
row reductions over chunks of ~512 KiB; a pair is always two consecutive rows of the blocks, so
while the blocks have at most twice as many rows as turns the sums run over all rows as views,
the one-row sums once per row, and are read at the pairs; otherwise the pairs' rows are
gathered); the slow loop reference is ``alignopsd.reference.boundary_scores_ref`` (a Python loop over
trajectories on the dense rows, the oracle of the tests). BLOCK = 128 source slots per
iteration (blocks are a few hundred turns; not tuned on a GPU, none was available).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._dispatch import HAS_TRITON, launch, resolve_impl
from .blocks import Blocks, all_finite, check_id_vectors, gather_blocks, task_blocks

if HAS_TRITON:
    import triton
    import triton.language as tl
else:  # pragma: no cover
    triton = None
    tl = None

__all__ = [
    "DISTANCES",
    "batch_threshold",
    "boundary_scores",
    "boundary_scores_blocks",
]

DISTANCES = ("jsd", "entropy", "cosine")
_LN2 = math.log(2.0)
_TINY = float(torch.finfo(torch.float32).tiny)
_BLOCK = 128
_CHUNK_CELLS = 1 << 17  # cells per chunk of the torch path's row sums (512 KiB of float32: fits a core's L2)
_ADJACENT_MAX_ROWS = 2.0  # torch path: sums over all block rows while they are at most this many times the turns


def _check_distance(distance: str) -> str:
    if distance not in DISTANCES:
        raise ValueError(f"distance: unknown value {distance!r}; allowed: {', '.join(map(repr, DISTANCES))}")
    return distance


def _adjacent(blocks: Blocks) -> tuple[Tensor, Tensor]:
    """(prev_K, cur_K) turn indices (input order) of consecutive turns of each trajectory."""
    order = blocks.order_M
    if order.numel() < 2:
        e = torch.zeros(0, dtype=torch.long, device=order.device)
        return e, e
    traj = blocks.traj_M[order]
    k = (traj[1:] == traj[:-1]).nonzero().flatten()
    return order[k], order[k + 1]


# --------------------------------------------------------------------------------------
# row statistics
# --------------------------------------------------------------------------------------
def _xlogx_sum(x_KN: Tensor) -> Tensor:
    """sum_j x log x per row, 0 log 0 = 0. Clamping at the smallest normal float keeps ``log`` off its slow
    path for zeros and subnormals; the clamped terms are multiplied by x = 0 (or < 1.2e-38) again."""
    return x_KN.clamp_min(_TINY).log_().mul_(x_KN).sum(-1)


def _pair_stats_torch(p_KN: Tensor, q_KN: Tensor, ep_KN: Tensor, eq_KN: Tensor, distance: str) -> Tensor:
    """[7, K]: sum p log p, sum q log q, sum m log m, <p,q>, |p|^2, |q|^2, eligibility mismatch.

    Only the sums ``distance`` needs are computed; the others are left at 0.
    """
    K = p_KN.shape[0]
    out = torch.zeros(7, K, dtype=torch.float32, device=p_KN.device)
    if K == 0:
        return out
    if distance in ("jsd", "entropy"):
        out[0] = _xlogx_sum(p_KN)
        out[1] = _xlogx_sum(q_KN)
    if distance == "jsd":
        out[2] = _xlogx_sum(torch.add(p_KN, q_KN).mul_(0.5))
    if distance == "cosine":
        out[3] = torch.linalg.vecdot(p_KN, q_KN)
        out[4] = torch.linalg.vecdot(p_KN, p_KN)
        out[5] = torch.linalg.vecdot(q_KN, q_KN)
    out[6] = (ep_KN != eq_KN).any(1).float()
    return out


def _chunks(rows: int, row_cells: int) -> list[tuple[int, int]]:
    """Ranges of about ``_CHUNK_CELLS`` cells over ``rows`` rows of ``row_cells`` cells: the row sums run chunk by
    chunk on cache-resident temporaries instead of full-size ones."""
    step = max(1, _CHUNK_CELLS // max(1, row_cells))
    return [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]


def _pair_stats_gather(P_RN: Tensor, E_RN: Tensor, rowp: Tensor, rowq: Tensor, distance: str) -> Tensor:
    """:func:`_pair_stats_torch` of the row pairs (rowp[k], rowq[k]) of P_RN / E_RN [rows, N], chunk by chunk."""
    K = rowp.numel()
    out = torch.zeros(7, K, dtype=torch.float32, device=P_RN.device)
    for k0, k1 in _chunks(K, P_RN.shape[1]):
        rp, rq = rowp[k0:k1], rowq[k0:k1]
        p, q = P_RN.index_select(0, rp), P_RN.index_select(0, rq)
        out[:, k0:k1] = _pair_stats_torch(p, q, E_RN.index_select(0, rp), E_RN.index_select(0, rq), distance)
    return out


def _pair_stats_adjacent(P_RN: Tensor, E_RN: Tensor, rowp: Tensor, rowq: Tensor, distance: str) -> Tensor:
    """:func:`_pair_stats_torch` when every pair is two consecutive rows (rowq = rowp + 1: consecutive turns of a
    trajectory are consecutive slots of its block).

    The sums are taken over all rows of the blocks, chunk by chunk, without gathers: the one-row sums
    (sum p log p, |p|^2) once per row, the two-row sums for every (row, next row) pair, as views; then read at
    the pairs. Rows between trajectories and padding rows are wasted work, so the caller uses this when the
    blocks have few rows besides the turns.
    """
    R, N = P_RN.shape
    dev = P_RN.device
    K = rowp.numel()
    out = torch.zeros(7, K, dtype=torch.float32, device=dev)
    if K == 0:
        return out
    one = torch.zeros(R, dtype=torch.float32, device=dev)  # sum p log p or |p|^2 of every row
    two = torch.zeros(R - 1, dtype=torch.float32, device=dev)  # sum m log m or <p, q> of rows r, r + 1
    cosine = distance == "cosine"
    for r0, r1 in _chunks(R, N):
        rows = P_RN[r0:r1]
        one[r0:r1] = torch.linalg.vecdot(rows, rows) if cosine else _xlogx_sum(rows)
        if distance in ("jsd", "cosine") and r0 < R - 1:
            p, q = P_RN[r0 : min(r1, R - 1)], P_RN[r0 + 1 : min(r1, R - 1) + 1]
            two[r0 : r0 + p.shape[0]] = torch.linalg.vecdot(p, q) if cosine else _xlogx_sum(torch.add(p, q).mul_(0.5))
    s_one, s_two = (4, 3) if cosine else (0, 2)
    out[s_one] = one[rowp]
    out[s_one + 1] = one[rowq]
    if distance != "entropy":
        out[s_two] = two[rowp]
    if N % 8 == 0 and E_RN.is_contiguous() and E_RN.storage_offset() % 8 == 0:
        E_RN = E_RN.view(torch.int64)  # compare 8 flags per word
    out[6] = ((E_RN[:-1] != E_RN[1:]).sum(1) > 0)[rowp]  # every (row, next row), as views; sum: faster than any
    return out


def _pair_kernel(
    p_ptr,
    e_ptr,
    rowp_ptr,
    rowq_ptr,
    out_ptr,
    K,
    N,
    BLOCK: tl.constexpr,
):
    """Program k: the six sums and the eligibility mismatch of rows rowp[k], rowq[k] of the [rows, N] blocks."""
    k = tl.program_id(0)
    rp = tl.load(rowp_ptr + k).to(tl.int64) * N
    rq = tl.load(rowq_ptr + k).to(tl.int64) * N
    s_pp = tl.zeros((BLOCK,), dtype=tl.float32)
    s_qq = tl.zeros((BLOCK,), dtype=tl.float32)
    s_mm = tl.zeros((BLOCK,), dtype=tl.float32)
    s_pq = tl.zeros((BLOCK,), dtype=tl.float32)
    s_p2 = tl.zeros((BLOCK,), dtype=tl.float32)
    s_q2 = tl.zeros((BLOCK,), dtype=tl.float32)
    mis = tl.zeros((BLOCK,), dtype=tl.int32)
    for j0 in range(0, N, BLOCK):
        js = j0 + tl.arange(0, BLOCK)
        jm = js < N
        p = tl.load(p_ptr + rp + js, mask=jm, other=0.0)
        q = tl.load(p_ptr + rq + js, mask=jm, other=0.0)
        ep = tl.load(e_ptr + rp + js, mask=jm, other=0)
        eq = tl.load(e_ptr + rq + js, mask=jm, other=0)
        m = (p + q) * 0.5
        s_pp += tl.where(p > 0, p * tl.log(tl.where(p > 0, p, 1.0)), 0.0)
        s_qq += tl.where(q > 0, q * tl.log(tl.where(q > 0, q, 1.0)), 0.0)
        s_mm += tl.where(m > 0, m * tl.log(tl.where(m > 0, m, 1.0)), 0.0)
        s_pq += p * q
        s_p2 += p * p
        s_q2 += q * q
        mis = tl.maximum(mis, (ep != eq).to(tl.int32))
    tl.store(out_ptr + 0 * K + k, tl.sum(s_pp, axis=0))
    tl.store(out_ptr + 1 * K + k, tl.sum(s_qq, axis=0))
    tl.store(out_ptr + 2 * K + k, tl.sum(s_mm, axis=0))
    tl.store(out_ptr + 3 * K + k, tl.sum(s_pq, axis=0))
    tl.store(out_ptr + 4 * K + k, tl.sum(s_p2, axis=0))
    tl.store(out_ptr + 5 * K + k, tl.sum(s_q2, axis=0))
    tl.store(out_ptr + 6 * K + k, tl.max(mis, axis=0).to(tl.float32))


def _pair_stats_triton(P_BTS: Tensor, E_BTS: Tensor, rowp: Tensor, rowq: Tensor) -> Tensor:
    T, N, _ = P_BTS.shape
    K = rowp.numel()
    out = torch.zeros(7, K, dtype=torch.float32, device=P_BTS.device)
    if K:
        launch(
            _pair_kernel,
            (K,),
            P_BTS.float().contiguous(),
            E_BTS.to(torch.int8).contiguous(),
            rowp.contiguous(),
            rowq.contiguous(),
            out,
            K,
            N,
            BLOCK=_BLOCK,
        )
    return out


def _distance(stats: Tensor, distance: str, M: int) -> Tensor:
    if distance == "jsd":
        jsd = 0.5 * (stats[0] + stats[1]) - stats[2]
        return (jsd / _LN2).clamp(0.0, 1.0)
    if distance == "entropy":
        if M <= 1:
            return torch.zeros_like(stats[0])
        return (stats[0] - stats[1]).abs() / math.log(M)
    den = torch.sqrt(stats[4]) * torch.sqrt(stats[5])
    cos = torch.where(den > 0, stats[3] / torch.where(den > 0, den, 1.0), 0.0)
    return (1.0 - cos).clamp(0.0, 1.0)


# --------------------------------------------------------------------------------------
# entries
# --------------------------------------------------------------------------------------
@torch.no_grad()
def boundary_scores_blocks(
    P_BTS: Tensor,
    E_BTS: Tensor,
    profile_valid: Tensor,
    blocks: Blocks,
    *,
    distance: str = "jsd",
    impl: str = "auto",
) -> tuple[Tensor, Tensor]:
    """:func:`boundary_scores` on the block form (e.g. ``SiblingTopK.P_BTS``/``E_BTS``/``blocks``).

    P_BTS [T, N, N] float (target-major profiles), E_BTS [T, N, N] bool (E_BTS[b, t, s] = B[s, t]),
    profile_valid [M] bool. Returns d [M] float32, boundary_valid [M] bool.
    """
    _check_distance(distance)
    impl = resolve_impl(impl, P_BTS)
    M = profile_valid.shape[0]
    dev = P_BTS.device
    prev, cur = _adjacent(blocks)
    N = P_BTS.shape[1]
    rowp = blocks.block_M[prev] * N + blocks.slot_M[prev]
    rowq = blocks.block_M[cur] * N + blocks.slot_M[cur]
    if impl == "triton":
        stats = _pair_stats_triton(P_BTS, E_BTS, rowp, rowq)
    elif P_BTS.shape[0] * N <= _ADJACENT_MAX_ROWS * M:
        stats = _pair_stats_adjacent(P_BTS.reshape(-1, N).float(), E_BTS.reshape(-1, N), rowp, rowq, distance)
    else:
        stats = _pair_stats_gather(P_BTS.reshape(-1, N).float(), E_BTS.reshape(-1, N), rowp, rowq, distance)
    ok = profile_valid[prev] & profile_valid[cur] & (stats[6] == 0)
    d = torch.zeros(M, dtype=torch.float32, device=dev)
    bv = torch.zeros(M, dtype=torch.bool, device=dev)
    d[cur] = torch.where(ok, _distance(stats, distance, M), 0.0)
    bv[cur] = ok
    return d, bv


@torch.no_grad()
def boundary_scores(
    P: Tensor,
    profile_valid: Tensor,
    eligible: Tensor,
    task: Tensor,
    rollout: Tensor,
    turn: Tensor,
    *,
    distance: str = "jsd",
    impl: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Distance of every turn to the previous turn of its trajectory (§3.3), whole batch at once.

    P [M, M] float: profiles P[target, source]; profile_valid [M] bool; eligible [M, M] bool B[source, target];
    task/rollout/turn [M] integer ids (any order; duplicate turn ids in a trajectory raise ValueError).
    distance: "jsd" | "entropy" | "cosine". impl: "auto" | "triton" | "torch".
    Returns d [M] float32 (0 where not a valid boundary) and boundary_valid [M] bool.
    """
    _check_distance(distance)
    task, rollout, turn = check_id_vectors(task, rollout, turn)
    M = task.shape[0]
    for name, x in (("P", P), ("eligible", eligible)):
        if not isinstance(x, Tensor) or x.shape != (M, M):
            raise ValueError(f"{name}: expected shape ({M}, {M}), got {tuple(getattr(x, 'shape', ()))}")
    if not P.is_floating_point() or not all_finite(P):
        raise ValueError("P: expected a finite floating tensor")
    if eligible.dtype != torch.bool:
        raise ValueError(f"eligible: expected a bool tensor, got {eligible.dtype}")
    pv = torch.as_tensor(profile_valid)
    if pv.dtype != torch.bool or pv.shape != (M,):
        raise ValueError(f"profile_valid: expected a bool tensor of shape ({M},), got {pv.dtype} {tuple(pv.shape)}")
    dev = P.device
    blocks = task_blocks(task.to(dev), rollout.to(dev), turn.to(dev))
    P_BTS = gather_blocks(P.float(), blocks, transpose=False)
    E_BTS = gather_blocks(eligible.to(dev), blocks, transpose=True)
    if int(E_BTS.sum()) != int(eligible.sum()):
        raise ValueError("eligible: marks a (source, target) pair of different tasks; eligibility is within a task")
    outside = P.float().abs().sum() - P_BTS.abs().sum()
    if float(outside) > 1e-5 * max(1.0, float(P.abs().sum())):
        raise ValueError("P: has mass outside the target's task block; profiles are within a task")
    return boundary_scores_blocks(P_BTS, E_BTS, pv.to(dev), blocks, distance=distance, impl=impl)


def batch_threshold(
    d: Tensor, boundary_valid: Tensor, *, quantile: float = 0.8, tau_min: float = 0.01, tau_max: float = 0.10
) -> float:
    """tau = clip(quantile of d over valid boundaries (linear interpolation), tau_min, tau_max); +inf if none (§3.4)."""
    for name, x in (("quantile", quantile), ("tau_min", tau_min), ("tau_max", tau_max)):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(float(x)):
            raise ValueError(f"{name}: expected a finite real number, got {x!r}")
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"quantile: must lie in [0, 1], got {quantile}")
    if tau_max < tau_min:
        raise ValueError(f"tau_max: must be >= tau_min = {tau_min}, got {tau_max}")
    if not isinstance(d, Tensor) or d.dim() != 1:
        raise ValueError(f"d: expected a 1-D tensor, got {getattr(d, 'shape', type(d))}")
    if not isinstance(boundary_valid, Tensor) or boundary_valid.dtype != torch.bool or boundary_valid.shape != d.shape:
        raise ValueError(f"boundary_valid: expected a bool tensor of shape {tuple(d.shape)}")
    vals = d[boundary_valid.to(d.device)].double()
    if vals.numel() == 0:
        return math.inf
    if not all_finite(vals):
        raise ValueError("d: contains NaN or inf at valid boundaries")
    q = float(torch.quantile(vals, float(quantile), interpolation="linear"))
    return min(max(q, float(tau_min)), float(tau_max))
