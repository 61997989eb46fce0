"""What the engine uses of a tokenizer: the step's rollout (chat template, encoding, end and pad ids), the region
diagnostics (decoding, character offsets), the audit records and the generation backends (decoding). A Hugging Face
tokenizer (``engine/models/loading.py: load_tokenizer``) is one; nothing else of it is read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class Tokenizer(Protocol):
    eos_token_id: int | None  # ends a turn's response (the rollout closes an empty response with it)
    pad_token_id: int | None  # pads token rows (the EOS id when the model has no pad token)

    def __call__(
        self, text: str, *, add_special_tokens: bool = True, return_offsets_mapping: bool = False
    ) -> Mapping[str, Any]:
        """``{"input_ids": [...]}`` (and ``"offset_mapping": [(start, end), ...]`` per token when asked)."""
        ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...

    def apply_chat_template(
        self, conversation: Sequence[Mapping[str, str]], *, tokenize: bool = True, add_generation_prompt: bool = False
    ) -> str:
        """The chat-formatted text of ``conversation`` (called with ``tokenize=False``)."""
        ...
