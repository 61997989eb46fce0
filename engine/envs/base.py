"""The environment protocol.

An environment instance plays one episode of one task at a time. The batched
``EnvManager`` (engine/envs/manager.py) runs many of them in worker processes, G sibling
episodes per task, and turns raw model responses into actions (ALGORITHM.md §1.5).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class TaskSpec:
    """One task instance. Siblings of a group share the same TaskSpec."""

    key: str  # unique, human-readable name (e.g. the game file's stem)
    env: str  # "alfworld" | "webshop" | "search" | test environments
    category: str  # task type (ALFWorld: pick/look/clean/heat/cool/pick2; Search: data source; ...)
    data_source: str = "text"  # ALGORITHM.md §1.1: "text" for ALFWorld/WebShop, nq/hotpotqa/... for Search
    payload: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)  # env-specific data
    # (ALFWorld: its game file, ``payload["gamefile"]``; what rows carry of it is the entry's ``task_info``)


@dataclass(frozen=True)
class ExpertTurn:
    """One supervised example of the warm start: a turn of an expert episode (an environment's ``expert_data``)."""

    task_key: str
    turn: int
    user_text: str  # the manager's rendered prompt (before the chat template)
    response: str  # what the expert answers at that turn (ALFWorld: <think>...</think><action>...</action>)


@dataclass
class StepResult:
    observation: str  # raw environment text after the action
    reward: float
    done: bool
    info: dict[str, Any]  # won, admissible_actions, task_score, ... and optionally ``truth``: a JSON-able dict of
    # ground truth about the state the next turn is played in, which the rows and the audit carry per turn


class Environment(Protocol):
    """One episode at a time. Implementations must be picklable-constructible in a worker."""

    name: str
    max_steps: int

    def reset(self, task: TaskSpec, seed: int) -> tuple[str, dict[str, Any]]:
        """Start an episode; returns (initial observation, info)."""
        ...

    def step(self, action: str) -> StepResult:
        """Apply an already-parsed action string."""
        ...


def percent(metrics: dict[str, float], key: str) -> float | None:
    """``metrics[key]`` (a fraction) as a percentage; None when the metric is absent."""
    v = metrics.get(key)
    return None if v is None else 100.0 * v


def success_columns(metrics: dict[str, float]) -> dict[str, float | None]:
    """The evaluation table of an environment without columns of its own: the success rate, then the success of
    each task category (percentages)."""
    out: dict[str, float | None] = {"Success": percent(metrics, "episode/success_rate")}
    for k in sorted(metrics):
        if k.startswith("episode/success/"):
            out[k.split("/")[-1]] = 100.0 * metrics[k]
    return out
