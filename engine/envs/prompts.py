"""Student prompt templates (ALGORITHM.md §1.3) and the prompt-building API environments plug into.

The manager keeps, per episode, the task description, every (observation, action) pair so far and the
current observation with its admissible actions; a :class:`PromptBuilder` turns that
:class:`PromptContext` into the user-message text of the current turn. The rollout wraps that text in
the tokenizer's chat template (:func:`chat_text`).

Templates are ``str.format`` strings over these fields:

``task_description`` the task text; ``step_count`` steps already taken; ``history_length`` number of
pairs shown; ``action_history`` the rendered pairs; ``current_step`` step_count + 1;
``current_observation`` the current observation; ``admissible_actions`` / ``available_actions`` the
action list (``help`` excluded). String/number values of the episode's info dict are available too.

Every environment registers its own builder (a :class:`PromptBuilder` with its templates) from its folder
through the registry (ALFWorld: engine/envs/alfworld/prompt.py, verl-agent's wording, reconstructed, §1.3).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PromptContext:
    """Everything a template can use for one turn of one episode."""

    task: str  # task description
    observation: str  # current observation (raw environment text)
    admissible_actions: list[str] = field(default_factory=list)
    history: list[tuple[str, str]] = field(default_factory=list)  # all (observation, action) pairs, oldest first
    info: dict[str, Any] = field(default_factory=dict)  # the env info of the current observation

    @property
    def step(self) -> int:
        """Number of steps already taken."""
        return len(self.history)


class PromptBuilder:
    """Renders a :class:`PromptContext` with a first-step template and a with-history template.

    Args:
        first_template: template used when no step was taken yet (or when history_length == 0).
        template: template used afterwards; shows the last ``history_length`` pairs.
        history_length: number of most recent (observation, action) pairs shown (§1.3: 2, 4 for Search).
        history_item: format of one pair; fields ``index`` (1-based absolute step), ``observation``,
            ``action``.
        history_sep: separator between pairs.
        action_item: format of one admissible action (field ``action``); joined by ``action_sep``.
        exclude_actions: actions never listed (ALFWorld drops ``help``).
        max_chars: when the rendered with-history prompt is longer, the first-step template is used
            instead (WebShop: 13,000). None disables the fallback.
    """

    def __init__(
        self,
        first_template: str,
        template: str,
        history_length: int,
        history_item: str = "[Observation {index}: '{observation}', Action {index}: '{action}']",
        history_sep: str = "\n",
        action_item: str = "'{action}'",
        action_sep: str = "\n ",
        exclude_actions: Sequence[str] = ("help",),
        max_chars: int | None = None,
    ) -> None:
        if not isinstance(history_length, int) or isinstance(history_length, bool) or history_length < 0:
            raise ValueError(f"history_length: expected an int >= 0, got {history_length!r}")
        if max_chars is not None and (not isinstance(max_chars, int) or max_chars <= 0):
            raise ValueError(f"max_chars: expected a positive int or None, got {max_chars!r}")
        self.first_template = first_template
        self.template = template
        self.history_length = history_length
        self.history_item = history_item
        self.history_sep = history_sep
        self.action_item = action_item
        self.action_sep = action_sep
        self.exclude_actions = tuple(exclude_actions)
        self.max_chars = max_chars

    def format_actions(self, actions: Sequence[str]) -> str:
        return self.action_sep.join(self.action_item.format(action=a) for a in actions if a not in self.exclude_actions)

    def format_history(self, history: Sequence[tuple[str, str]]) -> tuple[str, int]:
        """Last ``history_length`` pairs rendered; returns (text, number of pairs shown)."""
        if self.history_length == 0 or not history:
            return "", 0
        start = max(0, len(history) - self.history_length)
        items = [
            self.history_item.format(index=start + j + 1, observation=obs, action=act)
            for j, (obs, act) in enumerate(history[start:])
        ]
        return self.history_sep.join(items), len(items)

    def fields(self, ctx: PromptContext) -> dict[str, Any]:
        hist, shown = self.format_history(ctx.history)
        actions = self.format_actions(ctx.admissible_actions)
        values: dict[str, Any] = {k: v for k, v in ctx.info.items() if isinstance(v, (str, int, float))}
        values.update(
            task_description=ctx.task,
            step_count=ctx.step,
            history_length=shown,
            action_history=hist,
            current_step=ctx.step + 1,
            current_observation=ctx.observation,
            admissible_actions=actions,
            available_actions=actions,
        )
        return values

    def render(self, ctx: PromptContext) -> str:
        values = self.fields(ctx)
        if ctx.step == 0 or self.history_length == 0:
            return self.first_template.format_map(values)
        text = self.template.format_map(values)
        if self.max_chars is not None and len(text) > self.max_chars:
            return self.first_template.format_map(values)
        return text


def chat_text(tokenizer: Any, user_text: str, system: str | None = None) -> str:
    """The student prompt of §1.3: one user message through the chat template, generation prompt added."""
    if not isinstance(user_text, str):
        raise ValueError(f"user_text: expected str, got {type(user_text).__name__}")
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": user_text})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
