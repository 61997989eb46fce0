"""Sibling top-K: thinking similarity, eligibility, source selection and correspondence profiles in one call.

Legend: M = canonical turns, D = embedding size, T = tasks, N = slots of the largest task
block, G = rollouts of the largest task, K = top_k. Dense matrices: H_ST[source, target],
B_ST[source, target], P_TS[target, source]. Block tensors are target-major: x_BTS[b, t, s].

Design
------
All tasks are handled at once: turns are sorted by identity (task, rollout, turn) into
zero-padded task blocks (``blocks.py``), so cross-task cells are never computed and identity
order inside a block is slot order. Per block:

    H[s, t]   = clamp(<teacher_s, student_t>, -1, 1), 0 when either side is invalid       (§2.2)
    B[s, t]   = different rollout & teacher_s valid & student_t valid                     (§2.3)
    selection : candidates B & H >= gamma; per (target, source rollout) the best candidate
                (highest H, ties: smaller slot = smaller identity): the max of X (H on
                eligible cells, -inf elsewhere) over the rollout's slots, kept if >= gamma;
                the G rollout winners sorted stably by -H (rollouts are contiguous and in
                identity order, so stability is the identity tie-break); first K    (§2.4)
    P[t, :]   = softmax over eligible s of H[s, t] / T_p, 0 without an eligible source;
    valid[t]  = some eligible source and max eligible H[s, t] >= gamma                     (§3.2)

The per-rollout maxima: with a regular layout (every task G rollouts of L turns, see
``blocks.py``) X is reshaped to [targets, G, L] and one max over L gives the best and its
first (smallest) slot; with uneven rollouts the same max runs on the slots gathered into a
padded [G, Lp] view (Lp = longest rollout, -inf past a rollout's end) while G x Lp <= 2N;
beyond that, two scatter-reduces over the slots' rollout index.

Paths: the Triton kernel (one program per (block, target tile) computes the H tile with
``tl.dot``, an online max/sum over the block's source tiles, then recomputes the tile and
writes H, B and P) followed by the shared torch selection; the torch path, a group of
blocks (~512 KiB of cells) at a time: gather the group's embedding rows, batched matmul
into H, then X, the rollout maxima and the softmax on cache-resident temporaries (B is a
uint8 outer product of the validity masks minus the own-rollout cells). Both share the selection
(``_select_blocks`` / ``_masked_group``), the one implementation of §2.4 that ``alignopsd.select_sources`` also
calls; the loop written straight from the spec that the tests compare with is ``tests/m1_oracle.py``.

From a precomputed H (the algorithm core's inputs: dense H[source, target] and any
within-task eligibility B), ``sibling_topk_from_similarity`` gathers the task blocks and runs
the same selection; ``profiles.py`` has the profile entries (the Triton profile kernel is the
kernel above without the dot product: it reads the H and B tiles). ``alignopsd.select_sources``
calls these on CUDA tensors.

Launch configurations per GPU architecture, autotuning and roofline bounds: ``tuning.py``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from alignopsd.kernels._dispatch import resolve_impl
from alignopsd.kernels.blocks import (
    MASKED_LOGIT,
    Blocks,
    all_finite,
    block_groups,
    check_eligible_finite,
    check_id_vectors,
    check_params,
    gather_blocks,
    scatter_dense,
    task_blocks,
    to_blocks,
)
from alignopsd.kernels.sibling_topk_triton import blocks_triton, profiles_triton
from torch import Tensor

__all__ = [
    "SiblingTopK",
    "selection_lists",
    "sibling_topk",
    "sibling_topk_from_similarity",
]

_PAD_MAX = 2.0  # selection: padded per-rollout view while G x (longest rollout) <= _PAD_MAX x N


class SiblingTopK:
    """Result of :func:`sibling_topk` (all detached, on the input's device).

    selected: [M, K] long, the kept source indices per target in rank order, -1 padded;
    profile_valid: [M] bool. Dense views, built on first access and cached (each is M x M):
    ``H`` (H_ST float32), ``eligible`` (B_ST bool), ``P`` (P_TS float32; absent when the
    profiles were not asked for, see :func:`sibling_topk_from_similarity`).
    Block form (what the kernels produce; ``jsd_boundary.boundary_scores_blocks`` reads it
    directly): ``blocks``, ``H_BTS``, ``E_BTS``, ``P_BTS`` [T, N, N], target-major.
    """

    def __init__(
        self,
        selected: Tensor,
        profile_valid: Tensor,
        *,
        blocks: Blocks | None = None,
        H_BTS: Tensor | None = None,
        E_BTS: Tensor | None = None,
        P_BTS: Tensor | None = None,
        H: Tensor | None = None,
        eligible: Tensor | None = None,
        P: Tensor | None = None,
    ) -> None:
        self.selected = selected
        self.profile_valid = profile_valid
        self.blocks = blocks
        self.H_BTS = H_BTS
        self.E_BTS = E_BTS
        self.P_BTS = P_BTS
        self._H = H
        self._eligible = eligible
        self._P = P

    @property
    def num_turns(self) -> int:
        return int(self.selected.shape[0])

    @property
    def H(self) -> Tensor:
        if self._H is None:
            self._H = scatter_dense(self.H_BTS, self.blocks, self.num_turns, transpose=True)
        return self._H

    @property
    def eligible(self) -> Tensor:
        if self._eligible is None:
            self._eligible = scatter_dense(self.E_BTS, self.blocks, self.num_turns, transpose=True, fill=False)
        return self._eligible

    @property
    def P(self) -> Tensor:
        if self._P is None:
            if self.P_BTS is None:
                raise ValueError("P: profiles were not computed (profiles=False)")
            self._P = scatter_dense(self.P_BTS, self.blocks, self.num_turns, transpose=False)
        return self._P

    def selected_lists(self) -> list[list[int]]:
        """The selection as ``list[list[int]]`` (the core's ``select_sources`` format)."""
        return selection_lists(self.selected)


def selection_lists(selected_MK: Tensor) -> list[list[int]]:
    """[M, K] long, -1 padded -> per-target lists of source indices."""
    kept = selected_MK >= 0
    if kept.shape[1] > 1 and not bool((kept[:, 1:] <= kept[:, :-1]).all()):  # padding not only at the end
        return [[s for s in row if s >= 0] for row in selected_MK.tolist()]
    return [row[:n] for row, n in zip(selected_MK.tolist(), kept.sum(1).tolist())]


# --------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------
def _check(teacher_emb, student_emb, task, rollout, turn, source_valid, target_valid, gamma, top_k, temperature):
    for name, t in (("teacher_emb", teacher_emb), ("student_emb", student_emb)):
        if not isinstance(t, Tensor) or t.dim() != 2 or not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating [M, D] tensor, got {getattr(t, 'shape', type(t))}")
    if student_emb.shape != teacher_emb.shape:
        raise ValueError(f"student_emb: expected shape {tuple(teacher_emb.shape)}, got {tuple(student_emb.shape)}")
    for name, t in (("teacher_emb", teacher_emb), ("student_emb", student_emb)):
        if not all_finite(t):
            raise ValueError(f"{name}: contains NaN or inf")
    task, rollout, turn = check_id_vectors(task, rollout, turn)
    M = teacher_emb.shape[0]
    if task.shape[0] != M:
        raise ValueError(f"task: expected shape ({M},) like the embeddings, got {tuple(task.shape)}")
    out = []
    for name, v in (("source_valid", source_valid), ("target_valid", target_valid)):
        v = torch.as_tensor(v, device=teacher_emb.device)
        if v.dtype != torch.bool or v.shape != (M,):
            raise ValueError(f"{name}: expected a bool tensor of shape ({M},), got {v.dtype} {tuple(v.shape)}")
        out.append(v)
    check_params(gamma, top_k, temperature)
    dev = teacher_emb.device
    return task.to(dev), rollout.to(dev), turn.to(dev), out[0], out[1]


# --------------------------------------------------------------------------------------
# shared block stages
# --------------------------------------------------------------------------------------
class _Rollouts(NamedTuple):
    """How the selection finds per-rollout maxima (see :func:`_rollout_layout`)."""

    G: int  # rollouts of the largest task
    L: int  # regular layout: turns per rollout (slot n in rollout n // L); 0 otherwise
    lroll: Tensor  # [T, N] rollout of each slot (the scatter-reduce form)
    Lp: int = 0  # padded form: turns of the longest rollout; 0 when not used
    pad_idx: Tensor | None = None  # [T, G * Lp] slot of (rollout g, turn l), 0 where l is past the rollout's end
    pad_mask: Tensor | None = None  # [T, G * Lp] l is past the rollout's end
    start: Tensor | None = None  # [T, G] first slot of each rollout


def _rollout_layout(blocks: Blocks) -> _Rollouts:
    """Regular layout: reshape. Otherwise, unless the rollouts are so uneven that G x (longest rollout) exceeds
    ``_PAD_MAX`` x N, a padded [G, Lp] view of the slots gathered per group; else scatter-reduces."""
    G, L, lroll = max(1, blocks.num_rollouts), blocks.rollout_len, blocks.lroll_TN
    T, N = lroll.shape
    if L or not T * N:
        return _Rollouts(G, L, lroll)
    length = torch.zeros(T, G, dtype=torch.long, device=lroll.device).scatter_add_(1, lroll, blocks.member_TN.long())
    Lp = int(length.max())
    if G * Lp > _PAD_MAX * N:
        return _Rollouts(G, 0, lroll)
    start = torch.cumsum(length, 1) - length  # a block's rollouts are contiguous and in order from slot 0
    turn = torch.arange(Lp, device=lroll.device)
    pad_mask = turn >= length[:, :, None]
    pad_idx = (start[:, :, None] + turn).masked_fill_(pad_mask, 0)
    return _Rollouts(G, 0, lroll, Lp, pad_idx.view(T, -1), pad_mask.view(T, -1), start)


def _rollout_best(X_BTS: Tensor, ro: _Rollouts, b0: int, b1: int, gamma: float) -> tuple[Tensor, Tensor, Tensor]:
    """Per (target, source rollout) the best candidate of X (H on eligible cells, -inf elsewhere) (§2.4).

    X_BTS: blocks b0:b1. Returns best [n, N, G] (highest H >= gamma of the rollout, -inf without a candidate),
    first [n, N, G] (its smallest slot = smallest identity; any value where best is -inf) and rowmax [n, N]
    (max over all eligible sources, -inf without one). With a regular layout (see ``blocks.py``) the source
    axis is reshaped to [G, L] and one max over L gives both (ties: the first maximal index); with the padded
    form the same max runs on the slots gathered into [G, Lp] (-inf past a rollout's end); otherwise two
    scatter-reduces over the rollout index of each slot.
    """
    T, N, _ = X_BTS.shape
    dev = X_BTS.device
    G = ro.G
    if ro.L or ro.pad_idx is not None:
        if ro.L:
            best, arg = X_BTS.view(T, N, G, ro.L).max(3)
            first = arg.add_(torch.arange(0, N, ro.L, device=dev))
        else:
            Xp = X_BTS.gather(2, ro.pad_idx[b0:b1, None, :].expand(T, N, -1))
            best, arg = Xp.masked_fill_(ro.pad_mask[b0:b1, None, :], -math.inf).view(T, N, G, ro.Lp).max(3)
            first = arg.add_(ro.start[b0:b1, None, :])
        rowmax = best.amax(2)
        return best.masked_fill_(best < gamma, -math.inf), first, rowmax
    roll = ro.lroll[b0:b1, None, :].expand(T, N, N)
    best = torch.full((T, N, G), -math.inf, device=dev).scatter_reduce(2, roll, X_BTS, reduce="amax")
    rowmax = best.amax(2) if T * N else best.new_full((T, N), -math.inf)
    best.masked_fill_(best < gamma, -math.inf)
    # a cell equal to its rollout's thresholded best is a candidate (where best is -inf, first is unused)
    slot = torch.arange(N, device=dev).expand(T, N, N)
    first = torch.full((T, N, G), N, dtype=torch.long, device=dev).scatter_reduce(
        2, roll, torch.where(X_BTS == best.gather(2, roll), slot, N), reduce="amin"
    )
    return best, first, rowmax


def _rank_rollouts(best: Tensor, first: Tensor, top_k: int) -> Tensor:
    """Slots [T, N, K] (-1 padded): the rollout winners sorted stably by -H (rollouts are in identity order,
    so stability is the identity tie-break), first K."""
    T, N, _ = best.shape
    order = torch.sort(best, dim=2, descending=True, stable=True).indices[:, :, :top_k]
    win = first.gather(2, order)
    win = torch.where(best.gather(2, order) > -math.inf, win, -1)
    if win.shape[2] < top_k:
        win = torch.cat([win, win.new_full((T, N, top_k - win.shape[2]), -1)], dim=2)
    return win


def _masked_group(H: Tensor, E: Tensor, ro: _Rollouts | None, b0: int, b1: int, gamma: float, temperature, P_out):
    """Blocks b0:b1 (H, E: their slices): X = H on eligible cells, -inf elsewhere; the rollout bests (without
    ``ro``: only the row max); the profiles softmax(X / T_p) written into ``P_out`` when given (rows without an
    eligible source come out NaN; :func:`_finish_groups` zeroes them)."""
    X = torch.where(E, H.float(), -math.inf)
    if ro is None:
        out = (X.amax(2) if X.numel() else X.new_full(X.shape[:2], -math.inf),)
    else:
        out = _rollout_best(X, ro, b0, b1, gamma)
    if P_out is not None:
        torch._softmax(X.div_(temperature), 2, False, out=P_out)  # torch.softmax's op, written in place: no copy
    return out


def _finish_groups(parts: list, N: int, P: Tensor | None) -> list[Tensor]:
    """Concatenate the groups' outputs (best, first, rowmax or rowmax alone); zero the P rows without an eligible
    source."""
    if not parts:  # no blocks: the caller supplies empty outputs
        return []
    outs = [torch.cat(x) for x in zip(*parts)]
    if P is not None:
        none = (outs[-1] == -math.inf).view(-1).nonzero().view(-1)
        P.view(-1, N).index_fill_(0, none, 0.0)
    return outs


def _profile_valid(rowmax: Tensor, gamma: float) -> Tensor:
    """Some eligible source and max eligible H >= gamma (the max taken with masked cells at ``MASKED_LOGIT``)."""
    return (rowmax > -math.inf) & (rowmax.clamp_min(MASKED_LOGIT) >= gamma)


def _select_blocks(
    H_BTS: Tensor, E_BTS: Tensor, ro: _Rollouts, gamma: float, top_k: int, temperature=None
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Slots [T, N, K] (-1 padded) of the kept sources of every target, best first (§2.4); P [T, N, N] when a
    ``temperature`` is given (else None); the row max of the eligible H (-inf without an eligible source)."""
    T, N, _ = H_BTS.shape
    P = torch.empty(T, N, N, device=H_BTS.device) if temperature is not None else None
    parts = [
        _masked_group(H_BTS[b0:b1], E_BTS[b0:b1], ro, b0, b1, gamma, temperature, None if P is None else P[b0:b1])
        for b0, b1 in block_groups(T, N)
    ]
    best, first, rowmax = _finish_groups(parts, N, P) or _empty_groups(T, N, ro.G, H_BTS.device)
    return _rank_rollouts(best, first, top_k), P, rowmax


def _empty_groups(T: int, N: int, G: int, dev) -> list[Tensor]:
    return [
        torch.full((T, N, G), -math.inf, device=dev),
        torch.zeros(T, N, G, dtype=torch.long, device=dev),
        torch.full((T, N), -math.inf, device=dev),
    ]


def _blocks_torch(te, st, idx_TN, src_ok, tgt_ok, ro: _Rollouts, gamma, temperature, top_k):
    """H, B, P, validity and the selection of the blocks, group by group: the group's embedding rows gathered,
    a batched matmul into H, then the masked passes (:func:`_masked_group`) while the group is in cache."""
    T, N = idx_TN.shape
    dev = te.device
    # eligibility as a uint8 outer product (broadcast bool ops are slow on CPU), viewed as bool
    E = tgt_ok.to(torch.uint8)[:, :, None] * src_ok.to(torch.uint8)[:, None, :]
    if ro.L:
        E.view(T, ro.G, ro.L, ro.G, ro.L).diagonal(0, 1, 3).zero_()  # the target's own rollout
    else:
        E.mul_(ro.lroll[:, :, None] != ro.lroll[:, None, :])
    E = E.view(torch.bool)
    H = torch.empty(T, N, N, device=dev)
    P = torch.empty(T, N, N, device=dev)
    parts = []
    for b0, b1 in block_groups(T, N):
        ix = idx_TN[b0:b1]  # padding slots gather some turn's row; masked below (H) or not eligible (X)
        rows = ix.reshape(-1)  # index_select: several times faster than advanced indexing on CPU
        S = st.index_select(0, rows).view(b1 - b0, N, -1).float()
        Tt = te.index_select(0, rows).view(b1 - b0, N, -1).float().transpose(1, 2)
        torch.bmm(S, Tt, out=H[b0:b1]).clamp_(-1.0, 1.0)
        parts.append(_masked_group(H[b0:b1], E[b0:b1], ro, b0, b1, gamma, temperature, P[b0:b1]))
    best, first, rowmax = _finish_groups(parts, N, P) or _empty_groups(T, N, ro.G, dev)
    # rows of invalid targets and columns of invalid sources (padding slots included) are 0: index writes
    H[(~tgt_ok).nonzero(as_tuple=True)] = 0.0
    b_s, s_s = (~src_ok).nonzero(as_tuple=True)
    H[b_s, :, s_s] = 0.0
    return H, E, P, _profile_valid(rowmax, gamma), _rank_rollouts(best, first, top_k)


# --------------------------------------------------------------------------------------
# functional entry
# --------------------------------------------------------------------------------------
@torch.no_grad()
def sibling_topk(
    teacher_emb: Tensor,
    student_emb: Tensor,
    task: Tensor,
    rollout: Tensor,
    turn: Tensor,
    source_valid: Tensor,
    target_valid: Tensor,
    *,
    gamma: float,
    top_k: int,
    profile_temperature: float = 0.1,
    impl: str = "auto",
) -> SiblingTopK:
    """H, eligibility, selection, profiles and profile validity of a whole batch in one call.

    teacher_emb[M, D]: teacher-thinking embeddings (unit vectors; rows of invalid text are ignored).
    student_emb[M, D]: student-thinking embeddings. task/rollout/turn[M]: integer ids.
    source_valid[M] bool: the teacher thinking of the turn is valid; target_valid[M] bool: its student thinking.
    gamma: selection threshold (H >= gamma) and profile-validity threshold. top_k: K >= 1.
    profile_temperature: T_p. impl: "auto" | "triton" | "torch".
    Returns :class:`SiblingTopK`.
    """
    task, rollout, turn, sv, tv = _check(
        teacher_emb, student_emb, task, rollout, turn, source_valid, target_valid, gamma, top_k, profile_temperature
    )
    impl = resolve_impl(impl, teacher_emb)
    M = teacher_emb.shape[0]
    blocks = task_blocks(task, rollout, turn)
    src_ok = to_blocks(sv, blocks)
    tgt_ok = to_blocks(tv, blocks)
    ro = _rollout_layout(blocks)
    if impl == "triton":
        # padding slots hold a copy of some turn's embedding; the validity masks (False on padding) zero them out
        Tb = to_blocks(teacher_emb, blocks, zero_padding=False)
        Sb = to_blocks(student_emb, blocks, zero_padding=False)
        H_b, E_b, P_b, valid_b = blocks_triton(
            Tb, Sb, src_ok, tgt_ok, blocks.lroll_TN, float(gamma), float(profile_temperature)
        )
        win = _select_blocks(H_b, E_b, ro, float(gamma), top_k)[0]
    else:
        H_b, E_b, P_b, valid_b, win = _blocks_torch(
            teacher_emb,
            student_emb,
            blocks.idx_TN,
            src_ok,
            tgt_ok,
            ro,
            float(gamma),
            float(profile_temperature),
            top_k,
        )
    selected, valid = _to_turns(win, valid_b, blocks, M, top_k)
    return SiblingTopK(selected, valid, blocks=blocks, H_BTS=H_b, E_BTS=E_b, P_BTS=P_b)


def _to_turns(win: Tensor, valid_b: Tensor, blocks: Blocks, M: int, top_k: int) -> tuple[Tensor, Tensor]:
    """Selected [M, K] and profile_valid [M] in input order from the blocks' winning slots and validity."""
    dev = win.device
    T, N = blocks.idx_TN.shape
    chosen = torch.where(win >= 0, blocks.idx_TN.gather(1, win.clamp_min(0).reshape(T, -1)).reshape(win.shape), -1)
    selected = torch.full((M, top_k), -1, dtype=torch.long, device=dev)
    selected[blocks.idx_TN[blocks.member_TN]] = chosen[blocks.member_TN]
    valid = torch.zeros(M, dtype=torch.bool, device=dev)
    valid[blocks.idx_TN[blocks.member_TN]] = valid_b[blocks.member_TN]
    return selected, valid


@torch.no_grad()
def sibling_topk_from_similarity(
    H: Tensor,
    eligible: Tensor,
    task: Tensor,
    rollout: Tensor,
    turn: Tensor,
    *,
    gamma: float,
    top_k: int,
    profile_temperature: float = 0.1,
    profiles: bool = True,
    impl: str = "auto",
) -> SiblingTopK:
    """:func:`sibling_topk` from a precomputed similarity instead of embeddings (the core's inputs).

    H [M, M] float: H[source, target]; eligible [M, M] bool: any B[source, target] within tasks (a
    cross-task pair raises ValueError naming ``eligible``). Only eligible cells are read; they must be
    finite. task/rollout/turn [M] integer ids. gamma, top_k, profile_temperature: as :func:`sibling_topk`.
    profiles: also compute P (the Triton profile kernel under ``impl="triton"``); without it,
    ``profile_valid`` is still filled and ``P`` is absent. The selection is the batched block selection
    of :func:`sibling_topk` (torch ops on any device), equal to ``alignopsd.select_sources`` ties included.
    Returns :class:`SiblingTopK` whose dense ``H``/``eligible`` are the inputs (H as float32).
    """
    task, rollout, turn = check_id_vectors(task, rollout, turn)
    M = task.shape[0]
    for name, x in (("H", H), ("eligible", eligible)):
        if not isinstance(x, Tensor) or x.shape != (M, M):
            raise ValueError(f"{name}: expected shape ({M}, {M}), got {tuple(getattr(x, 'shape', ()))}")
    if not H.is_floating_point():
        raise ValueError(f"H: expected a floating tensor, got {H.dtype}")
    if eligible.dtype != torch.bool:
        raise ValueError(f"eligible: expected a bool tensor, got {eligible.dtype}")
    check_params(gamma, top_k, profile_temperature)
    if not isinstance(profiles, bool):
        raise ValueError(f"profiles: expected a bool, got {profiles!r}")
    impl = resolve_impl(impl, H)
    dev = H.device
    Hf = H.detach().float()
    eligible = eligible.to(dev)
    blocks = task_blocks(task.to(dev), rollout.to(dev), turn.to(dev))
    H_b = gather_blocks(Hf, blocks, transpose=True)
    E_b = gather_blocks(eligible, blocks, transpose=True)
    if int(E_b.sum()) != int(eligible.sum()):
        raise ValueError("eligible: marks a (source, target) pair of different tasks; eligibility is within a task")
    check_eligible_finite(H_b, E_b)
    torch_profiles = profiles and impl != "triton"
    win, P_b, rowmax = _select_blocks(
        H_b, E_b, _rollout_layout(blocks), float(gamma), top_k, float(profile_temperature) if torch_profiles else None
    )
    if not profiles:
        valid_b = rowmax >= gamma  # = some eligible source and max eligible H >= gamma
    elif impl == "triton":
        P_b, valid_b = profiles_triton(H_b, E_b, float(gamma), float(profile_temperature))
    else:
        valid_b = _profile_valid(rowmax, float(gamma))
    selected, valid = _to_turns(win, valid_b, blocks, M, top_k)
    return SiblingTopK(selected, valid, blocks=blocks, H_BTS=H_b, E_BTS=E_b, P_BTS=P_b, H=Hf, eligible=eligible)
