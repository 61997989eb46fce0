"""The composition root: build a run's parts (policy, generator, environments, encoder, scorers) from its config.

Every backend sits behind its protocol (``PolicyBackend``, ``GenerationBackend``); the step only ever sees a
:class:`~alignopsd.engine.step.components.Components` (its type is the step's). Nothing here runs a phase of the
step.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
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
from alignopsd.engine.run.kernel_probe import choose_cpu_kernels
from alignopsd.engine.step.components import Components
from alignopsd.engine.step.rescoring import Rescorer
from torch import nn

from alignopsd.estimators import get_estimator

log = logging.getLogger(__name__)


def hf_model_of(policy: PolicyBackend) -> nn.Module:
    """The module that Hugging Face generation samples from: the Hugging Face policy's own, or the Megatron
    policy's Hugging Face copy where it keeps one (:func:`needs_hf_copy`: the first rank of each tensor-parallel
    group); else the Megatron policy's shard (which scores itself and generates nothing)."""
    return policy.model if policy.hf_model is None else policy.hf_model


def needs_hf_copy(cfg: RunConfig) -> bool:
    """A Megatron-trained policy keeps a full Hugging Face copy of its weights only for Hugging Face generation
    (student and teacher rollouts sample from it), and then only on the first rank of each tensor-parallel group,
    which samples for the group (engine/parallel/tp_broadcast.py). Nothing else reads it: old log-probs, teacher forcing
    and the reference are scored by the shards, and vLLM receives the weights gathered from the shards."""
    return cfg.generation.backend in ("hf", "choice")


def megatron_layer_spec(cfg: RunConfig) -> str:
    """The layer spec a Megatron policy is built with: ``policy.layer_spec``, where ``auto`` means ``local`` when
    teacher forcing packs shared prefixes (only the local spec's attention takes their mask: engine/policy/megatron/
    scoring.py), so that a machine with Transformer Engine does not fail at the first scoring."""
    if cfg.policy.layer_spec == "auto" and cfg.trainer.rescoring_mode == "shared_prefix":
        return "local"
    return cfg.policy.layer_spec


@dataclass(frozen=True)
class OptimizerSettings:
    """What a policy's optimizer is started with apart from the config's betas: learning rate, weight decay and the
    linear warm-up's optimizer steps (then constant)."""

    lr: float
    weight_decay: float
    warmup_steps: int

    @classmethod
    def of_run(cls, cfg: RunConfig) -> OptimizerSettings:
        """The RL run's: ``trainer.lr``, ``trainer.weight_decay``, warm-up over ``trainer.warmup_ratio`` of
        ``trainer.total_steps``."""
        warmup = int(round(cfg.trainer.warmup_ratio * cfg.trainer.total_steps))
        return cls(lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay, warmup_steps=warmup)


def packed_rows(cfg: RunConfig, device: torch.device) -> bool | None:
    """``trainer.use_remove_padding`` resolved on ``device`` (``RunConfig.remove_padding_on``)."""
    return cfg.remove_padding_on(device.type)


def choose_cpu_paths(cfg: RunConfig, model: nn.Module, device: torch.device) -> None:
    """The custom CPU paths this process takes, measured on ``model`` once before any step and stated in the log
    (engine/run/kernel_probe.py): the C++ kernels, and packed or padded rows where ``use_remove_padding`` is auto."""
    packing = cfg.policy.backend == "hf" and packed_rows(cfg, device) is None
    for line in choose_cpu_kernels(model.config, model.dtype, device, packing=packing):
        log.info("kernels: %s", line)


