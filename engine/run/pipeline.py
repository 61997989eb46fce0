"""The quickstart pipeline (``alignopsd sft --pipeline``, ``make run``): held-out evaluation of the base model, the
warm start, its evaluation, the RL run starting from it, and the RL model's evaluation, all on the same held-out
games; the three held-out rows are printed and written into ``report.md``.

One session (engine/run/session.py) carries the whole pipeline: one environment plays the warm start's expert
episodes, the RL run's episodes and the held-out games of the three evaluations, one generator samples for all of
them (one engine start under vLLM), and one policy is evaluated as the base model, warm-started, evaluated again and
continued into RL in memory, its optimizer started afresh with the RL run's settings through the policy backend
(``Session.for_run``). The warm start's folder is still written (``runs/<name>/sft`` by default: a later run starts
from it with ``model.name``), and the RL run's config names it as its model, as a run started from the folder would:
its checkpoints, stored config and resume are those of that run. Its first step computes what it computes after
loading the folder back (tests/engine/test_pipeline.py). A LoRA policy's RL run trains fresh adapters over the
merged weights the warm start wrote, so its policy is built from that folder; ``--warm-start DIR`` builds the given
folder's policy for its evaluation and the RL run.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from alignopsd.engine.observe.memory import StageLog
from alignopsd.engine.observe.report import heldout_table, write_report
from alignopsd.engine.run.heldout import heldout_metrics
from alignopsd.engine.run.policy_builders import build_policy
from alignopsd.engine.run.session import Session, open_session
from alignopsd.engine.run.trainer import Trainer
from alignopsd.engine.run.warm_start import warm_start, warm_start_optimizer

if TYPE_CHECKING:
    from alignopsd.engine.config.schema import RunConfig


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


def _heldout(session: Session, label: str, stages: StageLog, stream) -> dict:
    """One held-out evaluation of the session's policy, timed as the stage ``eval <label>``; its row."""
    cfg = session.cfg
    print(f"[quickstart] held-out evaluation: {label} ({cfg.env.val_tasks} games)", file=stream, flush=True)
    with stages.stage(f"eval {label}"):
        m = heldout_metrics(session)
    row = {
        "success": m.get("episode/success_rate"),
        "valid": m.get("episode/valid_action_rate"),
        "turns": m.get("episode/turns_mean"),
        "episodes": int(m.get("episode/count", 0)),
    }
    print(f"[quickstart] {label}: {row}", file=stream, flush=True)
    return row


def run_pipeline(cfg: RunConfig, args, sft_out: Path, *, stages: StageLog | None = None, stream=None) -> dict:
    """The quickstart (see the module doc): base eval -> warm start -> eval -> RL from the warm start -> eval;
    report.md gets the three held-out rows and each stage's seconds and peak resident memory (added to ``stages``).
    Returns {"heldout": {stage: row}, "times": {stage: seconds}, "peaks": {stage: bytes}}. ``args``: ``steps``,
    ``lr``, ``batch_size``, ``warm_start`` (the options of ``alignopsd sft``). ``cfg`` (parsed by the caller) gives
    the RL run's config by :func:`derived_config`."""
    stream = stream if stream is not None else sys.stdout
    stages = StageLog() if stages is None else stages
    sft_out = Path(args.warm_start) if args.warm_start else sft_out
    rl_cfg = derived_config(
        cfg,
        model={"name": str(sft_out)},
        trainer={"validation": cfg.trainer.validation.model_copy(update={"after_train": False})},
    )
    session = open_session(cfg, optim=warm_start_optimizer(args.lr, args.steps))
    try:
        rows = {f"base ({cfg.model.name})": _heldout(session, "base", stages, stream)}
        if args.warm_start:  # given: its own weights, loaded as a run started from the folder loads them
            session = session.with_policy(rl_cfg, build_policy(rl_cfg, session.device, session.dist.world_size))
        else:
            with stages.stage("warm start"):
                warm_start(session, sft_out, steps=args.steps, batch_size=args.batch_size, lr=args.lr, stream=stream)
        rows["after warm start"] = _heldout(session, "warm start", stages, stream)
        if not args.warm_start:
            session = rl_session(session, rl_cfg)
        rows.update(_rl_stage(session, stages, stream))
    finally:
        session.close()
        session.dist.close()
    table = heldout_table(rows, stages.seconds, stages.peaks)
    print(table, file=stream, flush=True)
    if rl_cfg.trainer.logging.report:
        write_report(rl_cfg.out_dir, title=f"{rl_cfg.name}: {rl_cfg.algorithm_name()}", extra=table)
    return {"heldout": rows, "times": stages.seconds, "peaks": stages.peaks}


def rl_session(session: Session, rl_cfg: RunConfig) -> Session:
    """The RL run's session after the warm start of ``session``'s policy, whose weights were written to
    ``rl_cfg.model.name``: the same policy, its optimizer started afresh for the run (``Session.for_run``); a LoRA
    policy's run trains fresh adapters over the merged weights, so its policy is built from the folder (the rows it
    measured taken, not measured again)."""
    policy = session.policy
    if policy.adapter is None:
        return session.for_run(rl_cfg)
    rebuilt = build_policy(rl_cfg, session.device, session.dist.world_size, rows=policy.rows.choice)
    return session.with_policy(rl_cfg, rebuilt)


def _rl_stage(session: Session, stages: StageLog, stream) -> dict:
    """The RL run on ``session`` and its policy's evaluation (see :func:`run_pipeline`)."""
    cfg = session.cfg
    with stages.stage("RL steps"):
        Trainer.from_session(session, stream=stream).fit()
    return {f"after {cfg.trainer.total_steps} RL steps": _heldout(session, "RL", stages, stream)}
