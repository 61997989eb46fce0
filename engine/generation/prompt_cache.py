"""The prompts' keys and values of one generate call, kept for scoring other responses behind the same prompts.

Legend: B = rows of the generate call, U = distinct prompts of a chunk, W = their kept width (shared prefix and
own positions, left-padded), K = key/value heads, D = head dim, Dm = hidden size.

Why: the teacher pass (engine/step/teacher_pass.py) first samples one teacher response per privileged prompt and
then teacher-forces the student responses (the diagonal and the cross pairs, ALGORITHM.md §2.6) behind the same
privileged prompts with the same weights. Without a kept cache the teacher forcing pushes every distinct
privileged prompt through the model a second time (on the quickstart's CPU, three quarters of its positions);
with it, it pushes only the responses (engine/step/cached_scoring.py). The Hugging Face generator keeps the cache
when asked (``HFGenerator.generate(..., keep_prompt_cache=True)``, CPU decoding cache only); the consumer checks
that it scores the very prompts the cache was made from (:meth:`PromptKV.check`).

Identical prompts of a generate call are pushed once (:func:`distinct_prompts`): the siblings' first turns, and
so their privileged prompts, coincide.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor


def distinct_prompts(prompts: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[int]]:
    """(distinct prompts in first-seen order, index of each row's prompt among them)."""
    seen: dict[tuple[int, ...], int] = {}
    uniq: list[list[int]] = []
    inverse: list[int] = []
    for p in prompts:
        key = tuple(p)
        j = seen.get(key)
        if j is None:
            j = seen[key] = len(uniq)
            uniq.append(list(p))
        inverse.append(j)
    return uniq, inverse


@dataclass
class PromptChunk:
    """The distinct prompts of one generation chunk after their prefill."""

    keys: list[Tensor]  # per layer [U, K, W, D] fp32, the positions each prompt attends (padding masked by valid)
    values: list[Tensor]
    valid: Tensor  # [U, W] bool: non-padding positions
    last_hidden: Tensor  # [U, Dm]: the final hidden state at each prompt's last position (its first logits)
    prompt_of_row: list[int]  # per row of the chunk: its prompt among the U


@dataclass
class PromptKV:
    """Keys and values of the prompts of one generate call: row ``r`` (in the call's order) is prompt
    ``prompt_of_row[r]`` of chunk ``chunk_of_row[r]``."""

    prompts: list[tuple[int, ...]]  # each row's prompt, to check the consumer scores the same prompts
    chunk_of_row: list[int]
    prompt_of_row: list[int]
    chunks: list[PromptChunk]
    complete: bool = True  # False once a chunk did not fit the generator's byte limit (nothing is then returned)

    def check(self, prompts: Sequence[Sequence[int]]) -> None:
        """Raise ValueError unless ``prompts`` (the rows to score, unpadded) are the rows the cache was made from."""
        if len(prompts) != len(self.prompts):
            raise ValueError(f"prompt_cache: made for {len(self.prompts)} prompts, asked to score {len(prompts)}")
        for r, (a, b) in enumerate(zip(prompts, self.prompts)):
            if tuple(a) != b:
                raise ValueError(f"prompt_cache: row {r}'s prompt is not the one the cache was made from")

    @property
    def nbytes(self) -> int:
        """Bytes held by the kept keys and values."""
        return sum(t.numel() * t.element_size() for c in self.chunks for t in (*c.keys, *c.values))
