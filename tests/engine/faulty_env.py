"""An environment with injected faults for the tests of the environment manager, the rollout and the trainer: the
codeword game (engine/envs/codeword/env.py) whose task payload asks it to raise, hang or kill its own worker process
at a given step (or at reset), or to return a NaN reward at a given step.

It is no part of the product's registry. The ``faulty_env`` fixture (conftest.py beside this file) registers its row,
``codeword_faulty``, at run time as a user's own environment is registered (``register_env``). The row names this
module by its ``"module:attr"`` path, so the manager's spawned worker processes import it themselves: they inherit
the test process's ``sys.path``, where pytest put this folder.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from typing import Any

from alignopsd.engine.envs.base import StepResult, TaskSpec
from alignopsd.engine.envs.codeword.env import CodewordEnv, load_tasks
from alignopsd.engine.envs.registry import EnvEntry, register_env

NAME = "codeword_faulty"
KINDS = (None, "raise", "hang", "die", "nan")


def tasks(kind: str | None, at_step: int, n: int = 1, seed: int = 0) -> list[TaskSpec]:
    """Codeword tasks whose FaultyCodewordEnv will ``raise``/``hang``/``die``/``nan`` at ``at_step`` (-1: at reset;
    ``nan`` returns a NaN reward from that step)."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected None, 'raise', 'hang', 'die' or 'nan', got {kind!r}")
    out = []
    for t in load_tasks("fault", n, seed):
        payload = dict(t.payload, fault=kind, at_step=at_step)
        out.append(TaskSpec(f"{t.key}-{kind}", NAME, t.category, payload=payload))
    return out


class FaultyCodewordEnv(CodewordEnv):
    name = NAME

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


ENTRY = EnvEntry(
    NAME,
    f"{__name__}:FaultyCodewordEnv",
    "alignopsd.engine.envs.codeword.env:load_tasks",
    "alignopsd.engine.envs.codeword.prompt:codeword_prompt",
    lowercase_actions=True,
    history_length=4,
)


def register() -> None:
    """Register :data:`ENTRY` (again: the same row each time)."""
    register_env(ENTRY, replace=True)
