"""Supervised warm start on expert walkthroughs, and the quickstart pipeline built on it.

``alignopsd sft --config FILE --out DIR [--steps N] [--set k=v ...]`` fine-tunes the config's model on the expert
turns of its ALFWorld training games and writes a Hugging Face checkpoint (safetensors, config, tokenizer) that a
run then starts from with ``model.name: DIR``. ``--pipeline`` runs the whole quickstart instead: held-out
evaluation of the base model, the warm start, its evaluation, the RL run starting from it, and the RL model's
evaluation, all on the same held-out games; the three held-out rows are printed and written into ``report.md``.
``--easy-games`` plays generated pick-and-place games in small rooms whose expert walkthrough fits the turn limit.
The pipeline's first lines give the CPU profile (torch's kernel capability, the native-bf16 verdict, the dtype) and
an estimate of each stage's time from a few seconds of calibration on the run's own code paths
(engine/lab/estimate.py); ``--estimate`` prints them and exits.

The data (one example per expert turn): the prompt is what the rollout would give the policy at that turn (the
episode is played through the engine's :class:`EnvManager` with the expert's actions, and its user text goes
through the same chat template, tokenisation and left truncation as in ``rollout``); the response is
``<think>T</think><action>A</action>`` and the end-of-turn token, where A is the walkthrough's action and T a
short reasoning written from the game's own facts (task, target object and receptacle, what is held, the next
sub-goal). The loss is the next-token cross entropy on the response tokens only, averaged over them.

The training is the RL run's machinery with a supervised step recipe: the config's policy backend (Hugging Face,
its LoRA adapters, Megatron under tensor parallelism), its optimizer, and the engine's weight writer
(engine/run/warm_start.py, engine/step/supervised.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from alignopsd.engine.checkpoint.trainer_state import RowsChoice
from alignopsd.engine.envs.alfworld.expert import SEARCH_DETOURS, ExpertTurn, expert_turns
from alignopsd.engine.envs.prompts import chat_text
from alignopsd.engine.observe.memory import StageLog
from alignopsd.engine.run.warm_start import SFT_MARKER
from alignopsd.engine.tokens.layout import truncate_left
from alignopsd.engine.tokens.special import token_ids

if TYPE_CHECKING:
    from alignopsd.engine.config.schema import RunConfig


def encode_turn(tokenizer, turn: ExpertTurn, max_prompt_length: int, *, eos_id: int) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) of one example; the prompt exactly as the rollout tokenises it, the response
    closed with ``eos_id`` (the end-of-turn id of engine/tokens/special.py)."""
    ids = tokenizer(chat_text(tokenizer, turn.user_text), add_special_tokens=False)["input_ids"]
    ids, _ = truncate_left(ids, max_prompt_length)
    resp = tokenizer(turn.response, add_special_tokens=False)["input_ids"] + [int(eos_id)]
    return ids, resp


_SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def check_warm_start(path: str | Path, base: str) -> Path:
    """A warm-start checkpoint usable for model ``base``; ValueError naming the problem otherwise.

    Cheap (reads two JSON files): call it before anything heavy loads.
    """
    from alignopsd.engine.models.loading import resolve_model_path

    p = Path(path).expanduser()
    if not p.is_dir() or not (p / "config.json").is_file() or not any(p.glob("*.safetensors")):
        raise ValueError(
            f"warm start: {str(p)!r} is not a checkpoint folder (config.json + *.safetensors); "
            "write one with `alignopsd sft --config FILE --out DIR`"
        )
    marker = p / SFT_MARKER
    if marker.is_file():
        made_from = json.loads(marker.read_text()).get("base")
        if made_from != base:
            raise ValueError(f"warm start: {str(p)!r} was fine-tuned from {made_from!r}, not from model {base!r}")
    mine = json.loads((p / "config.json").read_text())
    theirs = json.loads((Path(resolve_model_path(base)) / "config.json").read_text())
    diff = [k for k in _SHAPE_KEYS if mine.get(k) != theirs.get(k)]
    if diff:
        raise ValueError(
            f"warm start: {str(p)!r} belongs to another model than {base!r} "
            f"({', '.join(f'{k} {mine.get(k)} vs {theirs.get(k)}' for k in diff)})"
        )
    return p


