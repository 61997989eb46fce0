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
    entropy = |H(p) - H(q)| / ln M          (M = the whole batch's turn count: ``num_turns`` when the turns
                                             given are one share of a larger batch)
    cosine  = 1 - <p, q> / (|p| |q|), clamped to [0, 1]
    d[cur]  = distance if boundary_valid[cur] else 0; the first turn of a trajectory is never a boundary

Zero-probability terms contribute 0 (x log x at 0). A profile row is non-zero only inside its
task block, so rows are read from the block layout: K x N work instead of K x M. Dense
inputs are checked for mass or eligibility outside the task blocks (ValueError).

The threshold (§3.4) is the linear-interpolation quantile of the valid distances of the whole
batch, clipped to [tau_min, tau_max]; +inf when there is none.

Paths: the Triton kernel (one program per pair, a loop over the block's source tiles that
accumulates the six row sums and the eligibility mismatch), and the torch path, the CPU path of
the whole project (the algorithm core's included). Only pairs of two valid profiles are scored,
and a pair is always two consecutive rows of the blocks, so the valid rows are compacted (padding
and invalid rows drop out; not when nearly all rows are valid, a copy would cost more than it
saves); the sums run as row reductions over chunks of ~512 KiB of those rows as views: the
one-row sums once per row (or sum p log p passed in by ``boundary_scores_rows``, from the
log-softmax of ``profiles.profile_rows``), the two-row sums for every (row, next row); then they
are read at the pairs. Eligibility rows are compared as packed words. The slow loop reference is
``alignopsd.testing.boundary_scores_ref`` (a Python loop over trajectories on the dense rows,
the oracle of the tests). BLOCK = 128 source slots per iteration (blocks are a few hundred
turns; not tuned on a GPU, none was available).
"""

from __future__ import annotations

import math

import torch
from alignopsd.kernels._dispatch import HAS_TRITON, resolve_impl
from alignopsd.kernels.blocks import (
    CHUNK_CELLS,
    Blocks,
    all_finite,
    check_id_vectors,
    gather_blocks,
    packed_rows,
    task_blocks,
)
from alignopsd.kernels.tuning import launch_tuned
from torch import Tensor

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
    "boundary_scores_rows",
]

DISTANCES = ("jsd", "entropy", "cosine")
_LN2 = math.log(2.0)
_TINY = float(torch.finfo(torch.float32).tiny)
_COMPACT_BELOW = 0.9  # torch path of dense blocks: the valid rows are copied out when fewer than this share of rows


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


def _chunks(rows: int, row_cells: int) -> list[tuple[int, int]]:
    """Ranges of about ``CHUNK_CELLS`` cells over ``rows`` rows of ``row_cells`` cells: the row sums run chunk by
    chunk on cache-resident temporaries instead of full-size ones."""
    step = max(1, CHUNK_CELLS // max(1, row_cells))
    return [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]


def _compact_pair_stats(P_VN: Tensor, one_V: Tensor | None, x_K: Tensor, distance: str) -> Tensor:
    """[7, K] sums (as :func:`_pair_stats_triton`, mismatch left 0) of the compacted row pairs (x_K, x_K + 1).

    The one-row sums (sum p log p, or |p|^2 for cosine) once per row unless given (``one_V``), the two-row sums
    (sum m log m or <p, q>) for every (row, next row), as views, chunk by chunk; then read at the pairs.
    """
    V, N = P_VN.shape
    out = torch.zeros(7, x_K.numel(), dtype=torch.float32, device=P_VN.device)
    if x_K.numel() == 0:
        return out
    cosine = distance == "cosine"
    one = torch.empty(V, dtype=torch.float32, device=P_VN.device) if one_V is None or cosine else one_V
    two = torch.zeros(V - 1, dtype=torch.float32, device=P_VN.device)
    for r0, r1 in _chunks(V, N):
        rows = P_VN[r0:r1]
        if one is not one_V:
            one[r0:r1] = torch.linalg.vecdot(rows, rows) if cosine else _xlogx_sum(rows)
        if distance != "entropy" and r0 < V - 1:
            p, q = P_VN[r0 : min(r1, V - 1)], P_VN[r0 + 1 : min(r1, V - 1) + 1]
            two[r0 : r0 + p.shape[0]] = torch.linalg.vecdot(p, q) if cosine else _xlogx_sum(torch.add(p, q).mul_(0.5))
    s_one, s_two = (4, 3) if cosine else (0, 2)
    out[s_one] = one[x_K]
    out[s_one + 1] = one[x_K + 1]
    if distance != "entropy":
        out[s_two] = two[x_K]
    return out


def _scores_torch(
    P_XN: Tensor, one_X: Tensor | None, valid_R: Tensor, E_RN: Tensor, rowp: Tensor, distance: str, M: int
) -> tuple[Tensor, Tensor]:
    """The torch path: pairs (rowp, rowp + 1) of the block rows. P_XN holds every row of the blocks, or only the
    valid rows (valid_R) in row order: the two rows of a valid pair are consecutive there too. Returns ok [K] (both
    valid, eligible rows equal) and the distance of the ok pairs."""
    words = packed_rows(E_RN)
    differ = (words[:-1] != words[1:]).sum(1) > 0  # every (row, next row), as views; sum: faster than any
    ok = valid_R[rowp] & valid_R[rowp + 1] & ~differ[rowp]
    x = rowp[ok]
    if P_XN.shape[0] != valid_R.shape[0]:  # compacted: the position of a valid row among the valid rows
        x = (torch.cumsum(valid_R, 0) - 1)[x]
    return ok, _distance(_compact_pair_stats(P_XN, one_X, x, distance), distance, M)


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
        launch_tuned(
            _pair_kernel,
            lambda meta: (K,),
            P_BTS.device,
            P_BTS.float().contiguous(),
            E_BTS.to(torch.int8).contiguous(),
            rowp.contiguous(),
            rowq.contiguous(),
            out,
            K,
            N,
        )
    return out


def _norm_turns(num_turns: int | None, M: int) -> int:
    """The M of the "entropy" normaliser ln M: the turns given, or the whole batch's count they belong to."""
    if num_turns is None:
        return M
    if isinstance(num_turns, bool) or not isinstance(num_turns, int) or num_turns < M:
        raise ValueError(f"num_turns: expected an int >= the {M} turns given, got {num_turns!r}")
    return num_turns


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
def _pairs(blocks: Blocks, N: int) -> tuple[Tensor, Tensor, Tensor]:
    """(prev_K, cur_K) turns and rowp_K, the row of prev in the flattened [T*N, N] blocks (cur is the next row)."""
    prev, cur = _adjacent(blocks)
    return prev, cur, blocks.block_M[prev] * N + blocks.slot_M[prev]


def _scores(M: int, cur: Tensor, ok: Tensor, dist: Tensor) -> tuple[Tensor, Tensor]:
    """d [M] (dist of the ok pairs at their current turn, else 0) and boundary_valid [M]."""
    d = torch.zeros(M, dtype=torch.float32, device=cur.device)
    bv = torch.zeros(M, dtype=torch.bool, device=cur.device)
    d[cur[ok]] = dist
    bv[cur] = ok
    return d, bv


@torch.no_grad()
def boundary_scores_blocks(
    P_BTS: Tensor,
    E_BTS: Tensor,
    profile_valid: Tensor,
    blocks: Blocks,
    *,
    distance: str = "jsd",
    impl: str = "auto",
    num_turns: int | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`boundary_scores` on the block form (e.g. ``SiblingTopK.P_BTS``/``E_BTS``/``blocks``).

    P_BTS [T, N, N] float (target-major profiles), E_BTS [T, N, N] bool (E_BTS[b, t, s] = B[s, t]),
    profile_valid [M] bool. Returns d [M] float32, boundary_valid [M] bool. The torch path scores the valid
    rows as :func:`boundary_scores_rows` does, on a compacted copy unless nearly all rows are valid.
    num_turns: the M of the "entropy" normaliser ln M (None: the M turns given; the whole batch's turn count
    when they are one share of it).
    """
    _check_distance(distance)
    impl = resolve_impl(impl, P_BTS)
    M = profile_valid.shape[0]
    norm_m = _norm_turns(num_turns, M)
    T, N = P_BTS.shape[0], P_BTS.shape[1]
    prev, cur, rowp = _pairs(blocks, N)
    if impl == "triton":
        stats = _pair_stats_triton(P_BTS, E_BTS, rowp, rowp + 1)
        ok = profile_valid[prev] & profile_valid[cur] & (stats[6] == 0)
        return _scores(M, cur, ok, _distance(stats, distance, norm_m)[ok])
    valid_R = torch.zeros(T * N, dtype=torch.bool, device=P_BTS.device)
    valid_R[blocks.block_M * N + blocks.slot_M] = profile_valid
    P_RN = P_BTS.reshape(-1, N).float()
    rows = valid_R.nonzero().view(-1)
    P_XN = P_RN.index_select(0, rows) if rows.numel() < _COMPACT_BELOW * valid_R.numel() else P_RN
    ok, dist = _scores_torch(P_XN, None, valid_R, E_BTS.reshape(-1, N), rowp, distance, norm_m)
    return _scores(M, cur, ok, dist)


@torch.no_grad()
def boundary_scores_rows(
    P_VN: Tensor,
    valid_BT: Tensor,
    E_BTS: Tensor,
    blocks: Blocks,
    *,
    negent_V: Tensor | None = None,
    distance: str = "jsd",
    impl: str = "auto",
    num_turns: int | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`boundary_scores_blocks` from the valid profile rows only (``profiles.profile_rows``).

    P_VN [V, N] float32: the rows r of the flattened [T*N, N] blocks with valid_BT.view(-1)[r], in row order;
    valid_BT [T, N] bool; negent_V [V] (optional): sum p log p of those rows, reused by "jsd" and "entropy".
    E_BTS, blocks, num_turns: as :func:`boundary_scores_blocks`. Returns d [M] float32, boundary_valid [M] bool.
    """
    _check_distance(distance)
    impl = resolve_impl(impl, P_VN)
    T, N = valid_BT.shape
    valid_R = valid_BT.reshape(-1)
    if P_VN.shape != (int(valid_R.sum()), N):
        raise ValueError(f"P_VN: expected one row of {N} per valid row ({int(valid_R.sum())}), got {tuple(P_VN.shape)}")
    if impl == "triton":  # the kernel reads the dense blocks
        P_RN = torch.zeros(T * N, N, dtype=torch.float32, device=P_VN.device)
        P_RN[valid_R] = P_VN.float()
        pv = valid_BT[blocks.block_M, blocks.slot_M]
        return boundary_scores_blocks(
            P_RN.view(T, N, N), E_BTS, pv, blocks, distance=distance, impl=impl, num_turns=num_turns
        )
    prev, cur, rowp = _pairs(blocks, N)
    M = blocks.block_M.shape[0]
    norm_m = _norm_turns(num_turns, M)
    ok, dist = _scores_torch(P_VN.float(), negent_V, valid_R, E_BTS.reshape(-1, N), rowp, distance, norm_m)
    return _scores(M, cur, ok, dist)


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
