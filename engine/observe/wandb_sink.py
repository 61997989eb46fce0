"""Weights & Biases sink (``trainer.logging.loggers: [..., wandb]``; the optional extra ``alignopsd[wandb]``).

* A fresh run creates a W&B run (project, entity, name, tags, mode and folder from ``trainer.logging.wandb``, unset
fields from
  ``WANDB_*`` as wandb reads them: engine/run/loggers.py) with the resolved run config as its config, logged
  once.
* Each metrics row is one ``run.log(..., step=<the row's step>)``: W&B's ``_step`` is the step of metrics.jsonl, a
  validation row lands in the same history row as the training row of its step, under ``val/...``.
* A resumed run continues the W&B run whose id the checkpoint holds, rewound to the checkpoint's step
  (``resume_from="<id>?_step=<step>"``, W&B's rewind): the history the abandoned attempt logged after that step is
  dropped from the run (W&B archives it), so each step has the one row the resumed run logs. Offline, each attempt is
  a folder of its own under ``<dir>/wandb/`` and the rewind is carried out when the folders are synced
  (``wandb sync``), oldest first.
* The end-of-run report: its numbers go to the run's summary, report.md and its plots to an artifact of type
  ``report``.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from alignopsd.engine.observe.sinks import Sink, series_name


class WandbSink(Sink):
    name: ClassVar[str] = "wandb"

    def __init__(
        self,
        *,
        folder: Path,
        config: dict,
        project: str | None = None,
        entity: str | None = None,
        name: str | None = None,
        tags: list[str] | None = None,
        mode: str | None = None,
        resume_id: str | None = None,
        resume_step: int = 0,
    ) -> None:
        """A W&B run writing under ``folder``; ``config`` logged when it is created; ``resume_id``: the run to continue,
        rewound to ``resume_step``. None leaves a setting to wandb (its ``WANDB_*`` variables)."""
        import wandb

        folder.mkdir(parents=True, exist_ok=True)
        kw: dict = dict(project=project, entity=entity, name=name, tags=tags or None, mode=mode, dir=str(folder))
        if resume_id is not None:
            kw["resume_from"] = f"{resume_id}?_step={int(resume_step)}"
        else:
            kw["config"] = config
        self._wandb = wandb
        self.run = wandb.init(**kw)
        self.run_id = self.run.id
        self.resumed_at = None if resume_id is None else int(resume_step)

    def log(self, step: int, flat: dict[str, float | None], kind: str) -> None:
        data = {series_name(kind, k): v for k, v in flat.items() if v is not None}
        self.run.log(data, step=int(step))

    def finish(self, files: list[Path], numbers: dict[str, float], step: int) -> None:
        self.run.summary.update(numbers)
        if files:
            art = self._wandb.Artifact(f"report-{self.run_id}", type="report")
            for f in files:
                art.add_file(str(f))
            self.run.log_artifact(art)

    def notes(self) -> list[str]:
        if self.resumed_at is None:
            return []
        return [
            f"W&B run {self.run_id}: rewound to step {self.resumed_at} on resume (resume_from); the rows an abandoned "
            "attempt logged after it are dropped from the run's history (offline: when the run folders are synced in "
            "order)."
        ]

    def close(self, status: str = "finished") -> None:
        self.run.finish(exit_code=0 if status == "finished" else 1)
