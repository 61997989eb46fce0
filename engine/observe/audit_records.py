"""The records of one audit step (ALGORITHM.md §4.3 "Audit"): the ``turn`` record of every canonical turn, the
choice of the snapshot's turns and their token records. ``audit.py`` writes them (files, budget, errors).

Legend: M = canonical turns of this rank's batch, L = response length, P = kept (source, target) pairs.

Records (one JSON object per line of the step's file, ``kind`` first; ``audit.py`` writes the ``step`` header):

* ``turn``: one per canonical turn, every step. Identity (canonical index = position in the sorted
  identity order of ALGORITHM.md §1.2, task / rollout / turn ids, task key, rows k), outcome and
  validity; ``regions``: per region (``response`` = all policy tokens, ``thinking``, ``action``,
  ``other`` = policy tokens in neither block; regions as in engine/step/regions.py, empty when they cannot be
  found) the token count, the sums of ℓ^old, of the final token advantage, of its absolute value and,
  when computed, of δ^diag = ℓ^diag − ℓ^old, of the cross gap c − ℓ^old and of δ̃ = ℓ̃ − ℓ^old, and the strict sign flips
  of the paired diagnostics (δ^diag < 0 < δ̃ is ``neg_to_pos``, δ^diag > 0 > δ̃ is ``pos_to_neg``; the
  ``cross_`` variants compare c − ℓ^old); ``m1`` (estimators with Mechanism 1): matched, ρ, α, thinking
  validity, H[t, t], eligible / threshold candidate counts, and ``sources``: each kept source's
  canonical index, identity, similarity ``H`` = H[s, t] and weight ``omega`` = ω in rank order; ``m2``
  (when Mechanism 2 ran): every per-turn field of ``alignopsd.credit.Credit`` (``span`` = segment
  index, boundary kinds by name), the span's first and end turn ids (``span_start``, ``span_end``,
  half-open), the kind of the boundary that opened the span (``span_boundary``; ``start`` at a
  trajectory's first turn), and the policy tokens whose final advantage has the opposite sign of the
  outcome advantage A (``advantage_neg_to_pos``: A < 0 < Â, ``advantage_pos_to_neg``).
* ``snapshot``: token records of up to 8 turns, on the first step, every 10th step and the last step.
  Half are a hash sample: the turns with the smallest SHA-256 of ``f"{step}:{task}:{rollout}:{turn}"``.
  The rest are targeted, one each, the best turn not already chosen: ``neg_to_pos`` / ``pos_to_neg``
  (most strict flips of δ̃ against δ^diag over the turn's policy tokens, the paired diagnostics' flips),
  ``fallback`` (a target without kept source) and ``max_cross_shift`` (largest mean |c − ℓ^diag| over
  the policy tokens of a matched target); ties and the order among fallbacks go by the hash. A target
  kind without candidate leaves its slot to the next hash-ordered turn (``reason`` = ``hash_fill``).
  Each token record: position, token id, text piece, region, ℓ^old (``student``), ℓ^diag
  (``teacher_diag``), each source's ℓ^{s→t} (``teacher_sources``, in ``sources`` order), c
  (``teacher_cross``), ℓ̃ (``teacher_rectified``), δ̃ (``evidence``) and the final advantage, as the
  estimator computed them.

Floats are written with 7 significant digits (float32 precision); non-finite values as null. An environment's
``truth`` is written as JSON can hold it (:func:`json_value`): a NaN or infinite number, or a value JSON has no form
for (a set, bytes, an object), becomes null and the record keeps the rest, with ``truth_nulled``: how many values were
replaced (absent when none; ``audit/truth_nulled_count`` sums them per step).
"""

from __future__ import annotations

import hashlib
import math
import numbers
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from alignopsd.engine.observe.strict import reraise_if_strict
from torch import Tensor

__all__ = [
    "BOUNDARY_KINDS",
    "SNAPSHOT_TURNS",
    "TARGETS",
    "identity_hash",
    "json_float",
    "json_floats",
    "json_value",
    "select_snapshot",
    "snapshot_records",
    "turn_records",
]

SNAPSHOT_TURNS = 8
TARGETS = ("neg_to_pos", "pos_to_neg", "fallback", "max_cross_shift")
BOUNDARY_KINDS = ("none", "semantic", "guided", "forced", "random")  # alignopsd.segmentation KIND_* values


