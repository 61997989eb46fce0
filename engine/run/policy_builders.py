"""The policy backends' builders, registered by backend name (``policy.backend``), as torchtitan registers its
model builders: a new backend adds a row (:func:`register_policy_builder`), not a branch.

Each builder is handed one :class:`PolicyRequest` (the run's config, the device, the processes, the optimizer
settings, a packed-or-padded rows choice made already in this process) and returns a ``PolicyBackend``:

- ``hf``: a Hugging Face causal LM (with its LoRA adapters when ``model.lora.enabled``), DDP when distributed; its
  rows start as :func:`start_rows` says (configured, taken, pinned or measured by the first update);
- ``megatron``: a megatron-core GPTModel with tensor parallelism (its layout checked before any weight loads), with
  a Hugging Face copy of the weights where Hugging Face generation samples from it (:func:`needs_hf_copy`).

Both state the custom CPU kernels they take in the run's first lines (:func:`choose_cpu_paths`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from alignopsd.engine.checkpoint.trainer_state import RowsChoice
from alignopsd.engine.config.errors import ConfigError
from alignopsd.engine.config.schema import RunConfig
from alignopsd.engine.models.loading import load_causal_lm, parse_dtype, resolve_model_path
from alignopsd.engine.models.shapes import ModelShape, shape_from_hf_config
from alignopsd.engine.observe.memory import GIB
from alignopsd.engine.policy.base import PolicyBackend, RowLayout
from alignopsd.engine.run.kernel_probe import choose_cpu_kernels
from alignopsd.kernels.native_choice import pinned
from torch import nn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OptimizerSettings:
    """What a policy's optimizer is started with apart from the config's betas: learning rate, weight decay and the
    linear warm-up's optimizer steps (then constant)."""

    lr: float
    weight_decay: float
    warmup_steps: int

    @classmethod
    def of_run(cls, cfg: RunConfig) -> OptimizerSettings:
        """The RL run's: ``trainer.optimizer.lr``, ``trainer.optimizer.weight_decay``, warm-up over
        ``trainer.optimizer.warmup_ratio`` of ``trainer.total_steps``."""
        warmup = int(round(cfg.trainer.optimizer.warmup_ratio * cfg.trainer.total_steps))
        return cls(lr=cfg.trainer.optimizer.lr, weight_decay=cfg.trainer.optimizer.weight_decay, warmup_steps=warmup)


def hf_model_of(policy: PolicyBackend) -> nn.Module:
    """The module that Hugging Face generation samples from: the Hugging Face policy's own, or the Megatron
    policy's Hugging Face copy where it keeps one (:func:`needs_hf_copy`: the first rank of each tensor-parallel
    group); else the Megatron policy's shard (which scores itself and generates nothing)."""
    return policy.model if policy.hf_model is None else policy.hf_model


def needs_hf_copy(cfg: RunConfig) -> bool:
    """A Megatron-trained policy keeps a full Hugging Face copy of its weights only for Hugging Face generation
    (student and teacher rollouts sample from it), and then only on the first rank of each tensor-parallel group,
    which samples for the group (engine/step/group_sampling.py). Nothing else reads it: old log-probs, teacher forcing
    and the reference are scored by the shards, and vLLM receives the weights gathered from the shards."""
    return cfg.generation.backend in ("hf", "choice")


def megatron_layer_spec(cfg: RunConfig) -> str:
    """The layer spec a Megatron policy is built with: ``policy.layer_spec``, where ``auto`` means ``local`` when
    teacher forcing packs shared prefixes (only the local spec's attention takes their mask: engine/policy/megatron/
    scoring.py), so that a machine with Transformer Engine does not fail at the first scoring."""
    if cfg.policy.layer_spec == "auto" and cfg.trainer.rescoring_mode == "shared_prefix":
        return "local"
    return cfg.policy.layer_spec


def packed_rows(cfg: RunConfig, device: torch.device) -> bool | None:
    """``trainer.ppo.use_remove_padding`` resolved on ``device`` (``RunConfig.remove_padding_on``)."""
    return cfg.remove_padding_on(device.type)


