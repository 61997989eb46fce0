"""Run configuration: one typed :class:`RunConfig` (pydantic), loaded strictly from YAML plus ``--set`` overrides.

A run is described by one :class:`RunConfig` (model, tokenizer, policy and generation backends, thinking encoder,
environment, algorithm, trainer, output directory). Loading is strict and happens before anything heavy is imported
or loaded:

* unknown keys are rejected, naming the dotted key and the keys that are allowed there;
* values of the wrong type, outside their range or their allowed set, NaN and infinities are rejected, naming the key
  (engine/config/sections.py);
* ``--set a.b=c`` overrides are applied to the raw mapping first (values parsed as YAML scalars), so they go
  through exactly the same validation as the file (engine/config/loader.py);
* cross-section consistency (ALGORITHM.md §6 case 48 and the length budgets of §1.7) is checked by the validators
  of :class:`RunConfig`.

Every failure is one :class:`ConfigError` naming the dotted key (engine/config/errors.py). The ``algorithm`` section
is the algorithm core's ``AlgorithmConfig`` dataclass (``alignopsd.config``), built and checked by the core's own
strict loader (its estimator name against the estimator registry, its ranges, its derived fields), so each rule of
the method's settings is written once, in the core.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

from alignopsd.engine.config.errors import ConfigError, rule
from alignopsd.engine.config.loader import deep_merge, read_run_mapping
from alignopsd.engine.config.sections import (
    EncoderConfig,
    EnvConfig,
    GenerationConfig,
    ModelConfig,
    PolicyConfig,
    Section,
)
from alignopsd.engine.config.trainer_section import TrainerConfig
from alignopsd.engine.parallel.hardware import check_device_dtype, choose_dtype, device_type, int8_sampling
from pydantic import AfterValidator, Field, PlainValidator, model_validator
from typing_extensions import Self

from alignopsd import config as core
from alignopsd.config import AlgorithmConfig
from alignopsd.estimators import get_estimator

__all__ = [
    "ConfigError",
    "EncoderConfig",
    "EnvConfig",
    "GenerationConfig",
    "ModelConfig",
    "PolicyConfig",
    "RunConfig",
    "TrainerConfig",
    "load_algorithm",
    "load_config",
]


def load_algorithm(value: Any) -> AlgorithmConfig:
    """The ``algorithm`` section: an AlgorithmConfig as is, or a mapping through the core's strict loader
    (``alignopsd.config.from_dict``), an optional ``preset`` (a profile of ``alignopsd.config.PRESETS``) under the
    keys the mapping sets itself. ValueError naming the dotted key."""
    if isinstance(value, AlgorithmConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"algorithm: expected a mapping, got {value!r}")
    data = dict(value)
    preset = data.pop("preset", None)
    if preset is not None:
        if preset not in core.PRESETS:
            allowed = ", ".join(map(repr, core.PRESETS))
            raise ValueError(f"algorithm.preset: unknown value {preset!r}; allowed: {allowed}")
        data = deep_merge(core.to_dict(core.PRESETS[preset]()), data)
    try:
        return core.from_dict(AlgorithmConfig, data, "algorithm")
    except (TypeError, KeyError) as exc:
        raise ValueError(f"algorithm: {exc}") from None


def _run_name(value: str) -> str:
    if not value or "/" in value:
        raise ValueError(f"must be a non-empty string without '/', got {value!r}")
    return value


class RunConfig(Section):
    """One training/evaluation run."""

    name: Annotated[str, AfterValidator(_run_name)] = "run"
    """Run name; the default output directory is runs/<name>."""
    output_dir: str | None = None
    """Where checkpoints, metrics.jsonl, tb/ and report.md go; None: runs/<name>."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    encoder: EncoderConfig = Field(default_factory=EncoderConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    algorithm: Annotated[AlgorithmConfig, PlainValidator(load_algorithm)] = Field(default_factory=AlgorithmConfig)
    """The algorithm core's settings (estimator, M1, M2, losses), alignopsd.config.AlgorithmConfig."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)

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

    @property
    def update_token_budget(self) -> int:
        """Computed positions per micro-batch of the update (``trainer.ppo.max_token_len_per_gpu`` resolved; 0: the
        fixed-row micro-batches)."""
        t = self.trainer.ppo.max_token_len_per_gpu
        if t == "auto":
            width = self.env.max_prompt_length + self.generation.max_response_length
            return self.trainer.ppo.micro_batch_size * width
        return int(t or 0)

    def remove_padding_on(self, device_type: str) -> bool | None:
        """``trainer.ppo.use_remove_padding`` resolved for a Hugging Face policy on ``device_type``: ``auto`` is
        padding-free rows on CUDA (flash-attention's varlen) and, on a CPU, None (where measured faster than padded
        rows by the run's first update, forward and backward: engine/step/packing_trial.py). The Megatron backend
        pads its plain rows whatever this says (``ShardScoring.rows``)."""
        setting = self.trainer.ppo.use_remove_padding
        if setting == "auto":
            return True if device_type == "cuda" else None
        return bool(setting)

    @model_validator(mode="after")
    def _sections_agree(self) -> Self:
        """Rules over several sections; each names the key to change."""
        if self.generation.backend == "vllm":
            need = self.env.max_prompt_length + max(self.teacher_budget, self.generation.max_response_length)
            if need > self.generation.max_model_len:
                raise rule(
                    "generation.max_model_len",
                    f"{self.generation.max_model_len} is smaller than env.max_prompt_length + teacher budget = {need} "
                    "(ALGORITHM.md §1.7)",
                )
        if self.env.student_skills == "always" and get_estimator(self.algorithm.estimator).needs_teacher_diag(
            self.algorithm
        ):  # the teacher's privileged view would be the student's own
            raise rule("env.student_skills", "'always' (Skill-GRPO) needs an estimator without a teacher pass")
        if self.policy.layer_spec == "te" and self.trainer.rescoring_mode == "shared_prefix":
            raise rule(
                "policy.layer_spec",
                "'te' (Transformer Engine's causal attention ignores an arbitrary mask) cannot score "
                "trainer.rescoring_mode='shared_prefix' packed rows; use layer_spec 'local' or 'auto', or "
                "rescoring_mode 'plain'",
            )
        if self.model.lora.enabled and self.policy.backend == "megatron":
            raise rule(
                "model.lora.enabled",
                "LoRA is not supported with policy.backend='megatron' (its shards train the full weights; the "
                "adapters are peft modules on the Hugging Face model): use policy.backend='hf' or disable LoRA",
            )
        try:
            check_device_dtype(self.model.dtype, self.trainer.device)
        except ValueError as exc:
            raise rule("model.dtype", f"{self.model.dtype!r} on {exc}") from None
        if self.trainer.ppo.logprob_reuse:
            self._reuse_samples_from_the_policy()
        return self

    def _reuse_samples_from_the_policy(self) -> None:
        """``trainer.ppo.logprob_reuse`` takes the sampler's log-probs as PPO's old log-probs: only a generator that
        samples from the trained module itself gives them (``samples_from``, checked again where the parts are
        built); each setting that rules that out at load is named."""
        if self.generation.backend != "hf":
            raise rule("trainer.ppo.logprob_reuse", "only valid with generation.backend='hf' (the trainer's own model)")
        if self.policy.backend == "megatron":
            raise rule(
                "trainer.ppo.logprob_reuse",
                "true needs a generator that samples from the trained module itself; with policy.backend='megatron' "
                "the hf generator samples from a Hugging Face copy: set trainer.ppo.logprob_reuse=false",
            )
        if self.samples_int8():
            where = "" if self.generation.quantize == "int8" else " (auto: the policy computes in float32 on the CPU)"
            raise rule(
                "trainer.ppo.logprob_reuse",
                f"true would make the int8 sampler's log-probs PPO's old log-probs: generation.quantize="
                f"'{self.generation.quantize}' samples from an int8 copy{where}, not the trained model; set "
                "trainer.ppo.logprob_reuse=false (the trainer then computes them and measures the gap) or "
                "generation.quantize='off'",
            )

    def samples_int8(self) -> bool:
        """Whether the hf generator will sample from an int8 copy (``generation.quantize``; ``auto`` by the dtype
        and device the policy will load in: engine/parallel/hardware.py ``int8_sampling``)."""
        kind = device_type(self.trainer.device)
        return int8_sampling(self.generation.quantize, kind, choose_dtype(self.model.dtype, kind).dtype)

    def validate(self) -> RunConfig:
        """Every check again, on the current values (after attribute edits); the checked copy, or ConfigError."""
        return self.from_mapping(self)

    def dtype_line(self) -> str:
        """The run's first line: the dtype its models load in and why (engine/parallel/hardware.py)."""
        choice = choose_dtype(self.model.dtype, device_type(self.trainer.device))
        return f"[dtype] {choice.line()} (the reference model and a last-token encoder alike)"


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML run config, apply overrides, validate. Nothing heavy is imported."""
    return RunConfig.from_mapping(read_run_mapping(path, overrides))
