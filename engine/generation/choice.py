"""Candidate-choice generation: a generation backend for admissible-action environments (``generation.backend:
choice``).

A random-weight or very small model cannot yet write the ``<think>...</think><action>...</action>`` format, so
free sampling would give nothing but malformed turns. This backend samples from the policy restricted to a fixed
set of well-formed responses instead: for each prompt it reads the admissible actions listed in the prompt (the
last ``Actions: [...]`` or ``Admissible actions: [...]`` list), builds two candidate responses per action
(:func:`candidate_texts`, each followed by EOS), scores every candidate under the policy at the sampling
temperature and samples one with probability proportional to exp(log p(candidate) / temperature) (the scores are
already tempered). Scoring shares each prompt among its candidates (the rescoring engine's shared-prefix scorer,
engine/policy/row_scoring.py: every distinct prompt is pushed through the model once and its key/value cache
serves all of its candidates; forwards of at most ``max_batch_tokens`` context tokens), so a turn costs about
one prompt forward plus its short candidates, not one full forward per candidate. The returned tokens and per-token
log-probs are a real sample of the policy restricted to the candidate set, so the PPO update on them moves
exactly the probabilities this backend samples from.

It samples from the trainer's own module (no weight copy; ``load_weights`` skips shared storage like the Hugging
Face backend), ignores ``max_new_tokens`` and stop strings (candidates are short and complete), and draws from a
``torch.Generator`` seeded with ``sampling.seed``, so a run is reproducible. It only applies to environments whose
prompts list their admissible actions (ALFWorld-style and the toy and credit environments, not WebShop or
Search); a prompt without such a list is an error naming it. Teacher prompts contain the student prompt, so the
teacher samples over the same candidates.
"""

from __future__ import annotations

import re

import torch
from alignopsd.engine.generation.base import GenerationOutput, SamplingParams
from alignopsd.engine.generation.hf import HFGenerator
from alignopsd.engine.parallel import devices
from alignopsd.engine.policy.row_scoring import score_shared_prefix
from alignopsd.engine.tokens.layout import left_pad, right_pad

_ACTIONS_RE = re.compile(r"(?:Admissible actions|Actions): \[(.*?)\]")


def candidate_texts(prompt_text: str) -> list[str]:
    """Two responses per admissible action listed in the prompt (its last 'Actions: [...]' list), in list order."""
    found = _ACTIONS_RE.findall(prompt_text)
    actions = [a.strip().strip("'\"") for a in found[-1].split(",") if a.strip()] if found else []
    if not actions:
        tail = prompt_text[-200:].replace("\n", " ")
        raise ValueError(f"prompt: no admissible actions listed (expected Actions: [a, ...]); prompt ends {tail!r}")
    out = []
    for a in actions:
        for t in (f"i will {a}", f"{a} looks good"):
            out.append(f"<think>{t}</think><action>{a}</action>")
    return out


class ChoiceGenerator:
    """Samples one candidate response per prompt (see the module docstring); ``model`` is the trained module."""

    def __init__(self, model, tokenizer, max_batch_tokens: int = 16384) -> None:
        self.model = model
        self.max_batch_tokens = int(max_batch_tokens)  # context tokens per forward (bounds the peak memory)
        self.tokenizer = tokenizer
        self.eos_token_ids = {tokenizer.eos_token_id}

    # it only scores the listed candidates: no context limit of its own, no prompt cache kept
    max_model_len: int = 1 << 62
    keeps_prompt_cache: bool = False

    # the Hugging Face backend's weight push into ``model`` (a no-op for the trainer's own tensors)
    load_weights = HFGenerator.load_weights

    def sleep(self) -> None:
        """Nothing to give back: it scores with a module the trainer holds anyway."""

    def close(self) -> None:
        """Nothing of its own to release."""

    def prefill_counts(self) -> dict[str, int]:
        """No prefill counts kept."""
        return {}

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, *, keep_prompt_cache: bool = False
    ) -> GenerationOutput:
        """One sampled candidate per prompt (``keep_prompt_cache`` is ignored: nothing is kept)."""
        tok = self.tokenizer
        eos = tok.eos_token_id
        cands = [candidate_texts(tok.decode(p, skip_special_tokens=False)) for p in prompts]
        texts = sorted({t for cs in cands for t in cs})
        ids = dict(zip(texts, tok(texts, add_special_tokens=False)["input_ids"]))  # one batched call
        rows_c = [ids[t] + [eos] for cs in cands for t in cs]
        row_prompt = torch.tensor([i for i, cs in enumerate(cands) for _ in cs], dtype=torch.long)
        width = max(len(c) for c in rows_c)
        was = self.model.training
        self.model.eval()
        dev = devices.module_device(self.model)
        p_ids, p_mask = left_pad(prompts, max(len(p) for p in prompts), eos)
        c_ids, c_mask = right_pad(rows_c, width, 0)
        rows = [devices.to_device(t, dev) for t in (p_ids, p_mask, row_prompt, c_ids, c_mask)]
        lp = score_shared_prefix(self.model, *rows, temperature=sampling.temperature, max_tokens=self.max_batch_tokens)[
            0
        ].cpu()  # the generation backend hands host lists back
        self.model.train(was)
        seq = (lp * c_mask).sum(1)
        gen = torch.Generator().manual_seed(int(sampling.seed or 0))
        out = GenerationOutput(token_ids=[], texts=[], logprobs=[], finish_reasons=[])
        start = 0
        for cs in cands:
            k = len(cs)
            j = int(torch.multinomial(torch.softmax(seq[start : start + k], 0), 1, generator=gen))
            r = start + j
            n = len(rows_c[r])
            out.token_ids.append(list(rows_c[r]))
            out.texts.append(cs[j])
            out.logprobs.append(lp[r, :n].tolist())
            out.finish_reasons.append("stop")
            start += k
        return out