def choose_cpu_paths(model: nn.Module, device: torch.device) -> None:
    """The custom CPU kernels this process takes, measured on ``model`` once before any step and stated in the log
    (engine/run/kernel_probe.py)."""
    for line in choose_cpu_kernels(model.config, model.dtype, device):
        log.info("kernels: %s", line)


def start_rows(rows: RowLayout, taken: RowsChoice | None) -> None:
    """Packed or padded rows of a policy whose ``use_remove_padding`` is auto on a CPU (``rows`` undecided): ``taken``
    (a choice this process made already: the warm start's, for the RL run that follows it), padded rows where
    ``ALIGNOPSD_CPU_PATHS=torch`` pins the torch paths, else padded until the first update has timed both (a resume
    takes its checkpoint's when it loads). States it in the log with the kernels' lines."""
    if not rows.undecided:
        return
    if taken is not None:
        rows.choose(taken)
    elif pinned():
        rows.choose(RowsChoice(False, why=pinned()))
    if rows.choice is not None:
        log.info("kernels: %s", rows.choice.describe())
    else:
        log.info("kernels: packed rows: padded rows (until the first update has timed both, forward and backward)")


CPU_ACTIVATION_GIB = 1.5  # trainer.ppo.activation_memory_gib auto on a CPU (see its docstring)


def shape_of(hf_config, name: str) -> ModelShape:
    """The cost model's shape of a loaded model (its Hugging Face config)."""
    conf = hf_config.to_dict()
    return shape_from_hf_config(conf.get("text_config", conf), name, "the loaded model's config")


