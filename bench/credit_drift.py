"""Drifting, multi-turn decisions (``credit_drift``): the regime the paper builds Mechanisms 1 and 2 for.

In ``credit_rules`` (bench/credit_rules.py) every decision comes at a turn the task fixes and lasts one turn. Here
the agent first finds its way to a stall, at its own pace, and then decides over three turns whose actions must
fit together. Two task kinds (the task's ``category``), the same skeleton:

* ``shop``: examine one of four lamps on the stall, have one wrapped, pay for one;
* ``workshop``: take one of four keys from the bench, carry one, use one on the gate.

One episode (at most :data:`HORIZON` = 18 turns):

1. **The way there** (its turn count depends on the agent's own actions): on the street four actions are listed
   (``walk on``, ``look around``, ``read the map``, ``ask for the way``) and only ``walk on`` moves the agent on.
   After the first step on, a **signpost** at a crossroads offers four coloured signs to follow (``follow the red
   sign``, ...): it reads like the stall's choice, but every sign leads on and none changes the outcome (a
   distractor). One more ``walk on`` reaches the stall. Under uniformly random play the stall comes at turn
   G1 + 1 + G2 (0-based) with G1, G2 ~ Geometric(1/4) (mean turn 9; siblings of one task meet it at different
   turns: simulated, the median displacement between two siblings is 4 turns, and 90 % of episodes reach the
   stall in time to finish the decision).
2. **The decision** (three turns, its ``decisive`` turns): *examine* (or *take*) one of four colours offered; then
   *wrap* (*carry*) one of two (the one in hand and another); then *pay for* (*use*) one of two (the one in hand
   and another). The episode is won when all three name the colour of the rule (the task's ``answer``, a variant
   stated only in the privileged skill); a random policy wins 1 in 16 of the episodes that reach the stall.
3. **The way home**: ``walk home`` or ``look around`` until two steps home end the episode. The outcome is fixed
   by the decision; the horizon ends an episode that has not got home (an agent that reaches the stall after turn
   15 cannot finish the decision and loses).

Ground truth. Every info carries ``truth`` for the state the next turn is played in (the engine's rows and the
audit keep it per turn): ``decision`` (``street``, ``signpost``, ``examine``, ``wrap``, ``pay``, ``home``: the
functional decision; ``examine``/``wrap``/``pay`` are the *take*/*carry*/*use* of ``workshop``), ``goal`` (the true
decision span: ``street`` up to the crossroads, ``crossroads`` from its signpost to the stall, ``buy``, ``home``)
and ``decisive`` (the turn's action decides the outcome). A true span boundary is a turn whose ``goal`` differs
from the previous turn's (simulated under random play: spans of 3.9 turns on average). The environment is
deterministic given the task and the actions.

A rule is one colour per kind, ``{"shop": colour, "workshop": colour}`` (:data:`BENCH_RULE` is the benchmark's);
the reader (bench/credit_reader.py) learns to follow whatever rule its skill states, every variant drawn at random.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from alignopsd.engine.envs.base import StepResult, TaskSpec
from alignopsd.engine.envs.prompts import PromptBuilder

ENV = "credit_drift"
TRUTH_PER_TURN = True  # the ground truth is in every info's ``truth`` (it depends on the agent's actions)
HORIZON = 18
KINDS: tuple[str, ...] = ("shop", "workshop")
COLOURS: tuple[str, ...] = ("red", "blue", "green", "yellow", "white", "black", "orange", "purple")
VARIANTS: dict[str, tuple] = {k: COLOURS for k in KINDS}
# The benchmark's rule, fixed before the first comparison (every variant is in the reader's training distribution).
BENCH_RULE: dict[str, Any] = {"shop": "orange", "workshop": "green"}
NOUN = {"shop": "lamp", "workshop": "key"}
VERBS = {"shop": ("examine", "wrap", "pay for"), "workshop": ("take", "carry", "use")}
STEPS = ("examine", "wrap", "pay")  # the decision's functional steps (truth labels, both kinds)
STREET = ("walk on", "look around", "read the map", "ask for the way")
HOME = ("walk home", "look around")
HOME_STEPS = 2
TASK_TEXT = {
    "shop": "walk to the market stall and buy a lamp, then go home.",
    "workshop": "walk to the workshop, open its gate with a key, then go home.",
}
GENERAL = "## General rule\nOnly the turns that offer a real choice decide whether you win."
REPEAT = 8


def check_rule(rule: dict[str, Any]) -> dict[str, Any]:
    """``rule`` if it names one known colour per kind (ValueError naming the culprit otherwise)."""
    from bench.credit_rules import check_variants

    return check_variants(rule, VARIANTS)


def _action(kind: str, step: int, colour: str) -> str:
    verb, noun = VERBS[kind][step], NOUN[kind]
    return f"{verb} the {colour} {noun}" + (" on the gate" if verb == "use" else "")


def skill_text(kind: str, variant: Any) -> str:
    """The skill that states ``variant`` of ``kind``: all three steps of the decision name its colour, repeated
    (:data:`REPEAT` times) as in ``credit_rules``, the form the two-layer reader reads."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    steps = ", then ".join(_action(kind, s, variant) for s in range(3))
    title = {"shop": "## The right lamp", "workshop": "## The right key"}[kind]
    return f"{title}\nAt the {'stall' if kind == 'shop' else 'bench'}, {steps}; no other colour. " + _rep(variant)


