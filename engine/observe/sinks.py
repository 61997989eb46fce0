"""Where the metrics of a run go besides ``metrics.jsonl``: the sinks of ``trainer.logging.loggers``.

:class:`~alignopsd.engine.observe.metrics.MetricsLogger` writes every record to ``metrics.jsonl`` (the run's own
record, which the report, ``compare`` and resume read) and fans the same flat record out to each sink, so every
logger receives the same names and step numbers:

* a training row's metric keeps its name (``episode/reward_mean``); a row of another kind is prefixed with the kind
  (``val/episode/reward_mean``), as TensorBoard panels have always shown them (:func:`series_name`);
* non-finite values (``null`` in the JSONL) are not sent;
* at the end of a run, the report's numbers (engine/observe/report.py ``report_numbers``) and its files (report.md and
  its plots) go to :meth:`Sink.finish`.

Sinks: :class:`TensorBoardSink` (``<output>/tb``), ``WandbSink`` (engine/observe/wandb_sink.py) and ``MlflowSink``
(engine/observe/mlflow_sink.py); engine/run/loggers.py opens those ``trainer.logging.loggers`` names, on the rank that
writes metrics only. A sink that fails while the run goes on
(a full disk, a server gone) is reported once and dropped; the run continues with the others (in strict mode, under
the tests, the error is raised instead: engine/observe/strict.py). A W&B or MLflow run's id goes into every
checkpoint (``TrainerState.logger_runs``), so a resumed run continues the same tracker run.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from alignopsd.engine.infra.mappings import flatten_config
from alignopsd.engine.observe.strict import reraise_if_strict


def series_name(kind: str, key: str) -> str:
    """The name a sink logs a metric of a ``kind`` row under: the key for training rows, ``<kind>/<key>`` else."""
    return key if kind == "train" else f"{kind}/{key}"


class Sink:
    """One logger of ``trainer.logging.loggers`` besides metrics.jsonl. ``run_id``: the tracker's run (None: no such
    run)."""

    name: ClassVar[str] = ""
    run_id: str | None = None

    def log(self, step: int, flat: dict[str, float | None], kind: str) -> None:
        """Record one metrics row of ``kind`` at ``step`` (the values of metrics.jsonl; None: not finite)."""
        raise NotImplementedError

    def finish(self, files: list[Path], numbers: dict[str, float], step: int) -> None:
        """The end-of-run report: its numbers and its files (report.md, plots); nothing by default."""

    def notes(self) -> list[str]:
        """Lines the run's report adds about this logger (what it could not do); none by default."""
        return []

    def close(self, status: str = "finished") -> None:
        """End the logger's run; ``status``: finished | killed (preempted) | failed."""


class TensorBoardSink(Sink):
    """TensorBoard event files under ``folder`` (``<output>/tb``)."""

    name: ClassVar[str] = "tensorboard"

    def __init__(self, folder: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(log_dir=str(folder))

    def log(self, step: int, flat: dict[str, float | None], kind: str) -> None:
        for k, v in flat.items():
            if v is not None:
                self._tb.add_scalar(series_name(kind, k), v, global_step=step)
        self._tb.flush()

    def close(self, status: str = "finished") -> None:
        self._tb.close()


def guarded(name: str, what: str, fn: Callable[[], Any], stream=None, sink: Sink | None = None) -> bool:
    """Run ``fn`` (a call into logger ``name``); on an exception, report it once, close ``sink`` (when given) as
    failed and return False: the caller drops the logger. Strict mode raises instead."""
    try:
        fn()
        return True
    except Exception as exc:
        reraise_if_strict(exc)
        err = stream if stream is not None else sys.stderr
        line = " ".join(f"{type(exc).__name__}: {exc}".split())
        print(f"[{name}] {what} failed ({line}); the run goes on without this logger", file=err, flush=True)
    if sink is not None:
        try:
            sink.close("failed")
        except Exception:  # already broken; its failure was reported
            pass
    return False


_REFUSED = re.compile(r"[^\w\-. /:]")


def flat_config(config: Any) -> dict[str, str]:
    """A nested config as ``{dotted key: text}`` (the parameters of a tracker that takes flat ones)."""
    return {k: str(v) for k, v in flatten_config(config).items()}


def plain_name(name: str) -> str:
    """``name`` with the characters MLflow refuses in a metric or parameter name (outside letters, digits and
    ``_-. /:``) as ``_``; the engine's own names have none."""
    return _REFUSED.sub("_", name)
