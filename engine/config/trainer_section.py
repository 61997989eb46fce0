"""The trainer section of a run config and its sections: ``optimizer``, ``ppo``, ``checkpoint``, ``validation``,
``logging`` (with its trackers' ``wandb`` and ``mlflow``) and ``restarts``; the run-wide settings (steps, seed,
device, ...) stay at its top.

Strict pydantic models like the other sections (engine/config/sections.py): unknown keys, values of the wrong type,
NaN and infinities, out-of-range values and contradicting fields raise ConfigError naming the dotted key.

Earlier versions kept every setting at the top of ``trainer`` (``trainer.lr``, ``trainer.ppo_mini_batch_size``,
``trainer.test_freq``, ...). Those keys are still read, each at its place in a section (:data:`LEGACY_KEYS`):
in a YAML file, in a config stored with a checkpoint (:func:`sectioned`) and as a ``--set`` override
(:func:`current_key`), so stored configs load and mean what they meant.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from alignopsd.engine.config.errors import rule
from alignopsd.engine.config.sections import (
    SEED_LIMIT,
    Count,
    Name,
    NonNegative,
    OffOrCount,
    Positive,
    Real,
    Section,
)
from pydantic import AfterValidator, BeforeValidator, Field, model_validator
from typing_extensions import Self


def _pair(value: Any) -> Any:
    """Two values, as a tuple (YAML gives a list)."""
    if isinstance(value, (list, tuple)) and len(value) != 2:
        raise ValueError(f"expected 2 entries, got {len(value)}")
    return tuple(value) if isinstance(value, list) else value


def _one_epoch(value: int) -> int:
    if value != 1:
        raise ValueError(f"the method uses exactly 1 PPO epoch, got {value}")
    return value


Beta = Annotated[Real, Field(ge=0, lt=1)]


LoggerName = Literal["jsonl", "tensorboard", "wandb", "mlflow"]


class WandbConfig(Section):
    """Weights & Biases (``trainer.logging.loggers`` holds ``wandb``; ``pip install alignopsd[wandb]``). A field left
    unset follows wandb's own conventions: the ``WANDB_*`` environment variables, then wandb's defaults."""

    KEY: ClassVar[str] = "trainer.logging.wandb"
    project: str | None = None
    """W&B project (None: WANDB_PROJECT, else wandb's default)."""
    entity: str | None = None
    """Team or user (None: WANDB_ENTITY, else the account's default)."""
    name: str | None = None
    """Display name of the run (None: WANDB_NAME, else the run config's ``name``)."""
    tags: list[Name] = Field(default_factory=list)
    """Tags of the run (empty: WANDB_TAGS, comma-separated)."""
    mode: Literal["online", "offline", "disabled"] | None = None
    """online | offline (sync later with ``wandb sync``) | disabled (None: WANDB_MODE, else online)."""
    dir: str | None = None
    """Folder of wandb's local files (None: WANDB_DIR, else the run's output folder)."""


class MlflowConfig(Section):
    """MLflow tracking (``trainer.logging.loggers`` holds ``mlflow``; ``pip install alignopsd[mlflow]``). A field
    left unset follows MLflow's own conventions: the ``MLFLOW_*`` environment variables, then MLflow's defaults."""

    KEY: ClassVar[str] = "trainer.logging.mlflow"
    tracking_uri: str | None = None
    """Tracking server or store (``http://host:5000``, ``file:///path/mlruns``, ...; None: MLFLOW_TRACKING_URI,
    else MLflow's default). MLflow 3 refuses a file store unless MLFLOW_ALLOW_FILE_STORE=true."""
    experiment: str | None = None
    """Experiment name, created when missing (None: MLFLOW_EXPERIMENT_NAME or MLFLOW_EXPERIMENT_ID, else MLflow's
    Default experiment)."""
    run_name: str | None = None
    """Name of the MLflow run (None: the run config's ``name``)."""
    tags: dict[Name, str] = Field(default_factory=dict)
    """Tags set on the run when it is created."""


class RestartsConfig(Section):
    """How a run restarted by a machine (torchrun's ``--max-restarts``, a Slurm requeue) treats its earlier failed
    attempts (engine/run/restarts.py): it waits before it starts, longer after each failure at the same step, and it
    stops only once the same failure has repeated over a stretch of time long enough for an outage to pass. A launch
    by a person, or after a person changed the config or the code, is never stopped and never waits."""

    KEY: ClassVar[str] = "trainer.restarts"
    backoff_s: NonNegative = 10.0
    """Seconds a restarted attempt waits before it starts when the attempt before it failed, doubled for each further
    attempt in a row that failed at the same step (0: no wait)."""
    backoff_max_s: Annotated[Real, Field(ge=0, le=600)] = 300.0
    """Ceiling of that wait, in seconds; at most 600 (a rank that waits longer than its peers' 10 minutes at the
    process group's rendezvous would make them give up)."""
    window_s: NonNegative = 1800.0
    """A failure (the same cause at the same step, a rank's own, not a peer's) stops the restarts only when it has
    recurred in every attempt in a row, two at least, over at least this many seconds from its first occurrence to
    its last: a deterministic bug, a config the run cannot use or a corrupt input, not an outage of a file system, a
    node or a server that a few minutes cure (0: two attempts in a row suffice)."""


def _loggers(value: list[str]) -> list[str]:
    if len(set(value)) != len(value):
        raise ValueError(f"lists a logger twice: {value}")
    if "jsonl" not in value:
        raise ValueError(
            f"must hold 'jsonl' (metrics.jsonl is the run's own record: the report, compare and resume "
            f"read it), got {value}"
        )
    return value


def _tensorboard_switch(data: Any) -> Any:
    """The earlier ``trainer.tensorboard: bool`` switch, as the ``tensorboard`` entry of ``trainer.logging.loggers``."""
    if not isinstance(data, dict) or "tensorboard" not in data:
        return data
    data = dict(data)
    on = data.pop("tensorboard")
    if not isinstance(on, bool):
        raise rule("tensorboard", f"must be true or false, got {on!r} (it is now an entry of trainer.logging.loggers)")
    if "loggers" in data:  # both: they must agree
        if isinstance(data["loggers"], list) and on == ("tensorboard" in data["loggers"]):
            return data
        raise rule(
            "tensorboard",
            f"{on} contradicts trainer.logging.loggers {data['loggers']!r} (set trainer.logging.loggers alone)",
        )
    data["loggers"] = ["jsonl", "tensorboard"] if on else ["jsonl"]
    return data


class OptimizerConfig(Section):
    """AdamW and its schedule."""

    KEY: ClassVar[str] = "trainer.optimizer"
    lr: Positive = 1e-6
    """AdamW learning rate (constant after warm-up)."""
    warmup_ratio: Annotated[Real, Field(ge=0, lt=1)] = 0.0
    """Linear warm-up as a fraction of trainer.total_steps."""
    weight_decay: NonNegative = 0.01
    """AdamW weight decay."""
    betas: Annotated[tuple[Beta, Beta], BeforeValidator(_pair)] = (0.9, 0.999)
    """AdamW betas, two numbers in [0, 1)."""
    grad_clip: Positive = 1.0
    """Global gradient-norm clip."""


class PpoConfig(Section):
    """The PPO update: its batches, how its forwards are cut and computed, and its corrections."""

    KEY: ClassVar[str] = "trainer.ppo"
    mini_batch_size: Count = 256
    """Turn rows per optimiser step (global, over all ranks)."""
    micro_batch_size: Count = 16
    """Turn rows per forward/backward on one rank (when max_token_len_per_gpu is 0 or null)."""
    max_token_len_per_gpu: Annotated[int, Field(ge=0)] | Literal["auto"] | None = "auto"
    """Micro-batches by tokens (verl's ppo_max_token_len_per_gpu): rows sorted by length, as many per forward/backward
    on one rank as fit in this many positions (rows x padded length; the old log-prob and reference passes sort their
    rows too). auto: micro_batch_size x (env.max_prompt_length + generation.max_response_length); 0/null: fixed
    rows."""
    activation_memory_gib: Annotated[float, Field(gt=0)] | Literal["auto"] | None = "auto"
    """The memory one micro-batch's activations may take, in GiB: micro-batches by tokens (the update's, and the
    warm start's) are cut to the positions whose activations fit (``ModelShape.activation_bytes_per_token`` in the
    model's dtype), at most max_token_len_per_gpu. auto: 1.5 GiB on a CPU (the quickstart then fits beside a
    browser on a 16 GB laptop), no cap on an accelerator; null: no cap."""
    use_remove_padding: bool | Literal["auto"] = "auto"
    """Padding-free rows (verl's name) in the Hugging Face policy's forwards (the update, and the old log-prob and
    reference passes in plain mode): each forward's attended positions packed into one sequence whose position ids
    restart at 0 in every row, so no padding is computed (on the CPU a Llama/Qwen model attends row by row,
    engine/policy/varlen_attention.py; elsewhere SDPA and eager attention keep each row to itself through Hugging
    Face's block-diagonal mask, flash attention through its variable-length path). auto: on CUDA; on a CPU
    where measured faster than padded rows of similar lengths (once per run, on its first forward of several rows);
    true: always; false: padded rows. The Megatron backend pads its plain rows."""
    epochs: Annotated[int, AfterValidator(_one_epoch)] = 1
    """PPO epochs per step (the method uses 1)."""
    logprob_reuse: bool = False
    """Take old log-probs from the rollout engine (hf backend only) instead of a trainer forward."""
    fused_head_loss: bool = True
    """PPO forward through the fused head loss (hf and megatron backends, vocab-parallel under tensor
    parallelism): the LM head's gradients are formed with the log-probs, three head matmuls instead of four
    (the policy loss is a sum of per-token terms). Off: autograd through alignopsd.kernels.logprob."""
    skip_no_signal: bool = False
    """Skip the rest of a step whose advantages are provably all zero and that has no auxiliary term (logged as
    update/skipped). Off by default, as in the authors' runs: their entropy (and KL) terms update the policy on
    every step, a step with zero advantages included."""
    rollout_is: Literal["off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = "off"
    """Rollout-trainer mismatch correction (alignopsd.losses.rollout_is_weights): off | token_truncate |
    token_mask | sequence_truncate | sequence_mask. The ratio is pi_trainer(old) / pi_rollout of each sampled
    token (a row's product for sequence level); truncate multiplies the policy loss by min(ratio, threshold),
    mask drops tokens (rows) whose ratio is outside [rollout_is_lower, rollout_is_threshold] from the loss and
    its token-mean denominator. Off as in the authors' runs."""
    rollout_is_threshold: Annotated[Real, Field(gt=1)] = 2.0
    """Upper bound of the importance ratio (the truncation cap, or the mask's upper bound); > 1."""
    rollout_is_lower: Annotated[Real, Field(ge=0, lt=1)] | None = None
    """Lower bound of the mask's accepted ratio range; None: 1 / rollout_is_threshold. In [0, 1)."""

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.micro_batch_size > self.mini_batch_size:
            raise rule(
                "micro_batch_size",
                f"{self.micro_batch_size} exceeds trainer.ppo.mini_batch_size {self.mini_batch_size}",
            )
        if self.logprob_reuse is True and self.rollout_is != "off":  # old log-probs would be the rollout's: ratio 1
            raise rule(
                "rollout_is",
                f"{self.rollout_is!r} with trainer.ppo.logprob_reuse=true corrects nothing (the old log-probs are the "
                "rollout engine's own, so every importance weight is 1); set trainer.ppo.logprob_reuse=false to "
                "correct the mismatch, or trainer.ppo.rollout_is=off",
            )
        return self


class CheckpointConfig(Section):
    """When checkpoints are written, how many are kept, and what they hold besides the run's own state."""

    KEY: ClassVar[str] = "trainer.checkpoint"
    save_freq: OffOrCount = -1
    """Checkpoint every N steps (-1: only at the end)."""
    save_every_s: Annotated[Real, Field(gt=0)] | None = None
    """Also checkpoint at the end of the first step that finishes this many seconds after the last save (or the
    start): bounds by time the work a fault can lose, as large runs do (None: save_freq alone). The ranks agree on
    the longest elapsed time; the log says what each save cost."""
    keep_last: Count = 2
    """Checkpoints kept on disk."""
    export_hf_freq: OffOrCount = -1
    """Sharded checkpoints (policy.backend megatron) and LoRA checkpoints (model.lora): also write the gathered
    (LoRA: merged) Hugging Face weights (model.safetensors + config.json, for eval and serving) into every Nth step's
    checkpoint; -1: only the last step's."""


class ValidationConfig(Section):
    """Validation passes on the held-out tasks."""

    KEY: ClassVar[str] = "trainer.validation"
    freq: OffOrCount = -1
    """Validate every N steps (-1: never during training; verl's test_freq)."""
    start_step: Annotated[int, Field(ge=0)] = 0
    """Periodic validation (freq) only from this step on (Search-3B: 70)."""
    before_train: bool = False
    """Run a validation pass before the first step."""
    after_train: bool = True
    """Run a validation pass after the last step."""


class LoggingConfig(Section):
    """What a run tells about itself: the metrics' loggers and their trackers' settings, the report, the audit."""

    KEY: ClassVar[str] = "trainer.logging"
    loggers: Annotated[list[LoggerName], AfterValidator(_loggers)] = Field(
        default_factory=lambda: ["jsonl", "tensorboard"]
    )
    """Where the metrics go: jsonl (metrics.jsonl, required) | tensorboard (<output>/tb) | wandb | mlflow; every logger
    gets the same names and steps (engine/observe/sinks.py). The former switch ``tensorboard: false`` is read as
    ``loggers: [jsonl]``."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases settings (used when loggers holds wandb)."""
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    """MLflow settings (used when loggers holds mlflow)."""
    report: bool = True
    """Write report.md and plots at the end."""
    audit: bool = True
    """Write the audit records of ALGORITHM.md §4.3 under <output>/audit/ (per-turn JSONL every step, token
    snapshots on the first, every 10th and the last step; see observe/audit.py). Training is identical either way."""
    audit_max_bytes: Count = 1 << 30
    """Cap on the audit's bytes over the whole run (all ranks together); past it, nothing more is written."""

    _tensorboard = model_validator(mode="before")(_tensorboard_switch)


LEGACY_KEYS: dict[str, str] = {
    **{k: f"optimizer.{k}" for k in ("lr", "warmup_ratio", "weight_decay", "betas", "grad_clip")},
    **{f"ppo_{k}": f"ppo.{k}" for k in ("mini_batch_size", "micro_batch_size", "max_token_len_per_gpu", "epochs")},
    **{
        k: f"ppo.{k}"
        for k in ("activation_memory_gib", "use_remove_padding", "logprob_reuse", "fused_head_loss", "skip_no_signal")
    },
    **{k: f"ppo.{k}" for k in ("rollout_is", "rollout_is_threshold", "rollout_is_lower")},
    **{k: f"checkpoint.{k}" for k in ("save_freq", "save_every_s", "keep_last", "export_hf_freq")},
    "test_freq": "validation.freq",
    **{f"val_{k}": f"validation.{k}" for k in ("start_step", "before_train", "after_train")},
    **{k: f"logging.{k}" for k in ("loggers", "wandb", "mlflow", "report", "audit", "audit_max_bytes", "tensorboard")},
}
"""The keys of the flat trainer section of earlier versions -> their place now (relative to ``trainer``)."""


def sectioned(trainer: Any) -> Any:
    """A raw trainer mapping with the keys of earlier versions (:data:`LEGACY_KEYS`) moved to their sections (a new
    mapping; anything else as it is). A key given both ways must have one value: ValueError naming both."""
    if not isinstance(trainer, dict) or not any(k in LEGACY_KEYS for k in trainer):
        return trainer
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in trainer.items() if k not in LEGACY_KEYS}
    for old, new in LEGACY_KEYS.items():
        if old not in trainer:
            continue
        section, key = new.split(".")
        target = out.setdefault(section, {})
        if isinstance(target, Section):  # a section built in code, beside an old key: the fields it was given
            target = out[section] = {name: getattr(target, name) for name in target.model_fields_set}
        if not isinstance(target, dict):
            raise ValueError(f"trainer.{section}: expected a mapping, got {target!r}")
        if key in target and target[key] != trainer[old]:
            raise ValueError(
                f"trainer.{old}: {trainer[old]!r} contradicts trainer.{new} = {target[key]!r} (trainer.{old} is the "
                f"earlier name of trainer.{new}: set trainer.{new} alone)"
            )
        target[key] = trainer[old]
    return out


def current_key(dotted: str) -> str:
    """A dotted run-config key (a ``--set`` override's) with an earlier version's trainer key at its place now
    (``trainer.lr`` -> ``trainer.optimizer.lr``, ``trainer.wandb.mode`` -> ``trainer.logging.wandb.mode``)."""
    parts = dotted.split(".")
    if len(parts) >= 2 and parts[0] == "trainer" and parts[1] in LEGACY_KEYS:
        return ".".join(["trainer", LEGACY_KEYS[parts[1]], *parts[2:]])
    return dotted


class TrainerConfig(Section):
    """The run's steps, seed, device and fault handling, and its sections."""

    KEY: ClassVar[str] = "trainer"
    total_steps: Count = 150
    """Training steps (one PPO update epoch per step)."""
    seed: Annotated[int, Field(ge=0, lt=SEED_LIMIT)] = 0
    """Seed of tasks, rollouts and model initialisation, in [0, 2**32)."""
    rescoring_mode: Literal["shared_prefix", "plain"] = "shared_prefix"
    """Teacher scoring: shared_prefix (prompt KV cache shared by diagonal and cross rows) | plain."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto | cpu | cuda."""
    deterministic: bool = True
    """torch.use_deterministic_algorithms (CPU) for exact resume."""
    torch_threads: Annotated[int, Field(ge=0)] = 0
    """torch intra-op threads (0: leave the default)."""
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    """AdamW and its warm-up."""
    ppo: PpoConfig = Field(default_factory=PpoConfig)
    """The PPO update: batch sizes, micro-batches, padding, the fused head loss, rollout correction."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoint cadence and retention."""
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    """Validation cadence."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Loggers and trackers, the report, the audit."""
    restarts: RestartsConfig = Field(default_factory=RestartsConfig)
    """How restarts without a person wait and when they stop (torchrun's --max-restarts, Slurm requeues)."""
    preempt_grace_s: Annotated[Real, Field(gt=0, le=3600)] = 20.0
    """Seconds a run has, after SIGTERM or SIGUSR1, to finish its step and write a checkpoint before it exits at once
    (engine/run/preemption.py); keep it below the scheduler's grace and torchrun's --shutdown_timeout (30 s)."""

    _legacy = model_validator(mode="before")(sectioned)
