"""Hugging Face generation backend: our own batched sampling loop over a transformers causal LM.

Legend: B = prompts in the current chunk, Lp = padded prompt length, V = vocabulary, b = rows still generating.

Why our own loop instead of ``model.generate``: per-row stop strings are checked on the decoded continuation
after every token, finished rows leave the batch (their KV cache rows are dropped), the log-prob of each
sampled token is returned without a second pass, and a prompt prefix shared by several rows (the G siblings'
common prompt, the privileged block of the teacher prompts) is encoded once (engine/generation/prefix.py).
On the CPU the key/value cache keeps each shared prefix once, preallocates the rows' own positions and decodes
with grouped matmuls instead of the model's SDPA (``fast_decode``, engine/generation/decode_cache.py); elsewhere
the prefix's keys and values are copied to its rows in transformers' dynamic cache.
``prefill_token_forwards`` counts the prompt positions the prefills pushed, ``prefill_token_forwards_unshared``
what one padded batch per chunk would have pushed.

Sampling semantics (same as the vLLM backend):

- ``logits / temperature`` gives the *sampling logits*; the reported log-prob of a sampled token is
  ``log_softmax(logits / temperature)[token]`` in fp32 -- the quantity the trainer recomputes. Top-k / top-p
  only restrict which tokens may be drawn; the reported log-probs are **not** renormalised over the kept set.
- ``do_sample=False`` is greedy (argmax); its log-probs are ``log_softmax(logits)`` (temperature ignored, as in
  vLLM, which treats greedy as temperature 0).
- A row finishes on an EOS token (the token is kept in ``token_ids``, left out of the text) or when a stop
  string appears in its decoded continuation (``finish_reason="stop"``; the token that completed the stop string
  is kept and the text is cut right after the stop string), or after ``max_new_tokens`` tokens
  (``finish_reason="length"``).
- With ``seed`` set, a ``torch.Generator`` seeded with it drives the draws: the same prompts in the same order
  with the same seed give the same samples. Without a seed the global torch RNG is used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping

import torch
from alignopsd.engine.generation.base import GenerationOutput, SamplingParams, check_prompts
from alignopsd.engine.generation.decode_cache import (
    ModelKV,
    SharedPrefixKV,
    shared_prefix_attention_on,
    shared_prefix_supported,
)
from alignopsd.engine.generation.prefix import plan_prefixes
from alignopsd.engine.generation.prompt_cache import PromptChunk, PromptKV, distinct_prompts, keeping_prefill
from alignopsd.engine.tokens.special import token_ids
from torch import Tensor


def filter_logits(logits_BV: Tensor, top_k: int, top_p: float) -> Tensor:
    """Set logits outside the top-k / top-p (nucleus) set to -inf. [B, V] fp32 in, [B, V] out.

    Top-p keeps the smallest prefix of tokens, by descending probability, whose mass reaches ``top_p``
    (always at least one token); top-k is applied first.
    """
    out = logits_BV
    if top_k is not None and top_k > 0 and top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[:, -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def sample_rows(probs_BV: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """[B] one draw per row of the categorical distributions ``probs_BV`` (non-negative, rows need not sum to 1).

    The inverse of each row's cumulative distribution (float64) at one uniform number: the distribution of
    ``torch.multinomial(probs, 1)``, which draws an exponential number per vocabulary entry instead (on the CPU
    that was ~15 ms a token for 32 rows of a 49k vocabulary, more than the rest of the sampling). A draw never
    lands on a token of zero mass.

    A row whose total is not finite or not positive (NaN or infinite logits, every token filtered out) has no
    distribution: it draws -1, which :func:`check_draws` turns into an error naming the row (read with the draws
    the caller already copies to the host, so checking costs no extra synchronisation).
    """
    cdf = probs_BV.double().cumsum(-1)
    total = cdf[:, -1:]
    u = torch.rand((probs_BV.shape[0], 1), generator=generator, device=probs_BV.device, dtype=torch.float64)
    idx = torch.searchsorted(cdf, u * total, right=True)
    last = (cdf < total).sum(-1, keepdim=True)  # the last token with positive mass
    ok = torch.isfinite(total) & (total > 0)
    return torch.where(ok, torch.minimum(idx, last), -1).squeeze(-1)


def check_draws(draws: list[int], probs_BV: Tensor, rows: list[int]) -> None:
    """Raise ValueError naming the first row that :func:`sample_rows` could not draw from (a -1 in ``draws``);
    ``rows``: the prompt index of each row of ``probs_BV``."""
    for j, t in enumerate(draws):
        if t < 0:
            total = float(probs_BV[j].double().sum())
            raise ValueError(
                f"sampling: prompt {rows[j]} has no distribution to draw from (its probabilities sum to {total}: "
                "NaN or infinite logits, or every token filtered out)"
            )


@torch.no_grad()
def copy_weights(model, state_dict: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]) -> None:
    """Copy ``state_dict`` (HF names) into ``model``'s tensors in place; a tensor that already is the model's own
    storage (a shared trainer model) is skipped. Unknown names and other shapes raise ValueError."""
    items = state_dict.items() if isinstance(state_dict, Mapping) else state_dict
    own = model.state_dict(keep_vars=True)
    for name, value in items:
        if name not in own:
            raise ValueError(f"state_dict: unknown parameter {name!r} for this model")
        dst = own[name]
        if dst.data_ptr() == value.data_ptr() and dst.shape == value.shape:
            continue
        if dst.shape != value.shape:
            raise ValueError(f"state_dict: {name!r} has shape {tuple(value.shape)}, model has {tuple(dst.shape)}")
        dst.data.copy_(value.to(device=dst.device, dtype=dst.dtype))


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for src in (gen_eos, getattr(model.config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if src is None:
            continue
        ids.update([src] if isinstance(src, int) else list(src))
    return ids


class HFGenerator:
    """Batched sampling from a transformers causal LM (implements ``GenerationBackend``).

    ``model`` may be the trainer's own model object: generation runs under ``torch.inference_mode`` in eval
    mode and restores the training flag afterwards, so weights are shared with no copy. It stops on
    ``eos_token_ids`` (default: the model's and the tokenizer's EOS ids) and pads rows with the pad id of
    engine/tokens/special.py (``pad_token_id`` wins where given).
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_batch_size: int | None = None,
        max_model_len: int | None = None,
        eos_token_ids: Iterable[int] | None = None,
        pad_token_id: int | None = None,
    ) -> None:
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size: must be >= 1, got {max_batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_model_len = int(max_model_len or getattr(model.config, "max_position_embeddings", 1 << 30))
        self.eos_token_ids = set(eos_token_ids) if eos_token_ids is not None else _eos_ids(model, tokenizer)
        self.pad_token_id = token_ids(tokenizer, stop=self.eos_token_ids, pad=pad_token_id).pad
        self.tokens_generated = 0  # running count, for throughput metrics
        self.share_prefixes = True  # push a prefix shared by several rows once (engine/generation/prefix.py)
        self.fast_decode = True  # keep shared prefixes once, decode by grouped matmuls where supported (the CPU)
        # kept prompt keys/values of one generate call at most; beyond it nothing is kept (the consumer then pushes
        # the prompts again: the teacher forcing of a large batch on a large model)
        self.prompt_cache_max_bytes = 2 << 30
        self.prefill_token_forwards = 0  # running count of prompt positions pushed by prefills, padding included
        self.prefill_token_forwards_unshared = 0  # what the same prefills push without sharing (one padded batch)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def load_weights(self, state_dict: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]) -> None:
        """Copy ``state_dict`` (HF names) into the model in place; tensors that already are the model's own
        storage (a shared trainer model) are skipped. Unknown names raise ValueError."""
        copy_weights(self.model, state_dict)

    def sleep(self) -> None:
        """Nothing to give back: it samples from a module the trainer holds anyway."""

    def close(self) -> None:
        """Nothing of its own to release."""

    def prefill_counts(self) -> dict[str, int]:
        """The running prefill counts (see the module docstring)."""
        return {
            "prefill_token_forwards": int(self.prefill_token_forwards),
            "prefill_token_forwards_unshared": int(self.prefill_token_forwards_unshared),
        }

    # ------------------------------------------------------------------ generation
    @property
    def keeps_prompt_cache(self) -> bool:
        """Whether ``generate(..., keep_prompt_cache=True)`` returns the prompts' keys and values (the CPU decoding
        cache, engine/generation/decode_cache.py; elsewhere nothing is kept)."""
        return self.fast_decode and shared_prefix_supported(self.model)

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, *, keep_prompt_cache: bool = False
    ) -> GenerationOutput:
        """Sample from ``prompts`` (token-id lists). keep_prompt_cache: also return the prompts' keys and values
        (``out.prompt_cache``, engine/generation/prompt_cache.py) where :attr:`keeps_prompt_cache`, else None."""
        check_prompts(prompts, sampling.max_new_tokens, self.max_model_len)
        out = GenerationOutput(token_ids=[], texts=[], logprobs=[], finish_reasons=[])
        if not prompts:
            return out
        keep = keep_prompt_cache and self.keeps_prompt_cache
        kept = PromptKV.for_prompts(prompts) if keep else None
        gen = None
        if sampling.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(int(sampling.seed))
        chunk = self.max_batch_size or len(prompts)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode(), self._attention():
                for start in range(0, len(prompts), chunk):
                    part = self._generate_chunk(prompts[start : start + chunk], sampling, gen, kept, start)
                    out.token_ids += part.token_ids
                    out.texts += part.texts
                    out.logprobs += part.logprobs
                    out.finish_reasons += part.finish_reasons
        finally:
            self.model.train(was_training)
        out.prompt_cache = kept.kept() if kept is not None else None
        return out

    def _attention(self):
        """The model's attention during generation: :func:`shared_prefix_attention_on` with the shared-prefix
        cache, else unchanged."""
        if self.fast_decode and shared_prefix_supported(self.model):
            return shared_prefix_attention_on(self.model)
        return contextlib.nullcontext()

    def _forward(self, input_ids: Tensor, pos: Tensor, kv) -> Tensor:
        """Last-position logits [b, V] fp32 of one forward over the cache ``kv`` (already pushed)."""
        res = self.model(input_ids=input_ids, position_ids=pos, use_cache=True, logits_to_keep=1, **kv.forward_kwargs())
        return res.logits[:, -1, :].float()

    def _new_kv(self, budget: int):
        """The chunk's key/value cache (engine/generation/decode_cache.py): shared prefixes kept once and decoding
        by grouped matmuls where the model supports it (the CPU), else the model's own attention."""
        if self.fast_decode and shared_prefix_supported(self.model):
            return SharedPrefixKV(self.model.config.num_hidden_layers, budget)
        return ModelKV()

    def _left_pad(self, rows: list[list[int]]) -> tuple[Tensor, Tensor]:
        """([n, L] token ids, [n, L] long mask) of ``rows`` left-padded to the longest, on the model's device."""
        width = max(len(p) for p in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, p in enumerate(rows):
            if p:
                ids[i, width - len(p) :] = torch.as_tensor(p, dtype=torch.long)
                mask[i, width - len(p) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def _prefill(
        self, prompts: list[list[int]], kv, keep_room: int | None = None
    ) -> tuple[Tensor, Tensor, PromptChunk | None]:
        """(last logits [B, V] fp32, next position [B], the kept prompts or None) after pushing the prompts into the
        cache ``kv``.

        Identical prompts are pushed once (:func:`distinct_prompts`) and their rows copied after the prefill; the
        distinct prompts are pushed by :meth:`_prefill_rows`. keep_room: keep the distinct prompts' keys, values
        and last hidden states before the copy if they fit in that many bytes (the cache must be a
        ``SharedPrefixKV``; engine/generation/prompt_cache.py); None: keep nothing."""
        lengths = [len(p) for p in prompts]
        self.prefill_token_forwards_unshared += len(prompts) * max(lengths)
        uniq, inverse = distinct_prompts(prompts) if self.share_prefixes else (prompts, list(range(len(prompts))))
        with keeping_prefill(self.model, kv, keep_room, inverse) as keeper:
            logits_UV, next_pos_U = self._prefill_rows(uniq, kv)
        kept = keeper.chunk
        if len(uniq) == len(prompts):
            return logits_UV, next_pos_U, kept
        idx = torch.tensor(inverse, dtype=torch.long, device=self.device)
        kv.select(idx)
        return logits_UV[idx], next_pos_U[idx], kept

    def _prefill_rows(self, prompts: list[list[int]], kv) -> tuple[Tensor, Tensor]:
        """(last logits [B, V] fp32, next position [B]) after pushing distinct prompts into the cache ``kv``.

        With shared prefixes (:func:`plan_prefixes`) and fewer positions to push than one padded batch, the
        prefixes go through one forward and become the cache's shared prefixes, and the rows' suffixes follow in
        a second forward over them (positions continuing from each row's prefix); otherwise one forward of the
        padded prompts."""
        lengths = [len(p) for p in prompts]
        plain = len(prompts) * max(lengths)
        plan = plan_prefixes(prompts) if self.share_prefixes else None
        if plan is None or not plan.length or plan.token_forwards(lengths) >= plain:
            ids_BL, mask_BL = self._left_pad(prompts)
            pos_BL = (mask_BL.cumsum(-1) - 1).clamp_min(0)
            kv.push(mask_BL)
            self.prefill_token_forwards += plain
            return self._forward(ids_BL, pos_BL, kv), pos_BL[:, -1] + 1
        pre_ids, pre_mask = self._left_pad([prompts[r][:n] for r, n in zip(plan.source, plan.length)])
        kv.push(pre_mask)
        self._forward(pre_ids, (pre_mask.cumsum(-1) - 1).clamp_min(0), kv)
        shared = torch.tensor([r >= 0 for r in plan.group], dtype=torch.long, device=self.device)
        row_prefix = torch.tensor([max(g, 0) for g in plan.group], dtype=torch.long, device=self.device)
        kv.share(row_prefix, shared)
        suf_ids, suf_mask = self._left_pad([p[plan.prefix_of(r) :] for r, p in enumerate(prompts)])
        pos_BS = pre_mask.sum(-1)[row_prefix][:, None] * shared[:, None] + (suf_mask.cumsum(-1) - 1).clamp_min(0)
        kv.push(suf_mask)
        self.prefill_token_forwards += int(pre_ids.numel() + suf_ids.numel())
        return self._forward(suf_ids, pos_BS, kv), pos_BS[:, -1] + 1

    def _generate_chunk(
        self, prompts: list[list[int]], sp: SamplingParams, gen, kept: PromptKV | None, first: int = 0
    ) -> GenerationOutput:
        """One chunk of :meth:`generate`: ``prompts`` are the call's prompts ``first``, ``first + 1``, ..."""
        dev = self.device
        B = len(prompts)
        kv = self._new_kv(sp.max_new_tokens)
        room = kept.room(self.prompt_cache_max_bytes) if kept is not None else None
        logits_bV, next_pos_b, chunk = self._prefill(prompts, kv, keep_room=room)
        if kept is not None:  # over the limit (no chunk): nothing of this call is kept
            kept.add(chunk, B)

        stops = tuple(s for s in sp.stop if s)
        window = max((len(s) for s in stops), default=0) + 2  # tokens enough to contain any stop string
        temperature = sp.temperature if sp.do_sample else 1.0  # greedy: log-probs of the raw logits (as vLLM)
        toks: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        reasons = ["length"] * B
        active = list(range(B))  # chunk row index of each live batch row

        for step in range(sp.max_new_tokens):
            scaled_bV = logits_bV / temperature
            logp_bV = torch.log_softmax(scaled_bV, dim=-1)
            if sp.do_sample:
                probs = filter_logits(scaled_bV, sp.top_k, sp.top_p).softmax(-1)
                tok_b = sample_rows(probs, gen)
            else:
                tok_b = scaled_bV.argmax(-1)
            lp_b = logp_bV.gather(-1, tok_b.clamp_min(0)[:, None]).squeeze(-1)
            # one host transfer per generated token (ids are exact in float64); end of sequence is read on the host
            tok_f, lp_l = torch.stack((tok_b.double(), lp_b.double())).tolist()
            tok_l = [int(t) for t in tok_f]
            if sp.do_sample:
                check_draws(tok_l, probs, [first + row for row in active])
            eos_l = [t in self.eos_token_ids for t in tok_l]
            keep: list[int] = []
            for j, row in enumerate(active):
                toks[row].append(tok_l[j])
                lps[row].append(lp_l[j])
                if eos_l[j]:
                    reasons[row] = "stop"
                    continue
                if stops:
                    tail = self.tokenizer.decode(toks[row][-window:], skip_special_tokens=True)
                    if any(s in tail for s in stops):
                        reasons[row] = "stop"
                        continue
                keep.append(j)
            self.tokens_generated += len(active)
            if not keep or step == sp.max_new_tokens - 1:
                break
            if len(keep) < len(active):  # drop finished rows from the batch and the KV cache
                sel = torch.tensor(keep, dtype=torch.long, device=dev)
                kv.select(sel)
                tok_b, next_pos_b = tok_b[sel], next_pos_b[sel]
                active = [active[j] for j in keep]
            kv.push(torch.ones((len(active), 1), dtype=torch.long, device=dev))
            logits_bV = self._forward(tok_b[:, None], next_pos_b[:, None], kv)
            next_pos_b = next_pos_b + 1

        texts = [self._text(t, stops) for t in toks]
        return GenerationOutput(token_ids=toks, texts=texts, logprobs=lps, finish_reasons=reasons)

    def _text(self, ids: list[int], stops: tuple[str, ...]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = [text.find(s) + len(s) for s in stops if s in text]
        return text[: min(cut)] if cut else text
