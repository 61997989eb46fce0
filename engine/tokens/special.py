"""The end and pad ids of a run, read from its tokenizer once: the one rule the generation backends, the rollout and
the warm start use.

- ``eos`` ends a turn's response (the rollout closes an empty response with it, the warm start's examples end with
  it): the tokenizer's EOS id, else the smallest of the ids that end sampling (``stop``: what a generation backend
  stops on, the model's own EOS ids among them), else none;
- ``pad`` fills token rows: an explicit pad id of the caller, else the tokenizer's pad id, else ``eos``.

0 is a token id like any other: a pad or EOS id of 0 is that id, never "missing".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from alignopsd.engine.tokens.tokenizer import Tokenizer


@dataclass(frozen=True)
class TokenIds:
    """The end-of-turn id (None where the tokenizer and the model name none) and the pad id of a tokenizer."""

    eos: int | None
    pad: int

    def end_of_turn(self, use: str) -> int:
        """``eos``; ValueError naming the tokenizer and ``use`` (what needs it) where there is none."""
        if self.eos is None:
            raise ValueError(f"tokenizer: no eos_token_id to {use}")
        return self.eos


def token_ids(tokenizer: Tokenizer, *, stop: Iterable[int] = (), pad: int | None = None) -> TokenIds:
    """The :class:`TokenIds` of ``tokenizer`` (see the module doc); ``stop``: the ids that end sampling (the
    fallback of the EOS id), ``pad``: an explicit pad id (wins over the tokenizer's)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        ids = sorted(int(i) for i in stop)
        eos = ids[0] if ids else None
    if pad is None:
        pad = tokenizer.pad_token_id
    if pad is None:
        pad = eos
    if pad is None:
        raise ValueError("tokenizer: no pad_token_id and no eos_token_id (nor an id that ends sampling) to pad rows")
    return TokenIds(eos=None if eos is None else int(eos), pad=int(pad))
