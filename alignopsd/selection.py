"""Mechanism 1's source selection (ALGORITHM.md §2.2–2.4): the thinking similarity, the structural mask and the
sources kept for each target, flattened into (source, target) pairs.

Legend: M = canonical turns, D = embedding width, P = kept (source, target) pairs.
``H_ST[source, target]`` is the thinking similarity, ``eligible_ST`` its structural mask.

Pure, detached tensor functions; the selection rule itself is implemented once, in
``alignopsd.kernels.sibling_topk``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from alignopsd._checks import (
    as_tensor,
    check_finite_fast,
    check_gamma,
    check_ids,
    check_ndim,
    check_shape,
    check_turn_matrix,
    check_turn_vector,
)
from alignopsd.kernels import core_uses_kernels
from alignopsd.kernels.sibling_topk import sibling_topk_from_similarity

__all__ = ["eligibility", "pairs_from_selection", "select_sources", "similarity_matrix"]


def _check_top_k(top_k) -> int:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k: expected an integer >= 1, got {top_k!r}")
    return int(top_k)


# ----------------------------------------------------------------------------- §2.2 similarity


def similarity_matrix(teacher_emb_MD: Tensor, student_emb_MD: Tensor, task_M: Tensor) -> Tensor:
    """H[source, target] = <teacher_emb[source], student_emb[target]>, clamped to [-1, 1], 0 across tasks.

    teacher_emb_MD, student_emb_MD: [M, D] unit (or zero, for invalid text) vectors.
    Returns H_ST [M, M] float32.
    """
    t = as_tensor(teacher_emb_MD, "teacher_emb")
    s = as_tensor(student_emb_MD, "student_emb")
    check_ndim(t, "teacher_emb", 2)
    check_ndim(s, "student_emb", 2)
    if t.shape != s.shape:
        raise ValueError(f"student_emb: expected shape {tuple(t.shape)} like teacher_emb, got {tuple(s.shape)}")
    check_finite_fast(t, "teacher_emb")
    check_finite_fast(s, "student_emb")
    task, _, _ = check_ids(task_M, task_M)
    check_shape(task, "task", (t.shape[0],))
    H = (t.float() @ s.float().T).clamp_(-1.0, 1.0)
    return torch.where(task[:, None] == task[None, :], H, torch.zeros((), dtype=H.dtype, device=H.device))


# ----------------------------------------------------------------------------- §2.3 eligibility


def eligibility(task: Tensor, rollout: Tensor, source_valid: Tensor, target_valid: Tensor) -> Tensor:
    """Structural mask B[source, target] (§2.3).

    task, rollout: [M] integer ids. source_valid: [M] bool, the teacher thinking of the source is
    valid. target_valid: [M] bool, the student thinking of the target is valid.
    Returns eligible_ST [M, M] bool: same task, different rollout, both sides valid.
    Turn ids are deliberately not compared.
    """
    task, rollout, _ = check_ids(task, rollout)
    M = task.numel()
    sv = check_turn_vector(source_valid, "source_valid", M, dtype=torch.bool)
    tv = check_turn_vector(target_valid, "target_valid", M, dtype=torch.bool)
    same_task = task[:, None] == task[None, :]
    other_rollout = rollout[:, None] != rollout[None, :]
    return same_task & other_rollout & sv[:, None] & tv[None, :]


# ----------------------------------------------------------------------------- §2.4 selection


def select_sources(
    H: Tensor, eligible: Tensor, task: Tensor, rollout: Tensor, turn: Tensor, *, gamma: float, top_k: int
) -> list[list[int]]:
    """Sparse source selection (§2.4), vectorised over padded task blocks.

    H: [M, M] similarity H[source, target]. eligible: [M, M] bool B[source, target] (same-task only).
    task, rollout, turn: [M] integer ids. Returns, for every target (in input order), the kept source
    indices best first: candidates with B and H >= gamma, the best source of each sibling rollout
    (ties: smaller identity), then the first ``top_k`` by (-H, identity).
    The rule is implemented once, in ``alignopsd.kernels.sibling_topk`` (any device); its test oracle is
    ``tests/m1_oracle.py``.
    """
    task, rollout, turn = check_ids(task, rollout, turn)
    M = task.numel()
    H_ST = check_turn_matrix(H, "H", M)
    B_ST = check_turn_matrix(eligible, "eligible", M, dtype=torch.bool)
    gamma = check_gamma(gamma)
    top_k = _check_top_k(top_k)
    if M == 0:
        return []
    # one implementation of the rule on every device: the batched block selection of the kernels package
    # (torch ops; its Triton kernels compute H and the profiles, not the selection)
    res = sibling_topk_from_similarity(
        H_ST,
        B_ST,
        task,
        rollout,
        turn,
        gamma=gamma,
        top_k=top_k,
        profiles=False,
        impl="triton" if core_uses_kernels(H_ST, B_ST) else "torch",
    )
    return res.selected_lists()


def pairs_from_selection(selected: Sequence[Sequence[int]], *, device=None) -> Tensor:
    """Flatten a per-target selection into pairs[P, 2] = (source, target), grouped by target in rank order."""
    src: list[int] = []
    tgt: list[int] = []
    for t, sources in enumerate(selected):
        src.extend(int(s) for s in sources)
        tgt.extend([t] * len(sources))
    return torch.tensor([src, tgt], dtype=torch.long, device=device).T.reshape(-1, 2)
