"""The rescoring engine: student old log-probs, diagonal and cross teacher log-probs of a turn batch.

Legend: M = turns, P = cross pairs, R = scored rows, L = padded response length (right-padded).

What is scored (ALGORITHM.md §2.6):
- student row t: ``[student prompt of t | response of t]`` -> ``old_logp[t]``;
- diagonal row t: ``[teacher prompt of t | response of t]`` -> ``diag[t]``;
- cross pair (s, t): ``[teacher prompt of s | response of t]`` -> ``cross[p]`` (scored tokens: t's response).
Every result is [rows, L] fp32, the log-prob of each response token under logits / temperature, 0 on
masked-out positions. How rows are pushed through the model (``plain`` or ``shared_prefix``, and a policy
backend scoring its own rows) is engine/policy/row_scoring.py; the counts it reports land in ``stats``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from alignopsd.engine.generation.base import samples_from
from alignopsd.engine.generation.prompt_cache import PromptKV, score_cached_prompts
from alignopsd.engine.parallel import devices
from alignopsd.engine.parallel.devices import module_device
from alignopsd.engine.policy.base import RowLayout
from alignopsd.engine.policy.row_scoring import (
    RESCORING_MODES,
    as_pairs,
    new_stats,
    score_plain,
    score_shared_prefix,
)
from alignopsd.engine.step.batch import TurnBatch
from torch import Tensor, nn

from alignopsd.losses import rollout_mismatch_metrics

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------------------------------
# the engine
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class RescoreOutput:
    """Everything the rescoring of one step produces (shapes in the module legend)."""

    old_logp: Tensor | None  # [M, L] student log-probs (None when not requested)
    diag: Tensor | None  # [M, L] diagonal teacher log-probs
    cross: Tensor | None  # [P, L] cross log-probs, in pair order
    entropy: Tensor | None = None  # [M, L] student entropy when requested
    stats: dict = field(default_factory=dict)


def unpadded_prompts(ids_ML: Tensor, mask_ML: Tensor) -> list[list[int]]:
    """The attended token ids of each left-padded prompt row."""
    return [[t for t, k in zip(ids, msk) if k] for ids, msk in zip(ids_ML.tolist(), mask_ML.tolist())]


class Rescorer:
    """Scores a ``TurnBatch`` with a causal LM (the current actor) in one of ``RESCORING_MODES``.

    model: the Hugging Face causal LM (the policy's weights; a ``HFPolicy``'s ``.model``). temperature: the
    rollout temperature (log-probs under logits / temperature). max_tokens: context tokens per forward.
    dedupe: merge identical prompts (shared_prefix). max_prefix_tokens: prompt tokens whose cache is held at once
    (shared_prefix; default max_tokens // 4).
    reuse_rollout_logp: take the student old log-probs from ``batch.rollout_logp`` (engine log-probs) instead
    of a forward (then no student entropy is returned); only correct when the engine samples from ``model`` itself
    (``samples_from``: the run's composition root asks it, engine/run/components.py ``reuses_rollout_logprobs``).
    check_reuse: with reuse on, also compute them and log the mismatch.
    scorer: ``scorer(prompt_ids, prompt_mask, row_prompt, resp_ids, resp_mask, with_entropy, stats) -> (logp, ent)``
    scores the rows ``[prompt_ids[row_prompt] | resp_ids]`` instead of ``model`` (student and teacher rows alike)
    and adds its counts to ``stats``: a policy backend that is not ``model`` scores with itself, in the mode
    :func:`backend_scorer` was given (the same ``mode`` as here).
    scope: a context every forward of ``model`` runs in (a LoRA policy's reference: its adapters disabled,
    ``LoraAdapter.disabled``).
    by_length: forwards take the rows longest first (engine/policy/row_scoring.py; ``trainer.ppo.max_token_len_per_gpu``
    on), the same results with less padding; the counts in ``stats`` include ``real_tokens``.
    rows: plain mode's rows packed (padding-free, engine/policy/lm_head.py ``score_rows``) or padded, as the policy's
    ``RowLayout`` says at each forward (``trainer.ppo.use_remove_padding``; the policy's own object, so a choice the
    update measures is taken here too); None: padded.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        mode: str = "shared_prefix",
        temperature: float = 1.0,
        max_tokens: int = 16384,
        impl: str = "auto",
        dedupe: bool = True,
        max_prefix_tokens: int | None = None,
        reuse_rollout_logp: bool = False,
        check_reuse: bool = False,
        scorer=None,
        scope: Callable[[], contextlib.AbstractContextManager] | None = None,
        by_length: bool = False,
        rows: RowLayout | None = None,
    ) -> None:
        if mode not in RESCORING_MODES:
            raise ValueError(f"mode: expected one of {RESCORING_MODES}, got {mode!r}")
        if not temperature > 0:
            raise ValueError(f"temperature: must be > 0, got {temperature}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
        self.model = model
        self.mode = mode
        self.temperature = float(temperature)
        self.max_tokens = int(max_tokens)
        self.impl = impl
        self.dedupe = dedupe
        self.max_prefix_tokens = max_prefix_tokens
        self.reuse_rollout_logp = reuse_rollout_logp
        self.check_reuse = check_reuse
        if scorer is not None and not callable(scorer):
            raise ValueError(f"scorer: expected a callable, got {type(scorer).__name__}")
        self.scorer = scorer
        self.scope = scope or contextlib.nullcontext
        self.scoped = scope is not None
        self.by_length = bool(by_length)
        self.rows = rows

    def _score(self, prompt_ids, prompt_mask, row_prompt, resp_ids, resp_mask, with_entropy, stats):
        """Score the rows on the model's device; results come back on the device of ``resp_ids``."""
        if self.scorer is not None:  # the training backend scores the rows itself (and counts its forwards)
            return self.scorer(prompt_ids, prompt_mask, row_prompt, resp_ids, resp_mask, with_entropy, stats)
        kw = dict(
            temperature=self.temperature,
            with_entropy=with_entropy,
            max_tokens=self.max_tokens,
            impl=self.impl,
            by_length=self.by_length,
        )
        back = resp_ids.device
        dev = module_device(self.model)
        rows = [devices.to_device(t, dev) for t in (prompt_ids, prompt_mask, row_prompt, resp_ids, resp_mask)]
        with self.scope():
            if self.mode == "plain":
                lp, en = score_plain(self.model, *rows, **kw, stats=stats, packed=self.packs())
            else:
                lp, en = score_shared_prefix(
                    self.model, *rows, **kw, dedupe=self.dedupe, max_prefix_tokens=self.max_prefix_tokens, stats=stats
                )
        return lp.to(back), (en.to(back) if en is not None else None)

    def packs(self) -> bool:
        """Whether plain mode's next forward runs in packed rows (the policy's ``RowLayout``)."""
        return self.rows is not None and self.rows.packs()

    def reads_prompt_cache(self, generator) -> bool:
        """Whether the teacher forcing can read the privileged prompts' keys and values that ``generator`` keeps
        (engine/generation/prompt_cache.py): the generator keeps them (the CPU decoding cache) and samples from this
        scorer's own model (same module, same weights, no :attr:`scope`), which scores in the ``shared_prefix`` mode
        by itself."""
        keeps = generator is not None and generator.keeps_prompt_cache
        own = self.scorer is None and not self.scoped and self.mode == "shared_prefix"
        return keeps and own and samples_from(generator, self.model)

    @torch.no_grad()
    def student_logprobs(self, batch: TurnBatch, *, with_entropy: bool = False) -> tuple[Tensor, Tensor | None, dict]:
        """([M, L] old log-probs of each turn's response under its student prompt, [M, L] entropy or None, stats)."""
        stats = new_stats()
        t0 = time.perf_counter()
        rows = torch.arange(batch.size, device=batch.response_ids.device)
        with _eval(self.model):
            lp, en = self._score(
                batch.prompt_ids, batch.prompt_mask, rows, batch.response_ids, batch.response_mask, with_entropy, stats
            )
        stats["seconds"] = time.perf_counter() - t0
        return lp, en, stats

    @torch.no_grad()
    def teacher_logprobs(
        self, batch: TurnBatch, pairs=None, *, diagonal: bool = True, prompt_cache: PromptKV | None = None
    ) -> tuple[Tensor | None, Tensor, dict]:
        """(diag [M, L] or None, cross [P, L], stats): teacher forcing under the privileged prompts.

        pairs: [P, 2] (source, target) cross pairs (a tensor or a list of tuples; None or empty: no cross rows).
        The diagonal and the cross rows go through one scoring pass (the fused batch of M + P rows).
        prompt_cache: the privileged prompts' keys and values kept by the teacher generation, one row per turn in
        turn order (only where :meth:`reads_prompt_cache`): then only the responses are pushed.
        """
        if batch.teacher_prompt_ids is None or batch.teacher_prompt_mask is None:
            raise ValueError("batch: teacher_prompt_ids/teacher_prompt_mask are required for teacher scoring")
        m = batch.size
        dev = batch.response_ids.device
        pr = as_pairs(pairs, m).to(dev)
        diag_idx = torch.arange(m, device=dev) if diagonal else torch.zeros(0, dtype=torch.long, device=dev)
        src = torch.cat([diag_idx, pr[:, 0]])
        tgt = torch.cat([diag_idx, pr[:, 1]])
        stats = new_stats()
        t0 = time.perf_counter()
        with _eval(self.model):
            if prompt_cache is not None:
                prompt_cache.check(unpadded_prompts(batch.teacher_prompt_ids, batch.teacher_prompt_mask))
                lp = score_cached_prompts(
                    self.model,
                    prompt_cache,
                    src,
                    batch.response_ids[tgt],
                    batch.response_mask[tgt],
                    temperature=self.temperature,
                    max_tokens=self.max_tokens,
                    impl=self.impl,
                    stats=stats,
                )
                stats["cached_prompts"] = 1
            else:
                lp, _ = self._score(
                    batch.teacher_prompt_ids,
                    batch.teacher_prompt_mask,
                    src,
                    batch.response_ids[tgt],
                    batch.response_mask[tgt],
                    False,
                    stats,
                )
        stats["seconds"] = time.perf_counter() - t0
        nd = int(diag_idx.numel())
        return (lp[:nd] if diagonal else None), lp[nd:], stats

    def __call__(
        self, batch: TurnBatch, pairs=None, *, student: bool = True, teacher: bool = True, with_entropy: bool = False
    ) -> RescoreOutput:
        """Student old log-probs (or the engine's, when reused) and the diagonal + cross teacher log-probs."""
        stats: dict = {"mode": self.mode}
        old = ent = None
        if student:
            # reuse skips the forward, so no entropy is available then (``entropy`` stays None)
            reuse = self.reuse_rollout_logp and batch.rollout_logp is not None
            if self.reuse_rollout_logp and batch.rollout_logp is None:
                log.warning("reuse_rollout_logp: the batch carries no rollout log-probs; computing them")
            if reuse:
                old = batch.rollout_logp.float() * batch.response_mask.float()
                stats["student/reused"] = True
                if self.check_reuse:  # the reused log-probs against the trainer's own (the step logs the rest)
                    ref, _, st = self.student_logprobs(batch)
                    stats.update(rollout_mismatch_metrics(batch.rollout_logp, ref, batch.response_mask))
            else:
                old, ent, st = self.student_logprobs(batch, with_entropy=with_entropy)
                stats.update({f"student/{k}": v for k, v in st.items()})
        diag = cross = None
        if teacher:
            diag, cross, st = self.teacher_logprobs(batch, pairs)
            stats.update({f"teacher/{k}": v for k, v in st.items()})
        return RescoreOutput(old_logp=old, diag=diag, cross=cross, entropy=ent, stats=stats)


class _eval:
    """Context manager: model in eval mode (no dropout) for scoring, previous mode restored after."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.was = model.training

    def __enter__(self):
        self.model.eval()
        return self.model

    def __exit__(self, *exc):
        self.model.train(self.was)
        return False
