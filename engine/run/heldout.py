"""Held-out evaluation without a Trainer: the config's held-out games played by a policy that is already built.

``alignopsd eval`` builds the policy once and plays the games; the quickstart pipeline (engine/commands/sft.py)
builds the held-out games' environment once and plays them with the base policy, the warm-started one and the RL
run's, each built once for its role. The pass is the trainer's validation pass at step 0 (``run_validation``:
group size 1, the validation sampling and seeds), with a generator built over the given policy for it (a
Hugging Face generator only wraps the policy's module; an engine of its own first receives the policy's weights),
and its metrics reduced over the data-parallel ranks as the trainer reduces them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from alignopsd.engine.config.schema import RunConfig
from alignopsd.engine.envs.manager import EnvManager
from alignopsd.engine.envs.skills import skill_lookup
from alignopsd.engine.observe.strict import strict
from alignopsd.engine.parallel.collectives import reduce_metrics
from alignopsd.engine.policy.base import PolicyBackend
from alignopsd.engine.run.components import build_env, build_generator
from alignopsd.engine.run.process import Dist
from alignopsd.engine.step.components import Components
from alignopsd.engine.step.episodes import run_validation

from alignopsd.estimators import get_estimator


@dataclass
class HeldoutGames:
    """The held-out games of a config and the environment that plays them, built once and played by every
    evaluation that shares them (:meth:`close` ends the environment's workers)."""

    env: EnvManager
    tasks: list
    skills: Callable[[dict], str] | None = None  # env.skills_dir's bank (None: the packaged bank)

    def close(self) -> None:
        self.env.close()


def heldout_games(cfg: RunConfig) -> HeldoutGames:
    """The environment and held-out tasks (``env.val_split``, ``env.val_tasks``) of ``cfg``, as a run builds them."""
    env, _, val_tasks = build_env(cfg)
    skills = skill_lookup(cfg.env.name, cfg.env.skills_dir) if cfg.env.skills_dir else None
    return HeldoutGames(env=env, tasks=val_tasks, skills=skills)


def heldout_metrics(
    cfg: RunConfig,
    policy: PolicyBackend,
    tokenizer,
    games: HeldoutGames,
    *,
    device: torch.device,
    dist: Dist | None = None,
) -> dict[str, float]:
    """The validation metrics of ``policy`` on ``games`` (see the module doc): every rank of the run calls it
    (``dist``: the run's processes; None: this one alone)."""
    generator = build_generator(cfg, policy, tokenizer, device)
    lay = policy.layout
    rank, world = (dist.rank, dist.world_size) if dist is not None else (0, 1)
    if lay.dp_group is not None:  # tensor parallelism: the ranks of one group play the same tasks
        rank, world = lay.dp_rank, lay.dp_size
    parts = Components(
        cfg=cfg,
        device=device,
        rank=rank,
        world_size=world,
        tokenizer=tokenizer,
        policy=policy,
        generator=generator,
        env=games.env,
        train_tasks=[],
        val_tasks=games.tasks,
        estimator=get_estimator(cfg.algorithm.estimator),
        dp_group=lay.dp_group,
        skill_lookup=games.skills,
    )
    try:
        parts.sync_weights()  # a no-op where the generator samples from the policy's own module
        metrics = run_validation(parts, 0)
    finally:
        if generator is not None:
            generator.close()
    if dist is None:
        return reduce_metrics([metrics], strict=strict())
    return dist.reduce_metrics(metrics, lead=lay.is_group_lead)
