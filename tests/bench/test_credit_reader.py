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
    rule = {"code": "marble", "key": "yellow", "agree": "purple"}
    code, key, agree = credit_rules.load_tasks("train", 3, 7, rule)
    assert code.payload["answer"] == "marble" and "marble" in code.payload["options"]
    res, seen = play(code, lambda t, acts: "say marble" if "say marble" in acts else acts[0])
    assert res.reward == 10.0 and not any("marble" in o for o in seen)  # no observation names the answer
    res, _ = play(key, lambda t, acts: "take red key" if "take red key" in acts else acts[0])
    assert res.reward == 0.0
    res, seen = play(key, lambda t, acts: "take yellow key" if "take yellow key" in acts else acts[0])
    assert res.reward == 10.0 and not any("yellow" in o for o in seen)
    # agree: the rule's colour at the paint pot and at the bridges; a mark and bridge that agree on another colour lose
    other = next(c for c in agree.payload["options"] if c != "purple")
    for paint, cross, reward in (("purple", "purple", 10.0), ("purple", other, 0.0), (other, other, 0.0)):
        picks = {"paint": f"paint {paint}", "cross": f"cross {cross} bridge"}
        assert play(agree, lambda t, acts, p=picks: p.get(acts[0].split()[0], acts[0]))[0].reward == reward
    assert credit_rules.decisive_turns(agree) == agree.payload["turns"]
    with pytest.raises(ValueError, match="key variant 'pink'"):
        credit_rules.load_tasks("train", 3, 0, {"code": "apple", "key": "pink", "agree": "red"})


def test_key_and_agree_offer_the_rule_among_four_and_the_bridge_turn_names_the_mark():
    rule = {"code": "apple", "key": "orange", "agree": "white"}
    for seed in range(6):
        code, key, agree = credit_rules.load_tasks("train", 3, seed, rule)
        for task, colour in ((key, "orange"), (agree, "white")):
            assert colour in task.payload["options"] and len(set(task.payload["options"])) == 4
            assert set(task.payload["options"]) <= set(credit_rules.KEY_COLOURS)
        paint, cross = agree.payload["turns"]
        mark = next(c for c in agree.payload["options"] if c != "white")
        _, seen = play(agree, lambda t, acts, m=mark: f"paint {m}" if f"paint {m}" in acts else acts[0])
        assert seen[cross] == f"Four bridges cross the river. Your mark is {mark}."
        assert all(mark not in o for i, o in enumerate(seen) if i != cross)
        # the rule states the bridge whatever the mark; after a wrong mark no bridge wins
        assert credit_rules.rule_action(agree, cross) == "cross white bridge"
        assert credit_rules.winning_action(agree, cross, mark) is None
        assert credit_rules.winning_action(agree, cross, "white") == "cross white bridge"
        assert credit_rules.winning_action(agree, paint) == credit_rules.rule_action(agree, paint) == "paint white"
        assert credit_rules.rule_action(agree, cross + 1) is None  # a corridor turn
    skill = credit_rules.skill_text("agree", "white")  # the colour, repeated, as code and key state theirs
    assert "paint your mark white, then cross the white bridge" in skill and skill.count("white") >= 8


def test_teacher_prompt_is_the_engines_and_targets_follow_the_rule(tmp_path, tok):
    from alignopsd.engine.envs.skills import skill_lookup, teacher_prompt_text

    credit_rules.register()
    rule = {"code": "river", "key": "blue", "agree": "black"}
    bank = credit_rules.write_skill_bank(tmp_path, rule)
    lookup = skill_lookup(credit_rules.ENV, bank)
    rng = random.Random(0)
    for task in credit_rules.load_tasks("train", 3, 1, rule):
        for turn in credit_reader.episode_turns(task, rng):
            student, teacher = credit_reader.prompt_texts(tok, task, turn, rule[task.category])
            row = {"data_source": task.data_source, "prompt_text": student}
            assert teacher == teacher_prompt_text(lookup(row), student)  # what the trainer's teacher sees
            assert credit_rules.skill_text(task.category, rule[task.category]) in teacher.split("<|im_start|>")[0]
            if turn["decisive"]:
                want = {"code": ["say river"], "key": ["take blue key"], "agree": ["paint black", "cross black bridge"]}
                assert turn["rule"] in want[task.category] and turn["win"] in (turn["rule"], None)


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
    assert uniform >= 8  # every code and key episode, both decisive turns of every agree episode


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
