"""The test oracles of Mechanism 1 (ALGORITHM.md §2.3–2.7), the only copies outside the runtime ones.

Legend: M = canonical turns, L = response length, P = pairs. They follow the spec's wording line by line, with
Python loops and float64 scalars: ``select_sources_ref`` per target (§2.4); ``sibling_topk_ref`` builds H, B and the
profiles of §2.2, §2.3 and §3.2 per task from the embeddings and takes its selection from ``select_sources_ref``;
``eligibility_ref`` (§2.3), ``action_filter_ref`` (§2.5) and ``rectify_ref`` (§2.6–2.7). The runtime implementations
(``alignopsd.kernels.sibling_topk``, which ``alignopsd.select_sources`` calls on every device, and the vectorised
functions of ``alignopsd.selection``, ``alignopsd.actions`` and ``alignopsd.rectification``) are tested equal to these.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from alignopsd.kernels import SiblingTopK
from torch import Tensor

from alignopsd.actions import parse_webshop_action


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


def eligibility_ref(task, rollout, source_valid, target_valid) -> Tensor:
    """B[source, target] [M, M] bool by a double loop."""
    M = len(task)
    out = torch.zeros(M, M, dtype=torch.bool)
    for s in range(M):
        for t in range(M):
            out[s, t] = bool(
                int(task[s]) == int(task[t])
                and int(rollout[s]) != int(rollout[t])
                and bool(source_valid[s])
                and bool(target_valid[t])
            )
    return out


def action_filter_ref(
    selected: Sequence[Sequence[int]],
    action_sim,
    source_action_valid,
    target_action_valid,
    *,
    threshold: float = 0.8,
    source_actions=None,
    target_actions=None,
    webshop: bool = False,
) -> list[list[int]]:
    """Keep (s, t) iff both actions valid, sim finite and >= threshold, and the WebShop rule (if on)."""
    out = []
    for t, sources in enumerate(selected):
        kept = []
        for s in sources:
            ok = bool(source_action_valid[s]) and bool(target_action_valid[t])
            if source_actions is not None and not (isinstance(source_actions[s], str) and source_actions[s].strip()):
                ok = False
            if target_actions is not None and not (isinstance(target_actions[t], str) and target_actions[t].strip()):
                ok = False
            sim = float(action_sim[s, t])
            ok = ok and math.isfinite(sim) and sim >= threshold
            if ok and webshop:
                a, b = parse_webshop_action(source_actions[s]), parse_webshop_action(target_actions[t])
                ok = a is not None and b is not None and a[0] == b[0] and (a[0] != "click" or a[1] == b[1])
            if ok:
                kept.append(s)
        out.append(kept)
    return out


def rectify_ref(diag, cross, pairs, H, *, gamma, alpha_max, temperature=0.1, mode="probability_mixture"):
    """Returns (corrected [M, L], rho [M], alpha [M], weights list, cross_score [M, L]) by a per-target loop."""
    diag = torch.as_tensor(diag).double()
    cross = torch.as_tensor(cross).double()
    M, L = diag.shape
    pairs_l = [tuple(int(v) for v in p) for p in torch.as_tensor(pairs).reshape(-1, 2).tolist()]
    corrected = diag.clone()
    cscore = diag.clone()
    rho = torch.zeros(M, dtype=torch.float64)
    alpha = torch.zeros(M, dtype=torch.float64)
    weights: list[Tensor] = [torch.zeros(0, dtype=torch.float64) for _ in range(M)]
    for t in range(M):
        rows = [j for j, (_, tt) in enumerate(pairs_l) if tt == t]
        if not rows:
            continue
        hs = [float(H[pairs_l[j][0], t]) for j in rows]
        zmax = max(h / temperature for h in hs)
        ez = [math.exp(h / temperature - zmax) for h in hs]
        w = [e / sum(ez) for e in ez]
        c = torch.zeros(L, dtype=torch.float64)
        for k in range(L):
            vals = [float(cross[j, k]) for j in rows]
            if mode == "probability_mixture":
                m = max(vals)
                c[k] = m + math.log(sum(wj * math.exp(v - m) for wj, v in zip(w, vals)))
            else:
                c[k] = sum(wj * v for wj, v in zip(w, vals))
        r = sum(wj * min(max((h - gamma) / (1.0 - gamma), 0.0), 1.0) for wj, h in zip(w, hs))
        a = min(max(alpha_max * r, 0.0), alpha_max)
        rho[t], alpha[t] = r, a
        corrected[t] = (1 - a) * diag[t] + a * c
        cscore[t] = c
        weights[t] = torch.tensor(w, dtype=torch.float64)
    return corrected, rho, alpha, weights, cscore
