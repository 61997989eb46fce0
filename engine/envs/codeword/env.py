"""A tiny, learnable test environment ("codeword").

Codeword: the first observation shows a code word; later observations hide it. The agent may do
anything on turns 0-2 (``wait`` is the intended action; saying a word early does nothing); at turn 3
(the 4th and last step) ``say <code word>`` wins (reward 10), anything else loses. Four candidate
words are listed as ``say <word>`` actions next to ``wait``, so a uniformly random policy wins about
1 in 5 episodes, and a policy that reads the code word from its history always wins. Everything is
deterministic given the task and the seed. (The test suite's fault-injecting variant, tests/engine/faulty_env.py,
builds on it.)
"""

from __future__ import annotations

import hashlib
import random
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