def micro_batch_tokens(cfg: RunConfig, shape: ModelShape, dtype: torch.dtype, device: torch.device) -> int:
    """Computed positions per micro-batch of the update and the warm start (0: micro-batches of fixed rows):
    ``trainer.ppo.max_token_len_per_gpu`` resolved (``RunConfig.update_token_budget``), cut to the positions whose
    activations fit ``trainer.ppo.activation_memory_gib`` (auto: :data:`CPU_ACTIVATION_GIB` on a CPU, no cap on an
    accelerator) at the model's activation bytes per token in ``dtype``; the cut is stated in the run's log."""
    tokens = cfg.update_token_budget
    cap_gib = cfg.trainer.ppo.activation_memory_gib
    if cap_gib == "auto":
        cap_gib = CPU_ACTIVATION_GIB if device.type == "cpu" else None
    if tokens == 0 or cap_gib is None:
        return tokens
    per_token = shape.activation_bytes_per_token(torch.empty((), dtype=dtype).element_size())
    cap = max(1, int(cap_gib * GIB // per_token))
    if cap < tokens:
        log.info(
            "memory: micro-batches of at most %d positions, not %d (activations %.2f MiB per token in %s; "
            "trainer.ppo.activation_memory_gib %s GiB)",
            cap,
            tokens,
            per_token / (1 << 20),
            str(dtype).removeprefix("torch."),
            f"{cap_gib:g}",
        )
    return min(tokens, cap)


def policy_placement(policy: PolicyBackend) -> tuple[torch.dtype, torch.device]:
    """The dtype and the device the policy's module computes in (its first parameter's)."""
    p = next(policy.model.parameters())
    return p.dtype, p.device


@dataclass(frozen=True)
class PolicyRequest:
    """What a policy builder is handed: the run's config, this process's device, all processes (``world_size``),
    the optimizer's settings and a packed-or-padded rows choice made already in this process (None: none)."""

    cfg: RunConfig
    device: torch.device
    world_size: int
    optim: OptimizerSettings
    rows: RowsChoice | None = None


PolicyBuilder = Callable[[PolicyRequest], PolicyBackend]
POLICY_BUILDERS: dict[str, PolicyBuilder] = {}


def register_policy_builder(name: str) -> Callable[[PolicyBuilder], PolicyBuilder]:
    """Register the builder of ``policy.backend: name`` (a second builder of one name is refused)."""

    def register(fn: PolicyBuilder) -> PolicyBuilder:
        if name in POLICY_BUILDERS:
            raise ValueError(f"policy builder {name!r} is registered already ({POLICY_BUILDERS[name].__qualname__})")
        POLICY_BUILDERS[name] = fn
        return fn

    return register


def build_policy(
    cfg: RunConfig,
    device: torch.device,
    world_size: int = 1,
    *,
    optim: OptimizerSettings | None = None,
    rows: RowsChoice | None = None,
) -> PolicyBackend:
    """The policy backend of ``policy.backend`` (its registered builder).

    Every optimisation setting reaches the backend: lr, weight decay, betas, the warm-up (``optim``, by default
    :meth:`OptimizerSettings.of_run`), gradient checkpointing (megatron: activation recomputation as
    ``policy.recompute`` says) and, for megatron, the distributed optimizer. ``rows``: packed or padded rows chosen
    already in this process (:func:`start_rows`; the warm start's choice handed to the RL run that follows it).
    """
    builder = POLICY_BUILDERS.get(cfg.policy.backend)
    if builder is None:
        raise ConfigError(
            f"policy.backend: no builder for {cfg.policy.backend!r} (known: {', '.join(POLICY_BUILDERS)})"
        )
    return builder(PolicyRequest(cfg, device, world_size, optim or OptimizerSettings.of_run(cfg), rows))


def load_policy_model(cfg: RunConfig, device: torch.device, load_on: torch.device) -> nn.Module:
    """The config's causal LM in the run's dtype, loaded on ``load_on``, and the CPU kernels chosen for it."""
    model = load_causal_lm(
        cfg.model.name,
        dtype=parse_dtype(cfg.model.dtype, device),
        attn_implementation=cfg.model.attn_implementation,
        device=load_on,
    )
    choose_cpu_paths(model, device)
    return model


@register_policy_builder("hf")
def build_hf_policy(req: PolicyRequest) -> PolicyBackend:
    """A Hugging Face policy (``HFPolicy``), with peft LoRA adapters where ``model.lora.enabled``."""
    from alignopsd.engine.policy.hf import HFPolicy

    cfg, optim = req.cfg, req.optim
    model = load_policy_model(cfg, req.device, req.device)
    adapter = None
    if cfg.model.lora.enabled:  # peft is imported only when asked for
        from alignopsd.engine.policy.lora import LoraAdapter

        lora = cfg.model.lora
        adapter = LoraAdapter.wrap(
            model, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.target_modules
        )
    policy = HFPolicy(
        model,
        packed=packed_rows(cfg, req.device),
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        betas=cfg.trainer.optimizer.betas,
        warmup_steps=optim.warmup_steps,
        gradient_checkpointing=cfg.policy.gradient_checkpointing,
        adapter=adapter,
    )
    start_rows(policy.rows, req.rows)
    return policy


@register_policy_builder("megatron")
def build_megatron_policy(req: PolicyRequest) -> PolicyBackend:
    """A megatron-core GPTModel with tensor parallelism (``MegatronPolicy``), scoring old log-probs and teacher forcing
    itself (``backend_scorer``: plain rows, or packed shared prefixes). A tensor-parallel layout that does not fit
    the model (heads, key/value heads, MLP width, vocabulary) or the world size fails before the weights load. Only
    Hugging Face generation keeps a Hugging Face copy of the same weights (``policy.hf_model``, refreshed after every
    update by ``Components.sync_weights``), on the first rank of each tensor-parallel group only; elsewhere, and with
    vLLM everywhere, the full model read from disk is loaded on the CPU and dropped once the rank holds its shard."""
    from alignopsd.engine.policy.megatron.backend import MegatronPolicy, tensor_parallel_rank
    from alignopsd.engine.policy.megatron.convert import check_parallel_layout
    from transformers import AutoConfig

    cfg, optim, tp = req.cfg, req.optim, req.cfg.policy.tensor_parallel_size
    hf_config = AutoConfig.from_pretrained(resolve_model_path(cfg.model.name), local_files_only=True)
    check_parallel_layout(hf_config, tp, req.world_size)  # pre-flight: the layout must fit before any weight loads
    keep_copy = needs_hf_copy(cfg) and tensor_parallel_rank(tp, cfg.trainer.seed) == 0
    # without a copy to keep, the full model is only the source of the shards: never on the accelerator
    model = load_policy_model(cfg, req.device, req.device if keep_copy else torch.device("cpu"))
    policy = MegatronPolicy(
        model.config,
        model.state_dict(),
        tp=tp,
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        betas=cfg.trainer.optimizer.betas,
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