def identity_hash(step: int, task: int, rollout: int, turn: int) -> str:
    """SHA-256 (hex) of ``f"{step}:{task}:{rollout}:{turn}"``: the audit's only source of choice."""
    return hashlib.sha256(f"{step}:{task}:{rollout}:{turn}".encode()).hexdigest()


def json_float(x: float) -> float | None:
    """``x`` with 7 significant digits (float32 precision), None when not finite."""
    x = float(x)
    if not math.isfinite(x):
        return None
    return float(f"{x:.7g}")


def json_floats(xs: Iterable[float]) -> list[float | None]:
    """:func:`json_float` of each."""
    return [json_float(x) for x in xs]


def json_value(value: Any) -> tuple[Any, int]:
    """(``value`` as JSON holds it, how many values in it became null): strings, booleans, integers and finite
    numbers as they are (numpy's scalars as Python's), lists, tuples and dicts member by member (keys as strings);
    a non-finite number or anything else (a set, bytes, an object) is null."""
    if value is None or isinstance(value, (str, bool)):
        return value, 0
    if isinstance(value, np.bool_):
        return bool(value), 0
    if isinstance(value, numbers.Integral):
        return int(value), 0
    if isinstance(value, numbers.Real):
        x = float(value)
        return (x, 0) if math.isfinite(x) else (None, 1)
    if isinstance(value, (list, tuple)):
        pairs = [json_value(v) for v in value]
        return [v for v, _ in pairs], sum(n for _, n in pairs)
    if isinstance(value, dict):
        out, nulled = {}, 0
        for k, v in value.items():
            out[k if isinstance(k, str) else str(k)], n = json_value(v)
            nulled += n
        return out, nulled
    return None, 1


# ---------------------------------------------------------------------------------------------------------------------
# records


def _region_masks(policy_ML: Tensor, regions) -> dict[str, Tensor]:
    masks = {"response": policy_ML}
    if regions is not None:
        th = regions.thinking.cpu().bool() & policy_ML
        ac = regions.action.cpu().bool() & policy_ML
        masks.update({"thinking": th, "action": ac, "other": policy_ML & ~(th | ac)})
    return masks


def _spans(task: list[int], roll: list[int], turn: list[int], seg: list[int]) -> dict[tuple, tuple[int, int]]:
    """(task, rollout, span) -> (first turn id, end turn id) of the span."""
    out: dict[tuple, tuple[int, int]] = {}
    for a, b, t, s in zip(task, roll, turn, seg):
        if s < 0:
            continue
        key = (a, b, s)
        lo, hi = out.get(key, (t, t + 1))
        out[key] = (min(lo, t), max(hi, t + 1))
    return out


def _region_columns(masks: dict[str, Tensor], per_tok: dict[str, Tensor], d_gap, c_gap, r_gap) -> dict[str, dict]:
    """Per region, its per-turn columns: token count, the sum of each per-token quantity over the region and,
    with a rectification, the strict sign flips of δ̃ (and of the cross gap) against δ^diag."""
    reg_lists: dict[str, dict[str, list]] = {}
    for name, mk in masks.items():
        mf = mk.double()
        cols: dict[str, list] = {"tokens": mk.sum(1).tolist()}
        for q, x in per_tok.items():
            cols[f"sum_{q}"] = json_floats((x * mf).sum(1).tolist())
        if r_gap is not None:
            for label, g in (("", r_gap), ("cross_", c_gap)):
                cols[f"{label}neg_to_pos"] = (mk & (d_gap < 0) & (g > 0)).sum(1).tolist()
                cols[f"{label}pos_to_neg"] = (mk & (d_gap > 0) & (g < 0)).sum(1).tolist()
        reg_lists[name] = cols
    return reg_lists


