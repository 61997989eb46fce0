"""Audit records of a run (ALGORITHM.md §4.3 "Audit"): local JSONL per step, never W&B, never fatal, except that
a full disk or a file size limit ends the run as it does for every write (engine/run/writes.py).

Legend: M = canonical turns of this rank's batch, L = response length, P = kept (source, target) pairs.

Files. ``<output_dir>/audit/step_<step:06d>.rank<r>.jsonl``, one file per training step (1-based, the
``step`` of ``metrics.jsonl``) and data-parallel rank ``r``. Every data-parallel rank writes the turns of
its own batch (its tasks differ from the other ranks'); under tensor parallelism only the first rank of
each tensor-parallel group writes, since the group's ranks hold the same batch. A file is written
whole to a temporary name and renamed, so a killed run leaves no half-written step. Before the writers
start, the trainer moves the files of an earlier run, or of steps after the checkpoint it resumes from (of
every rank), aside (engine/run/history.py); the files a writer finds are its rank's history and count
towards its budget.

Records (one JSON object per line, ``kind`` first):

* ``step``: one header per file: step, rank, world size, estimator, turns, rows, whether the update was
  skipped for lack of signal (then no other record follows), whether this step has a token snapshot,
  and the step-level constants (γ, α_max, K, the M2 threshold τ or null).
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

Floats are written with 7 significant digits (float32 precision); non-finite values as null.

Budget: at most ``trainer.audit_max_bytes`` (1 GiB) over the run, split evenly over the writing ranks
(no collective). A step whose file would cross the cap is not written; from then on nothing is, a
warning is logged once and ``audit/capped`` is 1. The audit draws no random numbers (selection is by
hash), reads the step's tensors without changing them, and catches every error: a failure is logged,
counted in ``audit/error_count`` and the run goes on.

The off-turn match weight of §4.3, Σ_t Σ_j ω_j · 1[turn(s_j) ≠ turn(t)] / #matched targets, is computed
from the turn records by :func:`off_turn_match_weight_from_records`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Iterable
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from alignopsd.engine.run.audit_read import AUDIT_FILE_RE
from alignopsd.engine.run.strict import reraise_if_strict
from alignopsd.engine.run.writes import WriteFailure, writing
from torch import Tensor

log = logging.getLogger("alignopsd.audit")

SNAPSHOT_EVERY = 10
SNAPSHOT_TURNS = 8
TARGETS = ("neg_to_pos", "pos_to_neg", "fallback", "max_cross_shift")
BOUNDARY_KINDS = ("none", "semantic", "guided", "forced", "random")  # alignopsd.segmentation KIND_* values


def audit_file(audit_dir: str | Path, step: int, rank: int) -> Path:
    """The audit file of ``step`` (1-based) and data-parallel ``rank``."""
    return Path(audit_dir) / f"step_{step:06d}.rank{rank}.jsonl"


def is_snapshot_step(step: int, total_steps: int, every: int = SNAPSHOT_EVERY) -> bool:
    """Token snapshots on the first step, every ``every``-th step and the last step (1-based steps)."""
    return step == 1 or step % every == 0 or step == total_steps


def identity_hash(step: int, task: int, rollout: int, turn: int) -> str:
    """SHA-256 (hex) of ``f"{step}:{task}:{rollout}:{turn}"``: the audit's only source of choice."""
    return hashlib.sha256(f"{step}:{task}:{rollout}:{turn}".encode()).hexdigest()


def _num(x: float) -> float | None:
    x = float(x)
    if not math.isfinite(x):
        return None
    return float(f"{x:.7g}")