def build_policy(
    cfg: RunConfig, device: torch.device, world_size: int = 1, *, optim: OptimizerSettings | None = None
) -> PolicyBackend:
    """Policy backend factory (``policy.backend``): hf | megatron.

    Every optimisation setting reaches the backend: lr, weight decay, betas, the warm-up (``optim``, by default
    :meth:`OptimizerSettings.of_run`), gradient checkpointing (megatron: activation
    recomputation as ``policy.recompute`` says) and, for megatron, the distributed optimizer. A tensor-parallel
    layout that does not fit the model (heads, key/value heads, MLP width, vocabulary) or the world size
    (``world_size``: all processes) fails before the weights load.

    The Megatron backend trains a megatron-core GPTModel with tensor parallelism and scores old log-probs and
    teacher forcing with it (``backend_scorer``: plain rows, or packed shared prefixes). Only Hugging Face
    generation keeps a Hugging Face copy of the same weights (``policy.hf_model``, refreshed after every update by
    :meth:`Components.sync_weights`), on the first rank of each tensor-parallel group only; elsewhere, and with
    vLLM everywhere, the full model read from disk is loaded on the CPU and dropped once the rank holds its shard.
    """
    optim = optim if optim is not None else OptimizerSettings.of_run(cfg)
    load_on, keep_copy = device, False
    if cfg.policy.backend == "megatron":  # pre-flight: the layout must fit before any weight loads
        from alignopsd.engine.policy.megatron.backend import tensor_parallel_rank
        from alignopsd.engine.policy.megatron.convert import check_parallel_layout
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(resolve_model_path(cfg.model.name), local_files_only=True)
        check_parallel_layout(hf_config, cfg.policy.tensor_parallel_size, world_size)
        keep_copy = needs_hf_copy(cfg) and tensor_parallel_rank(cfg.policy.tensor_parallel_size, cfg.trainer.seed) == 0
        if not keep_copy:
            load_on = torch.device("cpu")  # only the source of the shards: never on the accelerator
    model = load_causal_lm(
        cfg.model.name,
        dtype=parse_dtype(cfg.model.dtype, device),
        attn_implementation=cfg.model.attn_implementation,
        device=load_on,
    )
    choose_cpu_paths(cfg, model, device)
    if cfg.policy.backend == "megatron":
        from alignopsd.engine.policy.megatron.backend import (
            MegatronPolicy,  # megatron-core is imported only when asked for
        )

        policy = MegatronPolicy(
            model.config,
            model.state_dict(),
            tp=cfg.policy.tensor_parallel_size,
            lr=optim.lr,
            weight_decay=optim.weight_decay,
            betas=cfg.trainer.betas,
            params_dtype=model.dtype,
            seed=cfg.trainer.seed,
            warmup_steps=optim.warmup_steps,
            recompute=cfg.policy.recompute if cfg.policy.gradient_checkpointing else "none",
            distributed_optimizer=cfg.policy.distributed_optimizer,
            layer_spec=megatron_layer_spec(cfg),
        )
        if keep_copy:
            for p in model.parameters():
                p.requires_grad_(False)
            policy.hf_model = model
        return policy
    from alignopsd.engine.policy.hf import HFPolicy

    adapter = None
    if cfg.model.lora.enabled:  # peft is imported only when asked for
        from alignopsd.engine.policy.lora import LoraAdapter

        lora = cfg.model.lora
        adapter = LoraAdapter.wrap(
            model, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.target_modules
        )
    return HFPolicy(
        model,
        packed=packed_rows(cfg, device),
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        betas=cfg.trainer.betas,
        warmup_steps=optim.warmup_steps,
        gradient_checkpointing=cfg.policy.gradient_checkpointing,
        adapter=adapter,
    )


def build_reference(cfg: RunConfig, policy: PolicyBackend, device: torch.device) -> Rescorer:
    """The scorer of the reference model of the KL term (the initial weights; student rows, plain mode).

    A Megatron-trained policy's reference is a frozen snapshot of its own shard (``FrozenShard``: sharded like the
    policy, no gradients or optimizer state), taken here, before any update, and scored by the same backend code
    as the old log-probs. A LoRA policy's reference is its own frozen base: the same module with the adapters
    disabled (the adapters start at zero, so the base is the initial policy; no second copy is loaded). The Hugging
    Face policy's reference is otherwise a second Hugging Face model read from disk."""
    temperature, by_length = cfg.generation.temperature, cfg.update_token_budget > 0
    packed = policy.packed_rows  # the policy's own forwards' choice (the reference has the same architecture)
    if policy.adapter is not None:
        return Rescorer(
            policy.model,
            mode="plain",
            temperature=temperature,
            scope=policy.adapter.disabled,
            by_length=by_length,
            packed=packed,
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
    return Rescorer(ref_model, mode="plain", temperature=temperature, by_length=by_length, packed=packed)


def build_generator(cfg: RunConfig, policy: PolicyBackend, tokenizer, device: torch.device) -> GenerationBackend | None:
    """Generation backend factory (``generation.backend``): hf | vllm | choice. Under tensor parallelism only the
    first rank of each group generates (engine/parallel/tp_broadcast.py), so only it builds an engine: None on the
    group's
    other ranks.
    A vLLM engine starts from the weights on disk; :func:`build_components` pushes the policy's into it."""
    if not is_group_lead(policy):
        return None
    if cfg.generation.backend == "vllm":
        return VLLMBackend.from_settings(vllm_settings(cfg), tokenizer=tokenizer)
    if cfg.generation.backend == "choice":
        from alignopsd.engine.generation.choice import ChoiceGenerator

        return ChoiceGenerator(hf_model_of(policy), tokenizer)
    return hf_generator(cfg, policy, tokenizer)


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
    """Whether the old log-prob pass takes the rollout's log-probs (``trainer.logprob_reuse``): only where the
    generator samples from the scoring ``model`` itself (:func:`samples_from`), else its log-probs are another
    model's (an int8 copy, a Hugging Face copy of a Megatron policy, an engine of its own). The config refuses at load
    what it can know (engine/config/schema.py); what it cannot is refused here, as a ConfigError."""
    if not cfg.trainer.logprob_reuse:
        return False
    if not samples_from(generator, model):
        sampler = type(generator).__name__ if generator is not None else "no generator on this rank"
        raise ConfigError(
            f"trainer.logprob_reuse: true needs a generator that samples from the trained model itself, and this "
            f"run's ({sampler}) does not: set trainer.logprob_reuse=false (the trainer then computes old log-probs)"
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
        packed=policy.packed_rows,  # plain mode's rows padding-free where the policy's are
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


def build_components(cfg: RunConfig, *, device: torch.device, rank: int = 0, world_size: int = 1) -> Components:
    """Every part of a run, from its config (heavy: loads the models)."""
    est = get_estimator(cfg.algorithm.estimator)
    phases = est.phases(cfg.algorithm)
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.name)
    policy = build_policy(cfg, device, world_size)
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
    )
    if cfg.generation.backend == "vllm":  # the policy's weights into the engine (collective under tensor parallelism)
        parts.sync_weights()
    return parts