def _identity_records(step: int, rank: int, cb, counts: Tensor, reg_lists: dict[str, dict]) -> list[dict]:
    """One ``turn`` record per canonical turn: identity, rows, outcome, validity and the region columns."""
    m = cb.size
    task, roll, turn = cb.task.tolist(), cb.rollout.tolist(), cb.turn.tolist()
    k = counts.tolist()
    outcome = json_floats(cb.outcome.double().tolist())
    valid = cb.action_valid.bool().tolist()
    keys = list(cb.task_key) if len(cb.task_key) == m else [""] * m
    srcs = list(cb.data_source) if len(cb.data_source) == m else [None] * m
    truth = list(cb.truth) if len(cb.truth) == m else [None] * m
    recs: list[dict] = []
    for i in range(m):
        rec: dict[str, Any] = {
            "kind": "turn",
            "step": step,
            "rank": rank,
            "canonical_index": i,
            "task": task[i],
            "rollout": roll[i],
            "turn": turn[i],
            "task_key": keys[i],
            "rows": k[i],
            "data_source": srcs[i],
            "outcome": outcome[i],
            "action_valid": valid[i],
            "regions": {name: {c: v[i] for c, v in cols.items()} for name, cols in reg_lists.items()},
        }
        if truth[i] is not None:
            rec["truth"], nulled = json_value(truth[i])
            if nulled:
                rec["truth_nulled"] = nulled
        recs.append(rec)
    return recs


def _snapshot_scores(rect, resp: Tensor, d_gap: Tensor, c_gap: Tensor, r_gap: Tensor) -> dict[str, Tensor]:
    """Per-turn scores [M] of the snapshot's targeted choice (:data:`TARGETS`); ``resp``: [M, L] policy tokens."""
    matched = rect.matched.detach().cpu().bool()
    shift = ((c_gap - d_gap).abs() * resp.double()).sum(1) / resp.sum(1).clamp_min(1)
    return {
        "neg_to_pos": (resp & (d_gap < 0) & (r_gap > 0)).sum(1).double(),
        "pos_to_neg": (resp & (d_gap > 0) & (r_gap < 0)).sum(1).double(),
        "fallback": (~matched).double(),
        "max_cross_shift": torch.where(matched, shift, torch.zeros_like(shift)),
    }


def turn_records(
    step: int,
    rank: int,
    cb,
    counts: Tensor,
    old_logp: Tensor,
    advantage: Tensor,
    *,
    regions=None,
    rect=None,
    m1=None,
    credit=None,
) -> tuple[list[dict], dict[str, Tensor]]:
    """The ``turn`` records of one step (see the module docstring) and the per-turn scores of the
    snapshot's targeted choice. Inputs are read, never modified.

    cb: the canonical TurnBatch (M rows); counts: [M] rows per turn; old_logp, advantage: [M, L];
    regions: engine.regions.Regions or None; rect: alignopsd.rectification.Rectified or None; m1: the step's
    M1Result (H, eligible [M, M], diag [M, L], thinking validity [M]; any may be None) or None;
    credit: alignopsd.credit.Credit or None.
    """
    pm = cb.response_mask.detach().cpu().bool()
    old = old_logp.detach().cpu().double()
    adv = advantage.detach().cpu().double()
    diag = rect.diag if rect is not None else (m1.diag if m1 is not None else None)
    per_tok: dict[str, Tensor] = {"old_logp": old, "advantage": adv, "abs_advantage": adv.abs()}
    d_gap = c_gap = r_gap = None
    if diag is not None:
        d_gap = diag.detach().cpu().double() - old
        per_tok["diag_gap"] = d_gap
    if rect is not None:
        c_gap = rect.cross_score.detach().cpu().double() - old
        r_gap = rect.corrected.detach().cpu().double() - old
        per_tok["cross_gap"] = c_gap
        per_tok["corrected_gap"] = r_gap
    masks = _region_masks(pm, regions)
    recs = _identity_records(step, rank, cb, counts, _region_columns(masks, per_tok, d_gap, c_gap, r_gap))
    task, roll, turn = cb.task.tolist(), cb.rollout.tolist(), cb.turn.tolist()
    scores: dict[str, Tensor] = {}
    if rect is not None:
        _m1_fields(recs, rect, m1, task, roll, turn)
        scores = _snapshot_scores(rect, masks["response"], d_gap, c_gap, r_gap)
    if credit is not None:
        _m2_fields(recs, credit, task, roll, turn, adv, pm)
    return recs, scores


