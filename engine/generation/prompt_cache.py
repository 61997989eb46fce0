"""Teacher forcing behind kept prompts: the one owner of the prompts' keys and values one generate call keeps, from
the prefill that keeps them to the scoring that reads them.

Legend: B = rows of the generate call, U = distinct prompts of a chunk, W = their kept width (shared prefix and
own positions, left-padded), K = key/value heads, D = head dim, Dm = hidden size, R = scored rows, L = padded
response length (right-padded).

Why: the teacher pass (engine/step/teacher_pass.py) first samples one teacher response per privileged prompt and
then teacher-forces the student responses (the diagonal and the cross pairs, ALGORITHM.md §2.6) behind the same
privileged prompts with the same weights. Without a kept cache the teacher forcing pushes every distinct
privileged prompt through the model a second time (on the quickstart's CPU, three quarters of its positions);
with it, it pushes only the responses (where the rescorer reads it: engine/step/rescoring.py's
``Rescorer.reads_prompt_cache``). Here, in order:

- how a generate call keeps them: the Hugging Face generator (``HFGenerator.generate(..., keep_prompt_cache=True)``,
  CPU decoding cache only) wraps each chunk's prefill in :func:`keeping_prefill` (the prompts' keys, values and last
  hidden states, under a byte limit) and adds the chunk to the call's :class:`PromptKV` (:meth:`PromptKV.add`);
  identical prompts of a generate call are pushed once (:func:`distinct_prompts`): the siblings' first turns, and
  so their privileged prompts, coincide;
- the consumer's check that it scores the very prompts the cache was made from (:meth:`PromptKV.check`);
- the scoring (:func:`score_cached_prompts`): row r reads the kept keys/values of its prompt (the CPU decoding
  cache's shared-prefix attention, engine/generation/decode_cache.py, with the prompt as the row's prefix), its
  response tokens but the last go through the model at positions continuing from the prompt's length, and the
  log-prob of response token 0 comes from the prompt's kept last hidden state. Same contract and results as
  ``score_plain`` / ``score_shared_prefix`` (engine/policy/row_scoring.py) up to floating-point reassociation;
  what the forwards push is counted the same way (``response_tokens``; no ``prompt_tokens``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from alignopsd.engine.generation.decode_cache import SharedPrefixKV, shared_prefix_attention_on
from alignopsd.engine.policy.lm_head import logprob_head, scatter_response, transformer_body
from alignopsd.engine.policy.row_scoring import right_extents
from torch import Tensor, nn


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


class PrefillKeeper:
    """What :func:`keeping_prefill` kept: ``chunk`` after the block (None when nothing is kept)."""

    def __init__(self) -> None:
        self.last: list[Tensor] = []
        self.chunk: PromptChunk | None = None


@contextmanager
def keeping_prefill(
    model: nn.Module, kv: SharedPrefixKV, room: int | None, prompt_of_row: list[int]
) -> Iterator[PrefillKeeper]:
    """Around the prefill of a chunk's distinct prompts into ``kv``: keep their keys, values and last hidden states
    (the final hidden state of the last forward's last position, the first logits' input) as the keeper's ``chunk``
    if they fit in ``room`` bytes; ``room`` None keeps nothing. ``prompt_of_row``: each row's distinct prompt."""
    keeper = PrefillKeeper()
    if room is None:
        yield keeper
        return
    hook = transformer_body(model).register_forward_hook(
        lambda _m, _a, res: keeper.last.append(res.last_hidden_state[:, -1])
    )
    try:
        yield keeper
    finally:
        hook.remove()
    if kv.snapshot_bytes() <= room:  # before the rows of repeated prompts are copied
        keys, values, valid = kv.prompts_snapshot()
        keeper.chunk = PromptChunk(keys, values, valid, keeper.last[-1].clone(), prompt_of_row=prompt_of_row)


