"""``<output_dir>/attempts.jsonl``: the memory of a run's attempts, one JSON object per line (what the restart rule of
engine/run/restarts.py reads):

- ``{"event": "start", "attempt", "restart", "slurm_restart", "launch", "by_hand", "config", "code", "time"}``: rank
  0, before anything heavy: the attempt's number, ``TORCHELASTIC_RESTART_COUNT`` and ``SLURM_RESTART_COUNT`` (0 for
  a new launch), the launch it belongs to, whether a person launched it, and the digests of its config and code;
- ``{"event": "failure", "kind", "rank", "step", "cause", "time"}``: any rank whose code raised, after its attempt's
  start: the step it was running and the exception's type and first line, numbers masked (addresses, ports and
  sizes vary between attempts; the cause does not). ``kind`` is ``own``, or ``peer`` where the rank only saw another
  rank die: a collective that failed (``torch.distributed.DistError``, or gloo's ``Connection closed by peer``,
  ``Connection reset by peer``, ``Timed out waiting``), which is the dead rank's failure, not this one's;
- ``{"event": "stop", "launch", "time"}``: rank 0, when the restart rule stopped the run.

Each record is one ``write`` of its whole line, newline included, on a descriptor opened with ``O_APPEND``, so the
lines of ranks that append at the same moment never interleave. The reader (:func:`read_attempt_log`) trusts no
line: a line that is not a whole record (a write cut before its newline, by a kill or a full disk, followed by the
next record on the same line), or whose fields have the wrong type (``"step": null``), is skipped and reported,
and the whole record after a torn write on the same line is kept."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ATTEMPTS_FILE = "attempts.jsonl"


def cause_of(exc: BaseException) -> str:
    """``Type: first line`` of ``exc`` with every number masked, so the same failure reads the same in every attempt."""
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {re.sub(r'[0-9]+', '#', first)}"


# gloo's words for a peer that died or stopped answering (RuntimeError: "[.../gloo/transport/tcp/pair.cc:553]
# Connection closed by peer [127.0.0.1]:18087 ...", "[.../unbound_buffer.cc:78] Timed out waiting 5000ms for recv")
_GLOO_PEER = re.compile(r"gloo.*(Connection closed by peer|Connection reset by peer|Timed out waiting)", re.S)


def peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from or while handling) is a collective that failed because
    another rank died: not this rank's own failure."""
    import torch.distributed as dist

    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, dist.DistError) or (isinstance(cur, RuntimeError) and _GLOO_PEER.search(str(cur))):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _append(out_dir: Path, record: dict) -> bool:
    """Append one line; False when the folder cannot take it (a full disk must not hide the failure it records), or
    when it does not exist outside torchrun (a person's run that fails before it starts leaves no folder behind)."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    try:
        if not out_dir.is_dir() and "TORCHELASTIC_RUN_ID" not in os.environ:
            return False
        out_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(out_dir / ATTEMPTS_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            return os.write(fd, line) == len(line)  # one write of one line: several ranks' lines do not interleave
        finally:
            os.close(fd)
    except OSError:
        return False


def _count(value: object, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


# event -> field -> the check its value must pass (a record's other keys are not read)
def _text(value: object) -> bool:
    return isinstance(value, str)


# event -> field -> (the check its value must pass, whether the record must have it); other keys are not read. A
# record written before a field existed has none: a failure without ``kind`` is its rank's own, a start without
# ``by_hand``, ``config`` or ``code`` belongs to no launch the rule compares with the present one
_FIELDS: dict[str, dict[str, tuple[Callable[[object], bool], bool]]] = {
    "start": {
        "attempt": (lambda v: _count(v, 1), True),
        "restart": (lambda v: _count(v, 0), True),
        "time": (_number, True),
        "slurm_restart": (lambda v: _count(v, 0), False),
        "launch": (_text, False),
        "by_hand": (lambda v: isinstance(v, bool), False),
        "config": (_text, False),
        "code": (_text, False),
    },
    "failure": {
        "rank": (lambda v: _count(v, 0), True),
        "step": (lambda v: _count(v, 0), True),
        "cause": (_text, True),
        "time": (_number, True),
        "kind": (lambda v: v in ("own", "peer"), False),
    },
    "stop": {"time": (_number, True), "launch": (_text, True)},
}


def _problem(rec: object) -> str | None:
    """Why ``rec`` is not a record this module reads (None: it is one)."""
    if not isinstance(rec, dict):
        return f"a JSON {type(rec).__name__}, not an object"
    fields = _FIELDS.get(rec.get("event"))  # type: ignore[arg-type]
    if fields is None:
        return f"unknown event {json.dumps(rec.get('event'))[:40]}"
    for key, (ok, required) in fields.items():
        if key not in rec:
            if required:
                return f"{rec['event']} without {key!r}"
        elif not ok(rec[key]):
            return f"{key!r} of a {rec['event']} is {json.dumps(rec[key])[:40]}"
    return None


def _parse(line: str) -> tuple[dict | None, str | None]:
    """(the record of ``line`` or None, what was wrong with it or None). A write cut before its newline leaves its
    start in front of the next record on the same line: the whole record at the end of the line is kept."""
    try:
        rec = json.loads(line)
    except ValueError as exc:
        why = f"not JSON ({exc.msg})"
    else:
        why = _problem(rec)
        if why is None:
            return rec, None
    for i in (m.start() for m in re.finditer(r"\{", line) if m.start() > 0):
        try:
            tail = json.loads(line[i:])
        except ValueError:
            continue
        if _problem(tail) is None:
            return tail, f"a torn record ({i} characters) before a whole one, which is kept"
    return None, why


@dataclass(frozen=True)
class AttemptLog:
    """The readable records of ``attempts.jsonl`` in file order, and a line per damaged line skipped."""

    records: list[dict]
    damage: list[str]

    def said(self, where: Path) -> str | None:
        """One line about the damage (None without any)."""
        if not self.damage:
            return None
        shown = "; ".join(self.damage[:3]) + ("; ..." if len(self.damage) > 3 else "")
        return f"{where}: {len(self.damage)} damaged line(s) skipped ({shown})"


def read_attempt_log(out_dir: Path) -> AttemptLog:
    """Every record of ``attempts.jsonl`` that reads as one (no file: none); each damaged line skipped and named."""
    try:
        text = (out_dir / ATTEMPTS_FILE).read_text(errors="replace")
    except OSError:
        return AttemptLog([], [])
    records, damage = [], []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        rec, why = _parse(line)
        if rec is not None:
            records.append(rec)
        if why is not None:
            damage.append(f"line {n}: {why}")
    return AttemptLog(records, damage)


def read_attempts(out_dir: Path) -> list[dict]:
    """The records of ``attempts.jsonl`` (:func:`read_attempt_log`, damaged lines skipped)."""
    return read_attempt_log(out_dir).records


def record_start(out_dir: Path, context: dict | None = None, *, clock: Callable[[], float] = time.time) -> int:
    """Rank 0, before anything heavy: record the attempt now starting, with ``context`` (its launch: see the module
    docstring), and return its number (one more than the last recorded). Failures recorded after it are this
    attempt's (the previous attempt's processes are gone before a new one starts)."""
    attempt = 1 + sum(1 for r in read_attempts(out_dir) if r["event"] == "start")
    _append(out_dir, {"restart": 0, **(context or {}), "event": "start", "attempt": attempt, "time": clock()})
    return attempt


def record_failure(
    out_dir: Path, rank: int, step: int, exc: BaseException, *, clock: Callable[[], float] = time.time
) -> bool:
    """Record this rank's failure at ``step``: its own, or a peer's seen through a failed collective (kind
    ``peer``); False when it could not be written."""
    kind = "peer" if peer_failure(exc) else "own"
    record = {"event": "failure", "kind": kind, "rank": rank, "step": step, "cause": cause_of(exc), "time": clock()}
    return _append(out_dir, record)


def record_stop(out_dir: Path, launch: str, *, clock: Callable[[], float] = time.time) -> bool:
    """Rank 0: the restart rule stopped the run in ``launch`` (a later launch of the run is a person's)."""
    return _append(out_dir, {"event": "stop", "launch": launch, "time": clock()})
