"""``alignopsd profile``: run a few training steps and print the per-phase cost table (engine/profiler.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .config import ConfigError, load_config
from .preflight import preflight
from .profiler import format_side_by_side, format_table, summarize, write_json
from .step import run_step
from .train import Trainer, add_run_args


def profile_run(cfg, steps: int, *, trace_path: str | Path | None = None, warmup: int = 0) -> dict:
    """Run ``steps`` training steps of ``cfg`` (no checkpoints, no metrics files) and summarise their phases.

    The last step runs under ``torch.profiler`` (CPU activities, plus CUDA when available) and its
    Chrome trace is written to ``trace_path``; the trace shows the ``phase/<name>`` ranges. With two or more
    steps the traced step is left out of the summary (the profiler slows it down); with one step it is the
    summary.
    """
    if steps < 1:
        raise ValueError(f"steps: must be >= 1, got {steps}")
    trainer = Trainer(cfg)
    parts = trainer.parts
    try:
        for s in range(steps):
            if trace_path is not None and s == steps - 1:
                acts = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                with torch.profiler.profile(activities=acts, record_shapes=False) as prof:
                    run_step(parts, s)
                Path(trace_path).parent.mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(trace_path))
            else:
                run_step(parts, s)
    finally:
        parts.close()
    p = parts.profiler
    hist, secs = p.history, p.step_seconds
    if trace_path is not None and steps >= 2:  # the traced step carries the profiler's own overhead
        hist, secs = hist[:-1], secs[:-1]
    return summarize(hist, secs, skip=min(warmup, len(hist) - 1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="alignopsd profile", description="Per-phase cost of a training step.")
    add_run_args(ap)
    ap.add_argument("--steps", type=int, default=3, help="steps to run and average (default 3)")
    ap.add_argument("--warmup", type=int, default=0, help="leading steps left out of the average")
    ap.add_argument("--estimators", default=None,
                    help="comma-separated estimators to profile one after the other (e.g. grpo,alignopsd)")  # fmt: skip
    ap.add_argument("--json", default=None, help="write the summary JSON here (one estimator: the card's schema)")
    ap.add_argument("--trace-dir", default=None, help="torch.profiler traces go here (default <run dir>/profile)")
    args = ap.parse_args(argv)
    names = [e.strip() for e in args.estimators.split(",")] if args.estimators else [None]
    try:  # every phase is measured: steps without learnable signal are not skipped here
        extra = ["trainer.skip_no_signal=false"]
        cfgs = [load_config(args.config, [*extra, *args.overrides, *([f"algorithm.estimator={n}"] if n else [])])
                for n in names]  # fmt: skip
        for cfg in cfgs:
            preflight(cfg)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    summaries: dict[str, dict] = {}
    for cfg in cfgs:
        est = cfg.algorithm_name()
        trace_dir = Path(args.trace_dir) if args.trace_dir else cfg.out_dir / "profile"
        trace = trace_dir / f"trace_{cfg.algorithm.estimator}.json"
        s = profile_run(cfg, args.steps, trace_path=trace, warmup=args.warmup)
        summaries[est] = s
        print(format_table(s, f"{cfg.name}: {est}"))
        print(f"torch.profiler trace: {trace}\n", flush=True)
    if len(summaries) > 1:
        print(format_side_by_side(summaries))
    if args.json:
        if len(summaries) == 1:
            write_json(next(iter(summaries.values())), args.json)
        else:
            out = {
                k: {f: v[f] for f in ("phases", "step_seconds", "alignment_seconds", "overhead_vs_grpo")}
                for k, v in summaries.items()
            }
            Path(args.json).write_text(json.dumps(out, indent=2))
    return 0