@dataclass
class PromptKV:
    """Keys and values of the prompts of one generate call: row ``r`` (in the call's order) is prompt
    ``prompt_of_row[r]`` of chunk ``chunk_of_row[r]``."""

    prompts: list[tuple[int, ...]]  # each row's prompt, to check the consumer scores the same prompts
    chunk_of_row: list[int]
    prompt_of_row: list[int]
    chunks: list[PromptChunk]
    complete: bool = True  # False once a chunk did not fit the generator's byte limit (nothing is then returned)

    @classmethod
    def for_prompts(cls, prompts: Sequence[Sequence[int]]) -> PromptKV:
        """An empty record for a generate call of ``prompts``; its chunks are added as they are prefilled."""
        return cls([tuple(p) for p in prompts], [], [], [])

    def room(self, max_bytes: int) -> int | None:
        """Bytes the next chunk may keep under ``max_bytes`` in all (None once incomplete: nothing more is kept)."""
        return max_bytes - self.nbytes if self.complete else None

    def add(self, chunk: PromptChunk | None, rows: int) -> None:
        """The next ``rows`` rows of the call: their kept chunk, or None when it did not fit (then nothing of the call
        is kept)."""
        if chunk is None:
            self.complete = False
            self.chunks.clear()
            return
        self.chunk_of_row += [len(self.chunks)] * rows
        self.prompt_of_row += chunk.prompt_of_row
        self.chunks.append(chunk)

    def kept(self) -> PromptKV | None:
        """This record, when every chunk of the call was kept; None otherwise."""
        return self if self.complete else None

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


def score_cached_prompts(
    model: nn.Module,
    cache: PromptKV,
    row_prompt_R: Tensor,
    response_ids_RL: Tensor,
    response_mask_RL: Tensor,
    *,
    temperature: float = 1.0,
    max_tokens: int = 16384,
    impl: str = "auto",
    stats: dict,
) -> Tensor:
    """[R, L] fp32 log-probs (0 on masked-out positions; the teacher forcing needs no entropy) of rows
    ``[prompt row_prompt_R[r] | response r]``, the prompts being the rows of the generate call that made ``cache``;
    rows go through forwards of at most ``max_tokens`` context tokens (rows x (kept width + response)). ``model``
    must be the generating model with the weights it generated with. Counts are added to ``stats``
    (engine/policy/row_scoring.py's legend)."""
    r, lr = response_ids_RL.shape
    dev = response_ids_RL.device
    out = torch.zeros(r, lr, dtype=torch.float32, device=dev)
    head_fn = logprob_head(model, temperature=temperature, impl=impl)

    rp = row_prompt_R.tolist()
    if any(not 0 <= p < len(cache.prompts) for p in rp):
        raise ValueError(f"row_prompt: indices must be in [0, {len(cache.prompts)}) (the cached prompts)")
    right = right_extents(response_mask_RL)
    with shared_prefix_attention_on(model):
        for c, chunk in enumerate(cache.chunks):
            rows = [i for i in range(r) if cache.chunk_of_row[rp[i]] == c and right[i] > 0]
            rows.sort(key=lambda i: -right[i])  # rows of similar lengths share a forward: less padding pushed
            width = int(chunk.valid.shape[1])
            per = max(1, max_tokens // (width + right[rows[0]])) if rows else 1  # the longest rows come first
            for i in range(0, len(rows), per):
                sub = rows[i : i + per]
                idx = torch.tensor(sub, dtype=torch.long, device=dev)
                prompts = [cache.prompt_of_row[rp[k]] for k in sub]
                h = _hidden(model, chunk, prompts, response_ids_RL[idx], response_mask_RL[idx], right[sub[0]], stats)
                out[idx] = scatter_response(h, response_ids_RL[idx], response_mask_RL[idx].bool(), head_fn)[0]
    stats["rows"] += r
    return out


def _hidden(
    model: nn.Module,
    chunk: PromptChunk,
    prompts: list[int],
    resp_ids: Tensor,
    resp_mask: Tensor,
    l_used: int,
    stats: dict,
) -> Tensor:
    """[n, l_used, Dm] final hidden states whose position j predicts response token j: the prompt's kept last
    state, then the forward of response tokens 0..l_used-2 behind the kept prompt."""
    dev = resp_ids.device
    u = torch.tensor(prompts, dtype=torch.long, device=chunk.valid.device)
    h_rows = [chunk.last_hidden.index_select(0, u).to(dev)[:, None]]
    if l_used > 1:
        r_ids, r_mask = resp_ids[:, : l_used - 1], resp_mask[:, : l_used - 1].long()
        kv = SharedPrefixKV.reading(chunk.keys, chunk.values, chunk.valid, u)
        kv.push(r_mask)
        # positions continue the prompt's count of attended tokens, as position_ids of [prompt | response]
        pos = (chunk.valid.sum(-1).index_select(0, u)[:, None] + r_mask.cumsum(-1) - 1).clamp_min(0)
        res = transformer_body(model)(input_ids=r_ids, position_ids=pos, use_cache=True, **kv.forward_kwargs())
        h_rows.append(res.last_hidden_state.to(h_rows[0].dtype))
        stats["response_tokens"] += int(r_ids.numel())
        stats["token_forwards"] += int(r_ids.numel())
        stats["forwards"] += 1
    return torch.cat(h_rows, dim=1)
