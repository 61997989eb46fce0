"""Estimators side by side: ``alignopsd compare --config FILE --estimators grpo,alignopsd --seeds 3 --steps N``.

Trains every (estimator, seed) pair of a config for ``N`` steps and evaluates the held-out success of each run on
one schedule, then writes, under ``--out`` (default ``runs/compare-<config name>``):

* ``<estimator>-seed<seed>/``: the run directory of each pair (the trainer's own files: ``metrics.jsonl``,
  ``config.yaml``, checkpoints, report), plus ``val_tasks.json`` (the keys of the held-out games it played);
* ``compare.json``: the plan, every run's held-out success at every evaluation step, and the summary;
* ``compare.md``: held-out success (rows: evaluation steps; columns: estimators; cells ``mean ± std (n)`` over
  seeds, in percent), the ``alignopsd eval`` table of the last step, the paired per-seed difference to the first
  estimator, the wall seconds per step;
* ``compare.png``: held-out success over steps, a mean line and a ±1 std band per estimator (thin lines: seeds).

What is held equal across estimators, so that the estimator is the only difference:

* starting weights: every run loads ``model.name`` as configured;
* training tasks and sampling seeds: a run of seed ``s`` sets ``trainer.seed=s``; the tasks of each step and all
  sampling derive from it (engine/step/episodes.py), identically for every estimator;
* held-out games: the environment's validation split is sampled with the run's seed (``components.build_env``),
  so compare builds it once from ``--val-seed`` (default: the config's ``trainer.seed``) and gives that same list
  to every run (``parts.val_tasks``); each run records the keys it played in ``val_tasks.json``;
* evaluation schedule: before the first step (step 0), every ``--eval-every`` steps and after the last step
  (``trainer.validation.before_train``, ``trainer.validation.freq``, ``trainer.validation.after_train``,
  ``trainer.validation.start_step=0``). Validation samples with seeds of the run's seed and step, so for one seed every
  estimator's step-0 evaluation is the same pass on the same weights.

Runs are sequential in this process (each builds its own Trainer, which re-seeds every generator), so one place
decides the held-out games, and under ``torchrun`` every rank runs the same sequence (rank 0 writes). Resumable: a
run whose ``metrics.jsonl`` holds its last step and last evaluation is read, not redone, once its stored config and
held-out games are checked to be the ones asked for; an unfinished run resumes from its newest verified
checkpoint (``--set trainer.checkpoint.save_freq=K`` makes long runs resumable mid-way), or starts again. So each run
can also have a fresh process of its own (``--estimators grpo --seeds 1 --first-seed 2``, same ``--out``), and a last
call with every estimator and seed reads them all and writes the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from alignopsd.engine.checkpoint.manifest import atomic_write_bytes
from alignopsd.engine.commands.compare_plan import (
    VAL_TASKS_FILE,
    Plan,
    RunSpec,
    held_out_tasks,
    plan_comparison,
)
from alignopsd.engine.commands.compare_report import fmt_percent, markdown, plot, step_seconds, success_of, summarize
from alignopsd.engine.config.schema import ConfigError, load_config
from alignopsd.engine.observe.metrics import read_metrics
from alignopsd.engine.run.resume import config_changes, stored_config


class PrefixedStream:
    """A text stream writing each complete line to ``stream`` with ``prefix`` in front (one run's progress)."""

    def __init__(self, stream, prefix: str) -> None:
        self.stream = stream
        self.prefix = prefix
        self._pending = ""

    def write(self, text: str) -> int:
        self._pending += text
        while "\n" in self._pending:
            line, self._pending = self._pending.split("\n", 1)
            self.stream.write(f"{self.prefix}{line}\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def finished_evaluations(run_dir: Path, steps: int) -> dict[int, dict] | None:
    """The validation records (by step; the last of a step) of a run that trained ``steps`` steps and was
    evaluated after the last one; None when the run is missing or unfinished."""
    recs = read_metrics(Path(run_dir) / "metrics.jsonl", kind=None)
    trained = any(r.get("kind", "train") == "train" and int(r.get("step", -1)) == steps for r in recs)
    val = {int(r["step"]): r for r in recs if r.get("kind") == "val"}
    if not trained or steps not in val:
        return None
    return val


def check_reusable(spec: RunSpec, task_keys: list[str]) -> None:
    """A finished run is reused only if it was trained with this run's config and evaluated on these games."""
    try:
        saved = stored_config(load_config(spec.out_dir / "config.yaml"))
    except ConfigError as exc:
        raise ConfigError(f"{spec.out_dir}: cannot read the finished run's config.yaml ({exc})") from None
    blocking, _ = config_changes(saved, stored_config(spec.load()), step=0)
    if blocking:
        listed = "\n  ".join(blocking)
        raise ConfigError(
            f"{spec.out_dir}: this finished run was trained with another config:\n  {listed}\n"
            "use another --out, or remove that run directory to train it again"
        )
    path = spec.out_dir / VAL_TASKS_FILE
    played = json.loads(path.read_text()) if path.exists() else None
    if played != task_keys:
        raise ConfigError(
            f"{path}: this finished run was evaluated on other held-out games than the {len(task_keys)} of "
            "--val-seed; use another --out, or remove that run directory to train it again"
        )


def default_trainer(config: str, overrides: list[str]):
    """The real trainer of one run (the factory ``run`` uses unless given another)."""
    from alignopsd.engine.run.trainer import Trainer

    return Trainer(load_config(config, overrides))


def train_one(spec: RunSpec, steps: int, val_tasks: list, factory: Callable, stream) -> dict[int, dict]:
    """Train one run (resuming from its newest verified checkpoint if it has one) on the pinned held-out games;
    its validation records by step."""
    import torch

    keys = [t.key for t in val_tasks]
    trainer = factory(spec.config, list(spec.overrides))  # takes the run folder's lock: nothing is written before
    try:
        if int(os.environ.get("RANK", "0")) == 0:
            atomic_write_bytes(spec.out_dir / VAL_TASKS_FILE, json.dumps(keys).encode())
        trainer.parts = replace(trainer.parts, val_tasks=list(val_tasks))
        trainer.stream = PrefixedStream(stream, f"[{spec.label}] ")
        trainer.fit(resume="auto")
        trainer.dist.barrier()  # rank 0 has written the run's last records before any rank reads them
    finally:
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    val = finished_evaluations(spec.out_dir, steps)
    if val is None:
        raise RuntimeError(f"{spec.out_dir}: the run ended without a training record and an evaluation at step {steps}")
    return val


def train_runs(plan: Plan, *, trainer_factory: Callable | None, stream) -> tuple[list[str], dict[tuple, dict]]:
    """Every run of the plan, in order: read when finished earlier, else trained. Returns the keys of the
    held-out games and the validation records (by step) of each (estimator, seed)."""
    rank0 = int(os.environ.get("RANK", "0")) == 0

    def say(line: str) -> None:
        if rank0:
            print(f"[compare] {line}", file=stream, flush=True)

    val_tasks = held_out_tasks(plan)
    keys = [t.key for t in val_tasks]
    say(
        f"{len(plan.runs)} runs, {plan.steps} steps each, held-out games ({len(keys)}, val seed {plan.val_seed}): "
        f"{', '.join(keys)}"
    )
    factory = trainer_factory or default_trainer
    evals: dict[tuple[str, int], dict[int, dict]] = {}
    for i, spec in enumerate(plan.runs, 1):
        head = f"run {i}/{len(plan.runs)} {spec.label}"
        val = finished_evaluations(spec.out_dir, plan.steps)
        if val is not None:
            check_reusable(spec, keys)
            say(f"{head}: finished earlier, read {spec.out_dir / 'metrics.jsonl'}")
        else:
            say(f"{head}: start ({spec.out_dir})")
            t0 = time.perf_counter()
            val = train_one(spec, plan.steps, val_tasks, factory, stream)
            say(f"{head}: done in {time.perf_counter() - t0:.1f} s")
        say(
            f"{head}: held-out success "
            + ", ".join(f"step {s}: {fmt_percent(success_of(val[s]))}" for s in sorted(val))
        )
        evals[(spec.estimator, spec.seed)] = val
    return keys, evals


# ---------------------------------------------------------------------------------------------------------------------
# summary and outputs


def run(
    config: str | os.PathLike,
    *,
    estimators: Sequence[str] = ("grpo", "alignopsd"),
    seeds: int = 3,
    steps: int,
    eval_every: int | None = None,
    out: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    val_seed: int | None = None,
    first_seed: int | None = None,
    trainer_factory: Callable[[str, list[str]], Any] | None = None,
    stream=None,
) -> dict[str, Any]:
    """Plan, train (or read) every run, write compare.json / compare.md / compare.png; returns compare.json's
    content. ``trainer_factory(config, overrides)`` builds one run's trainer (default: the engine's Trainer)."""
    stream = stream if stream is not None else sys.stdout
    plan = plan_comparison(
        config,
        estimators=estimators,
        seeds=seeds,
        steps=steps,
        eval_every=eval_every,
        out=out,
        overrides=overrides,
        val_seed=val_seed,
        first_seed=first_seed,
    )
    try:
        keys, evals = train_runs(plan, trainer_factory=trainer_factory, stream=stream)
    finally:
        _close_process_group()
    return write_outputs(plan, keys, evals, stream)


def write_outputs(plan: Plan, keys: list[str], evals: dict[tuple[str, int], dict[int, dict]], stream) -> dict:
    """compare.json, compare.md and compare.png of the finished runs (rank 0); returns compare.json's content."""
    summary = summarize(plan, evals)
    seconds = step_seconds(plan)
    result = {
        "config": plan.config,
        "overrides": list(plan.overrides),
        "name": plan.base.name,
        "model": plan.base.model.name,
        "env": plan.base.env.name,
        "val_split": plan.base.env.val_split,
        "val_seed": plan.val_seed,
        "val_tasks": keys,
        "estimators": list(plan.estimators),
        "seeds": list(plan.seeds),
        "steps": plan.steps,
        "eval_every": plan.eval_every,
        "eval_steps": plan.schedule,
        "runs": [
            dict(
                estimator=r.estimator,
                seed=r.seed,
                dir=str(r.out_dir),
                success={str(st): success_of(rec) for st, rec in sorted(evals[(r.estimator, r.seed)].items())},
            )
            for r in plan.runs
        ],
        **summary,
        "step_seconds": seconds,
    }
    if int(os.environ.get("RANK", "0")) == 0:
        plan.out.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(plan.out / "compare.json", json.dumps(result, indent=2).encode())
        atomic_write_bytes(plan.out / "compare.md", markdown(plan, summary, len(keys), seconds).encode())
        plot(plan, summary, evals, plan.out / "compare.png")
        print(f"[compare] wrote {plan.out / 'compare.md'}, compare.json, compare.png", file=stream, flush=True)
    return result


def _close_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    from alignopsd.engine.commands.options import add_run_args

    p = argparse.ArgumentParser(
        prog="alignopsd compare",
        description="Train estimators side by side from the same weights, tasks and seeds; compare held-out success.",
    )
    add_run_args(p)
    p.add_argument("--estimators", default="grpo,alignopsd", help="comma-separated estimators (default grpo,alignopsd)")
    p.add_argument("--seeds", type=int, default=3, help="number of seeds: S, S+1, ... (default 3)")
    p.add_argument("--first-seed", type=int, default=None, help="the first seed S (default: trainer.seed)")
    p.add_argument("--steps", type=int, required=True, help="training steps of every run")
    p.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="held-out evaluation every K steps, besides before and after training (default steps/10; "
        "0: only before and after)",
    )
    p.add_argument(
        "--val-seed",
        type=int,
        default=None,
        help="seed of the held-out games, one for all runs (default: trainer.seed)",
    )
    p.add_argument("--out", default=None, help="output folder (default runs/compare-<config name>)")
    return p


def main(argv: list[str] | None = None) -> int:
    import logging

    from alignopsd.engine.checkpoint.checkpoint import UnsafeStateError

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        run(
            args.config,
            estimators=args.estimators.split(","),
            seeds=args.seeds,
            steps=args.steps,
            eval_every=args.eval_every,
            out=args.out,
            overrides=args.overrides,
            val_seed=args.val_seed,
            first_seed=args.first_seed,
        )
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except UnsafeStateError as exc:  # a checkpoint to resume from that fails its checks
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
