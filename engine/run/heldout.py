"""Held-out evaluation without a Trainer: the config's held-out games played by a session's policy.

``alignopsd eval`` opens a session (policy, generator, games) and plays its held-out games once; the quickstart
pipeline (engine/run/pipeline.py) plays them with its one session's policy as the base model, after the warm start
and after the RL run, with the session's one generator (one engine start under vLLM, not one per evaluation). The
pass is the trainer's validation pass at step 0 (``run_validation``: group size 1, the validation sampling and
seeds), the policy's weights pushed into the generator first where it has an engine of its own, and its metrics
reduced over the data-parallel ranks as the trainer reduces them.
"""

from __future__ import annotations

from alignopsd.engine.run.components import Games, build_games
from alignopsd.engine.run.session import Session
from alignopsd.engine.step.components import Components
from alignopsd.engine.step.episodes import run_validation

from alignopsd.estimators import get_estimator


def heldout_games(cfg) -> Games:
    """The environment and tasks of ``cfg`` (``env.val_split``, ``env.val_tasks`` held out), as a run builds them."""
    return build_games(cfg)


def heldout_metrics(session: Session) -> dict[str, float]:
    """The validation metrics of the session's policy on its held-out games (see the module doc): every rank of the
    session calls it."""
    cfg, policy, dist = session.cfg, session.policy, session.dist
    lay = policy.layout
    rank, world = dist.rank, dist.world_size
    if lay.dp_group is not None:  # tensor parallelism: the ranks of one group play the same tasks
        rank, world = lay.dp_rank, lay.dp_size
    games = session.games
    parts = Components(
        cfg=cfg,
        device=session.device,
        rank=rank,
        world_size=world,
        tokenizer=session.tokenizer,
        policy=policy,
        generator=session.generator,
        env=games.env,
        train_tasks=[],
        val_tasks=games.val_tasks,
        estimator=get_estimator(cfg.algorithm.estimator),
        dp_group=lay.dp_group,
        skill_lookup=games.skills,
    )
    parts.sync_weights()  # a no-op where the generator samples from the policy's own module
    return dist.reduce_metrics(run_validation(parts, 0), lead=lay.is_group_lead)
