"""``alignopsd profile``: run a few training steps and print the per-phase cost table (engine/observe/profiler.py).

Also runs under ``torchrun`` (data or tensor parallel, e.g. the Megatron backend at TP=2): every rank runs the
steps (they are collective), rank 0 prints the tables and writes ``--json``; the times are rank 0's and the
counts (rows, turns, token lengths) are the metrics reduced over the data-parallel ranks as in training. Each rank
writes its own torch.profiler trace (``trace_<estimator>.json`` on rank 0, ``trace_<estimator>.rank<r>.json``
on the others).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import torch
from alignopsd.engine.commands.options import add_run_args
from alignopsd.engine.config.preflight import preflight
from alignopsd.engine.config.schema import ConfigError, RunConfig, load_config
from alignopsd.engine.observe.cuda_syncs import CudaSyncCounter
from alignopsd.engine.observe.profiler import SUMMARY_KEYS, format_side_by_side, format_table, summarize, write_json
from alignopsd.engine.run.process import Dist, pick_device
from alignopsd.engine.run.trainer import Trainer
from alignopsd.engine.step.recipe import run_step

# step metrics kept in the summary as ``counts`` (per step, reduced over data-parallel ranks): batch size and lengths
COUNT_METRICS = (
    "batch/rows",
    "batch/turns",
    "rollout/prompt_length_mean",
    "rollout/response_length_mean",
    "rollout/response_length_max",
    "m1/teacher_forcing_row_count",
    "m1/teacher_forcing_token_forwards",
    "actor/old_logprob_token_forwards",
    "rollout/prefill_token_forwards",
    "rollout/prefill_token_forwards_unshared",
    "m1/teacher_prefill_token_forwards",
    "m1/teacher_prefill_token_forwards_unshared",
    "m1/teacher_tokens_generated",
    "m1/teacher_response_length_mean",
    "m1/teacher_forcing_cached_prompts",
    "actor/padding_fraction",  # computed positions that carry no token: the update's forwards
    "actor/padding_fraction_old_logprob",  # and the old log-prob pass's
)


def profile_run(
    cfg: RunConfig, steps: int, *, trace_path: str | Path | None = None, warmup: int = 0, dist: Dist | None = None
) -> dict:
    """Run ``steps`` training steps of ``cfg`` (no checkpoints, no metrics files) and summarise their phases.

    The last step runs under ``torch.profiler`` (CPU activities, plus CUDA when available) and its
    Chrome trace is written to ``trace_path``; the trace shows the ``phase/<name>`` ranges. With two or more
    steps the traced step is left out of the summary (the profiler slows it down); with one step it is the
    summary. Under torchrun every rank calls this (``dist``: the process group, shared by successive runs); each
    rank gets the same counts and its own times, and rank r > 0 writes its trace beside ``trace_path`` with
    ``.rank<r>`` before the suffix.
    """
    if steps < 1:
        raise ValueError(f"steps: must be >= 1, got {steps}")
    trainer = Trainer(cfg, dist=dist, lock_output=False)  # writes only its own trace files
    parts = trainer.parts
    if trace_path is not None and trainer.rank > 0:
        trace_path = Path(trace_path).with_suffix(f".rank{trainer.rank}{Path(trace_path).suffix}")
    counts: list[dict[str, float]] = []
    syncs_ctx = contextlib.ExitStack()
    try:
        if (
            parts.device.type == "cuda"
        ):  # host syncs per phase from torch's sync debug mode (engine/observe/cuda_syncs.py)
            syncs_ctx.enter_context(CudaSyncCounter())
        if parts.encoder_factory is not None:
            parts.get_encoder()  # loaded once per run, not a cost of the step that first encodes
        for s in range(steps):
            if trace_path is not None and s == steps - 1:
                acts = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                with torch.profiler.profile(activities=acts, record_shapes=False) as prof:
                    out = run_step(parts, s)
                Path(trace_path).parent.mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(trace_path))
            else:
                out = run_step(parts, s)
            m = trainer.reduce_metrics(out.metrics)  # collective under torchrun
            counts.append({k: m[k] for k in COUNT_METRICS if k in m})
    finally:
        syncs_ctx.close()
        parts.close()
    p = parts.profiler
    hist, secs, syncs = p.history, p.step_seconds, p.sync_history
    if trace_path is not None and steps >= 2:  # the traced step carries the profiler's own overhead
        hist, secs, counts, syncs = hist[:-1], secs[:-1], counts[:-1], syncs[:-1]
    return summarize(
        hist, secs, skip=min(warmup, len(hist) - 1), counts=counts, syncs=syncs or None, peaks=p.peak_history
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="alignopsd profile", description="Per-phase cost of a training step.")
    add_run_args(ap)
    ap.add_argument("--steps", type=int, default=3, help="steps to run and average (default 3)")
    ap.add_argument("--warmup", type=int, default=0, help="leading steps left out of the average")
    ap.add_argument(
        "--estimators",
        default=None,
        help="comma-separated estimators to profile one after the other (e.g. grpo,alignopsd)",
    )
    ap.add_argument("--json", default=None, help="write the summary JSON here (one estimator: the card's schema)")
    ap.add_argument("--trace-dir", default=None, help="torch.profiler traces go here (default <run dir>/profile)")
    ap.add_argument(
        "--cost", action="store_true", help="then per-phase work, efficiency against this device's limits, prediction"
    )
    ap.add_argument("--cost-out", default=None, help="with --cost: also write the tables (markdown) here")
    ap.add_argument(
        "--no-trace", action="store_true", help="no torch.profiler step (else the traced last step is left out)"
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    load0 = os.getloadavg()  # for --cost-out: the load when the run started and when it ended
    if args.warmup >= args.steps - (0 if args.no_trace or args.steps < 2 else 1):
        print(
            f"--warmup: {args.warmup} leaves no measured step of --steps {args.steps}"
            f"{'' if args.no_trace else ' (the last, traced, step is left out; see --no-trace)'}",
            file=sys.stderr,
        )
        return 2
    names = [e.strip() for e in args.estimators.split(",")] if args.estimators else [None]
    try:  # every phase is measured: steps without learnable signal are not skipped here
        extra = ["trainer.ppo.skip_no_signal=false"]
        cfgs = [
            load_config(args.config, [*extra, *args.overrides, *([f"algorithm.estimator={n}"] if n else [])])
            for n in names
        ]
        for cfg in cfgs:
            preflight(cfg)
        device = pick_device(cfgs[0], int(os.environ.get("LOCAL_RANK", "0")))
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":
        print(cfgs[0].dtype_line(), flush=True)
    dist = Dist(device.type)  # one process group for every estimator's run (torchrun); no-op single-process
    summaries: dict[str, dict] = {}
    try:
        for cfg in cfgs:
            est = cfg.algorithm_name()
            trace_dir = Path(args.trace_dir) if args.trace_dir else cfg.out_dir / "profile"
            trace = None if args.no_trace else trace_dir / f"trace_{cfg.algorithm.estimator}.json"
            s = profile_run(cfg, args.steps, trace_path=trace, warmup=args.warmup, dist=dist)
            summaries[est] = s
            if dist.rank == 0:
                where = f" (rank 0 of {dist.world_size})" if dist.enabled else ""
                print(format_table(s, f"{cfg.name}: {est}{where}"))
                print(f"torch.profiler trace: {trace}\n" if trace else "", flush=True)
    finally:
        dist.close()
    if dist.rank != 0:
        return 0
    tables = [format_side_by_side(summaries)] if len(summaries) > 1 else []
    if tables:
        print(tables[0])
    if args.cost:  # engine/lab/efficiency.py: calibrated after the steps, under the same load
        from alignopsd.engine.lab.calibration import calibrate_phases
        from alignopsd.engine.lab.efficiency import cost_report

        try:  # the steps' tables are printed already: a model the cost model cannot size is one line, not a crash
            rates = calibrate_phases(cfgs[0], device)  # the phases' own code paths: the prediction
            tables.append(cost_report(summaries, cfgs[0], device, world_size=dist.world_size, rates=rates))
        except ValueError as exc:
            tables.append(f"cost model: {exc}")
        print("\n" + tables[-1], flush=True)
        if args.cost_out:
            from alignopsd.engine.lab.efficiency import provenance

            each = [format_table(s, f"{cfgs[0].name}: {e}") for e, s in summaries.items()]
            Path(args.cost_out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.cost_out).write_text("\n\n".join([provenance(argv, load0), *each, *tables]) + "\n")
    if args.json:
        if len(summaries) == 1:
            write_json(next(iter(summaries.values())), args.json)
        else:
            out = {k: {f: v[f] for f in SUMMARY_KEYS if f in v} for k, v in summaries.items()}
            Path(args.json).write_text(json.dumps(out, indent=2))
    return 0
