"""A tiny, learnable test environment ("codeword") and a fault-injecting variant.

Codeword: the first observation shows a code word; later observations hide it. The agent may do
anything on turns 0-2 (``wait`` is the intended action; saying a word early does nothing); at turn 3
(the 4th and last step) ``say <code word>`` wins (reward 10), anything else loses. Four candidate
words are listed as ``say <word>`` actions next to ``wait``, so a uniformly random policy wins about
1 in 5 episodes, and a policy that reads the code word from its history always wins. Everything is
deterministic given the task and the seed.

FaultyCodeword: the same game, but the task payload can ask it to raise, hang or kill its own worker
process at a given step (or at reset), or return a NaN reward at a given step; the environment
manager's fault tests use it.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import time
from typing import Any

from alignopsd.engine.envs.base import StepResult, TaskSpec

WORDS: tuple[str, ...] = (
    "apple", "river", "candle", "falcon", "marble", "violet", "copper", "lantern",
    "meadow", "pepper", "saddle", "tunnel", "walnut", "zephyr", "harbor", "quartz",
)  # fmt: skip
TASK_TEXT = "remember the code word and say it at step 4."


def _rng(*parts: object) -> random.Random:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def load_tasks(split: str = "train", n: int | None = None, seed: int = 0, **_: Any) -> list[TaskSpec]:
    """``n`` codeword tasks (default 16); the same (split, n, seed) always gives the same tasks."""
    n = 16 if n is None or n <= 0 else int(n)
    tasks = []
    for i in range(n):
        r = _rng("codeword", split, seed, i)
        words = r.sample(WORDS, 4)
        code = words[r.randrange(4)]
        tasks.append(
            TaskSpec(
                key=f"codeword-{split}-{seed}-{i}-{code}",
                env="codeword",
                category="codeword",
                payload={"words": words, "code": code},
            )
        )
    return tasks


class CodewordEnv:
    """See the module docstring. ``max_steps`` is 4; the answer is judged at turn 3."""

    name = "codeword"
    max_steps = 4
    answer_turn = 3

    def __init__(self, **_: Any) -> None:
        self.task: TaskSpec | None = None
        self.t = 0
        self.done = True

    def _actions(self) -> list[str]:
        assert self.task is not None
        return [f"say {w}" for w in self.task.payload["words"]] + ["wait"]

    def _info(self, won: bool = False) -> dict[str, Any]:
        return {"won": won, "admissible_actions": self._actions(), "task": TASK_TEXT}

    def reset(self, task: TaskSpec, seed: int) -> tuple[str, dict[str, Any]]:
        words, code = task.payload.get("words"), task.payload.get("code")
        if not isinstance(words, list) or len(words) != 4 or code not in words:
            raise ValueError(f"task: codeword payload needs 4 words including the code, got {task.payload!r}")
        self.task, self.t, self.done = task, 0, False
        obs = f"The code word is '{code}'. Remember it: at step 4 you must say it. Until then, wait."
        return obs, self._info()

    def step(self, action: str) -> StepResult:
        if self.task is None or self.done:
            raise RuntimeError("step() called on a finished or unstarted episode")
        code = self.task.payload["code"]
        t = self.t
        self.t += 1
        if t < self.answer_turn:
            if action == "wait":
                obs = "You wait. The code word is hidden now."
            elif action in self._actions():
                obs = "You speak, but nobody listens yet. The code word is hidden now."
            else:
                obs = "Nothing happens."
            if self.t == self.answer_turn:
                obs += " This is the last step: say the code word now."
            return StepResult(obs, 0.0, False, self._info())
        self.done = True
        won = action == f"say {code}"
        obs = "Correct, you win!" if won else "Wrong, you lose."
        return StepResult(obs, 10.0 if won else 0.0, True, self._info(won))


def faulty_tasks(kind: str | None, at_step: int, n: int = 1, seed: int = 0) -> list[TaskSpec]:
    """Codeword tasks whose FaultyCodewordEnv will ``raise``/``hang``/``die``/``nan`` at ``at_step`` (-1: at reset;
    ``nan`` returns a NaN reward from that step)."""
    if kind not in (None, "raise", "hang", "die", "nan"):
        raise ValueError(f"kind: expected None, 'raise', 'hang', 'die' or 'nan', got {kind!r}")
    out = []
    for t in load_tasks("fault", n, seed):
        payload = dict(t.payload, fault=kind, at_step=at_step)
        out.append(TaskSpec(f"{t.key}-{kind}", "codeword_faulty", t.category, payload=payload))
    return out


class FaultyCodewordEnv(CodewordEnv):
    name = "codeword_faulty"

    def __init__(self, hang_seconds: float = 3600.0, **kw: Any) -> None:
        super().__init__(**kw)
        self.hang_seconds = hang_seconds

    def _maybe_fault(self, where: int) -> None:
        assert self.task is not None
        kind, at = self.task.payload.get("fault"), self.task.payload.get("at_step", 0)
        if kind is None or where != at:
            return
        if kind == "raise":
            raise RuntimeError(f"injected fault at step {where}")
        if kind == "hang":
            time.sleep(self.hang_seconds)
        if kind == "die":
            if multiprocessing.parent_process() is None:  # never kill the caller's own process
                raise RuntimeError("injected 'die' fault outside a worker process")
            os._exit(3)

    def reset(self, task: TaskSpec, seed: int) -> tuple[str, dict[str, Any]]:
        out = super().reset(task, seed)
        self._maybe_fault(-1)
        return out

    def step(self, action: str) -> StepResult:
        t = self.t
        self._maybe_fault(t)
        out = super().step(action)
        assert self.task is not None
        if self.task.payload.get("fault") == "nan" and t == self.task.payload.get("at_step", 0):
            return StepResult(out.observation, float("nan"), out.done, out.info)
        return out
