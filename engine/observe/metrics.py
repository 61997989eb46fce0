"""Step metrics: a progress line per step, ``metrics.jsonl`` and TensorBoard event files.

Every step logs one flat ``{name: float}`` mapping. Names use ``/`` as a namespace separator
(``m1/valid_match_rate``, ``m2/segment_length_mean``, ``time/rollout_generation``, ...), which
TensorBoard groups into panels. Non-numeric and non-finite values are dropped from TensorBoard
(they are kept in the JSONL as ``null``). Only rank 0 writes. The logger appends to the run's files: the
trainer first moves the records of an earlier run, or of steps after the checkpoint it resumes from, aside
(engine/run/history.py).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from alignopsd.engine.infra.writes import writing
from alignopsd.engine.observe.progress import time_left

# the keys of the progress line, in order: (metric name, label, format)
PROGRESS_KEYS = (
    ("episode/reward_mean", "reward", "{:.3f}"),
    ("episode/success_rate", "success", "{:.3f}"),
    ("episode/valid_action_rate", "valid", "{:.3f}"),
    ("actor/loss", "loss", "{:+.4f}"),
    ("time/step", "time", "{:.1f}s"),
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
    """JSONL + TensorBoard + progress line. Create on every rank; only ``rank == 0`` writes."""

    def __init__(
        self,
        out_dir: str | Path,
        *,
        total_steps: int,
        tensorboard: bool = True,
        rank: int = 0,
        stream=None,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.total_steps = int(total_steps)
        self.rank = rank
        self.stream = stream if stream is not None else sys.stdout
        self._tb = None
        self.path = self.out_dir / "metrics.jsonl"
        self._t0 = time.perf_counter()  # the time-left estimate counts the steps this process ran
        self._first_step: int | None = None
        if rank != 0:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(self.out_dir / "tb"))
            except ImportError as exc:  # pragma: no cover - tensorboard is an engine dependency
                print(f"[metrics] TensorBoard disabled: {exc}", file=sys.stderr)

    def log(self, step: int, metrics: dict[str, Any], *, kind: str = "train", echo: bool = True) -> dict:
        flat = flatten(metrics)
        if self.rank != 0:
            return flat
        rec = {"kind": kind, "step": int(step), "wall_time": time.time(), **flat}
        with writing(self.path), open(self.path, "a") as f:
            f.write(json.dumps(rec, allow_nan=False) + "\n")
        if self._tb is not None:
            prefix = "" if kind == "train" else f"{kind}/"
            for k, v in flat.items():
                if v is not None:
                    self._tb.add_scalar(prefix + k, v, global_step=step)
            self._tb.flush()
        if echo and kind == "train":
            if self._first_step is None:
                self._first_step = int(step) - 1
            done, total = int(step) - self._first_step, self.total_steps - self._first_step
            left = time_left(time.perf_counter() - self._t0, done, total)
            print(progress_line(step, self.total_steps, flat, left), file=self.stream, flush=True)
        return flat

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


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
