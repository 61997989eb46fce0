"""The generation-backend interface shared by the Hugging Face and vLLM backends."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from alignopsd.engine.generation.prompt_cache import PromptKV
from torch import nn

from alignopsd.reduction import summed


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one generate call."""

    max_new_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    do_sample: bool = True
    stop: tuple[str, ...] = ()  # stop strings (e.g. "</action>"); the stop string is kept in the output
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0 and self.do_sample:
            raise ValueError(f"temperature: must be > 0 when sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")


@dataclass
class GenerationOutput:
    """Per prompt: generated token ids (no padding), text, per-token log-probs, why it stopped."""

    token_ids: list[list[int]]
    texts: list[str]
    logprobs: list[list[float]]
    finish_reasons: list[str] = field(default_factory=list)  # "stop" | "length"
    prompt_cache: PromptKV | None = (
        None  # the prompts' keys and values when asked and kept (engine/generation/prompt_cache.py)
    )


class GenerationBackend(Protocol):
    """Generates from token-id prompts; receives the trainer's weights after each update.

    Everything the engine reads from a generation backend is declared here and implemented by every backend
    (Hugging Face, choice, vLLM, the tensor-parallel lead wrapper); nothing probes a backend for a member.
    """

    model: nn.Module | None
    """The module it samples from (the Hugging Face and choice backends: the trainer's own, or a Hugging Face copy);
    None for an engine that holds its own copy of the weights (vLLM). See :func:`samples_from`."""

    max_model_len: int
    """The engine's context limit: a prompt plus its budget above it is refused."""

    eos_token_ids: set[int]
    """The token ids that end a response (the fallback end-of-turn token when the tokenizer names none)."""

    keeps_prompt_cache: bool
    """Whether ``generate(..., keep_prompt_cache=True)`` returns the prompts' keys and values (engine/generation/
    prompt_cache.py); False for a backend that never keeps them."""

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, *, keep_prompt_cache: bool = False
    ) -> GenerationOutput:
        """Sample one response per prompt. keep_prompt_cache: also return the prompts' keys and values in
        ``out.prompt_cache`` where :attr:`keeps_prompt_cache` (ignored by the others)."""
        ...

    def load_weights(self, state_dict) -> None: ...

    def sleep(self) -> None:
        """Give back the engine's accelerator memory until it generates or receives weights again (vLLM's sleep
        mode); a no-op for a backend without one."""
        ...

    def close(self) -> None:
        """Release the engine at the end of a run (a no-op for a backend that holds nothing of its own)."""
        ...

    def prefill_counts(self) -> dict[str, int]:
        """Running prefill counts of a backend that keeps them (the Hugging Face generator: prompt positions pushed,
        and what one padded batch per chunk would have pushed without shared prefixes); empty for the others."""
        ...


def samples_from(generator: GenerationBackend | None, model: nn.Module | None) -> bool:
    """Whether ``generator`` samples from ``model`` itself (same module, same weights): then the trainer need not
    push its weights into it, and its per-token log-probs are ``model``'s up to kernel differences."""
    return generator is not None and model is not None and generator.model is model


def prefill_counts(backend: GenerationBackend | None) -> dict[str, int]:
    """:meth:`GenerationBackend.prefill_counts` of ``backend``; empty without one (tensor-parallel ranks other
    than their group's first hold no generator)."""
    return {} if backend is None else backend.prefill_counts()


def prefill_delta(before: dict[str, int], after: dict[str, int], prefix: str) -> dict[str, float]:
    """Step metrics ``<prefix><count>`` of the prefills between two :func:`prefill_counts` readings (counts:
    summed over data-parallel ranks)."""
    return {f"{prefix}{k}": summed(v - before.get(k, 0)) for k, v in after.items()}


def check_prompts(prompts, max_new_tokens: int, max_model_len: int) -> None:
    """A generation call's prompts: a list of non-empty token-id lists whose longest, plus the budget, fits the
    engine's ``max_model_len`` (ValueError naming what is wrong)."""
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts: expected a list of token-id lists, got {type(prompts).__name__}")
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)) or len(p) == 0:
            raise ValueError(f"prompts: row {i} must be a non-empty list of token ids")
    longest = max((len(p) for p in prompts), default=0)
    if longest + max_new_tokens > max_model_len:
        raise ValueError(
            f"sampling.max_new_tokens: prompt length {longest} + budget {max_new_tokens} exceeds "
            f"max_model_len {max_model_len}"
        )
