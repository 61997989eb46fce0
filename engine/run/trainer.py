"""The training loop (``Trainer``) of ``alignopsd train`` (engine/commands/train.py).

Also runs under ``torchrun --nproc_per_node=N`` (data parallel: gloo on CPU, NCCL on CUDA). Each rank
plays ``tasks_per_step / N`` tasks per step (a task's sibling group stays on one rank, so group
advantages are local); gradients are averaged across ranks and the loss is the exact global weighted
token-mean of ALGORITHM.md §3.12.

A run writes under ``runs/<config name>/`` (or ``output_dir``): ``config.yaml``, ``checkpoints/``,
``metrics.jsonl``, ``tb/``, ``span_lengths.json``, ``report.md`` and its plots, and (``trainer.logging.audit``)
``audit/step_<step>.rank<r>.jsonl``: the per-turn audit records of every step and the token snapshots of
ALGORITHM.md §4.3, one file per step and data-parallel rank (engine/observe/audit.py).

Determinism: every random draw of a step (task sampling, environment seeds, sampling) derives from
``trainer.seed``, the step index and the rank, plus the torch/python/numpy generator states, which
checkpoints store; so ``--resume auto`` continues with exactly the steps an uninterrupted run takes.
Resuming reads verified checkpoints only and refuses a config that changes training
(engine/run/resume.py; ``--allow-config-change`` overrides); config errors, including the pre-flight checks
of engine/config/preflight.py, end the command with exit code 2 before anything heavy loads.

Output folder: a run holds the folder's exclusive lock (``run.lock``, engine/run/runlock.py) from before its model
is built until it ends; a second run on the folder exits with code 2 naming the holder. A resumed run first moves
the records of steps after its checkpoint (metrics and validation rows, audit files of every rank, TensorBoard
events, later checkpoints) aside into ``abandoned/<UTC time>/`` (engine/run/history.py); a fresh run so moves an
earlier run's records.

Exit status of ``train``: 0 done; 1 the weights became non-finite (nothing saved); 2 a config error (including
the output folder's lock); 143 preempted: SIGTERM or SIGUSR1 arrived, every rank finished the current step and the
run wrote its checkpoint (resume with ``--resume auto``); 124 the grace ``trainer.preempt_grace_s`` ran out or the
signal came again before that checkpoint was complete: exited at once, the previous checkpoint is intact
(engine/run/preemption.py).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import weakref
from dataclasses import replace
from pathlib import Path

from alignopsd.engine.checkpoint.checkpoint import is_complete, load_checkpoint, save_checkpoint, step_dir_name
from alignopsd.engine.checkpoint.manifest import atomic_write_bytes
from alignopsd.engine.checkpoint.rng_state import derived_rng_state, restore_rng_state
from alignopsd.engine.checkpoint.trainer_state import RowsChoice, TrainerState
from alignopsd.engine.config.dump import dump_config
from alignopsd.engine.config.schema import ConfigError, RunConfig
from alignopsd.engine.infra.writes import writing
from alignopsd.engine.observe.audit import Auditor
from alignopsd.engine.observe.metrics import MetricsLogger
from alignopsd.engine.observe.report import report_files, report_numbers, write_report
from alignopsd.engine.parallel.split import check_split
from alignopsd.engine.run.components import build_components
from alignopsd.engine.run.history import set_aside
from alignopsd.engine.run.loggers import open_sinks
from alignopsd.engine.run.preemption import Preempted, PreemptionWatch
from alignopsd.engine.run.process import Dist, pick_device, process_settings
from alignopsd.engine.run.resume import check_lora_base, prepare_resume, read_span_lengths, stored_config
from alignopsd.engine.run.runlock import agree_on_failure, claim_output_dir
from alignopsd.engine.step.episodes import run_validation
from alignopsd.engine.step.recipe import run_step
from alignopsd.kernels.native_choice import choices_state, restore_choices

log = logging.getLogger("alignopsd.train")


class Trainer:
    """Builds the components of a run and drives steps, validation, checkpoints, metrics and the report."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        dist: Dist | None = None,
        stream=None,
        lock_output: bool = True,
        rows: RowsChoice | None = None,
    ) -> None:
        """``lock_output``: take the output folder's exclusive lock (engine/run/runlock.py) before anything is built;
        a run whose folder another live run holds is refused with OutputLockedError (exit code 2). Commands that
        only read a run's folder (``eval``, ``profile``) pass False. ``rows``: packed or padded rows chosen already
        in this process (the warm start's, in the quickstart pipeline), taken instead of measured."""
        self.cfg = cfg
        self.device = pick_device(cfg, int(os.environ.get("LOCAL_RANK", "0")))
        self.dist = dist or Dist(self.device.type)
        self.rank, self.world_size = self.dist.rank, self.dist.world_size
        self.out_dir = cfg.out_dir
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.stream = stream if stream is not None else sys.stdout
        tp = cfg.policy.tensor_parallel_size
        check_split(
            cfg.env.tasks_per_step,
            max(1, self.world_size // tp),
            key="env.tasks_per_step",
            items="tasks per step",
            groups_from=f"{self.world_size} processes / policy.tensor_parallel_size {tp}",
        )
        self.lock = None
        if lock_output:
            self.lock = claim_output_dir(
                self.out_dir,
                rank=self.rank,
                gather=self.dist.gather_objects if self.dist.enabled else None,
                say=self._say,
            )
            if self.lock is not None:
                weakref.finalize(self, self.lock.release)
        try:
            self._build(cfg, rows)
        except BaseException:
            self.release_output()
            raise

    def release_output(self) -> None:
        """Release the output folder's lock (idempotent; the end of :meth:`fit` does it)."""
        if self.lock is not None:
            self.lock.release()

    def _build(self, cfg: RunConfig, rows: RowsChoice | None) -> None:
        process_settings(cfg, self.rank)
        self.parts = build_components(cfg, device=self.device, rank=self.rank, world_size=self.world_size, rows=rows)
        if self.dist.enabled:  # every rank computes with rank 0's measured CPU paths (kernels/native_choice.py)
            chosen = self.dist.gather_objects(choices_state())[0]
            if self.rank:
                restore_choices(chosen, "rank 0's measurement")
        self.step = 0
        self.span_lengths: list[int] = []
        self.logger_runs: dict[str, str] = {}  # logger name -> its W&B / MLflow run, stored with every checkpoint

    # -- checkpoints ---------------------------------------------------------------------------------------------------

    def save(self) -> Path:
        """Checkpoint the current step. A backend with a sharded save (Megatron) writes its shards from every rank
        (torch.distributed.checkpoint) and a gathered Hugging Face export only when :meth:`export_due`; the
        others write the gathered weights and optimizer state (engine/checkpoint/checkpoint.py); a LoRA policy its
        adapter and optimizer state, with the merged weights only when :meth:`export_due`."""
        policy = self.parts.policy
        sharded = policy.sharded_checkpoint
        adapter = policy.adapter
        full = not sharded and adapter is None
        return save_checkpoint(
            self.ckpt_dir,
            self.step,
            model_state=policy.hf_state_dict() if full or self.export_due() else None,
            adapter=(adapter.adapter_state(), adapter.adapter_config()) if adapter is not None else None,
            optimizer_state=None if sharded else policy.optimizer_state(),
            trainer_state=TrainerState(
                step=self.step,
                data_position={"step": self.step, "seed": self.cfg.trainer.seed},
                config_name=self.cfg.name,
                run_config=stored_config(self.cfg),
                span_lengths_count=len(self.span_lengths),
                logger_runs=self.logger_runs or None,
                paths=choices_state() or None,
                rows=policy.rows.choice,
                lora_base=self.lora_base(),
            ),
            hf_config=policy.hf_config,
            keep_last=self.cfg.trainer.checkpoint.keep_last,
            rank=self.rank,
            world_size=self.world_size,
            barrier=self.dist.barrier,
            gather=self.dist.gather_objects if self.dist.enabled else None,
            shards=policy.save_checkpoint if sharded else None,
            shard_state=policy.local_state() if sharded else None,  # this rank's weights, checked for NaN/inf
        )

    def lora_base(self) -> dict[str, str] | None:
        """A LoRA policy's base as its checkpoints name it (``model.name`` and the digest of its weights)."""
        adapter = self.parts.policy.adapter
        return None if adapter is None else {"model": self.cfg.model.name, "digest": adapter.base_digest()}

    def export_due(self) -> bool:
        """A sharded or LoRA checkpoint carries a Hugging Face export (LoRA: the merged weights) every
        ``trainer.checkpoint.export_hf_freq`` steps and at the end of the run."""
        freq = self.cfg.trainer.checkpoint.export_hf_freq
        return self.step == self.cfg.trainer.total_steps or (freq > 0 and self.step % freq == 0)

    def load(self, path: Path) -> None:
        """Restore the policy (through its ``PolicyBackend`` checkpoint methods), the step, the span lengths and
        this rank's generator state from the checkpoint at ``path``."""
        ck = load_checkpoint(path, rank=self.rank, restore_rng=False)  # verifies every file before reading
        policy = self.parts.policy
        if ck.shards is not None:
            if not policy.sharded_checkpoint:
                raise ConfigError(
                    f"--resume: {path} is a sharded checkpoint; policy.backend={self.cfg.policy.backend!r} cannot "
                    "load it (resume with the backend that wrote it, or start a new run from its model.safetensors)"
                )
            policy.load_checkpoint(ck.shards, verify=False)  # verified with the checkpoint
        else:
            try:
                self._load_weights(path, ck.model_state, ck.adapter_state)
                if ck.optimizer_state is not None:
                    policy.load_optimizer_state(ck.optimizer_state)
            except ValueError as exc:
                raise ValueError(f"checkpoint {path}: {exc}") from None
        self.parts.sync_weights()
        self.step = ck.trainer_state.step
        self.logger_runs = dict(ck.trainer_state.logger_runs or {})
        why = "as the run that wrote the checkpoint measured"
        for choice in restore_choices(ck.trainer_state.paths or {}, why):
            self._say(f"[train] kernels: {choice.describe()}")  # the paths it computed with: a resume is exact
        stored = ck.trainer_state.rows
        if stored is not None and policy.rows.undecided:  # its rows too (a configured layout stays as configured)
            self._say(f"[train] kernels: {policy.rows.choose(stored).describe()} ({why})")
        n = ck.trainer_state.span_lengths_count or 0
        self.span_lengths, warning = read_span_lengths(self.out_dir / "span_lengths.json", n)
        if warning:
            self._say(warning)
        # RNG last: nothing after this point may draw random numbers before the next step
        if ck.rng_state is None:  # a rank beyond the saving run's world: its own state, not rank 0's copy
            derived_rng_state(self.cfg.trainer.seed, self.rank, self.step)
        else:
            restore_rng_state(ck.rng_state)

    def _load_weights(self, path: Path, model_state: dict | None, adapter_state: dict | None) -> None:
        """A plain checkpoint's weights into the policy: the full weights, or a LoRA checkpoint's adapter (its base
        is the configured model, loaded already)."""
        adapter = self.parts.policy.adapter
        if adapter is None and adapter_state is not None:
            raise ConfigError(f"--resume: {path} holds a LoRA adapter; resume it with model.lora.enabled=true")
        if adapter is not None and adapter_state is None:
            raise ConfigError(f"--resume: {path} holds full weights, not a LoRA adapter; set model.lora.enabled=false")
        if adapter is not None:
            adapter.load_adapter_state(adapter_state)
        else:
            self.parts.policy.load_hf_state_dict(model_state)

    # -- loop ----------------------------------------------------------------------------------------------------------

    def fit(self, resume: str | None = None, *, allow_config_change: bool = False) -> dict:
        """Train to ``trainer.total_steps`` (from the checkpoint ``resume`` names, if any); returns the last step's
        metrics. Raises :class:`Preempted` after writing the checkpoint of the step a SIGTERM or SIGUSR1 ended
        (engine/run/preemption.py). The output folder's lock is released when it returns or raises."""
        cfg = self.cfg
        try:
            path, changes = prepare_resume(
                cfg, resume, world_size=self.world_size, allow_changes=allow_config_change, say=self._say
            )
            for line in changes:
                self._say(f"[resume] config change: {line}")
            if path is not None:  # a LoRA adapter resumes over the base it was trained on only
                for line in check_lora_base(path, self.lora_base(), allow_changes=allow_config_change):
                    self._say(line)
            if self.rank == 0:
                self.out_dir.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(self.out_dir / "config.yaml", dump_config(cfg).encode())
            watch = PreemptionWatch(cfg.trainer.preempt_grace_s).install()
            try:
                if path is not None:
                    self.load(path)
                    self._say(f"[train] resumed from {path} at step {self.step}")
                self._set_history_aside(self.step if path is not None else None)
                logger = self._metrics_logger(resumed=path is not None)
                self.parts = replace(self.parts, audit=self._auditor())
                try:
                    last = self._train(logger, watch)
                except Preempted:
                    logger.close("killed")
                    self.parts.close()  # environment workers and the generation engine end with the run
                    raise
                except BaseException:
                    logger.close("failed")
                    raise
            finally:
                watch.close()
            self._finish(logger)
            self.parts.close()
            return last
        finally:
            self.release_output()

    def _metrics_logger(self, *, resumed: bool) -> MetricsLogger:
        """metrics.jsonl and the other loggers of ``trainer.logging.loggers`` (engine/observe/sinks.py), opened on rank
        0: a resumed run continues the W&B / MLflow runs its checkpoint names."""
        cfg = self.cfg
        sinks = []
        if self.rank == 0:
            sinks = open_sinks(
                cfg.trainer,
                self.out_dir,
                run_name=cfg.name,
                config=stored_config(cfg),
                resume=self.logger_runs if resumed else None,
                resume_step=self.step,
            )
        logger = MetricsLogger(
            self.out_dir, total_steps=cfg.trainer.total_steps, sinks=sinks, rank=self.rank, stream=self.stream
        )
        self.logger_runs = {**(self.logger_runs if resumed else {}), **logger.run_ids()}
        return logger

    def _finish(self, logger: MetricsLogger) -> None:
        """The span lengths, the report (with what a logger could not do) and its numbers and files to the loggers; then
        the loggers close."""
        try:
            self._write_spans()
            if self.rank == 0 and self.cfg.trainer.logging.report:
                title = f"{self.cfg.name}: {self.cfg.algorithm_name()}"
                notes = "\n\n".join(logger.notes())
                with writing(self.out_dir / "report.md"):  # and its plots beside it
                    report = write_report(self.out_dir, title=title, extra=f"## Loggers\n\n{notes}" if notes else "")
                print(f"[train] report: {report}", file=self.stream, flush=True)
                logger.finish(report_files(self.out_dir), report_numbers(self.out_dir), self.step)
        except BaseException:
            logger.close("failed")
            raise
        logger.close()

    def _train(self, logger: MetricsLogger, watch: PreemptionWatch) -> dict:
        """The steps, validation passes and saves; a preemption request ends it after the current step."""
        cfg = self.cfg
        last: dict = {}
        if cfg.trainer.validation.before_train and self.step == 0:
            self._validate(logger)
        last_save = time.monotonic()
        while self.step < cfg.trainer.total_steps:
            t0 = time.perf_counter()
            result = run_step(self.parts, self.step)
            self.step += 1
            metrics = self.reduce_metrics(result.metrics)
            metrics["time/step_wall"] = time.perf_counter() - t0
            self.span_lengths.extend(int(x) for x in result.span_lengths)
            last = logger.log(self.step, metrics)
            if (
                cfg.trainer.validation.freq > 0
                and self.step % cfg.trainer.validation.freq == 0
                and self.step >= cfg.trainer.validation.start_step
            ):
                self._validate(logger)
            if self._save_due(last_save):
                t_save = time.perf_counter()
                self._write_spans()
                self.save()
                last_save = time.monotonic()
                self._say(f"[train] checkpoint of step {self.step}: {time.perf_counter() - t_save:.2f} s")
            self._stop_if_preempted(watch)
        if cfg.trainer.validation.after_train and not (
            cfg.trainer.validation.freq > 0
            and cfg.trainer.total_steps % cfg.trainer.validation.freq == 0
            and cfg.trainer.total_steps >= cfg.trainer.validation.start_step
        ):
            self._validate(logger)
        return last

    def _save_due(self, last_save: float) -> bool:
        """A checkpoint at this step's end: every ``trainer.checkpoint.save_freq`` steps, at the last step, and when
        ``trainer.checkpoint.save_every_s`` seconds have passed since the last save on the slowest rank (all ranks
        agree)."""
        t = self.cfg.trainer.checkpoint
        if (t.save_freq > 0 and self.step % t.save_freq == 0) or self.step == self.cfg.trainer.total_steps:
            return True
        if t.save_every_s is None:
            return False
        elapsed = time.monotonic() - last_save
        if self.dist.enabled:
            elapsed = self.dist.all_reduce([elapsed], "max")[0]
        return elapsed >= t.save_every_s

    def _stop_if_preempted(self, watch: PreemptionWatch) -> None:
        """At a step boundary: when any rank was asked to stop, every rank writes this step's checkpoint (unless
        it was just written) and raises Preempted (engine/run/preemption.py)."""
        flag = 1.0 if watch.requested else 0.0
        if self.dist.enabled:
            flag = self.dist.all_reduce([flag], "max")[0]
        if flag == 0.0:
            return
        watch.agree("another rank was signalled")
        path = self.ckpt_dir / step_dir_name(self.step)
        done = 1.0 if is_complete(path) else 0.0  # this step's checkpoint was just written: not again
        if self.dist.enabled:
            done = self.dist.all_reduce([done], "min")[0]
        if done == 0.0:
            self._write_spans()
            path = self.save()
        self.dist.barrier()
        watch.mark_saved()
        raise Preempted(self.step, path, watch.cause or "signal")

    def _set_history_aside(self, resume_step: int | None) -> None:
        """Rank 0 moves the records of an earlier run, or of steps after the checkpoint, aside (engine/run/history.py)
        before any rank writes."""
        # one gather: every rank waits here for rank 0, and ends with its I/O error if it had one
        got = agree_on_failure(
            lambda: set_aside(self.out_dir, resume_step),
            run_here=self.rank == 0,
            gather=self.dist.gather_objects if self.dist.enabled else None,
            what=f"cannot set the history of {self.out_dir} aside",
        )
        if got is not None and got[0] is not None:
            after = "of an earlier run" if resume_step is None else f"of steps after {resume_step}"
            self._say(f"[history] moved the records {after} aside to {got[0]}: {', '.join(got[1])}")

    def _auditor(self):
        """The audit writer of this process (engine/observe/audit.py); None when the audit is off or another rank of
        this process's tensor-parallel group writes the same batch."""
        cfg = self.cfg
        if not cfg.trainer.logging.audit or not self.parts.policy.layout.is_group_lead:
            return None
        return Auditor(
            self.out_dir,
            rank=self.parts.rank,
            world_size=self.parts.world_size,
            total_steps=cfg.trainer.total_steps,
            max_bytes=cfg.trainer.logging.audit_max_bytes,
            tokenizer=self.parts.tokenizer,
            header=audit_header(cfg),
        )

    def _write_spans(self) -> None:
        if self.rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self.out_dir / "span_lengths.json", json.dumps(self.span_lengths).encode())

    def _say(self, line: str) -> None:
        if self.rank == 0:
            print(line, file=self.stream, flush=True)

    def _validate(self, logger) -> dict:
        metrics = self.reduce_metrics(run_validation(self.parts, self.step))
        flat = logger.log(self.step, metrics, kind="val", echo=False)
        if self.rank == 0:
            sr = flat.get("episode/success_rate")
            rw = flat.get("episode/reward_mean")
            print(
                f"[val] step {self.step}: success {sr:.3f} | reward {rw:.3f} | "
                f"episodes {int(flat.get('episode/count', 0))}",
                file=self.stream,
                flush=True,
            )
        return flat

    def reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Metrics over data-parallel ranks (:meth:`Dist.reduce_metrics`; under tensor parallelism only the first rank
        of each group contributes)."""
        return self.dist.reduce_metrics(metrics, lead=self.parts.policy.layout.is_group_lead)


def audit_header(cfg: RunConfig) -> dict:
    """The run's step-level constants that every audit ``step`` header carries (engine/observe/audit.py)."""
    a = cfg.algorithm
    return {
        "estimator": str(a.estimator),
        "gamma": float(a.rectify.gamma),
        "top_k": int(a.rectify.top_k),
        "alpha_max": float(a.effective_alpha_max),
        "ablation": str(a.ablation),
    }
