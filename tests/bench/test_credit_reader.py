"""The rule variants (credit_rules), the reader's data and prompts, and its verified cache."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import credit_reader, credit_rules  # noqa: E402

TINY_RECIPE = dict(credit_reader.RECIPE, episodes=6, steps=2, batch=4)


@pytest.fixture(scope="module")
def tok():
    return credit_reader.build_tokenizer(TINY_RECIPE)


def play(task, actions_by_turn):
    env = credit_rules.RuleEnv()
    obs, info = env.reset(task, 0)
    seen, done, res = [obs], False, None
    while not done:
        acts = info["admissible_actions"]
        res = env.step(actions_by_turn(env.t, acts))
        seen.append(res.observation)
        info, done = res.info, res.done
    return res, seen


def test_the_rule_alone_decides_and_the_student_never_sees_it():
    rule = {"code": "marble", "key": "yellow", "agree": 2}
    code, key, agree = credit_rules.load_tasks("train", 3, 7, rule)
    assert code.payload["answer"] == "marble" and "marble" in code.payload["options"]
    res, seen = play(code, lambda t, acts: "say marble" if "say marble" in acts else acts[0])
    assert res.reward == 10.0 and not any("marble" in o for o in seen)  # no observation names the answer
    res, _ = play(key, lambda t, acts: "take red key" if "take red key" in acts else acts[0])
    assert res.reward == 0.0
    res, seen = play(key, lambda t, acts: "take yellow key" if "take yellow key" in acts else acts[0])
    assert res.reward == 10.0 and not any("yellow" in o for o in seen)
    # agree, shift 2: blue -> yellow (red, blue, green, yellow), and the same colour loses
    picks = {"paint": "paint blue", "cross": "cross yellow bridge"}
    assert play(agree, lambda t, acts: picks.get(acts[0].split()[0], acts[0]))[0].reward == 10.0
    picks["cross"] = "cross blue bridge"
    assert play(agree, lambda t, acts: picks.get(acts[0].split()[0], acts[0]))[0].reward == 0.0
    assert credit_rules.decisive_turns(agree) == agree.payload["turns"]
    with pytest.raises(ValueError, match="key variant 'pink'"):
        credit_rules.load_tasks("train", 3, 0, {"code": "apple", "key": "pink", "agree": 0})


def test_key_offers_the_rule_among_four_and_the_bridge_turn_names_the_mark():
    rule = {"code": "apple", "key": "orange", "agree": 1}
    for seed in range(6):
        code, key, agree = credit_rules.load_tasks("train", 3, seed, rule)
        assert "orange" in key.payload["options"] and len(set(key.payload["options"])) == 4
        assert set(key.payload["options"]) <= set(credit_rules.KEY_COLOURS)
        paint, cross = agree.payload["turns"]
        _, seen = play(agree, lambda t, acts: "paint green" if "paint green" in acts else acts[0])
        assert seen[cross] == "Four bridges cross the river. Your mark is green."
        assert all("green" not in o for i, o in enumerate(seen) if i != cross)
    skill = credit_rules.skill_text("agree", 1)  # the table spells the shift out for every mark
    assert "mark red bridge blue; mark blue bridge green; mark green bridge yellow; mark yellow bridge red" in skill


def test_teacher_prompt_is_the_engines_and_targets_follow_the_rule(tmp_path, tok):
    from alignopsd.engine.envs.skills import skill_lookup, teacher_prompt_text

    credit_rules.register()
    rule = {"code": "river", "key": "blue", "agree": 3}
    bank = credit_rules.write_skill_bank(tmp_path, rule)
    lookup = skill_lookup(credit_rules.ENV, bank)
    rng = random.Random(0)
    for task in credit_rules.load_tasks("train", 3, 1, rule):
        for turn in credit_reader.episode_turns(task, rng):
            student, teacher = credit_reader.prompt_texts(tok, task, turn, rule[task.category])
            row = {"data_source": task.data_source, "prompt_text": student}
            assert teacher == teacher_prompt_text(lookup(row), student)  # what the trainer's teacher sees
            assert credit_rules.skill_text(task.category, rule[task.category]) in teacher.split("<|im_start|>")[0]
            if turn["decisive"] and task.category != "agree":
                assert turn["win"] == {"code": "say river", "key": "take blue key"}[task.category]


def test_reader_examples_teach_the_rule_with_the_skill_and_chance_without(tok):
    data = credit_reader.examples(tok, TINY_RECIPE)
    assert len(data) % 2 == 0 and len(data) >= 6 * 2 * 2  # decisive + one corridor turn, both views
    uniform = 0
    for (p_s, _, f_s, a_s), (p_t, r_t, f_t, a_t) in zip(data[0::2], data[1::2]):
        student, teacher = tok.decode(p_s), tok.decode(p_t)
        assert teacher.startswith("[Privileged Skill Information]") and teacher.endswith(student)
        assert "[Privileged" not in student and a_t == [] and f_t >= 0 and f_s >= 0
        assert tok.decode(r_t[f_t]).strip() in tok.decode(r_t).split("<action>")[1]  # a word of the action
        if a_s:  # a turn whose action the rule fixes: without the skill, every action's deciding token alike
            uniform += 1
            word = tok.decode(r_t[f_t]).strip()
            assert r_t[f_t] in a_s and len(a_s) == 4 and word in teacher.split("<|im_start|>")[0]
    assert uniform >= 6  # every code and key episode, every agree episode's bridge turn


def test_reader_cache_is_verified_and_rebuilt_when_corrupt_or_foreign(tmp_path, monkeypatch):
    built = []
    real = credit_reader.build_reader

    def counting(out, recipe):
        built.append(out)
        real(out, recipe)

    monkeypatch.setattr(credit_reader, "build_reader", counting)
    first = credit_reader.ensure_reader(tmp_path, TINY_RECIPE)
    assert len(built) == 1 and first.name == f"credit-reader-{credit_reader.recipe_key(TINY_RECIPE)}"
    assert credit_reader.ensure_reader(tmp_path, TINY_RECIPE) == first and len(built) == 1  # trusted, not rebuilt
    weights = first / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:-8] + b"\0" * 8)  # flipped bytes: the checksum fails
    assert "crc32" in (credit_reader.cached_reader_problem(first, TINY_RECIPE) or "").lower()
    assert credit_reader.ensure_reader(tmp_path, TINY_RECIPE) == first and len(built) == 2
    assert weights.read_bytes() == good  # rebuilt to the same bytes (the recipe is deterministic)
    stored = json.loads((first / credit_reader.RECIPE_FILE).read_text())
    stored["recipe"]["steps"] += 1  # a foreign folder under this key (its manifest rewritten to match)
    (first / credit_reader.RECIPE_FILE).write_text(json.dumps(stored))
    from alignopsd.engine.checkpoint.manifest import write_manifest

    write_manifest(first)
    assert credit_reader.cached_reader_problem(first, TINY_RECIPE) == "its stored recipe is not this reader's"
    assert credit_reader.ensure_reader(tmp_path, TINY_RECIPE) == first and len(built) == 3
    (first / "tokenizer.json").unlink()  # an incomplete folder
    assert credit_reader.ensure_reader(tmp_path, TINY_RECIPE) == first and len(built) == 4
    assert credit_reader.cached_reader_problem(first, TINY_RECIPE) is None
    assert not [p for p in tmp_path.iterdir() if p != first]  # nothing left aside


def test_premise_verdict_names_each_failure():
    ok = {"n": 10, "teacher": 0.9, "student": 0.27, "chance": 0.25}
    choice = {k: dict(ok) for k in (*credit_rules.KINDS, "all")}
    assert credit_reader.premise_failures(choice) == []
    choice["key"] = dict(ok, teacher=0.6)
    choice["code"] = dict(ok, student=0.5)
    bad = credit_reader.premise_failures(choice)
    assert len(bad) == 2 and bad[0].startswith("code: without the skill") and bad[1].startswith("key: with the skill")
