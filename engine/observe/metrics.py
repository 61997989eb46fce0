"""Step metrics: a progress line per step, ``metrics.jsonl`` and the other loggers (engine/observe/sinks.py).

Every step logs one flat ``{name: float}`` mapping. Names use ``/`` as a namespace separator
(``m1/valid_match_rate``, ``m2/segment_length_mean``, ``time/rollout_generation``, ...), which
TensorBoard, W&B and MLflow group into panels. Non-numeric values are dropped; non-finite ones are kept in the JSONL as
``null`` and not sent to the other loggers. Only rank 0 writes. The logger appends to the run's files: the
trainer first moves the records of an earlier run, or of steps after the checkpoint it resumes from, aside
(engine/run/history.py).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from alignopsd.engine.infra.writes import writing
from alignopsd.engine.observe.progress import time_left
from alignopsd.engine.observe.sinks import Sink, guarded

# the keys of the progress line, in order: (metric name, label, format)
PROGRESS_KEYS = (
    ("episode/reward_mean", "reward", "{:.3f}"),
    ("episode/success_rate", "success", "{:.3f}"),
    ("episode/valid_action_rate", "valid", "{:.3f}"),
    ("actor/loss", "loss", "{:+.4f}"),
    ("time/step", "time", "{:.1f}s"),
    ("memory/peak_rss_gib", "peak mem", "{:.1f} GiB"),
)


def _to_float(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    if hasattr(v, "item") and getattr(v, "numel", lambda: 2)() == 1:
        return float(v.item())
    return None


def flatten(metrics: dict[str, Any], prefix: str = "") -> dict[str, float | None]:
    """Nested dicts joined with '/'; scalar tensors converted; other values dropped."""
    out: dict[str, float | None] = {}
    for k, v in metrics.items():
        name = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(flatten(v, name))
            continue
        f = _to_float(v)
        if f is None:
            continue
        out[name] = f if math.isfinite(f) else None
    return out


def progress_line(step: int, total: int, metrics: dict[str, float | None], left: str = "") -> str:
    """``step k/N | reward ... | time ...s`` and, when given, the estimate of the time left (``~4m10s left``)."""
    parts = [f"step {step:>4d}/{total}"]
    for key, label, fmt in PROGRESS_KEYS:
        v = metrics.get(key)
        if v is not None:
            parts.append(f"{label} {fmt.format(v)}")
    if metrics.get("update/skipped"):
        parts.append("(update skipped)")
    if left:
        parts.append(left)
    return " | ".join(parts)


class MetricsLogger:
    """metrics.jsonl + the sinks of ``trainer.logging.loggers`` (TensorBoard, W&B, MLflow: engine/observe/sinks.py) +
    the progress line. Create on every rank; only ``rank == 0`` writes (the other ranks' ``sinks`` are closed
    unused)."""

    def __init__(
        self,
        out_dir: str | Path,
        *,
        total_steps: int,
        sinks: Sequence[Sink] = (),
        rank: int = 0,
        stream=None,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.total_steps = int(total_steps)
        self.rank = rank
        self.stream = stream if stream is not None else sys.stdout
        self.sinks = list(sinks) if rank == 0 else []
        self._run_ids = {s.name: s.run_id for s in self.sinks if s.run_id is not None}
        self.path = self.out_dir / "metrics.jsonl"
        self._t0 = time.perf_counter()  # the time-left estimate counts the steps this process ran
        self._first_step: int | None = None
        if rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)

    def run_ids(self) -> dict[str, str]:
        """Logger name -> id of its tracker run (W&B, MLflow), for the checkpoint; kept after a sink failed."""
        return dict(self._run_ids)

    def _each(self, what: str, call) -> None:
        """``call(sink)`` on every sink; one that raises is reported once and dropped (sinks.guarded)."""
        for sink in list(self.sinks):
            if not guarded(sink.name, what, lambda s=sink: call(s), sink=sink):
                self.sinks.remove(sink)

    def log(self, step: int, metrics: dict[str, Any], *, kind: str = "train", echo: bool = True) -> dict:
        flat = flatten(metrics)
        if self.rank != 0:
            return flat
        rec = {"kind": kind, "step": int(step), "wall_time": time.time(), **flat}
        with writing(self.path), open(self.path, "a") as f:
            f.write(json.dumps(rec, allow_nan=False) + "\n")
        self._each(f"logging step {int(step)}", lambda s: s.log(int(step), flat, kind))
        if echo and kind == "train":
            if self._first_step is None:
                self._first_step = int(step) - 1
            done, total = int(step) - self._first_step, self.total_steps - self._first_step
            left = time_left(time.perf_counter() - self._t0, done, total)
            print(progress_line(step, self.total_steps, flat, left), file=self.stream, flush=True)
        return flat

    def notes(self) -> list[str]:
        """What the sinks could not do, for the run's report (e.g. MLflow keeping an abandoned attempt's points)."""
        out: list[str] = []
        self._each("reading its notes", lambda s: out.extend(s.notes()))
        return out

    def finish(self, files: list[Path], numbers: dict[str, float], step: int) -> None:
        """The end-of-run report's files and numbers to every sink."""
        self._each("logging the report", lambda s: s.finish(files, numbers, int(step)))

    def close(self, status: str = "finished") -> None:
        """End every sink's run (idempotent); ``status``: finished | killed | failed."""
        self._each("closing", lambda s: s.close(status))
        self.sinks = []


def read_metrics(path: str | Path, kind: str | None = "train") -> list[dict]:
    """Records of a metrics.jsonl (optionally only one kind), in file order."""
    out = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if kind is None or rec.get("kind", "train") == kind:
            out.append(rec)
    return out
