"""The ALFWorld expert planner: expert episodes played through the engine, one supervised example per turn.

Each example's prompt is the environment manager's rendered user text at that turn (exactly what the rollout
gives the policy); the response is ``<think>T</think><action>A</action>`` where A is the walkthrough's action,
optionally after searching a few other receptacles first, and T a short reasoning written from the game's own
facts (task, target object and receptacle, where the agent is, what it holds, the next sub-goal). The warm start
(engine/run/warm_start.py) trains on these examples; the registry's ``expert_data`` hook of ALFWorld is
:func:`expert_data`.
"""

from __future__ import annotations

import random
import re

from alignopsd.engine.envs.alfworld.gen import game_facts
from alignopsd.engine.envs.base import ExpertTurn

SEARCH_DETOURS = 2  # receptacles the expert searches before the object's place (see expert_turns)

__all__ = ["SEARCH_DETOURS", "ExpertTurn", "expert_data", "expert_thinking", "expert_turns"]


def expert_thinking(facts: dict, action: str, holding: bool, at: str | None = None) -> str:
    """Short reasoning for ``action`` written from the game's facts (§ module doc); no model involved.

    It starts from where the agent stands (``at``: the receptacle of the last ``go to``, None before the first
    move), so the model learns to read its position from the observation before choosing a move."""
    obj, parent = facts.get("object") or "object", facts.get("parent") or "target"
    verb, _, rest = action.partition(" ")
    where = f"I am at {at}" if at else "I am in the middle of the room"
    have = f"I hold the {obj}" if holding else f"I need a {obj}"
    if action == "look":
        return f"{where}. I need to put a {obj} in or on the {parent}. First I look around."
    if verb == "go" and not holding and at:
        return f"{where}. The {obj} is not here. I will look for it at {rest[3:]}."
    if verb == "go" and not holding:
        return f"{where}. {have}. I will look for it at {rest[3:]}."
    if verb == "go":
        return f"{where}. {have}. Next I go to the {parent}: {rest[3:]}."
    if verb == "open":
        return f"{where}. {rest} is closed. I open it to see inside."
    if verb == "close":
        return f"{where}. I close {rest}."
    if verb == "take":
        return f"{where}. The {obj} is here. I take it."
    if verb in ("move", "put"):
        return f"{where}, the {parent}, with the {obj}. I put it here."
    if verb == "use":
        return f"{where}. I turn on the {facts.get('toggle') or 'light'} to look at the {obj}."
    return f"{where}. {have}. Next step toward the goal: {action}."


def _go_targets(prompt_text: str) -> list[str]:
    """The ``go to`` targets among the admissible actions listed in a rendered ALFWorld prompt."""
    listed = prompt_text.rsplit("admissible actions of the current situation are: [", 1)[-1].split("].", 1)[0]
    return [a[len("'go to ") : -1] for a in listed.split("\n ") if a.startswith("'go to ") and a.endswith("'")]


def _search_plan(facts: dict, first_prompt: str, rng: random.Random, detours: int, max_turns: int | None) -> list:
    """Receptacles visited (in order) before the expert's own walkthrough: at most ``detours``, each costing up
    to two turns (go there, open it if closed), within ``max_turns``; never the object's place or the goal."""
    walk = facts["walkthrough"]
    budget = 0 if max_turns is None else (max_turns - len(walk)) // 2
    first_go = next((a[len("go to ") :] for a in walk if a.startswith("go to ")), None)
    avoid = {first_go} | {r for r in _go_targets(first_prompt) if facts.get("parent") and r.startswith(facts["parent"])}
    options = [r for r in _go_targets(first_prompt) if r not in avoid]
    return rng.sample(options, min(detours, budget, len(options)))


