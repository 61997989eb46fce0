"""``alignopsd sft``: the supervised warm start on expert walkthroughs, and the quickstart pipeline built on it.

``alignopsd sft --config FILE --out DIR [--steps N] [--set k=v ...]`` fine-tunes the config's model on the expert
turns of its training games (its environment's expert data: ALFWorld's walkthroughs) and writes a Hugging Face
checkpoint (safetensors, config, tokenizer) that a run then starts from with ``model.name: DIR``
(engine/run/warm_start.py). ``--pipeline`` runs the whole quickstart instead (engine/run/pipeline.py): held-out
evaluation of the base model, the warm start, its evaluation, the RL run continuing from it, and the RL model's
evaluation, all on the same held-out games; the three held-out rows are printed and written into ``report.md``.
``--easy-games`` plays generated pick-and-place games in small rooms whose expert walkthrough fits the turn limit.
The pipeline's first lines give the CPU profile (torch's kernel capability, the native-bf16 verdict, the dtype) and
an estimate of each stage's time from a few seconds of calibration on the run's own code paths
(engine/lab/estimate.py); ``--estimate`` prints them and exits.

The command parses its arguments and checks what is cheap to check (the config, a given warm start, the trackers,
the environment's expert data) before anything heavy loads; the work is engine/run/'s.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from alignopsd.engine.observe.memory import StageLog
from alignopsd.engine.run.pipeline import EASY_MAX_WALKTHROUGH, derived_config, easy_games_root, run_pipeline
from alignopsd.engine.run.warm_start import (
    SFT_MARKER,
    build_examples,
    check_warm_start,
    encode_turn,
    run_sft,
    warm_start,
)

if TYPE_CHECKING:
    from alignopsd.engine.config.schema import RunConfig

__all__ = [  # the warm start's and the pipeline's names, as this module gave them before they moved to engine/run/
    "EASY_MAX_WALKTHROUGH",
    "SFT_MARKER",
    "add_sft_args",
    "build_examples",
    "check_warm_start",
    "derived_config",
    "easy_games_root",
    "encode_turn",
    "main",
    "pipeline_estimate",
    "run_pipeline",
    "run_sft",
    "warm_start",
]


def pipeline_estimate(cfg: RunConfig, args) -> str:
    """The CPU profile line and the pipeline's estimated stage times from a short calibration in this process
    (engine/lab/estimate.py)."""
    import torch
    from alignopsd.engine.lab.calibration import calibrate_phases
    from alignopsd.engine.lab.estimate import (
        cpu_profile_line,
        estimate_pipeline,
        format_estimate,
        peak_memory_line,
    )
    from alignopsd.engine.models.loading import parse_dtype
    from alignopsd.engine.models.shapes import resolve_shape
    from alignopsd.engine.observe.memory import rss_bytes
    from alignopsd.engine.parallel.load import busy_line
    from alignopsd.engine.run.policy_builders import micro_batch_tokens
    from alignopsd.engine.run.process import pick_device

    from alignopsd.estimators import get_estimator

    device = pick_device(cfg)
    games = easy_games_root(cfg, generate=False)[1] if args.easy_games else 0
    rates = calibrate_phases(cfg, device)  # the warm start's step runs the update's calibrated paths
    shape = resolve_shape(cfg.model.name)
    stages = estimate_pipeline(cfg, shape, rates, steps=args.steps, batch=args.batch_size, games=games)
    if args.warm_start:  # given: not trained here
        stages = [s for s in stages if s.name != "warm start"]
    dtype = parse_dtype(cfg.model.dtype, device)
    tokens = micro_batch_tokens(cfg, shape, dtype, device)
    ref = get_estimator(cfg.algorithm.estimator).phases(cfg.algorithm).ref
    lines = [cpu_profile_line(cfg.model.dtype, device.type), format_estimate(stages, rates)]
    lines.append(peak_memory_line(cfg, shape, dtype, tokens, rss_bytes() or 0, reference=ref))
    busy = busy_line(torch.get_num_threads()) if device.type == "cpu" else None  # the run's threads (process_settings)
    if busy:  # the calibration ran under the same load; a load that comes or goes after it is not in the estimate
        lines.append(f"{busy}; the estimate's calibration ran under this load")
    return "\n".join(lines)


def add_sft_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="checkpoint folder (default: <run output>/sft)")
    p.add_argument("--steps", type=int, default=24, help="optimizer steps (batches of --batch-size expert turns)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--pipeline", action="store_true", help="base eval, warm start, eval, RL, eval (the quickstart)")
    p.add_argument("--warm-start", default=None, help="with --pipeline: use this checkpoint instead of training one")
    p.add_argument("--easy-games", action="store_true", help="pick-and-place games in small rooms (see doc)")
    p.add_argument(
        "--estimate", action="store_true", help="print the CPU profile and the pipeline's estimated time, then exit"
    )


def main(argv: list[str] | None = None) -> int:
    from alignopsd.engine.commands.options import add_run_args
    from alignopsd.engine.config.schema import ConfigError, load_config
    from alignopsd.engine.envs.registry import expert_data_of
    from alignopsd.engine.infra.writes import WriteFailure
    from alignopsd.engine.infra.writes import report as report_write_failure

    p = argparse.ArgumentParser(prog="alignopsd sft", description="Supervised warm start on expert walkthroughs.")
    add_run_args(p)
    add_sft_args(p)
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.lr <= 0:
        p.error("--steps and --batch-size must be >= 1 and --lr > 0")
    overrides = list(args.overrides or [])
    try:
        cfg = load_config(args.config, overrides)
        if args.warm_start:
            check_warm_start(args.warm_start, cfg.model.name)
        elif not args.estimate:  # the warm start plays its environment's expert episodes
            expert_data_of(cfg.env.name)
        if args.pipeline:  # its RL stage logs to trainer.logging.loggers: a tracker that cannot start fails here
            from alignopsd.engine.config.logger_check import check_loggers

            check_loggers(cfg.trainer, cfg.out_dir, os.environ)
    except (ConfigError, ValueError) as exc:
        print(f"alignopsd sft: {exc}", file=sys.stderr)
        return 2
    print(cfg.dtype_line(), flush=True)
    if args.pipeline or args.estimate:  # the first lines say what the run will cost
        print(pipeline_estimate(cfg, args), flush=True)
        if args.estimate:
            return 0
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")  # as `alignopsd train`
    stages = StageLog()
    if args.easy_games:
        with stages.stage("games"):
            cfg = derived_config(cfg, env={"data_dir": str(easy_games_root(cfg)[0])})
    out = Path(args.out) if args.out else cfg.out_dir / "sft"
    try:
        if not args.pipeline:
            run_sft(cfg, out, steps=args.steps, lr=args.lr, batch_size=args.batch_size)
            print(f"[sft] checkpoint: {out}")
            return 0
        run_pipeline(cfg, args, out, stages=stages)
    except WriteFailure as exc:  # a full disk, a file size limit or an I/O error (engine/infra/writes.py)
        return report_write_failure(exc, "alignopsd sft")
    return 0


if __name__ == "__main__":
    sys.exit(main())
