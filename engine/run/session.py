"""The session: what a run builds once, handed to everything that works on the run.

A :class:`Session` is frozen: the config, this process's device and processes (``Dist``: rank, world size, the
process group), the tokenizer and its token ids and the parts every consumer shares (:class:`BuiltParts`: the
policy, its generator, the environment with its tasks). The CPU paths measured while the policy was built are the
process's (kernels/native_choice.py, which checkpoints store); opening a session makes every rank take rank 0's.
``Trainer.from_session`` trains on one, the held-out evaluation plays its games with its generator
(engine/run/heldout.py), the warm start trains its policy on its environment's expert data
(engine/run/warm_start.py), and the quickstart pipeline (engine/run/pipeline.py) opens one session and carries it
from the base model's evaluation through the warm start into the RL run (:meth:`Session.for_run`).

Whoever opens a session closes it (:meth:`Session.close`: the environment's workers and the generator); a
``Trainer(cfg)`` opens and closes its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
from alignopsd.engine.checkpoint.trainer_state import RowsChoice
from alignopsd.engine.config.schema import RunConfig
from alignopsd.engine.generation.base import GenerationBackend
from alignopsd.engine.policy.base import PolicyBackend
from alignopsd.engine.run.components import BuiltParts, Games, build_generator, build_parts
from alignopsd.engine.run.policy_builders import OptimizerSettings
from alignopsd.engine.run.process import Dist, pick_device, process_settings
from alignopsd.engine.step.components import close_all
from alignopsd.engine.tokens.special import TokenIds, token_ids
from alignopsd.engine.tokens.tokenizer import Tokenizer
from alignopsd.kernels.native_choice import choices_state, restore_choices


@dataclass(frozen=True)
class Session:
    """What a run builds once (see the module doc)."""

    cfg: RunConfig
    device: torch.device
    dist: Dist
    built: BuiltParts
    ids: TokenIds  # the tokenizer's end-of-turn and pad ids

    @property
    def tokenizer(self) -> Tokenizer:
        return self.built.tokenizer

    @property
    def policy(self) -> PolicyBackend:
        return self.built.policy

    @property
    def generator(self) -> GenerationBackend | None:
        return self.built.generator

    @property
    def games(self) -> Games:
        return self.built.games

    def for_run(self, cfg: RunConfig) -> Session:
        """This session as the RL run of ``cfg`` starts on it, in memory: the same processes, tokenizer, policy
        weights, generator and games, the policy's optimizer started afresh with the run's settings
        (``trainer.optimizer.lr``, weight decay, warm-up: ``OptimizerSettings.of_run``), as a policy built from these
        weights for ``cfg`` starts. ``cfg`` must build the same parts (the pipeline's RL config differs from the warm
        start's in ``model.name``, the folder these weights were written to, and in trainer settings)."""
        optim = OptimizerSettings.of_run(cfg)
        self.policy.reset_optimizer(lr=optim.lr, weight_decay=optim.weight_decay, warmup_steps=optim.warmup_steps)
        return replace(self, cfg=cfg)

    def with_policy(self, cfg: RunConfig, policy: PolicyBackend) -> Session:
        """This session with another policy (``cfg``'s, built by the caller) and a generator over it; the games and
        processes stay, the old generator is closed."""
        close_all([self.generator])
        generator = build_generator(cfg, policy, self.tokenizer, self.device)
        built = replace(self.built, policy=policy, generator=generator)
        return replace(self, cfg=cfg, built=built)

    def close(self) -> None:
        """End the environment's workers and the generator (the processes stay: ``dist`` is the caller's)."""
        close_all([self.games.env, self.generator])


def open_session(
    cfg: RunConfig,
    *,
    dist: Dist | None = None,
    device: torch.device | None = None,
    rows: RowsChoice | None = None,
    optim: OptimizerSettings | None = None,
    generate: bool = True,
) -> Session:
    """Build a session of ``cfg``: the device (``trainer.device``, this process's local rank) and processes unless
    given, the process settings, then :func:`build_parts` (``rows``, ``optim``: the policy's; ``generate``: build a
    generator at all) and the CPU paths every rank takes from rank 0."""
    device = device if device is not None else pick_device(cfg, int(os.environ.get("LOCAL_RANK", "0")))
    dist = dist if dist is not None else Dist(device.type)
    process_settings(cfg, dist.rank)
    built = build_parts(cfg, device, dist.world_size, rows=rows, optim=optim, generate=generate)
    if dist.enabled:  # every rank computes with rank 0's measured CPU paths (kernels/native_choice.py)
        chosen = dist.gather_objects(choices_state())[0]
        if dist.rank:
            restore_choices(chosen, "rank 0's measurement")
    return Session(
        cfg=cfg,
        device=device,
        dist=dist,
        built=built,
        ids=token_ids(built.tokenizer),
    )
