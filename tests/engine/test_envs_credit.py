"""The credit-assignment environments: determinism, ground truth in the info, skills, random-policy success."""

from __future__ import annotations

import random

import pytest
from alignopsd.engine.envs.credit.env import HORIZON, KINDS, CreditEnv, decisive_turns, load_tasks, true_boundaries
from alignopsd.engine.envs.skills import skill_lookup


def play(task, pick) -> tuple[bool, list[dict]]:
    env = CreditEnv()
    _, info = env.reset(task, 0)
    infos = []
    while True:
        res = env.step(pick(env.t, info["admissible_actions"]))
        infos.append(res.info)
        info = res.info
        if res.done:
            return bool(res.info["won"]), infos


def uniform(seed: int):
    r = random.Random(seed)
    return lambda _t, acts: r.choice(acts)


def test_uniform_random_policy_wins_10_to_30_percent():
    tasks = load_tasks("train", 600, seed=3)
    wins = [play(t, uniform(i))[0] for i, t in enumerate(tasks)]
    rate = sum(wins) / len(wins)
    assert 0.10 <= rate <= 0.30, rate
    for kind in KINDS:  # every kind is hard for a random policy, not only on average
        k = [w for w, t in zip(wins, tasks) if t.category == kind]
        assert 0.10 <= sum(k) / len(k) <= 0.40, (kind, sum(k) / len(k))


def winning_pick(task):
    p = task.payload

    def pick(t, acts):
        if t not in p["turns"]:
            return acts[-1]
        if task.category == "code":
            return f"say {p['answer']}"
        if task.category == "key":
            return f"take {p['answer']} key"
        colour = p["options"][2]
        return f"paint {colour}" if t == p["turns"][0] else f"cross {colour} bridge"

    return pick


def check_rule(task) -> None:
    good = winning_pick(task)
    won, infos = play(task, good)
    assert won and len(infos) == HORIZON
    assert [t for t, i in enumerate(infos) if i["decisive"]] == decisive_turns(task)
    assert [t for t, i in enumerate(infos) if i["span_start"]] == true_boundaries(task)
    assert all(i["decisive_turns"] == decisive_turns(task) for i in infos)
    turns, last = task.payload["turns"], task.payload["turns"][-1]
    # a different choice on a corridor turn changes nothing; a wrong one on a decisive turn loses
    assert play(task, lambda t, acts: acts[0] if t not in turns else good(t, acts))[0]
    assert not play(task, lambda t, acts: next(a for a in acts if a != good(t, acts)) if t == last else good(t, acts))[
        0
    ]


def test_rule_wins_and_only_decisive_turns_matter():
    for task in load_tasks("train", 9, seed=1):
        check_rule(task)


def test_tasks_are_seeded_and_deterministic():
    a, b = load_tasks("train", 6, seed=0), load_tasks("train", 6, seed=0)
    assert [(t.key, t.payload) for t in a] == [(t.key, t.payload) for t in b]
    assert [t.payload for t in load_tasks("train", 6, seed=1)] != [t.payload for t in a]
    assert [t.category for t in a] == ["code", "key", "agree"] * 2
    assert all(1 <= min(true_boundaries(t)) and max(decisive_turns(t)) < HORIZON - 1 for t in a)


def test_each_kind_has_its_privileged_skill():
    lookup = skill_lookup("credit")
    for task, rule in zip(load_tasks("train", 3), ("say exactly that word", "key of the door's colour", "same colour")):
        env = CreditEnv()
        obs, info = env.reset(task, 0)
        text = lookup({"data_source": "text", "prompt_text": "Task: " + info["task"] + "\n" + obs})
        assert rule in text and "Only the turns that offer a real choice" in text
        others = [r for r in ("say exactly that word", "key of the door's colour", "same colour") if r != rule]
        assert not any(o in text for o in others)


def test_malformed_task_is_refused():
    task = load_tasks("train", 1)[0]
    bad = type(task)(task.key, "credit", "code", payload={**task.payload, "answer": "nothing"})
    with pytest.raises(ValueError, match="answer 'nothing' not among the options"):
        CreditEnv().reset(bad, 0)
    with pytest.raises(ValueError, match="not a credit task"):
        decisive_turns(type(task)("x", "credit", "maze", payload={"turns": [1]}))


def test_options_of_a_turn_have_equal_token_counts():
    """Under the tiny model's SmolLM2 vocabulary every action of a turn is as long as the others in each candidate
    template, so the candidate-choice sampler's random initial policy is not biased towards short options."""
    from alignopsd.engine.generation.choice import candidate_texts
    from alignopsd.engine.models.loading import load_tokenizer

    tok = load_tokenizer("tiny")
    for task in load_tasks("train", 30, seed=2):
        env = CreditEnv()
        _, info = env.reset(task, 0)
        while True:
            texts = candidate_texts("Actions: [" + ", ".join(info["admissible_actions"]) + "]")
            lens = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
            assert len(set(lens[0::2])) == 1 and len(set(lens[1::2])) == 1, (task.key, env.t, texts, lens)
            res = env.step(info["admissible_actions"][0])
            info = res.info
            if res.done:
                break