def _take_here(facts: dict, now: str, here: str, queue: list[str]) -> list[str]:
    """The rest of the plan when a searched receptacle shows a matching object (a second one of the target
    type): take it here and finish from the walkthrough's step after its own ``take``, for this object."""
    seen = re.search(rf"\b{re.escape(facts['object'])} (\d+)", now)
    walk = facts["walkthrough"]
    took = next((k for k, a in enumerate(walk) if a.startswith("take ")), None)
    if seen is None or took is None:
        return queue
    mine, theirs = f"{facts['object']} {seen.group(1)}", walk[took][len("take ") :].split(" from ")[0]
    rest = [a.replace(theirs, mine) for a in walk[took + 1 :] if not a.startswith("close ")]
    return [f"take {mine} from {here}", *rest]


def expert_turns(
    manager, tasks: list, *, seed: int = 0, detours: int = 0, max_turns: int | None = None
) -> list[ExpertTurn]:
    """Play every task's expert walkthrough through ``manager`` (an EnvManager); one example per turn.

    detours: with ``max_turns``, the expert first searches up to this many other receptacles (chosen with
    ``seed``; a closed one is opened and found empty) while the episode still fits ``max_turns``, so the data
    also shows what to do where the object is not, which a policy that does not know the object's place meets
    on every search. Raises ValueError when an episode does not win its game in the engine (stale or foreign
    game files).
    """
    if not tasks:
        raise ValueError("tasks: expected at least one task with a game file")
    facts = [game_facts(t.payload["gamefile"]) for t in tasks]
    obs, _ = manager.reset(list(tasks), group_n=1, seed=seed)
    rng = random.Random(seed)
    plans = [_search_plan(f, o, rng, detours, max_turns) for f, o in zip(facts, obs)]
    queues = [[f"go to {r}" for r in p] + list(f["walkthrough"]) for f, p in zip(facts, plans)]
    holding = [False] * len(tasks)
    at: list[str | None] = [None] * len(tasks)
    done = [False] * len(tasks)
    out: list[ExpertTurn] = []
    turn = 0
    while not all(done[i] or not queues[i] for i in range(len(tasks))):
        responses: list[str | None] = [None] * len(tasks)
        for i, f in enumerate(facts):
            if done[i] or not queues[i]:
                continue
            now = obs[i].rsplit("current observation is:", 1)[-1].split("Your admissible actions", 1)[0]
            if at[i] in plans[i] and f"The {at[i]} is closed" in now:
                queues[i].insert(0, f"open {at[i]}")
            elif at[i] in plans[i] and not holding[i]:
                queues[i] = _take_here(f, now, at[i], queues[i])
            action = queues[i].pop(0)
            think = expert_thinking(f, action, holding[i], at[i])
            responses[i] = f"<think>{think}</think><action>{action}</action>"
            out.append(ExpertTurn(tasks[i].key, turn, obs[i], responses[i]))
            holding[i] = holding[i] or action.startswith("take ")
            at[i] = action[len("go to ") :] if action.startswith("go to ") else at[i]
        obs, _, dones, _ = manager.step(responses)
        done = [bool(d) for d in dones]
        turn += 1
    lost = [r["task_key"] for r in manager.episode_results() if not r["won"]]
    if lost:
        raise ValueError(f"tasks: the expert walkthrough does not win {lost[:3]} in the engine")
    return out


def expert_data(manager, tasks: list, *, seed: int, max_turns: int) -> list[ExpertTurn]:
    """ALFWorld's expert data (its registry entry's ``expert_data``): every distinct game of ``tasks`` (the task pool
    may repeat games; one walkthrough each) played through ``manager`` with :data:`SEARCH_DETOURS` searched
    receptacles before the walkthrough. The episode's step limit is ``max_turns`` raised by the turns the detours may
    take while these episodes play, so every game gets them (the prompts are the rollout's otherwise)."""
    limit = max_turns + 2 * SEARCH_DETOURS
    seen, unique = set(), []
    for t in tasks:
        if t.key not in seen:
            seen.add(t.key)
            unique.append(t)
    with manager.step_limit(limit):
        return expert_turns(manager, unique, seed=seed, detours=SEARCH_DETOURS, max_turns=limit)
