"""The members of ``GenerationBackend`` that a test double does not exercise, with the answers of a backend that
keeps nothing: no module of the trainer's (the weights are pushed), no context limit, no prompt cache, no prefill
counts, nothing to release. A double subclasses it and defines what its test drives."""

from __future__ import annotations


class GeneratorDouble:
    model = None
    max_model_len: int = 1 << 62
    eos_token_ids: set[int] = set()
    keeps_prompt_cache: bool = False

    def sleep(self) -> None:
        return None

    def close(self) -> None:
        return None

    def prefill_counts(self) -> dict[str, int]:
        return {}

    def load_weights(self, state_dict) -> None:
        return None
