"""Reading a run's audit records (engine/observe/audit.py writes them): per step and rank, and the off-turn match
weight of ALGORITHM.md §4.3 recomputed from them."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

AUDIT_FILE_RE = re.compile(r"^step_(\d+)\.rank(\d+)\.jsonl$")


def off_turn_match_weight_from_records(records: Iterable[dict]) -> float:
    """Σ_t Σ_j ω_j · 1[turn(s_j) ≠ turn(t)] / #matched targets over the ``turn`` records given (ALGORITHM.md §4.3).

    Pass the records of one step (any number of ranks): a source's turn is looked up by its canonical
    index among the records of the same (step, rank). A target is matched when it has a source. 0 when
    nothing is matched; records without ``m1`` are ignored.
    """
    turns = [r for r in records if r.get("kind") == "turn" and r.get("m1") is not None]
    turn_of = {(r["step"], r["rank"], r["canonical_index"]): r["turn"] for r in turns}
    total, matched = 0.0, 0
    for r in turns:
        srcs = r["m1"].get("sources") or []
        if not srcs:
            continue
        matched += 1
        for s in srcs:
            st = turn_of.get((r["step"], r["rank"], s["index"]), s.get("turn"))
            if st != r["turn"]:
                total += float(s["omega"])
    return total / matched if matched else 0.0


def read_audit(audit_dir: str | Path, step: int | None = None, kind: str | None = None) -> list[dict]:
    """Records of the audit files (one step or all, all ranks), in step then rank then file order."""
    d = Path(audit_dir)
    files = []
    for p in d.glob("step_*.rank*.jsonl") if d.is_dir() else []:
        mt = AUDIT_FILE_RE.match(p.name)
        if mt and (step is None or int(mt.group(1)) == step):
            files.append((int(mt.group(1)), int(mt.group(2)), p))
    out = []
    for _, _, p in sorted(files):
        for line in p.read_text().splitlines():
            rec = json.loads(line)
            if kind is None or rec.get("kind") == kind:
                out.append(rec)
    return out
