"""The turn batch that flows through a training step.

Legend: M = turn rows, Lp = padded prompt length (left-padded), L = padded response length
(right-padded), Lt = padded teacher-prompt length (left-padded).

One row is one environment step of one episode (ALGORITHM.md §1.1). Identity is the triple
(task, rollout, turn): ``task`` groups the G sibling episodes of one task instance, ``rollout``
names an episode (distinct within its task), ``turn`` is the 0-based step inside the episode.
The model input of a row is ``[prompt_ids | response_ids]`` with mask ``[prompt_mask |
response_mask]``; positions are ``cumsum(mask) - 1`` clipped at 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch
from torch import Tensor


@dataclass
class TurnBatch:
    """A batch of turn rows (see module docstring for shapes)."""

    task: Tensor  # [M] long
    rollout: Tensor  # [M] long
    turn: Tensor  # [M] long
    prompt_ids: Tensor  # [M, Lp] long, left-padded
    prompt_mask: Tensor  # [M, Lp] long/bool
    response_ids: Tensor  # [M, L] long, right-padded
    response_mask: Tensor  # [M, L] long/bool: sampled response tokens
    outcome: Tensor  # [M] float: episode reward (same on every turn of an episode)
    action_valid: Tensor  # [M] bool: the environment accepted the action
    teacher_prompt_ids: Tensor | None = None  # [M, Lt] long, left-padded
    teacher_prompt_mask: Tensor | None = None  # [M, Lt]
    won: Tensor | None = None  # [M] bool
    truncated: Tensor | None = None  # [M] bool: response hit the token budget
    data_source: list[str] = field(default_factory=list)
    category: list[str] = field(default_factory=list)
    gamefile: list[str | None] = field(default_factory=list)
    response_text: list[str] = field(default_factory=list)
    prompt_text: list[str] = field(default_factory=list)
    task_key: list[str] = field(default_factory=list)  # human-readable task name per row
    truth: list[dict | None] = field(default_factory=list)  # the environment's per-turn ground truth (info "truth")
    rollout_logp: Tensor | None = None  # [M, L] fp32: log-probs reported by the generation engine
    extras: dict = field(default_factory=dict)  # step-specific tensors (old_logp, ref_logp, ...)

    def __post_init__(self) -> None:
        m = int(self.task.shape[0])
        for f in ("rollout", "turn", "outcome", "action_valid"):
            t = getattr(self, f)
            if t.shape[0] != m:
                raise ValueError(f"{f}: expected {m} rows like task, got {t.shape[0]}")
        for f in ("prompt_ids", "prompt_mask", "response_ids", "response_mask"):
            t = getattr(self, f)
            if t.dim() != 2 or t.shape[0] != m:
                raise ValueError(f"{f}: expected [{m}, *], got {tuple(t.shape)}")
        if self.prompt_ids.shape != self.prompt_mask.shape:
            raise ValueError("prompt_mask: shape differs from prompt_ids")
        if self.response_ids.shape != self.response_mask.shape:
            raise ValueError("response_mask: shape differs from response_ids")

    @property
    def size(self) -> int:
        return int(self.task.shape[0])

    @property
    def response_length(self) -> int:
        return int(self.response_ids.shape[1])

    def input_ids(self) -> Tensor:
        """[M, Lp + L] student model input."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    def attention_mask(self) -> Tensor:
        """[M, Lp + L] student attention mask."""
        return torch.cat([self.prompt_mask.long(), self.response_mask.long()], dim=1)

    def select(self, index) -> TurnBatch:
        """Rows ``index`` (a list or LongTensor), in that order."""
        idx = torch.as_tensor(index, dtype=torch.long)
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                out[f.name] = v[idx]
            elif isinstance(v, list):
                out[f.name] = [v[i] for i in idx.tolist()] if v else []
            elif isinstance(v, dict):
                out[f.name] = {
                    k: (t[idx] if isinstance(t, Tensor) and t.shape[:1] == (self.size,) else t) for k, t in v.items()
                }
            else:
                out[f.name] = v
        return replace(self, **out)

    def to(self, device) -> TurnBatch:
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                out[f.name] = v.to(device)
        return replace(self, **out)