def build_examples(cfg: RunConfig, tokenizer, *, n_games: int | None = None) -> tuple[list[ExpertTurn], list]:
    """(expert turns, encoded examples) of the config's training games (ALFWorld only).

    Each game is played with :data:`SEARCH_DETOURS` searched receptacles before the walkthrough; its step limit
    is raised by the turns they may take, so every game gets them (the prompts are the rollout's otherwise)."""
    from alignopsd.engine.run.components import build_env

    if cfg.env.name != "alfworld":
        raise ValueError(f"env.name: the warm start needs expert walkthroughs (alfworld), got {cfg.env.name!r}")
    limit = cfg.env.max_turns + 2 * SEARCH_DETOURS
    derived = cfg.model_copy(update={"env": cfg.env.model_copy(update={"max_turns": limit})})
    manager, train_tasks, _ = build_env(derived.validate())  # a copy is not validated: check it as loading would
    try:
        seen, tasks = set(), []
        for t in train_tasks:  # the task pool may repeat games; one walkthrough each
            if t.key not in seen:
                seen.add(t.key)
                tasks.append(t)
        turns = expert_turns(
            manager,
            tasks[:n_games] if n_games else tasks,
            seed=cfg.trainer.seed,
            detours=SEARCH_DETOURS,
            max_turns=limit,
        )
    finally:
        manager.close()
    eos = token_ids(tokenizer).end_of_turn("close an expert response")
    return turns, [encode_turn(tokenizer, t, cfg.env.max_prompt_length, eos_id=eos) for t in turns]


def warm_start(
    cfg: RunConfig,
    policy,
    tokenizer,
    out_dir: str | Path,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    stream=None,
    write=True,
) -> Path:
    """The warm start of a built policy (engine/run/warm_start.py): expert examples of ``cfg``'s training games,
    ``steps`` supervised steps, the checkpoint in ``out_dir`` (written where ``write``; every rank gathers)."""
    from alignopsd.engine.run.policy_builders import micro_batch_tokens, policy_placement, shape_of
    from alignopsd.engine.run.warm_start import save_warm_start, train_supervised

    stream = stream if stream is not None else sys.stdout
    t0 = time.perf_counter()
    turns, examples = build_examples(cfg, tokenizer)
    n_tok = sum(len(p) + len(r) for p, r in examples)
    print(f"[sft] {len(turns)} expert turns, {n_tok} tokens ({time.perf_counter() - t0:.0f}s)", file=stream, flush=True)
    losses = train_supervised(
        policy,
        examples,
        pad_id=token_ids(tokenizer).pad,
        steps=steps,
        batch_size=batch_size,
        seed=cfg.trainer.seed,
        fused=cfg.trainer.ppo.fused_head_loss,
        stream=stream,
        token_budget=micro_batch_tokens(cfg, shape_of(policy.hf_config, cfg.model.name), *policy_placement(policy)),
    )
    meta = {
        "steps": steps,
        "lr": lr,
        "batch_size": batch_size,
        "examples": len(examples),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "seconds": time.perf_counter() - t0,
    }
    return save_warm_start(policy, tokenizer, out_dir, base=cfg.model.name, meta=meta, write=write)


def run_sft(cfg: RunConfig, out_dir: str | Path, *, steps: int, lr: float, batch_size: int, stream=None) -> Path:
    """``alignopsd sft``: the config's policy (its backend, LoRA adapters, tensor parallelism; every process of a
    ``torchrun`` launch) built with the warm start's optimizer, warm-started, written to ``out_dir``."""
    from alignopsd.engine.models.loading import load_tokenizer
    from alignopsd.engine.run.process import Dist, pick_device, process_settings
    from alignopsd.engine.run.warm_start import build_warm_start_policy

    device = pick_device(cfg, int(os.environ.get("LOCAL_RANK", "0")))  # trainer.device, as the RL run's
    dist = Dist(device.type)
    try:
        process_settings(cfg, dist.rank)
        tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.name)
        policy = build_warm_start_policy(cfg, device, steps=steps, lr=lr, world_size=dist.world_size)
        out = warm_start(
            cfg,
            policy,
            tokenizer,
            out_dir,
            steps=steps,
            batch_size=batch_size,
            lr=lr,
            stream=stream,
            write=dist.rank == 0,
        )
        dist.barrier()  # the folder is complete before any rank returns
    finally:
        dist.close()
    return out