def _rep(word: str) -> str:
    return "Remember: " + " ".join([word] * REPEAT) + "."


def make_task(kind: str, variant: Any, split: str, seed: int, i: int) -> TaskSpec:
    """One task of ``kind`` under ``variant``, fixed by (split, seed, i): the four colours on the stall (the
    rule's and three others), the signpost's four (any four: the rule's colour among them is a lure), and the
    alternative offered at the second and third steps of the decision."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    r = random.Random(f"{ENV}:{kind}:{split}:{seed}:{i}")
    opts = [variant, *r.sample([c for c in COLOURS if c != variant], 3)]
    r.shuffle(opts)
    payload = {"options": opts, "answer": variant, "signs": r.sample(COLOURS, 4), "alt_seed": r.randrange(1 << 30)}
    return TaskSpec(key=f"{ENV}-{kind}-{split}-{seed}-{i}", env=ENV, category=kind, payload=payload)


def load_tasks(
    split: str = "train", n: int | None = None, seed: int = 0, rule: dict | None = None, **_: Any
) -> list[TaskSpec]:
    """``n`` tasks (default 12), the kinds in turn, under ``rule`` (default :data:`BENCH_RULE`)."""
    r = check_rule(dict(BENCH_RULE if rule is None else rule))
    n = 12 if n is None or n <= 0 else int(n)
    return [make_task(KINDS[i % len(KINDS)], r[KINDS[i % len(KINDS)]], split, seed, i) for i in range(n)]


def true_boundaries_of(truths: list[dict | None]) -> list[int]:
    """Positions (in the trajectory's turn order) that open a true span: where ``goal`` changes."""
    return [k for k in range(1, len(truths)) if (truths[k] or {}).get("goal") != (truths[k - 1] or {}).get("goal")]


class DriftEnv:
    """See the module docstring."""

    name = ENV
    max_steps = HORIZON

    def __init__(self, **_: Any) -> None:
        self.task: TaskSpec | None = None
        self.done = True

    def reset(self, task: TaskSpec, seed: int) -> tuple[str, dict[str, Any]]:
        p = task.payload
        opts, signs = p.get("options"), p.get("signs")
        if task.category not in KINDS or not isinstance(opts, list) or len(opts) != 4 or p.get("answer") not in opts:
            raise ValueError(f"task: malformed {ENV} task {task.key!r}: category {task.category!r}, payload {p!r}")
        if not isinstance(signs, list) or len(signs) != 4:
            raise ValueError(f"task: {task.key!r} needs four signpost colours, got {signs!r}")
        self.task, self.done = task, False
        self.t, self.pos, self.home = 0, 0, 0  # pos: 0 street, 1 signpost, 2 street, 3 the stall
        self.step_of_decision = -1  # -1 before the stall, 0..2 the decision's steps, 3 after it
        self.held: str | None = None
        self.picks: list[str] = []
        self.alt = random.Random(int(p.get("alt_seed", 0)))
        self.offer: list[str] = []
        return "You stand at your door. " + self._observation(), self._info()

    def phase(self) -> str:
        """The functional decision of the current state (a truth label)."""
        if self.pos in (0, 2):
            return "street"
        if self.pos == 1:
            return "signpost"
        return STEPS[self.step_of_decision] if 0 <= self.step_of_decision < 3 else "home"

    def _colours(self) -> list[str]:
        """The colours offered at the decision's current step (the held one and another, in a drawn order)."""
        assert self.task is not None
        if self.step_of_decision == 0:
            return list(self.task.payload["options"])
        if not self.offer:
            other = self.alt.choice([c for c in self.task.payload["options"] if c != self.held])
            self.offer = [self.held, other] if self.alt.random() < 0.5 else [other, self.held]
        return self.offer

    def actions(self) -> list[str]:
        """The admissible actions of the current state."""
        assert self.task is not None
        ph = self.phase()
        if ph == "street":
            return list(STREET)
        if ph == "signpost":
            return [f"follow the {c} sign" for c in self.task.payload["signs"]]
        if ph == "home":
            return list(HOME)
        return [_action(self.task.category, self.step_of_decision, c) for c in self._colours()]

    def rule_action(self) -> str | None:
        """The action the task's rule states in the current state (None: a state the rule leaves free, or one where
        the rule's colour is not offered, after a wrong colour was examined)."""
        assert self.task is not None
        if self.phase() not in STEPS:
            return None
        act = _action(self.task.category, self.step_of_decision, self.task.payload["answer"])
        return act if act in self.actions() else None

    def winning_action(self) -> str | None:
        """The action that still wins in the current state (None: none does, or any action does)."""
        act = self.rule_action()
        if act is None or any(c != self.task.payload["answer"] for c in self.picks):
            return None
        return act

    def _observation(self) -> str:
        assert self.task is not None
        kind, ph, noun = self.task.category, self.phase(), NOUN[self.task.category]
        if ph == "street":
            return "You walk down a busy street." if self.pos == 0 else "The street goes on past a fountain."
        if ph == "signpost":
            return "Four signs point the way: " + ", ".join(self.task.payload["signs"]) + "."
        if ph == "examine":
            where = "on the stall" if kind == "shop" else "on the bench"
            return f"Four {noun}s lie {where}: " + ", ".join(self.task.payload["options"]) + "."
        if ph in ("wrap", "pay"):
            return f"You hold the {self.held} {noun}. " + ("Choose one to keep." if ph == "wrap" else "Finish it.")
        return "You are on your way home." if self.home == 0 else "Your door is in sight."

    def _info(self, won: bool = False) -> dict[str, Any]:
        assert self.task is not None
        ph = self.phase()
        goal = "buy" if ph in STEPS else ("home" if ph == "home" else ("street" if self.pos == 0 else "crossroads"))
        info: dict[str, Any] = {"won": won, "task": TASK_TEXT[self.task.category]}
        info["admissible_actions"] = [] if self.done else self.actions()
        info["truth"] = {"decision": ph, "goal": goal, "decisive": ph in STEPS}
        return info

    def _won(self) -> bool:
        assert self.task is not None
        return len(self.picks) == 3 and all(c == self.task.payload["answer"] for c in self.picks)

    def _act(self, action: str) -> None:
        ph, acts = self.phase(), self.actions()
        if action not in acts:  # an inadmissible or malformed action changes nothing (it still costs the turn)
            return
        if ph == "street" and action == "walk on":
            self.pos += 1
            self.step_of_decision = 0 if self.pos == 3 else -1
        elif ph == "signpost":
            self.pos = 2
        elif ph in STEPS:
            colour = self._colours()[acts.index(action)]
            self.picks.append(colour)
            self.held = colour  # the item in hand is the one last examined or wrapped
            self.offer = []
            self.step_of_decision += 1
        elif ph == "home" and action == "walk home":
            self.home += 1

    def step(self, action: str) -> StepResult:
        if self.task is None or self.done:
            raise RuntimeError("step() called on a finished or unstarted episode")
        self._act(action)
        self.t += 1
        if self.home < HOME_STEPS and self.t < HORIZON:
            return StepResult(self._observation(), 0.0, False, self._info())
        self.done = True
        won = self._won()
        obs = "The episode ends: you win!" if won else "The episode ends: you lose."
        return StepResult(obs, 10.0 if won else 0.0, True, self._info(won))


DRIFT_TEMPLATE_NO_HIS = """Task: {task_description}
Observation: {current_observation}
Actions: [{admissible_actions}].
"""

DRIFT_TEMPLATE = """Task: {task_description}
{action_history}
Observation: {current_observation}
Actions: [{admissible_actions}].
"""
HISTORY = 2  # turns of history in the prompt: the state is in the observation (what is held), the rest is the way


def drift_prompt(history_length: int = HISTORY) -> PromptBuilder:
    return PromptBuilder(
        DRIFT_TEMPLATE_NO_HIS,
        DRIFT_TEMPLATE,
        history_length,
        history_item="Step {index}: {observation} -> {action}",
        action_sep=", ",
    )


def skill_mapping() -> dict[str, Any]:
    return {
        "skill_files": {"general_skills": "general.md", **{k: f"{k}.md" for k in KINDS}},
        "task_to_skill": {k: k for k in KINDS},
        "task_keywords": {"shop": ["buy a lamp"], "workshop": ["open its gate"]},
    }


def write_skill_bank(root: str | Path, rule: dict[str, Any] | None = None) -> Path:
    """The skill bank stating ``rule`` (default :data:`BENCH_RULE`) under ``root/credit_drift``; returns ``root``."""
    from bench.credit_rules import write_bank

    r = check_rule(dict(BENCH_RULE if rule is None else rule))
    return write_bank(root, ENV, GENERAL, {k: skill_text(k, r[k]) for k in KINDS}, skill_mapping())


def register() -> None:
    """Register ``credit_drift`` in this process's environment registry (idempotent)."""
    from alignopsd.engine.envs import registry

    me = f"{__name__}"
    registry.register_env(
        registry.EnvEntry(
            ENV,
            f"{me}:DriftEnv",
            f"{me}:load_tasks",
            f"{me}:drift_prompt",
            lowercase_actions=True,
            history_length=HISTORY,
        ),
        replace=True,
    )
