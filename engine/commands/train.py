"""``alignopsd train --config FILE [--set k=v ...] [--resume auto]``: one run of the training loop.

Also runs under ``torchrun --nproc_per_node=N``. The loop itself, its files and its exit statuses:
engine/run/trainer.py.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from alignopsd.engine.checkpoint.checkpoint import UnsafeStateError
from alignopsd.engine.commands.options import add_run_args
from alignopsd.engine.config.preflight import preflight
from alignopsd.engine.config.schema import ConfigError, RunConfig, load_config
from alignopsd.engine.infra.allocator import allocator_line
from alignopsd.engine.infra.writes import WriteFailure
from alignopsd.engine.infra.writes import report as report_write_failure
from alignopsd.engine.run.attempts import record_failure
from alignopsd.engine.run.preemption import EXIT_PREEMPTED, Preempted
from alignopsd.engine.run.restarts import EXIT_REPEATED, begin_attempt, launch_identity, stop_agent
from alignopsd.engine.run.resume import prepare_resume
from alignopsd.engine.run.trainer import Trainer

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="alignopsd train", description="Train a policy with AlignOPSD or a baseline.")
    add_run_args(p)
    p.add_argument("--resume", default=None, help="'auto' (newest verified checkpoint), a checkpoint path, or none")
    p.add_argument("--output-dir", default=None, help="override output_dir (default runs/<config name>)")
    p.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume even though the config differs from the checkpoint's in settings that change training",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = list(args.overrides)
    if args.output_dir:
        overrides.append(f"output_dir={args.output_dir}")

    rank = int(os.environ.get("RANK", "0"))
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if rank == 0 else (lambda line: None)
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    attempt = _Attempt(cfg.out_dir, rank, 0)
    try:
        # every rank reads what the attempts before it died of (a restart waits, or stops, by trainer.restarts)
        number = begin_attempt(cfg.out_dir, cfg.trainer.restarts, launch_identity(cfg), rank, say)
        if number is None:
            stop_agent()
            return EXIT_REPEATED
        attempt.number = number
        return _run(args, cfg, say, attempt)
    except BaseException as exc:
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            attempt.failed(exc)
        raise


class _Attempt:
    """This process's part of one attempt: its trainer once built, and the record of its failure (its own, or a
    peer's seen through a collective: engine/run/attempts.py) at the step it was running."""

    def __init__(self, out_dir, rank: int, number: int) -> None:
        self.out_dir, self.rank, self.number = out_dir, rank, number
        self.trainer: Trainer | None = None

    def failed(self, exc: BaseException) -> None:
        record_failure(self.out_dir, self.rank, 0 if self.trainer is None else self.trainer.step + 1, exc)


def _run(args, cfg: RunConfig, say, attempt: _Attempt) -> int:
    """The attempt after its start is recorded: config checks, the resume, the trainer and its steps; a failure the
    command turns into an exit status is recorded all the same (``attempts.record_failure``)."""
    try:  # every config error before anything heavy loads: the machine, the checkpoint to resume
        preflight(cfg)
        prepared = prepare_resume(
            cfg,
            args.resume,
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            allow_changes=args.allow_config_change,
            say=say,
        )
    except ConfigError as exc:
        attempt.failed(exc)
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    resume = prepared[0]
    if resume is None and args.resume == "auto" and attempt.number > 1:
        where = cfg.out_dir / "checkpoints"
        say(
            f"[train] attempt {attempt.number}: --resume auto found no checkpoint under {where} (no step was saved): "
            "starting fresh"
        )
    if attempt.rank == 0:
        print(cfg.dtype_line(), flush=True)
        print(f"[memory] {allocator_line()}", flush=True)
        if busy := machine_busy(cfg):
            print(busy, flush=True)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        trainer = Trainer(cfg)
    except ConfigError as exc:  # the output folder's lock, the data-parallel split, the device
        attempt.failed(exc)
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    attempt.trainer = trainer
    try:
        trainer.fit(allow_config_change=args.allow_config_change, prepared=prepared)  # the resume checked above
    except UnsafeStateError as exc:
        attempt.failed(exc)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:  # what only the built run can check: the kind of checkpoint, a LoRA adapter's base
        attempt.failed(exc)
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except WriteFailure as exc:  # a full disk, a file size limit or an I/O error (engine/infra/writes.py)
        return report_write_failure(exc, "alignopsd train")
    except Preempted as exc:
        if trainer.rank == 0:
            print(f"[train] {exc}", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    finally:
        trainer.dist.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())


def machine_busy(cfg: RunConfig) -> str | None:
    """The line that names a busy machine (engine/parallel/load.py) for a CPU run: its ranks on this machine
    (``LOCAL_WORLD_SIZE``) times their threads (``trainer.torch_threads``, else torch's)."""
    import torch
    from alignopsd.engine.parallel.hardware import device_type
    from alignopsd.engine.parallel.load import busy_line

    if device_type(cfg.trainer.device) != "cpu":
        return None
    threads = cfg.trainer.torch_threads or torch.get_num_threads()
    return busy_line(threads * max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