def derived_config(cfg: RunConfig, **sections: dict):
    """``cfg`` with fields of its sections changed (``model={"name": ...}``), checked again as loading checks it:
    the pipeline's configs come from the one it parsed, the file is not read again."""
    update = {name: getattr(cfg, name).model_copy(update=values) for name, values in sections.items()}
    return cfg.model_copy(update=update).validate()


EASY_MAX_WALKTHROUGH = 8  # turn limit of the quickstart; the easy games' expert wins within it


def _easy_splits(cfg: RunConfig) -> tuple[tuple[str, int, int], ...]:
    return (cfg.env.split, cfg.env.num_games, 11), (cfg.env.val_split, cfg.env.val_tasks, 12)


def easy_games_root(cfg: RunConfig, *, generate: bool = True) -> tuple[Path, int]:
    """(folder, games not generated yet) of the easy games (official layout): pick-and-place in small rooms, expert
    walkthrough of at most ``EASY_MAX_WALKTHROUGH`` steps; ``env.num_games`` training and ``env.val_tasks`` held-out
    games, generated once (unless ``generate`` is false) and cached beside the generated splits."""
    from alignopsd.engine.envs.alfworld.env import default_cache_dir
    from alignopsd.engine.envs.alfworld.gen import generate_games

    if cfg.env.name != "alfworld":
        raise ValueError(f"--easy-games: only for env.name alfworld, got {cfg.env.name!r}")
    if cfg.env.max_turns < EASY_MAX_WALKTHROUGH:
        raise ValueError(f"--easy-games: env.max_turns must be >= {EASY_MAX_WALKTHROUGH}, got {cfg.env.max_turns}")
    missing = 0
    root = default_cache_dir() / f"easy-pick-w{EASY_MAX_WALKTHROUGH}-n{cfg.env.num_games}-v{cfg.env.val_tasks}"
    for split, n, seed in _easy_splits(cfg):
        done = root / f"COMPLETE-{split}"
        if done.exists() or not generate:
            missing += 0 if done.exists() else n
            continue
        print(f"[games] generating {n} easy {split} games under {root}", flush=True)
        generate_games(
            n,
            root,
            seed=seed,
            split=split,
            task_types=("pick_and_place_simple",),
            max_steps=EASY_MAX_WALKTHROUGH,
            max_tries_per_game=40,
            small=True,
        )
        done.write_text(str(n))
    return root, missing


def _heldout(cfg: RunConfig, policy, tokenizer, games, label: str, stages: StageLog, stream, *, device, dist) -> dict:
    from alignopsd.engine.run.heldout import heldout_metrics

    print(f"[quickstart] held-out evaluation: {label} ({cfg.env.val_tasks} games)", file=stream, flush=True)
    with stages.stage(f"eval {label}"):
        m = heldout_metrics(cfg, policy, tokenizer, games, device=device, dist=dist)
    row = {
        "success": m.get("episode/success_rate"),
        "valid": m.get("episode/valid_action_rate"),
        "turns": m.get("episode/turns_mean"),
        "episodes": int(m.get("episode/count", 0)),
    }
    print(f"[quickstart] {label}: {row}", file=stream, flush=True)
    return row