def _m1_fields(recs, rect, m1, task, roll, turn) -> None:
    m = len(recs)
    pairs = rect.pairs.detach().cpu().tolist()
    w = json_floats(rect.pair_weight.detach().cpu().tolist())
    h = json_floats(rect.pair_similarity.detach().cpu().tolist())
    by_target: list[list[dict]] = [[] for _ in range(m)]
    for (s, t), wj, hj in zip(pairs, w, h):
        by_target[t].append({"index": s, "task": task[s], "rollout": roll[s], "turn": turn[s], "H": hj, "omega": wj})
    matched = rect.matched.detach().cpu().tolist()
    rho = json_floats(rect.rho.detach().cpu().tolist())
    alpha = json_floats(rect.alpha.detach().cpu().tolist())
    extra: dict[str, list] = {}
    H, eligible = (m1.H, m1.eligible) if m1 is not None else (None, None)
    if H is not None:
        H_ST = H.detach().cpu().float()
        extra["H_diag"] = json_floats(torch.diagonal(H_ST).tolist())
        if eligible is not None:
            B = eligible.detach().cpu().bool()
            extra["eligible_sources"] = B.sum(0).tolist()
            extra["threshold_candidates"] = (B & (H_ST >= rect.gamma)).sum(0).tolist()
    valid = {} if m1 is None else {"student": m1.student_thinking_valid, "teacher": m1.teacher_thinking_valid}
    for who, v in valid.items():
        if v is not None:
            extra[f"{who}_thinking_valid"] = v.detach().cpu().bool().tolist()
    for i, rec in enumerate(recs):
        out = {"matched": matched[i], "rho": rho[i], "alpha": alpha[i]}
        out.update({name: vals[i] for name, vals in extra.items()})
        out["sources"] = by_target[i]
        rec["m1"] = out


def _m2_fields(recs, credit, task, roll, turn, adv_ML: Tensor, pm: Tensor) -> None:
    m = len(recs)
    cols: dict[str, list] = {}
    for name, v in vars(credit).items():  # the Credit dataclass's fields, in declaration order
        if not isinstance(v, Tensor) or tuple(v.shape) != (m,):
            continue
        v = v.detach().cpu()
        if name == "boundary_kind":
            cols[name] = [BOUNDARY_KINDS[int(x)] if 0 <= int(x) < len(BOUNDARY_KINDS) else str(int(x)) for x in v]
        elif not v.is_floating_point():  # bool flags and integer ids
            cols["span" if name == "segment_index" else name] = v.tolist()
        else:
            cols[name] = json_floats(v.tolist())
    A = credit.advantage.detach().cpu().double()
    cols["advantage_neg_to_pos"] = (pm & (A[:, None] < 0) & (adv_ML > 0)).sum(1).tolist()
    cols["advantage_pos_to_neg"] = (pm & (A[:, None] > 0) & (adv_ML < 0)).sum(1).tolist()
    seg = cols.get("span", [-1] * m)
    spans = _spans(task, roll, turn, seg)
    kinds = cols.get("boundary_kind", ["none"] * m)
    first: dict[tuple, int] = {}
    for a, b, t in zip(task, roll, turn):
        first[(a, b)] = min(t, first.get((a, b), t))
    opener: dict[tuple, str] = {}
    for i in range(m):
        if seg[i] >= 0 and turn[i] == spans[(task[i], roll[i], seg[i])][0]:
            opener[(task[i], roll[i], seg[i])] = "start" if turn[i] == first[(task[i], roll[i])] else kinds[i]
    for i, rec in enumerate(recs):
        m2 = {name: vals[i] for name, vals in cols.items()}
        if seg[i] >= 0:
            key = (task[i], roll[i], seg[i])
            m2["span_start"], m2["span_end"] = spans[key]
            m2["span_boundary"] = opener.get(key)
        rec["m2"] = m2


