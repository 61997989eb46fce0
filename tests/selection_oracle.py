"""The test oracle of the source selection (ALGORITHM.md §2.4), its only copy outside the runtime one.

``select_sources_ref`` follows the spec's wording per target with Python loops; ``sibling_topk_ref`` builds H,
B and the profiles of §2.2, §2.3 and §3.2 per task from the embeddings, and takes its selection from
``select_sources_ref``. The runtime implementation (``alignopsd.kernels.sibling_topk``, which
``alignopsd.select_sources`` calls on every device) is tested equal to these.
"""

from __future__ import annotations

import torch
from alignopsd.kernels import SiblingTopK
from torch import Tensor


def select_sources_ref(H, eligible, task, rollout, turn, *, gamma: float, top_k: int) -> list[list[int]]:
    """Per target: candidates, best per rollout (ties by identity), then top-K by (-H, identity)."""
    M = len(task)
    ident = [(int(task[i]), int(rollout[i]), int(turn[i])) for i in range(M)]
    out: list[list[int]] = []
    for t in range(M):
        cands = [s for s in range(M) if bool(eligible[s, t]) and float(H[s, t]) >= gamma]
        best: dict[tuple[int, int], int] = {}
        for s in cands:
            key = (ident[s][0], ident[s][1])
            cur = best.get(key)
            if cur is None or (-float(H[s, t]), ident[s]) < (-float(H[cur, t]), ident[cur]):
                best[key] = s
        winners = sorted(best.values(), key=lambda s: (-float(H[s, t]), ident[s]))
        out.append(winners[:top_k])
    return out


@torch.no_grad()
def sibling_topk_ref(
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
) -> SiblingTopK:
    """H, B, selection, profiles and profile validity per task in fp32, per target in Python."""
    M = teacher_emb.shape[0]
    dev = teacher_emb.device
    te, st = teacher_emb.float(), student_emb.float()
    sv, tv = source_valid.bool(), target_valid.bool()
    H = torch.zeros(M, M, device=dev)
    B = torch.zeros(M, M, dtype=torch.bool, device=dev)
    P = torch.zeros(M, M, device=dev)
    valid = torch.zeros(M, dtype=torch.bool, device=dev)
    for tk in torch.unique(task).tolist():
        idx = (task == tk).nonzero().flatten()
        blk = (te[idx] @ st[idx].T).clamp(-1.0, 1.0) * (sv[idx][:, None] & tv[idx][None, :])
        H[idx[:, None], idx[None, :]] = blk
        B[idx[:, None], idx[None, :]] = (
            sv[idx][:, None] & tv[idx][None, :] & (rollout[idx][:, None] != rollout[idx][None, :])
        )
    for t in range(M):
        srcs = B[:, t].nonzero().flatten()
        if srcs.numel():
            P[t, srcs] = torch.softmax(H[srcs, t] / profile_temperature, 0)
            valid[t] = bool(H[srcs, t].max() >= gamma)
    lists = select_sources_ref(H, B, task, rollout, turn, gamma=gamma, top_k=top_k)
    selected = torch.full((M, top_k), -1, dtype=torch.long, device=dev)
    for t, kept in enumerate(lists):
        selected[t, : len(kept)] = torch.tensor(kept, dtype=torch.long, device=dev)
    return SiblingTopK(selected, valid, H=H, eligible=B, P=P)