def run_pipeline(cfg: RunConfig, args, sft_out: Path, *, stages: StageLog | None = None, stream=None) -> dict:
    """The quickstart: base eval -> warm start -> eval -> RL from the warm start -> eval; report.md gets the
    three held-out rows and each stage's seconds and peak resident memory (added to ``stages``). Returns {"heldout":
    {stage: row}, "times": {stage: seconds}, "peaks": {stage: bytes}}. ``args``: ``steps``, ``lr``, ``batch_size``,
    ``warm_start`` (see :func:`add_sft_args`).

    Each part is built once: ``cfg`` (parsed by the caller) gives the RL run's config by :func:`derived_config`;
    one environment plays the held-out games of the three evaluations (engine/run/heldout.py, no Trainer); the base
    model's policy is evaluated, warm-started and evaluated again (with ``--warm-start DIR`` the warm start's own
    policy is built for its evaluation instead); the RL run's policy trains and is evaluated."""
    from alignopsd.engine.models.loading import load_tokenizer
    from alignopsd.engine.observe.report import heldout_table, write_report
    from alignopsd.engine.run.heldout import heldout_games
    from alignopsd.engine.run.process import Dist, pick_device, process_settings

    stream = stream if stream is not None else sys.stdout
    stages = StageLog() if stages is None else stages
    sft_out = Path(args.warm_start) if args.warm_start else sft_out
    rl_cfg = derived_config(
        cfg,
        model={"name": str(sft_out)},
        trainer={"validation": cfg.trainer.validation.model_copy(update={"after_train": False})},
    )
    device = pick_device(cfg, int(os.environ.get("LOCAL_RANK", "0")))
    dist = Dist(device.type)
    process_settings(cfg, dist.rank)
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.name)
    games = heldout_games(cfg)
    try:
        rows, chosen = _warm_stages(
            cfg, rl_cfg, args, sft_out, tokenizer, games, stages, stream, device=device, dist=dist
        )
        rows.update(_rl_stage(rl_cfg, games, stages, stream, dist=dist, chosen=chosen))
    finally:
        games.close()
        dist.close()
    table = heldout_table(rows, stages.seconds, stages.peaks)
    print(table, file=stream, flush=True)
    if rl_cfg.trainer.logging.report:
        write_report(rl_cfg.out_dir, title=f"{rl_cfg.name}: {rl_cfg.algorithm_name()}", extra=table)
    return {"heldout": rows, "times": stages.seconds, "peaks": stages.peaks}


def _warm_stages(
    cfg: RunConfig, rl_cfg: RunConfig, args, sft_out: Path, tokenizer, games, stages: StageLog, stream, *, device, dist
) -> tuple[dict, RowsChoice | None]:
    """The base model's evaluation, the warm start and its evaluation, on one policy (see :func:`run_pipeline`);
    returns the held-out rows and the packed-or-padded rows the warm start measured (None: not measured), which the
    RL run takes."""
    from alignopsd.engine.run.policy_builders import build_policy
    from alignopsd.engine.run.warm_start import build_warm_start_policy

    policy = build_warm_start_policy(cfg, device, steps=args.steps, lr=args.lr, world_size=dist.world_size)
    rows = {
        f"base ({cfg.model.name})": _heldout(
            cfg, policy, tokenizer, games, "base", stages, stream, device=device, dist=dist
        )
    }
    if args.warm_start:  # given: its own weights, loaded as the RL run will load them
        del policy
        policy = build_policy(rl_cfg, device, dist.world_size)
    else:
        with stages.stage("warm start"):
            warm_start(
                cfg,
                policy,
                tokenizer,
                sft_out,
                steps=args.steps,
                batch_size=args.batch_size,
                lr=args.lr,
                stream=stream,
                write=dist.rank == 0,
            )
            dist.barrier()
    rows["after warm start"] = _heldout(
        rl_cfg, policy, tokenizer, games, "warm start", stages, stream, device=device, dist=dist
    )
    return rows, policy.rows.choice


def _rl_stage(rl_cfg: RunConfig, games, stages: StageLog, stream, *, dist, chosen: RowsChoice | None = None) -> dict:
    """The RL run from the warm start, its policy's evaluation and the report (see :func:`run_pipeline`)."""
    from alignopsd.engine.run.trainer import Trainer

    with stages.stage("RL steps"):
        trainer = Trainer(rl_cfg, dist=dist, stream=stream, rows=chosen)
        trainer.fit()
    parts = trainer.parts  # its environment and generator closed with the run; the trained policy stays
    label = f"after {rl_cfg.trainer.total_steps} RL steps"
    rows = {
        label: _heldout(
            rl_cfg, parts.policy, parts.tokenizer, games, "RL", stages, stream, device=trainer.device, dist=dist
        )
    }
    return rows


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