def _nums(xs: Iterable[float]) -> list[float | None]:
    return [_num(x) for x in xs]


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
    regions: engine.regions.Regions or None; rect: alignopsd.rectify.Rectified or None; m1: the step's
    M1Result (H, eligible [M, M], diag [M, L], thinking validity [M]; any may be None) or None;
    credit: alignopsd.credit.Credit or None.
    """
    m = cb.size
    pm = cb.response_mask.detach().cpu().bool()
    old = old_logp.detach().cpu().double()
    adv = advantage.detach().cpu().double()
    diag = rect.diag if rect is not None else getattr(m1, "diag", None)
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
    reg_lists: dict[str, dict[str, list]] = {}
    for name, mk in masks.items():
        mf = mk.double()
        cols: dict[str, list] = {"tokens": mk.sum(1).tolist()}
        for q, x in per_tok.items():
            cols[f"sum_{q}"] = _nums((x * mf).sum(1).tolist())
        if r_gap is not None:
            for label, g in (("", r_gap), ("cross_", c_gap)):
                cols[f"{label}neg_to_pos"] = (mk & (d_gap < 0) & (g > 0)).sum(1).tolist()
                cols[f"{label}pos_to_neg"] = (mk & (d_gap > 0) & (g < 0)).sum(1).tolist()
        reg_lists[name] = cols

    task, roll, turn = cb.task.tolist(), cb.rollout.tolist(), cb.turn.tolist()
    k = counts.tolist()
    outcome = _nums(cb.outcome.double().tolist())
    valid = cb.action_valid.bool().tolist()
    keys = list(cb.task_key) if len(cb.task_key) == m else [""] * m
    srcs = list(cb.data_source) if len(cb.data_source) == m else [None] * m
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
        recs.append(rec)

    scores: dict[str, Tensor] = {}
    if rect is not None:
        _m1_fields(recs, rect, m1, task, roll, turn)
        resp = masks["response"]
        scores["neg_to_pos"] = (resp & (d_gap < 0) & (r_gap > 0)).sum(1).double()
        scores["pos_to_neg"] = (resp & (d_gap > 0) & (r_gap < 0)).sum(1).double()
        matched = rect.matched.detach().cpu().bool()
        scores["fallback"] = (~matched).double()
        shift = ((c_gap - d_gap).abs() * resp.double()).sum(1) / resp.sum(1).clamp_min(1)
        scores["max_cross_shift"] = torch.where(matched, shift, torch.zeros_like(shift))
    if credit is not None:
        _m2_fields(recs, credit, task, roll, turn, adv, pm)
    return recs, scores


def _m1_fields(recs, rect, m1, task, roll, turn) -> None:
    m = len(recs)
    pairs = rect.pairs.detach().cpu().tolist()
    w = _nums(rect.pair_weight.detach().cpu().tolist())
    h = _nums(rect.pair_similarity.detach().cpu().tolist())
    by_target: list[list[dict]] = [[] for _ in range(m)]
    for (s, t), wj, hj in zip(pairs, w, h):
        by_target[t].append({"index": s, "task": task[s], "rollout": roll[s], "turn": turn[s], "H": hj, "omega": wj})
    matched = rect.matched.detach().cpu().tolist()
    rho = _nums(rect.rho.detach().cpu().tolist())
    alpha = _nums(rect.alpha.detach().cpu().tolist())
    extra: dict[str, list] = {}
    H, eligible = getattr(m1, "H", None), getattr(m1, "eligible", None)
    if H is not None:
        H_ST = H.detach().cpu().float()
        extra["H_diag"] = _nums(torch.diagonal(H_ST).tolist())
        if eligible is not None:
            B = eligible.detach().cpu().bool()
            extra["eligible_sources"] = B.sum(0).tolist()
            extra["threshold_candidates"] = (B & (H_ST >= rect.gamma)).sum(0).tolist()
    for name in ("student_thinking_valid", "teacher_thinking_valid"):
        v = getattr(m1, name, None)
        if v is not None:
            extra[name] = v.detach().cpu().bool().tolist()
    for i, rec in enumerate(recs):
        out = {"matched": matched[i], "rho": rho[i], "alpha": alpha[i]}
        out.update({name: vals[i] for name, vals in extra.items()})
        out["sources"] = by_target[i]
        rec["m1"] = out


def _m2_fields(recs, credit, task, roll, turn, adv_ML: Tensor, pm: Tensor) -> None:
    m = len(recs)
    cols: dict[str, list] = {}
    for f in fields(credit):
        v = getattr(credit, f.name)
        if not isinstance(v, Tensor) or tuple(v.shape) != (m,):
            continue
        v = v.detach().cpu()
        if f.name == "boundary_kind":
            cols[f.name] = [BOUNDARY_KINDS[int(x)] if 0 <= int(x) < len(BOUNDARY_KINDS) else str(int(x)) for x in v]
        elif not v.is_floating_point():  # bool flags and integer ids
            cols["span" if f.name == "segment_index" else f.name] = v.tolist()
        else:
            cols[f.name] = _nums(v.tolist())
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
    diag = rect.diag if rect is not None else getattr(m1, "diag", None)
    diag = diag.detach().cpu().float() if diag is not None else None
    cross = getattr(m1, "cross", None)
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
        cols: dict[str, list] = {"student": _nums(old[i, pos].tolist())}
        if diag is not None:
            cols["teacher_diag"] = _nums(diag[i, pos].tolist())
        if rect is not None:
            cols["teacher_cross"] = _nums(rect.cross_score[i, pos].detach().cpu().tolist())
            corrected = rect.corrected[i, pos].detach().cpu().float()
            cols["teacher_rectified"] = _nums(corrected.tolist())
            cols["evidence"] = _nums((corrected - old[i, pos]).tolist())
        cols["advantage"] = _nums(adv[i, pos].tolist())
        by_src = [_nums(cross_PL[j, pos].tolist()) for j in rows] if cross_PL is not None else []
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


# ---------------------------------------------------------------------------------------------------------------------
# the writer


class Auditor:
    """Writes one audit file per step for one data-parallel rank (see the module docstring)."""

    def __init__(
        self,
        out_dir: str | Path,
        *,
        rank: int = 0,
        world_size: int = 1,
        total_steps: int,
        max_bytes: int = 1 << 30,
        tokenizer=None,
        header: dict | None = None,
    ) -> None:
        self.dir = Path(out_dir) / "audit"
        self.rank = int(rank)
        self.world_size = max(1, int(world_size))
        self.total_steps = int(total_steps)
        self.max_bytes = int(max_bytes) // self.world_size  # this rank's share of the run's cap
        self.tokenizer = tokenizer
        self.header = dict(header or {})
        self.capped = False
        self.errors = 0
        self.bytes = 0  # bytes of this rank's audit files on disk
        try:
            self.bytes = sum(p.stat().st_size for _, p in self._own_files())
            if self.bytes > self.max_bytes:
                self._cap(0)
        except Exception as exc:  # noqa: BLE001 - the audit never stops a run
            self._error("cannot read the audit directory", exc)

    def _own_files(self) -> list[tuple[int, Path]]:
        if not self.dir.is_dir():
            return []
        out = []
        for p in self.dir.iterdir():
            mt = AUDIT_FILE_RE.match(p.name)
            if mt and int(mt.group(2)) == self.rank:
                out.append((int(mt.group(1)), p))
        return sorted(out)

    def _error(self, what: str, exc: BaseException) -> None:
        reraise_if_strict(exc)
        self.errors += 1
        log.warning(
            "audit: %s (%s: %s); training goes on (%d audit errors so far)", what, type(exc).__name__, exc, self.errors
        )

    def _cap(self, step: int) -> None:
        if not self.capped:
            self.capped = True
            log.warning(
                "audit: size cap of %d bytes reached at step %d; no further audit records are written",
                self.max_bytes,
                step,
            )

    def metrics(self, records: int = 0, snapshot_turns: int = 0, seconds: float = 0.0) -> dict[str, float]:
        return {
            "audit/capped": float(self.capped),
            "audit/byte_count": float(self.bytes),
            "audit/error_count": float(self.errors),
            "audit/record_count": float(records),
            "audit/snapshot_turn_count": float(snapshot_turns),
            "audit/seconds": float(seconds),
        }

    def write(self, step: int, records: list[dict]) -> int:
        """Write ``records`` as the file of ``step`` (whole or not at all); returns the records written."""
        if self.capped:
            return 0
        try:
            data = "".join(
                json.dumps(r, separators=(",", ":"), allow_nan=False, ensure_ascii=False) + "\n" for r in records
            ).encode()
            path = audit_file(self.dir, step, self.rank)
            old = path.stat().st_size if path.exists() else 0
            if self.bytes - old + len(data) > self.max_bytes:
                self._cap(step)
                return 0
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            try:
                with writing(path), open(tmp, "wb") as f:
                    f.write(data)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            os.replace(tmp, path)
            self.bytes += len(data) - old
            return len(records)
        except WriteFailure:  # a full disk or a size limit stops the run like any other write of it
            raise
        except Exception as exc:  # noqa: BLE001 - otherwise the audit never stops a run
            self._error(f"cannot write the records of step {step}", exc)
            return 0

    def _head(self, step: int, **extra) -> dict:
        return {"kind": "step", "step": step, "rank": self.rank, "world_size": self.world_size, **self.header, **extra}

    def record_skipped(self, step: int, rows: int) -> dict[str, float]:
        """A step skipped for lack of signal: its header only."""
        t0 = time.perf_counter()
        n = self.write(step, [self._head(step, skipped=True, rows=rows, turns=0, snapshot=False)])
        return self.metrics(n, 0, time.perf_counter() - t0)

    def record(
        self, step: int, cb, counts: Tensor, old_logp: Tensor, advantage: Tensor, est_out, m1, regions=None
    ) -> dict[str, float]:
        """Build and write the records of one step (1-based); returns the ``audit/*`` metrics. Never raises.

        cb: canonical TurnBatch; counts: [M] rows per turn; old_logp, advantage: [M, L]; est_out: the
        estimator's output (rectified, credit); m1: the step's M1Result or None; regions: Regions or None.
        """
        if self.capped:
            return self.metrics()
        t0 = time.perf_counter()
        try:
            rect, credit = getattr(est_out, "rectified", None), getattr(est_out, "credit", None)
            args = (step, self.rank, cb)
            kw = {"regions": regions, "rect": rect, "m1": m1}
            recs, scores = turn_records(*args, counts, old_logp, advantage, credit=credit, **kw)
            snap = is_snapshot_step(step, self.total_steps)
            snaps: list[dict] = []
            if snap:
                chosen = select_snapshot(step, cb, scores)
                snaps = snapshot_records(*args, chosen, old_logp, advantage, self.tokenizer, **kw)
            tau = getattr(credit, "threshold", None)
            info = {"rows": int(counts.sum()), "turns": cb.size, "snapshot": snap, "regions_found": regions is not None}
            head = self._head(step, skipped=False, **info, m2_threshold=None if tau is None else _num(tau))
            n = self.write(step, [head, *recs, *snaps])
            return self.metrics(n, len(snaps) if n else 0, time.perf_counter() - t0)
        except WriteFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - the audit never stops a run
            self._error(f"cannot build the records of step {step}", exc)
            return self.metrics(0, 0, time.perf_counter() - t0)


def header_of(cfg) -> dict:
    """Step-level constants of the run for the ``step`` header."""
    a = cfg.algorithm
    return {"estimator": str(a.estimator), "gamma": float(a.rectify.gamma), "top_k": int(a.rectify.top_k),
            "alpha_max": float(a.effective_alpha_max), "ablation": str(a.ablation)}  # fmt: skip
