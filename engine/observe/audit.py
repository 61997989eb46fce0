"""Audit records of a run (ALGORITHM.md §4.3 "Audit"): local JSONL per step, never W&B, never fatal, except that
a full disk or a file size limit ends the run as it does for every write (engine/infra/writes.py).

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
* ``turn``: one per canonical turn, every step, and ``snapshot``: token records of up to 8 turns, on the first
  step, every 10th step and the last step; their fields, and how the snapshot's turns are chosen, are described
  in engine/observe/audit_records.py, which builds them. A turn record carries ``truth`` where the environment
  reported one for the state the turn was played in (its info's ``truth`` dict, e.g. which functional decision
  the turn is and whether it decided the outcome): the ground truth a benchmark scores the mechanisms against.
  A value of it that JSON cannot hold (NaN, infinity, a set, an object) is written as null, the rest of the record
  and of the step as they are, and counted in ``audit/truth_nulled_count``.

Budget: at most ``trainer.logging.audit_max_bytes`` (1 GiB) over the run, split evenly over the writing ranks
(no collective). A step whose file would cross the cap is not written; from then on nothing is, a
warning is logged once and ``audit/capped`` is 1. The audit draws no random numbers (selection is by
hash), reads the step's tensors without changing them, and catches every error: a failure is logged,
counted in ``audit/error_count`` and the run goes on.

The off-turn match weight of §4.3, Σ_t Σ_j ω_j · 1[turn(s_j) ≠ turn(t)] / #matched targets, is logged per step
(``m1/off_turn_match_weight``); the audit tests recompute it from the turn records.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path

from alignopsd.engine.infra.writes import WriteFailure, writing
from alignopsd.engine.observe.audit_records import (
    BOUNDARY_KINDS,
    SNAPSHOT_TURNS,
    TARGETS,
    identity_hash,
    json_float,
    select_snapshot,
    snapshot_records,
    turn_records,
)
from alignopsd.engine.observe.strict import reraise_if_strict
from torch import Tensor

from alignopsd.reduction import extreme_max, slowest, summed

__all__ = [
    "AUDIT_FILE_RE",
    "BOUNDARY_KINDS",
    "SNAPSHOT_EVERY",
    "SNAPSHOT_TURNS",
    "TARGETS",
    "Auditor",
    "audit_file",
    "identity_hash",
    "is_snapshot_step",
    "select_snapshot",
    "snapshot_records",
    "turn_records",
]

log = logging.getLogger("alignopsd.audit")

SNAPSHOT_EVERY = 10
AUDIT_FILE_RE = re.compile(r"^step_(\d+)\.rank(\d+)\.jsonl$")  # the name of :func:`audit_file`: (step, rank)


def audit_file(audit_dir: str | Path, step: int, rank: int) -> Path:
    """The audit file of ``step`` (1-based) and data-parallel ``rank``."""
    return Path(audit_dir) / f"step_{step:06d}.rank{rank}.jsonl"


def is_snapshot_step(step: int, total_steps: int, every: int = SNAPSHOT_EVERY) -> bool:
    """Token snapshots on the first step, every ``every``-th step and the last step (1-based steps)."""
    return step == 1 or step % every == 0 or step == total_steps


# ---------------------------------------------------------------------------------------------------------------------
# the writer


class Auditor:
    """Writes one audit file per step for one data-parallel rank (see the module docstring). ``header``: the run's
    step-level constants every ``step`` header carries (the trainer's ``audit_header``)."""

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

    def metrics(
        self, records: int = 0, snapshot_turns: int = 0, seconds: float = 0.0, truth_nulled: int = 0
    ) -> dict[str, float]:
        return {
            "audit/capped": extreme_max(self.capped, 1),  # each rank writes its own files: any rank capped
            "audit/byte_count": summed(self.bytes),
            "audit/error_count": summed(self.errors),
            "audit/record_count": summed(records),
            "audit/snapshot_turn_count": summed(snapshot_turns),
            "audit/truth_nulled_count": summed(truth_nulled),  # values of environments' truth written as null
            "audit/seconds": slowest(seconds),
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
            rect, credit = (est_out.rectified, est_out.credit) if est_out is not None else (None, None)
            args = (step, self.rank, cb)
            kw = {"regions": regions, "rect": rect, "m1": m1}
            recs, scores = turn_records(*args, counts, old_logp, advantage, credit=credit, **kw)
            snap = is_snapshot_step(step, self.total_steps)
            snaps: list[dict] = []
            if snap:
                chosen = select_snapshot(step, cb, scores)
                snaps = snapshot_records(*args, chosen, old_logp, advantage, self.tokenizer, **kw)
            tau = credit.threshold if credit is not None else None
            info = {"rows": int(counts.sum()), "turns": cb.size, "snapshot": snap, "regions_found": regions is not None}
            head = self._head(step, skipped=False, **info, m2_threshold=None if tau is None else json_float(tau))
            n = self.write(step, [head, *recs, *snaps])
            nulled = sum(r.get("truth_nulled", 0) for r in recs) if n else 0
            return self.metrics(n, len(snaps) if n else 0, time.perf_counter() - t0, nulled)
        except WriteFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - the audit never stops a run
            self._error(f"cannot build the records of step {step}", exc)
            return self.metrics(0, 0, time.perf_counter() - t0)
