"""A run restarted without a person: torchrun's elastic agent (``--max-restarts``) and Slurm requeues.

``torchrun --max-restarts=N ... -m alignopsd.engine train --config C --resume auto`` restarts the whole worker group
when any worker dies, and every restarted attempt resumes from the newest verified checkpoint (``--resume auto``;
nothing verified and nothing ever saved: a fresh start, said in the log). A requeued Slurm job is the same command
run again. What this module adds is the memory of the attempts, in ``<output_dir>/attempts.jsonl`` (one JSON line
per event, appended with one write):

- ``{"event": "start", "attempt", "restart"}``: rank 0, before anything heavy: the attempt's number and
  ``TORCHELASTIC_RESTART_COUNT`` (0 for a new launch);
- ``{"event": "failure", "rank", "step", "cause"}``: any rank whose own code raised, after its attempt's start: the
  step it was running and the exception's type and first line, numbers masked (addresses, ports and sizes vary
  between attempts; the cause does not). A rank that only saw a peer die (a collective failed:
  ``torch.distributed.DistError``) records nothing: that is the peer's failure, not its own.

:func:`repeated_failure` is read at the start of every restarted attempt (:func:`restarted`): when the last two
attempts both failed at the same step with the same cause, a third would too (a deterministic bug, a config the run
cannot use, a corrupt input), so the attempt stops with one message (exit status :data:`EXIT_REPEATED`) and, under
torchrun, asks its agent to stop restarting instead of spending every restart on it."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

from alignopsd.engine.parallel.group import restart_count

ATTEMPTS_FILE = "attempts.jsonl"
EXIT_REPEATED = 3  # the same failure at the same step in two attempts in a row: not restarted again


def restarted() -> bool:
    """Whether this attempt was started by a machine, not a person: a torchrun restart (``TORCHELASTIC_RESTART_COUNT``
    > 0) or a requeued Slurm job (``SLURM_RESTART_COUNT`` > 0). Only such an attempt is stopped by a repeated failure:
    a person who launches the run again (after fixing the cause) is never refused."""
    if (restart_count() or 0) > 0:
        return True
    try:
        return int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0
    except ValueError:
        return False


def cause_of(exc: BaseException) -> str:
    """``Type: first line`` of ``exc`` with every number masked, so the same failure reads the same in every attempt."""
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {re.sub(r'[0-9]+', '#', first)}"


def peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed because another rank died (not this rank's own failure)."""
    import torch.distributed as dist

    return isinstance(exc, getattr(dist, "DistError", ())) or "Connection closed by peer" in str(exc)


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


def read_attempts(out_dir: Path) -> list[dict]:
    """The events of ``attempts.jsonl`` (a torn last line, from a process killed while writing it, is skipped)."""
    try:
        text = (out_dir / ATTEMPTS_FILE).read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") in ("start", "failure"):
            out.append(rec)
    return out


def record_start(out_dir: Path) -> int:
    """Rank 0, before anything heavy: record the attempt now starting and return its number (one more than the
    last recorded). Failures recorded after it are this attempt's (the previous attempt's processes are gone
    before a new one starts)."""
    attempt = 1 + sum(1 for r in read_attempts(out_dir) if r["event"] == "start")
    _append(out_dir, {"event": "start", "attempt": attempt, "restart": restart_count() or 0, "time": time.time()})
    return attempt


def record_failure(out_dir: Path, rank: int, step: int, exc: BaseException) -> bool:
    """Record this rank's own failure at ``step`` (a peer's, seen through a failed collective: False, nothing
    written)."""
    if peer_failure(exc):
        return False
    return _append(
        out_dir, {"event": "failure", "rank": rank, "step": step, "cause": cause_of(exc), "time": time.time()}
    )


def repeated_failure(out_dir: Path) -> str | None:
    """Read before an attempt records its start: the message that stops it when the last two attempts both failed
    at the same step with the same cause (an attempt without a failure of its own in between clears it); None
    otherwise."""
    segments: list[set[tuple[int, str]]] = []
    for r in read_attempts(out_dir):
        if r["event"] == "start":
            segments.append(set())
        elif segments:
            segments[-1].add((int(r.get("step", 0)), str(r.get("cause", ""))))
    if len(segments) < 2:
        return None
    same = segments[-1] & segments[-2]
    if not same:
        return None
    step, cause = min(same)
    where = f"at step {step}" if step else "before its first step"
    n = len(segments)
    return (
        f"attempts {n - 1} and {n} both failed {where} with the same cause ({cause}); a restart would fail again, "
        f"so this one stops: fix the cause, then resume with --resume auto (attempts: {out_dir / ATTEMPTS_FILE})"
    )


def stop_agent() -> None:
    """Under torchrun, ask the local elastic agent (this worker's parent) to stop the worker group instead of
    restarting it; outside torchrun, nothing."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            parent = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return
    if "torch.distributed.run" in parent or "torchrun" in parent:
        os.kill(os.getppid(), signal.SIGTERM)
