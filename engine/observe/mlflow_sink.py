"""MLflow sink (``trainer.logging.loggers: [..., mlflow]``; the optional extra ``alignopsd[mlflow]``, mlflow-skinny
suffices).

* A fresh run creates an MLflow run in the experiment of ``trainer.logging.mlflow`` (or MLFLOW_EXPERIMENT_NAME /
  MLFLOW_EXPERIMENT_ID, else MLflow's Default experiment; created when missing) at the tracking URI that section or
  MLFLOW_TRACKING_URI names (engine/run/loggers.py), tagged with the section's tags. The resolved run config is
  logged once: as the run's parameters (dotted keys) and as the artifact ``config.json``.
* Each metrics row is one ``log_batch`` of metrics at the row's step (names as :func:`series_name` gives them, with a
  character MLflow refuses written ``_``).
* A resumed run continues the MLflow run whose id the checkpoint holds. MLflow cannot delete metric points, so the
  points an abandoned attempt logged after the checkpoint's step stay in the run's history beside the resumed run's
  (the later point of a step is the resumed run's): the run's tag ``alignopsd.abandoned_steps`` lists those steps and
  the run's report says so (:meth:`MlflowSink.notes`).
* The end-of-run report: its numbers as metrics at the last step, report.md and its plots as artifacts under
  ``report/``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import ClassVar

from alignopsd.engine.observe.sinks import Sink, flat_config, plain_name, series_name

ABANDONED_TAG = "alignopsd.abandoned_steps"
PARAM_LIMIT = 6000  # characters of a parameter value MLflow stores
BATCH = 100  # parameters per log_batch (MLflow's limit); metrics go 1000 at a time


class MlflowSink(Sink):
    name: ClassVar[str] = "mlflow"

    def __init__(
        self,
        *,
        config: dict,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        experiment_id: str = "0",
        run_name: str | None = None,
        tags: dict[str, str] | None = None,
        resume_id: str | None = None,
        resume_step: int = 0,
    ) -> None:
        """An MLflow run at ``tracking_uri`` (None: MLflow's default) in ``experiment`` (created when missing; None:
        the experiment of ``experiment_id``); ``config`` logged when it is created; ``resume_id``: the run to continue
        from ``resume_step``."""
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        if resume_id is not None:
            self.run_id = resume_id
            self._set_aside_after(int(resume_step))
            self.client.update_run(resume_id, status="RUNNING")
            return
        if experiment is not None:
            exp = self.client.get_experiment_by_name(experiment)
            experiment_id = exp.experiment_id if exp is not None else self.client.create_experiment(experiment)
        run = self.client.create_run(experiment_id, run_name=run_name, tags=dict(tags or {}))
        self.run_id = run.info.run_id
        from mlflow.entities import Param

        params = [Param(plain_name(k)[:250], v[:PARAM_LIMIT]) for k, v in flat_config(config).items()]
        for i in range(0, len(params), BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + BATCH])
        self.client.log_dict(self.run_id, config, "config.json")

    def _set_aside_after(self, step: int) -> None:
        """Tag the steps after ``step`` that the run's history holds (points of an abandoned attempt)."""
        run = self.client.get_run(self.run_id)
        steps = {m.step for key in run.data.metrics for m in self.client.get_metric_history(self.run_id, key)}
        late = sorted(s for s in steps if s > step)
        if not late:
            return
        earlier = run.data.tags.get(ABANDONED_TAG)
        span = f"{late[0]}-{late[-1]}" if len(late) > 1 else str(late[0])
        self.client.set_tag(self.run_id, ABANDONED_TAG, f"{earlier}, {span}" if earlier else span)

    def log(self, step: int, flat: dict[str, float | None], kind: str) -> None:
        self._metrics({series_name(kind, k): v for k, v in flat.items() if v is not None}, step)

    def _metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(plain_name(k), float(v), now, int(step)) for k, v in values.items()]
        for i in range(0, len(rows), 1000):
            self.client.log_batch(self.run_id, metrics=rows[i : i + 1000])

    def finish(self, files: list[Path], numbers: dict[str, float], step: int) -> None:
        self._metrics(numbers, step)
        for f in files:
            self.client.log_artifact(self.run_id, str(f), "report")

    def notes(self) -> list[str]:
        steps = self.client.get_run(self.run_id).data.tags.get(ABANDONED_TAG)
        if not steps:
            return []
        return [
            f"MLflow run {self.run_id}: the metric points of steps {steps}, logged by an attempt that a resume set "
            "aside, stay in the run's history beside this run's (MLflow cannot delete metric points; the later point "
            f"of a step is this run's); the run's tag {ABANDONED_TAG} lists them."
        ]

    def close(self, status: str = "finished") -> None:
        self.client.set_terminated(
            self.run_id, status={"finished": "FINISHED", "killed": "KILLED"}.get(status, "FAILED")
        )
