"""A resumed run rewrites its folder's history: what was recorded after the checkpoint is moved aside.

Before any writer opens a file, rank 0 of a run that resumes from the checkpoint of step ``S`` moves every record
of a step after ``S`` out of the run's files into ``<output_dir>/abandoned/<UTC time>/`` (nothing is deleted):

* ``metrics.jsonl``: training and validation rows with ``step > S`` (and lines cut by a kill) go to
  ``abandoned/<t>/metrics.jsonl``; the kept rows are rewritten atomically, in their order;
* ``audit/step_<n>.rank<r>.jsonl`` with ``n > S``, of every rank (the run that wrote them may have had another
  data-parallel size: a DP=2 run resumed at DP=1 keeps no ``rank1`` file of the steps it runs again), and
  unfinished ``*.jsonl.tmp`` files, go to ``abandoned/<t>/audit/``; the files of steps ``<= S`` are the
  checkpoint's own history (of whatever data-parallel size wrote them) and stay;
* TensorBoard (``tb/``): an event file holding events of steps after ``S`` is moved whole to
  ``abandoned/<t>/tb/`` and replaced by a copy of its events of steps ``<= S``, so the resumed run's events are
  the only ones of the later steps (no reliance on TensorBoard's purge markers);
* ``checkpoints/step_<n>`` with ``n > S`` (a resume from an explicit older checkpoint) go to
  ``abandoned/<t>/checkpoints/``, so a later ``--resume auto`` never picks up the abandoned future.

A fresh run (no checkpoint) on a folder that holds an earlier run's files moves all of them aside the same way
(the earlier run is the abandoned history). Each step's records therefore appear once, written by the run that
produced the current checkpoint chain. ``span_lengths.json`` is cut by engine/run/resume.py; the report is written
again at the end of the run.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from alignopsd.engine.checkpoint.checkpoint import STEP_RE
from alignopsd.engine.checkpoint.manifest import atomic_write_bytes

ABANDONED = "abandoned"
_AUDIT_RE = re.compile(r"^step_(\d+)\.rank\d+\.jsonl(\.tmp)?$")


class _Aside:
    """The ``abandoned/<UTC time>/`` folder of one rewrite, made on first use."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.path: Path | None = None
        self.moved: list[str] = []

    def folder(self, sub: str = "") -> Path:
        if self.path is None:
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            path, n = self.out_dir / ABANDONED / stamp, 1
            while path.exists():
                path, n = self.out_dir / ABANDONED / f"{stamp}-{n}", n + 1
            path.mkdir(parents=True)
            self.path = path
        out = self.path / sub
        out.mkdir(parents=True, exist_ok=True)
        return out

    def move(self, src: Path, sub: str) -> None:
        os.replace(src, self.folder(sub) / src.name)
        self.moved.append(str(src.relative_to(self.out_dir)))


def set_aside(out_dir: str | os.PathLike, step: int | None) -> tuple[Path | None, list[str]]:
    """Move the records of steps after ``step`` (None: a fresh run, every record) aside (module docstring);
    returns (the ``abandoned/<t>`` folder or None when nothing was moved, what was moved, relative paths).
    Rank 0 calls this before any rank writes."""
    out = Path(out_dir)
    if not out.is_dir():
        return None, []
    after = -1 if step is None else int(step)
    aside = _Aside(out)
    _metrics(out, after, aside)
    audit = out / "audit"
    for p in sorted(audit.iterdir()) if audit.is_dir() else []:
        m = _AUDIT_RE.match(p.name)
        if m and (int(m.group(1)) > after or m.group(2)):
            aside.move(p, "audit")
    tb = out / "tb"
    for p in sorted(tb.iterdir()) if tb.is_dir() else []:
        if p.is_file() and "tfevents" in p.name:
            _events(p, after, aside)
    ckpts = out / "checkpoints"
    for p in sorted(ckpts.iterdir()) if ckpts.is_dir() else []:
        m = STEP_RE.match(p.name)
        if m and p.is_dir() and int(m.group(1)) > after:
            aside.move(p, "checkpoints")
    return aside.path, aside.moved


def _metrics(out: Path, after: int, aside: _Aside) -> None:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return
    keep, drop = [], []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
            late = int(rec.get("step", 0)) > after
        except (ValueError, TypeError, AttributeError):
            late = True  # a line cut by a kill (or not a record)
        (drop if late else keep).append(line)
    if not drop:
        return
    if not keep:
        aside.move(path, "")
        return
    (aside.folder() / path.name).write_text("".join(x + "\n" for x in drop))
    atomic_write_bytes(path, "".join(x + "\n" for x in keep).encode())
    aside.moved.append(f"{path.name} ({len(drop)} rows)")


def _events(path: Path, after: int, aside: _Aside) -> None:
    """Move an event file holding events after ``after`` aside, leaving a copy of its earlier events."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.summary.writer.record_writer import RecordWriter

    events = list(EventFileLoader(str(path)).Load())  # stops at a record cut by a kill
    stepped = [e for e in events if e.WhichOneof("what") not in (None, "file_version")]
    if all(e.step <= after for e in stepped):
        return
    keep = [e for e in events if e.WhichOneof("what") in (None, "file_version") or e.step <= after]
    aside.move(path, "tb")
    if not any(e.step <= after and e.WhichOneof("what") not in (None, "file_version") for e in keep):
        return
    with open(path, "wb") as f:
        writer = RecordWriter(f)
        for e in keep:
            writer.write(e.SerializeToString())
        writer.flush()
        os.fsync(f.fileno())
