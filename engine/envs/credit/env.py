"""Credit-assignment environments with known decision points (the ``credit`` family).

Every episode lasts ``HORIZON`` = 8 turns and pays a sparse terminal reward (10 when won, else 0). Most turns
are corridor turns: two admissible actions (``walk on`` / ``look around``) that change nothing. A few turns are
decisive: their action alone decides the outcome. Three task kinds (the task's ``category``):

* ``code``: the first observation shows a code word; at the door turn ``u`` (4-6) the agent must ``say`` that
  word among four listed. Decisive turn: ``u``.
* ``key``: the first observation names the colour of the door at the end; at turn ``k`` (1-3) four keys lie on
  the floor and the agent must take the key of the door's colour, before a long corridor. Decisive turn: ``k``.
* ``agree``: at turn ``a`` (1-2) the agent paints a mark in one of four colours, at turn ``b`` (5-6) it must
  choose the bridge of the same colour. Decisive turns: ``a`` and ``b`` (they must agree).

A uniformly random policy wins 1 in 4 episodes of each kind. Each kind has a privileged skill in the packaged
skill bank (``skills/credit/``) stating the rule that wins (engine/envs/skills.py looks it up by keyword).

Ground truth. :func:`decisive_turns` gives a task's decisive turns (fixed by the task, whatever the agent does);
the true decision spans cut the trajectory before every decisive turn (:func:`true_boundaries`: the decisive
turns other than turn 0), so each span runs from one decisive turn to the next. The environment reports both in
its info: ``decisive`` (the turn just played was decisive), ``span_start`` (it opened a true decision span) and
``decisive_turns`` (the whole episode's list); and, for the state the next turn is played in, ``truth``
(``decisive``, ``span_start``), which the engine's rows carry per turn (engine/envs/base.py). Everything is
deterministic given the task.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from alignopsd.engine.envs.base import StepResult, TaskSpec
from alignopsd.engine.envs.prompts import PromptBuilder

HORIZON = 8
KINDS: tuple[str, ...] = ("code", "key", "agree")
WORDS: tuple[str, ...] = ("apple", "river", "candle", "falcon", "marble", "violet", "copper", "lantern")
COLOURS: tuple[str, ...] = ("red", "blue", "green", "yellow")
CORRIDOR: tuple[str, ...] = ("walk on", "look around")
TASK_TEXT = {
    "code": "read the code word, remember it and say it when the door asks for it.",
    "key": "cross the hall and open the door at its end.",
    "agree": "paint a mark, then later choose which bridge to cross.",
}


def _rng(*parts: object) -> random.Random:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def make_task(kind: str, split: str, seed: int, i: int) -> TaskSpec:
    """One task of ``kind``, fixed by (split, seed, i)."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    r = _rng("credit", kind, split, seed, i)
    if kind == "code":
        words = r.sample(WORDS, 4)
        payload: dict[str, Any] = {"options": words, "answer": words[r.randrange(4)], "turns": [r.choice((4, 5, 6))]}
    elif kind == "key":
        opts = r.sample(COLOURS, 4)
        payload = {"options": opts, "answer": opts[r.randrange(4)], "turns": [r.choice((1, 2, 3))]}
    else:
        payload = {"options": r.sample(COLOURS, 4), "turns": [r.choice((1, 2)), r.choice((5, 6))]}
    return TaskSpec(key=f"credit-{kind}-{split}-{seed}-{i}", env="credit", category=kind, payload=payload)


def load_tasks(split: str = "train", n: int | None = None, seed: int = 0, **_: Any) -> list[TaskSpec]:
    """``n`` tasks (default 12), the kinds in turn (code, key, agree, code, ...); seeded and deterministic."""
    n = 12 if n is None or n <= 0 else int(n)
    return [make_task(KINDS[i % len(KINDS)], split, seed, i) for i in range(n)]


def decisive_turns(task: TaskSpec) -> list[int]:
    """The task's decisive turns (0-based), ascending."""
    turns = task.payload.get("turns")
    if task.category not in KINDS or not isinstance(turns, list) or not turns:
        raise ValueError(f"task: {task.key!r} is not a credit task (category {task.category!r}, turns {turns!r})")
    return sorted(int(t) for t in turns)


def true_boundaries(task: TaskSpec) -> list[int]:
    """Turns that open a true decision span (the decisive turns other than turn 0)."""
    return [t for t in decisive_turns(task) if t > 0]


