"""Row scoring behind prompts whose keys and values a generate call kept (engine/generation/prompt_cache.py).

Legend: R = scored rows, L = padded response length (right-padded), U = a chunk's distinct prompts, W = their kept
width, Dm = hidden size.

The teacher pass generates from the privileged prompts and then teacher-forces the student responses behind the
same prompts (ALGORITHM.md §2.6). When the generator is the scoring model itself (the Hugging Face generator on
the trainer's module, CPU decoding cache) it keeps the prompts' keys and values, and the teacher forcing pushes
only the responses: row r reads the kept keys/values of its prompt (the CPU decoding cache's shared-prefix
attention, engine/generation/decode_cache.py, with the prompt as the row's prefix), its response tokens but the
last go through the model at positions continuing from the prompt's length, and the log-prob of response token 0
comes from the prompt's kept last hidden state. Same contract and results as ``score_plain`` /
``score_shared_prefix`` (engine/policy/row_scoring.py) up to floating-point reassociation; what the forwards push is
counted the same way (``response_tokens``; no ``prompt_tokens``).
"""

from __future__ import annotations

import torch
from alignopsd.engine.generation.decode_cache import SharedPrefixKV, shared_prefix_attention_on
from alignopsd.engine.generation.prompt_cache import PromptChunk, PromptKV
from alignopsd.engine.policy.lm_head import logprob_head, scatter_response, transformer_body
from alignopsd.engine.policy.row_scoring import right_extents
from torch import Tensor, nn


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