def select_snapshot(step: int, cb, scores: dict[str, Tensor], n: int = SNAPSHOT_TURNS) -> list[tuple[int, str]]:
    """Up to ``n`` (canonical index, reason) of the token snapshot: n//2 by hash, then the targets."""
    task, roll, turn = cb.task.tolist(), cb.rollout.tolist(), cb.turn.tolist()
    m = len(task)
    digest = [identity_hash(step, task[i], roll[i], turn[i]) for i in range(m)]
    by_hash = sorted(range(m), key=lambda i: (digest[i], i))
    chosen: list[tuple[int, str]] = []
    taken: set[int] = set()

    def take(i: int, reason: str) -> None:
        chosen.append((i, reason))
        taken.add(i)

    for i in by_hash[: min(n // 2, m)]:
        take(i, "hash")
    for target in TARGETS:
        if len(chosen) >= n:
            break
        s = scores.get(target)
        if s is None:
            continue
        vals = s.tolist()
        cands = [i for i in by_hash if i not in taken and vals[i] > 0]
        if cands:
            best = max(vals[i] for i in cands)
            take(next(i for i in cands if vals[i] == best), target)  # by_hash order breaks ties
    for i in by_hash:
        if len(chosen) >= min(n, m):
            break
        if i not in taken:
            take(i, "hash_fill")
    return chosen


def snapshot_records(
    step: int,
    rank: int,
    cb,
    chosen: list[tuple[int, str]],
    old_logp: Tensor,
    advantage: Tensor,
    tokenizer,
    *,
    regions=None,
    rect=None,
    m1=None,
) -> list[dict]:
    """Token records of the ``chosen`` turns (see the module docstring); ``m1.cross``: [P, L] ℓ^{s→t} in
    ``rect.pairs`` order, ``m1.diag``: [M, L] ℓ^diag (used when there is no ``rect``)."""
    pm = cb.response_mask.detach().cpu().bool()
    ids_ML = cb.response_ids.detach().cpu()
    old = old_logp.detach().cpu().float()
    adv = advantage.detach().cpu().float()
    diag = rect.diag if rect is not None else (m1.diag if m1 is not None else None)
    diag = diag.detach().cpu().float() if diag is not None else None
    cross = m1.cross if m1 is not None else None
    pair_rows: dict[int, list[int]] = {}
    pairs: list[list[int]] = []
    if rect is not None:
        pairs = rect.pairs.detach().cpu().tolist()
        for j, (_, t) in enumerate(pairs):
            pair_rows.setdefault(t, []).append(j)
    cross_PL = cross.detach().cpu().float() if (cross is not None and rect is not None) else None
    th = regions.thinking.detach().cpu().bool() if regions is not None else None
    ac = regions.action.detach().cpu().bool() if regions is not None else None
    out = []
    for i, reason in chosen:
        pos = torch.nonzero(pm[i]).flatten().tolist()
        ids = ids_ML[i, pos].tolist()
        rows = pair_rows.get(i, [])
        cols: dict[str, list] = {"student": json_floats(old[i, pos].tolist())}
        if diag is not None:
            cols["teacher_diag"] = json_floats(diag[i, pos].tolist())
        if rect is not None:
            cols["teacher_cross"] = json_floats(rect.cross_score[i, pos].detach().cpu().tolist())
            corrected = rect.corrected[i, pos].detach().cpu().float()
            cols["teacher_rectified"] = json_floats(corrected.tolist())
            cols["evidence"] = json_floats((corrected - old[i, pos]).tolist())
        cols["advantage"] = json_floats(adv[i, pos].tolist())
        by_src = [json_floats(cross_PL[j, pos].tolist()) for j in rows] if cross_PL is not None else []
        tokens = []
        for n, (p, tid) in enumerate(zip(pos, ids)):
            region = "other"
            if th is not None and bool(th[i, p]):
                region = "thinking"
            elif ac is not None and bool(ac[i, p]):
                region = "action"
            elif th is None:
                region = None
            tok: dict[str, Any] = {"pos": p, "id": tid, "piece": _piece(tokenizer, tid), "region": region}
            tok.update({c: v[n] for c, v in cols.items()})
            if cross_PL is not None:
                tok["teacher_sources"] = [v[n] for v in by_src]
            tokens.append(tok)
        out.append(
            {
                "kind": "snapshot",
                "step": step,
                "rank": rank,
                "canonical_index": i,
                "task": int(cb.task[i]),
                "rollout": int(cb.rollout[i]),
                "turn": int(cb.turn[i]),
                "reason": reason,
                "sources": [pairs[j][0] for j in rows],
                "tokens": tokens,
            }
        )
    return out


def _piece(tokenizer, tid: int) -> str | None:
    if tokenizer is None:
        return None
    try:
        return tokenizer.decode([tid], skip_special_tokens=False)
    except Exception as exc:  # noqa: BLE001 - a text piece is optional (outside strict mode)
        reraise_if_strict(exc)
        return None
