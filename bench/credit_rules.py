"""Rule variants of the credit tasks: the winning action is stated only in the privileged skill (``credit_rules``).

The ``credit`` environments (engine/envs/credit/env.py) show the student everything it needs (the code word and the
door's colour are in the first observation). Here the rule that wins is a *variant* the student cannot see:

* ``code``: which word opens the door (one of ``credit.WORDS``; the door offers it among four words);
* ``key``: which key to take (one of :data:`KEY_COLOURS`; four keys lie on the floor, the rule's and three
  others, in a random order, as the code task offers four words);
* ``agree``: which colour the mark must be (one of :data:`KEY_COLOURS`); the bridge must agree with it, so the
  rule fixes both decisive turns: paint that colour, then cross the bridge of that colour. Four colours are
  offered (the rule's and three others, in a random order), the same four at the paint pot and at the bridges;
  the bridge turn's observation names the mark the agent painted (what its history already shows). A random
  policy wins 1 in 16 of these episodes. (The second recipe's variant, a shift of the bridge relative to any
  mark spelt out as a table in the skill, was not read by the two-layer reader: 0.249 with the skill,
  bench/results/credit-2026-12-03.md. The rule's colour repeated in the skill and offered once among the
  actions is what this reader reads, as for code and key.)

The first observation no longer reveals anything (the note is faded, the door's colour is not named). Timing,
corridor turns, rewards and the ground truth (decisive turns, span boundaries) are those of ``credit``; a random
policy wins 1 in 4 episodes of code and key, 1 in 16 of agree (two rule-fixed turns), whatever the rule.

A rule is one variant per kind, ``{"code": word, "key": colour, "agree": colour}``. The benchmark fixes one
(:data:`BENCH_RULE`): the student (no skill) must find it by RL, the teacher (the same weights, the skill in its
prompt) is told it. The reader model (bench/credit_reader.py) learns beforehand to follow whatever rule its skill
states, over every variant drawn at random per episode.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from alignopsd.engine.envs.base import TaskSpec
from alignopsd.engine.envs.credit import env as credit

ENV = "credit_rules"
KINDS = credit.KINDS
# Eight key colours, four on the floor: with all four of ``credit.COLOURS`` always on the floor, a tiny reader
# learnt the colours' frequencies from the action list and never looked at its skill (0.26 with it, 0.27 without)
KEY_COLOURS: tuple[str, ...] = (*credit.COLOURS, "white", "black", "orange", "purple")
VARIANTS: dict[str, tuple] = {"code": credit.WORDS, "key": KEY_COLOURS, "agree": KEY_COLOURS}
# The benchmark's rule, fixed before the first comparison; every variant is in the reader's training distribution.
BENCH_RULE: dict[str, Any] = {"code": "falcon", "key": "green", "agree": "orange"}
TASK_TEXT = {
    "code": "say the code word when the door asks for it.",
    "key": "cross the hall and open the door at its end.",  # the skill bank's keywords: see skill_mapping()
    "agree": "paint a mark, then later choose which bridge to cross.",
}
FIRST_OBS = {
    "code": "A note on the wall is too faded to read.",
    "key": "The door at the end of the hall is locked.",
    "agree": "You stand at the start of a long path.",
}
GENERAL = "## General rule\nOnly the turns that offer a real choice decide whether you win."  # short: the reader
# is trained on every token of the teacher's prompt, and attends over them with two heads
REPEAT = 8


def check_variants(rule: dict[str, Any], variants: dict[str, tuple]) -> dict[str, Any]:
    """``rule`` if it names one of ``variants[kind]`` for every kind (ValueError naming the culprit otherwise)."""
    if not isinstance(rule, dict) or set(rule) != set(variants):
        raise ValueError(f"rule: expected one variant for each of {tuple(variants)}, got {rule!r}")
    for kind, v in rule.items():
        if v not in variants[kind]:
            raise ValueError(f"rule: {kind} variant {v!r} is not one of {variants[kind]}")
    return rule


def check_rule(rule: dict[str, Any]) -> dict[str, Any]:
    """``rule`` if it names one known variant per kind (ValueError naming the culprit otherwise)."""
    return check_variants(rule, VARIANTS)


def skill_text(kind: str, variant: Any) -> str:
    """The skill that states ``variant`` of ``kind`` (the only place the student's missing information is). The
    rule's key word is repeated (:data:`REPEAT` times): a two-layer model with a hidden size of 64 reads a word
    that dominates the context's word counts far sooner than it learns to copy one mention from 150 tokens back."""
    if kind == "code":
        return f"## The code word\nWhen the door asks for the code, say {variant}; no other word. " + _rep(variant)
    if kind == "key":
        return f"## The right key\nWhen the keys lie on the floor, take the {variant} key. " + _rep(variant)
    if kind == "agree":
        how = f"paint your mark {variant}, then cross the {variant} bridge: the bridge must agree with the mark. "
        return "## The safe bridge\nAt the paint pot, " + how + _rep(variant)
    raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")


def _rep(word: str) -> str:
    return "Remember: " + " ".join([word] * REPEAT) + "."


def rule_action(task: TaskSpec, turn: int) -> str | None:
    """The action the task's rule states for ``turn`` (None: a turn the rule leaves free, any action does)."""
    p = task.payload
    if turn not in p["turns"]:
        return None
    if task.category == "code":
        return f"say {p['answer']}"
    if task.category == "key":
        return f"take {p['answer']} key"
    return f"paint {p['answer']}" if turn == p["turns"][0] else f"cross {p['answer']} bridge"


def winning_action(task: TaskSpec, turn: int, mark: str | None = None) -> str | None:
    """The action that still wins at ``turn`` (None: none does, or any action does): the rule's, except at the
    bridge turn of ``agree`` after a mark (``mark``: the painted colour) other than the rule's, where all lose."""
    act = rule_action(task, turn)
    if task.category == "agree" and act is not None and turn != task.payload["turns"][0]:
        return act if mark == task.payload["answer"] else None
    return act


def make_task(kind: str, variant: Any, split: str, seed: int, i: int) -> TaskSpec:
    """One task of ``kind`` under ``variant``, fixed by (split, seed, i): the timing and option order of
    ``credit``'s task, the answer or shift of the variant."""
    base = credit.make_task(kind, split, seed, i)
    p = dict(base.payload)
    r = random.Random(f"{ENV}:{split}:{seed}:{i}")
    opts = [variant, *r.sample([w for w in VARIANTS[kind] if w != variant], 3)]
    r.shuffle(opts)
    p.update(options=opts, answer=variant)
    return TaskSpec(key=f"{ENV}-{kind}-{split}-{seed}-{i}", env=ENV, category=kind, payload=p)


def load_tasks(
    split: str = "train", n: int | None = None, seed: int = 0, rule: dict | None = None, **_: Any
) -> list[TaskSpec]:
    """``n`` tasks (default 12), the kinds in turn, under ``rule`` (default :data:`BENCH_RULE`)."""
    r = check_rule(dict(BENCH_RULE if rule is None else rule))
    n = 12 if n is None or n <= 0 else int(n)
    return [make_task(KINDS[i % len(KINDS)], r[KINDS[i % len(KINDS)]], split, seed, i) for i in range(n)]


decisive_turns = credit.decisive_turns
true_boundaries = credit.true_boundaries


class RuleEnv(credit.CreditEnv):
    """``credit`` with the rule's answer hidden from the observations and the ``agree`` kind's colour."""

    name = ENV

    def reset(self, task: TaskSpec, seed: int) -> tuple[str, dict[str, Any]]:
        p = task.payload
        if task.category == "agree" and p.get("answer") not in (p.get("options") or []):
            raise ValueError(f"task: agree answer {p.get('answer')!r} not among the options {p.get('options')!r}")
        return super().reset(task, seed)

    def _observation(self) -> str:
        assert self.task is not None
        turns = self.task.payload["turns"]
        if self.t == 0 and self.t not in turns:
            return FIRST_OBS[self.task.category]
        if self.task.category == "agree" and self.t == turns[-1]:
            paint = self.choices.get(turns[0], "")
            mark = paint[len("paint ") :] if paint.startswith("paint ") else "nothing"
            return f"Four bridges cross the river. Your mark is {mark}."
        return super()._observation()

    def rule_action(self) -> str | None:
        """The action the rule states for the current turn (None: a turn it leaves free)."""
        assert self.task is not None
        return rule_action(self.task, self.t)

    def winning_action(self) -> str | None:
        """The action that still wins at the current turn (:func:`winning_action`, with the mark painted so far)."""
        assert self.task is not None
        paint = self.choices.get(self.task.payload["turns"][0], "")
        return winning_action(self.task, self.t, paint[len("paint ") :] if paint.startswith("paint ") else None)

    def _info(self, won: bool = False, played: int | None = None) -> dict[str, Any]:
        info = super()._info(won, played)
        assert self.task is not None
        info["task"] = TASK_TEXT[self.task.category]
        return info

    def _won(self) -> bool:
        assert self.task is not None
        if self.task.category != "agree":
            return super()._won()
        paint, cross = (self.choices.get(t, "") for t in self.task.payload["turns"])
        answer = self.task.payload["answer"]
        return paint == f"paint {answer}" and cross == f"cross {answer} bridge"


def skill_mapping() -> dict[str, Any]:
    return {
        "skill_files": {"general_skills": "general.md", **{k: f"{k}.md" for k in KINDS}},
        "task_to_skill": {k: k for k in KINDS},
        "task_keywords": {"code": ["code word"], "key": ["open the door"], "agree": ["paint a mark"]},
    }


def write_bank(root: str | Path, env: str, general: str, skills: dict[str, str], mapping: dict[str, Any]) -> Path:
    """A skill bank under ``root/env``: the general rule, one file per kind (``skills``: kind -> text) and the
    mapping the engine's lookup reads; returns ``root``."""
    folder = Path(root) / env
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "general.md").write_text(general + "\n")
    for kind, text in skills.items():
        (folder / f"{kind}.md").write_text(text + "\n")
    (folder / "skill_mapping.json").write_text(json.dumps(mapping, indent=2) + "\n")
    return Path(root)


def write_skill_bank(root: str | Path, rule: dict[str, Any] | None = None) -> Path:
    """The skill bank stating ``rule`` (default :data:`BENCH_RULE`) under ``root/credit_rules``; returns ``root``."""
    r = check_rule(dict(BENCH_RULE if rule is None else rule))
    return write_bank(root, ENV, GENERAL, {k: skill_text(k, r[k]) for k in KINDS}, skill_mapping())


def register() -> None:
    """Register ``credit_rules`` in this process's environment registry (idempotent)."""
    from alignopsd.engine.envs import registry

    entry = registry.get_entry("credit")
    me = f"{__name__}"
    registry.register_env(
        registry.EnvEntry(
            ENV, f"{me}:RuleEnv", f"{me}:load_tasks", entry.prompt, lowercase_actions=True, history_length=8
        ),
        replace=True,
    )