class CreditEnv:
    """See the module docstring."""

    name = "credit"
    max_steps = HORIZON

    def __init__(self, **_: Any) -> None:
        self.task: TaskSpec | None = None
        self.t = 0
        self.done = True
        self.choices: dict[int, str] = {}

    def _actions(self) -> list[str]:
        assert self.task is not None
        kind, p = self.task.category, self.task.payload
        if self.t not in p["turns"]:
            return list(CORRIDOR)
        if kind == "code":
            return [f"say {w}" for w in p["options"]]
        if kind == "key":
            return [f"take {c} key" for c in p["options"]]
        if self.t == p["turns"][0]:
            return [f"paint {c}" for c in p["options"]]
        return [f"cross {c} bridge" for c in p["options"]]

    def _observation(self) -> str:
        assert self.task is not None
        kind, p, t = self.task.category, self.task.payload, self.t
        if t in p["turns"]:
            return {
                "code": "A door asks: what is the code word?",
                "key": "Four keys lie on the floor. The corridor ahead is long.",
                "agree": "A pot of paint stands here." if t == p["turns"][0] else "Four bridges cross the river.",
            }[kind]
        if t == 0:
            return {
                "code": f"A note on the wall reads: the code word is '{p.get('answer')}'.",
                "key": f"The door at the end of the hall is {p.get('answer')}.",
                "agree": "You stand at the start of a long path.",
            }[kind]
        return "You are in a corridor."

    def _info(self, won: bool = False, played: int | None = None) -> dict[str, Any]:
        assert self.task is not None
        turns = decisive_turns(self.task)
        info: dict[str, Any] = {"won": won, "task": TASK_TEXT[self.task.category], "decisive_turns": turns}
        info["admissible_actions"] = [] if self.done else self._actions()
        if played is not None:
            info["decisive"] = played in turns
            info["span_start"] = played in true_boundaries(self.task)
        if not self.done:  # the ground truth of the state the next turn is played in (the rows carry it per turn)
            info["truth"] = {"decisive": self.t in turns, "span_start": self.t in true_boundaries(self.task)}
        return info

    def reset(self, task: TaskSpec, seed: int) -> tuple[str, dict[str, Any]]:
        turns = decisive_turns(task)
        opts = task.payload.get("options")
        if not isinstance(opts, list) or len(opts) != 4 or any(t < 0 or t >= HORIZON for t in turns):
            raise ValueError(f"task: malformed credit payload {task.payload!r}")
        if task.category != "agree" and task.payload.get("answer") not in opts:
            raise ValueError(f"task: answer {task.payload.get('answer')!r} not among the options {opts!r}")
        self.task, self.t, self.done, self.choices = task, 0, False, {}
        return self._observation(), self._info()

    def _won(self) -> bool:
        assert self.task is not None
        p = self.task.payload
        picks = [self.choices.get(t, "") for t in p["turns"]]
        if self.task.category == "agree":
            first, second = picks
            return first.startswith("paint ") and second == f"cross {first[len('paint ') :]} bridge"
        want = f"say {p['answer']}" if self.task.category == "code" else f"take {p['answer']} key"
        return picks[0] == want

    def step(self, action: str) -> StepResult:
        if self.task is None or self.done:
            raise RuntimeError("step() called on a finished or unstarted episode")
        played = self.t
        if played in self.task.payload["turns"]:
            self.choices[played] = action if action in self._actions() else ""
        self.t += 1
        if self.t < HORIZON:
            return StepResult(self._observation(), 0.0, False, self._info(played=played))
        self.done = True
        won = self._won()
        obs = "The episode ends: you win!" if won else "The episode ends: you lose."
        return StepResult(obs, 10.0 if won else 0.0, True, self._info(won, played=played))


CREDIT_TEMPLATE_NO_HIS = """Task: {task_description}
Observation: {current_observation}
Actions: [{admissible_actions}].
"""

CREDIT_TEMPLATE = """Task: {task_description}
{action_history}
Observation: {current_observation}
Actions: [{admissible_actions}].
"""


def credit_prompt(history_length: int = HORIZON) -> PromptBuilder:
    """Shows the whole episode so far (what the first observation said stays visible)."""
    return PromptBuilder(
        CREDIT_TEMPLATE_NO_HIS,
        CREDIT_TEMPLATE,
        history_length,
        history_item="Step {index}: {observation} -> {action}",
        action_sep=", ",
    )
