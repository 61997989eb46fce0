"""The loggers of ``trainer.logging.loggers`` opened for a run: the sinks of engine/observe/sinks.py built from the
config.

What a section leaves unset is resolved here as each library resolves it (engine/config/logger_check.py, the same
rules the pre-flight check applied): W&B's mode (WANDB_MODE, else online) and folder (WANDB_DIR, else the run's output
folder), its run name (WANDB_NAME, else the run config's name); project, entity and tags left to wandb (WANDB_PROJECT,
WANDB_ENTITY, WANDB_TAGS); MLflow's tracking URI (MLFLOW_TRACKING_URI, else MLflow's default), experiment
(MLFLOW_EXPERIMENT_NAME, else MLFLOW_EXPERIMENT_ID, else the Default experiment, id 0) and run name (the run config's).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from alignopsd.engine.config.logger_check import mlflow_uri, wandb_dir, wandb_mode
from alignopsd.engine.config.trainer_section import TrainerConfig
from alignopsd.engine.observe.mlflow_sink import MlflowSink
from alignopsd.engine.observe.sinks import Sink, TensorBoardSink, guarded
from alignopsd.engine.observe.wandb_sink import WandbSink


def make_sink(
    name: str,
    trainer: TrainerConfig,
    out_dir: Path,
    *,
    run_name: str,
    config: dict,
    resume_id: str | None,
    resume_step: int,
    env: Mapping[str, str],
) -> Sink:
    """The sink of logger ``name`` (not jsonl: that file is the MetricsLogger's own)."""
    if name == "tensorboard":
        return TensorBoardSink(out_dir / "tb")
    if name == "wandb":
        w = trainer.logging.wandb
        return WandbSink(
            folder=wandb_dir(w, env, out_dir),
            config=config,
            project=w.project,
            entity=w.entity,
            name=w.name or env.get("WANDB_NAME") or run_name,
            tags=w.tags,
            mode=wandb_mode(w, env),
            resume_id=resume_id,
            resume_step=resume_step,
        )
    if name == "mlflow":
        m = trainer.logging.mlflow
        return MlflowSink(
            config=config,
            tracking_uri=mlflow_uri(m, env),
            experiment=m.experiment or env.get("MLFLOW_EXPERIMENT_NAME"),
            experiment_id=env.get("MLFLOW_EXPERIMENT_ID", "0"),
            run_name=m.run_name or run_name,
            tags=m.tags,
            resume_id=resume_id,
            resume_step=resume_step,
        )
    raise ValueError(f"trainer.logging.loggers: no sink named {name!r}")


def open_sinks(
    trainer: TrainerConfig,
    out_dir: Path,
    *,
    run_name: str,
    config: dict,
    resume: dict[str, str] | None = None,
    resume_step: int = 0,
    stream=None,
) -> list[Sink]:
    """The sinks of ``trainer.logging.loggers``. ``config``: the resolved run config, logged once, when a tracker run is
    created; ``resume``: logger name -> run id of the checkpoint the run resumes from at ``resume_step`` (those runs
    are continued). A tracker that cannot start is reported and left out (strict mode raises)."""
    resume = resume or {}
    sinks: list[Sink] = []
    for name in trainer.logging.loggers:
        if name == "jsonl":
            continue

        def start(n: str = name) -> None:
            sinks.append(
                make_sink(
                    n,
                    trainer,
                    out_dir,
                    run_name=run_name,
                    config=config,
                    resume_id=resume.get(n),
                    resume_step=resume_step,
                    env=os.environ,
                )
            )

        guarded(name, "start", start, stream)
    return sinks
