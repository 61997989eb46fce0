"""Teacher generation (ALGORITHM.md §2.1, §1.7) with early stop and saved-token counting.

Legend: M = canonical turns, W = teacher budget (output width).

For every canonical turn the policy samples one response from its privileged (teacher) prompt, with exactly
the rollout's sampling settings and the teacher's own token budget for this call only. Only the teacher's
thinking (and, for the action filter, its action) is ever used, so generation stops at ``</think>`` when the
action filter is off and at the closing action tag (``</action>``, ``</search>``, ``</answer>``) when it is on:
the sampled text up to that point is the same as under the authors' full budget, and everything they would
have sampled after it is never read. ``tokens_saved_estimate`` counts, for rows that stopped at such a tag,
the tokens up to the budget that the authors' run could have spent (an upper bound: their run would also have
ended at an EOS before the budget).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from alignopsd.engine.envs.parsing import ACTION_TAGS, parse_action, parse_thinking
from alignopsd.engine.generation.base import GenerationBackend, SamplingParams
from alignopsd.engine.generation.prompt_cache import PromptKV
from torch import Tensor

from alignopsd.reduction import same, summed, weighted_mean

THINK_STOP: tuple[str, ...] = ("</think>",)
ACTION_STOPS: tuple[str, ...] = tuple(f"</{tag}>" for tag in ACTION_TAGS)  # every environment parses these tags


def teacher_stops(action_filter: bool) -> tuple[str, ...]:
    """Stop strings of the teacher call: the closing action tags with the action filter, else ``</think>``."""
    return ACTION_STOPS if action_filter else THINK_STOP


@dataclass
class TeacherOutput:
    """One teacher response per prompt, its parsed thinking/action and the budget accounting."""

    texts: list[str]
    thinking: list[str]
    action: list[str]
    thinking_valid: Tensor  # [M] bool
    action_valid: Tensor  # [M] bool
    tokens_generated: int
    tokens_saved_estimate: int
    at_budget_fraction: float
    budget: int
    token_ids: list[list[int]] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    stopped_at_tag: Tensor | None = None  # [M] bool: ended on the early-stop tag
    prompt_cache: PromptKV | None = None  # the prompts' keys and values, when asked and the backend keeps them

    def padded(self, pad_token_id: int) -> tuple[Tensor, Tensor]:
        """([M, W] long token ids right-padded to the budget width, [M, W] bool mask) -- §2.1's output shape."""
        M, W = len(self.token_ids), self.budget
        ids = torch.full((M, W), int(pad_token_id), dtype=torch.long)
        mask = torch.zeros((M, W), dtype=torch.bool)
        for i, row in enumerate(self.token_ids):
            ids[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
            mask[i, : len(row)] = True
        return ids, mask

    def metrics(self) -> dict[str, float]:
        """Logged teacher-generation diagnostics (prefix ``m1/``), declared (``alignopsd.reduction``)."""
        n = len(self.texts)
        M = max(1, n)
        full = M * self.budget
        stops = self.stopped_at_tag.numel() if self.stopped_at_tag is not None else 0
        valid = self.thinking_valid.numel()
        return {
            "m1/teacher_output_budget": same(self.budget),
            "m1/teacher_tokens_generated": summed(self.tokens_generated),
            "m1/teacher_response_length_mean": weighted_mean(self.tokens_generated / M, n),
            "m1/teacher_tokens_saved": summed(self.tokens_saved_estimate),
            "m1/teacher_tokens_saved_fraction": weighted_mean(self.tokens_saved_estimate / full if full else 0.0, full),
            "m1/teacher_at_budget_fraction": weighted_mean(self.at_budget_fraction, n),
            "m1/teacher_early_stop_fraction": weighted_mean(
                float(self.stopped_at_tag.float().mean()) if stops else 0.0, stops
            ),
            "m1/teacher_thinking_valid_fraction": weighted_mean(
                float(self.thinking_valid.float().mean()) if valid else 0.0, valid
            ),
        }


def generate_teacher(
    backend: GenerationBackend,
    teacher_prompt_ids: list[list[int]],
    sampling: SamplingParams,
    budget: int | None,
    action_filter: bool,
    *,
    teacher_do_sample: bool | None = None,
    max_model_len: int | None = None,
    keep_prompt_cache: bool = False,
) -> TeacherOutput:
    """Sample one teacher response per prompt (unpadded token-id lists) and parse it.

    Args:
        backend: the generation backend (the same policy weights as the student).
        teacher_prompt_ids: M privileged prompts, token ids without padding.
        sampling: the rollout's sampling settings; reused as they are except ``max_new_tokens`` (the teacher
            budget, this call only) and ``stop``. The caller's object is not modified.
        budget: teacher tokens per response; None means the student budget (``sampling.max_new_tokens``).
        action_filter: stop at the closing action tag (True) or at ``</think>`` (False).
        teacher_do_sample: a separate teacher ``do_sample`` setting; one that disagrees with the rollout's is a
            configuration error (§2.1).
        max_model_len: the engine's context limit; prompt + budget above it raises. Defaults to the backend's
            ``max_model_len``.
        keep_prompt_cache: ask a backend that can (``keeps_prompt_cache``) to keep the prompts' keys and values
            for the teacher forcing (engine/generation/prompt_cache.py); ignored by the others.
    """
    if teacher_do_sample is not None and bool(teacher_do_sample) != bool(sampling.do_sample):
        raise ValueError(
            f"teacher_do_sample: {teacher_do_sample} disagrees with the rollout's do_sample={sampling.do_sample}; "
            "the teacher samples with exactly the rollout's settings"
        )
    W = int(sampling.max_new_tokens if budget is None else budget)
    if W < 1:
        raise ValueError(f"budget: must be >= 1, got {budget}")
    if not isinstance(teacher_prompt_ids, (list, tuple)):
        raise ValueError(f"teacher_prompt_ids: expected a list of token-id lists, got {type(teacher_prompt_ids)}")
    for i, p in enumerate(teacher_prompt_ids):
        if not isinstance(p, (list, tuple)) or not p:
            raise ValueError(f"teacher_prompt_ids: row {i} must be a non-empty list of token ids")
    limit = max_model_len if max_model_len is not None else backend.max_model_len
    longest = max((len(p) for p in teacher_prompt_ids), default=0)
    if longest + W > int(limit):
        raise ValueError(
            f"budget: teacher prompt length {longest} + budget {W} exceeds the model limit max_model_len={limit}"
        )
    stops = teacher_stops(action_filter)
    keep = keep_prompt_cache and backend.keeps_prompt_cache
    out = backend.generate(
        [list(p) for p in teacher_prompt_ids], replace(sampling, max_new_tokens=W, stop=stops), keep_prompt_cache=keep
    )

    thinking, t_valid, action, a_valid, at_tag = [], [], [], [], []
    for text, reason in zip(out.texts, out.finish_reasons or ["length"] * len(out.texts)):
        th, tv = parse_thinking(text)
        ac, av, _ = parse_action(text)
        thinking.append(th)
        t_valid.append(tv)
        action.append(ac)
        a_valid.append(av)
        at_tag.append(reason == "stop" and any(s in text for s in stops))
    lens = [len(t) for t in out.token_ids]
    M = len(lens)
    saved = sum(W - n for n, hit in zip(lens, at_tag) if hit)
    return TeacherOutput(
        texts=list(out.texts),
        thinking=thinking,
        action=action,
        thinking_valid=torch.tensor(t_valid, dtype=torch.bool),
        action_valid=torch.tensor(a_valid, dtype=torch.bool),
        tokens_generated=sum(lens),
        tokens_saved_estimate=int(saved),
        at_budget_fraction=(sum(n >= W for n in lens) / M) if M else 0.0,
        budget=W,
        token_ids=[list(t) for t in out.token_ids],
        finish_reasons=list(out.finish_reasons),
        stopped_at_tag=torch.tensor(at_tag, dtype=torch.bool),
        prompt_cache=out.prompt_cache if keep_prompt_cache else None,
    )
