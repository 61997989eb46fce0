"""Prompt templates (ALGORITHM.md §1.3), skill lookup and the teacher prompt builder (§1.4)."""

from __future__ import annotations

import json

import pytest
import torch
from alignopsd.engine.envs.alfworld.prompt import alfworld_prompt
from alignopsd.engine.envs.prompts import PromptBuilder, PromptContext, chat_text
from alignopsd.engine.envs.registry import make_prompt
from alignopsd.engine.envs.skills import (
    HEADER,
    build_teacher_prompts,
    load_skill_bank,
    skill_lookup,
    teacher_prompt_text,
)

ADM = ["go to cabinet 1", "help", "inventory", "look"]


def _ctx(n_hist: int) -> PromptContext:
    hist = [(f"obs {i + 1}", f"act {i + 1}") for i in range(n_hist)]
    return PromptContext(task="put a clean apple in fridge.", observation="current obs", admissible_actions=ADM,
                         history=hist)  # fmt: skip


def test_alfworld_templates():
    b = make_prompt("alfworld")
    first = b.render(_ctx(0))
    assert "Your current observation is: current obs" in first and "Prior to this step" not in first
    assert "'go to cabinet 1'\n 'inventory'\n 'look'" in first and "'help'" not in first
    assert "<think> </think>" in first and "<action> </action>" in first
    later = b.render(_ctx(3))
    assert "Your task is to: put a clean apple in fridge." in later
    assert "already taken 3 step(s)" in later and "most recent 2 observations" in later
    assert "[Observation 2: 'obs 2', Action 2: 'act 2']\n[Observation 3: 'obs 3', Action 3: 'act 3']" in later
    assert "Observation 1:" not in later and "You are now at step 4" in later
    one = alfworld_prompt(2).render(_ctx(1))
    assert "most recent 1 observations" in one and "[Observation 1: 'obs 1'" in one


def test_builder_fallback_and_validation():
    b = PromptBuilder("FIRST {current_observation}", "HIST {action_history} {current_observation}", 2, max_chars=60)
    assert b.render(_ctx(1)) == "HIST [Observation 1: 'obs 1', Action 1: 'act 1'] current obs"
    assert b.render(_ctx(3)) == "FIRST current obs"  # over 60 characters -> no-history template
    assert PromptBuilder("F", "H {history_length}", 0).render(_ctx(2)) == "F"
    with pytest.raises(ValueError, match="history_length"):
        PromptBuilder("a", "b", -1)
    with pytest.raises(ValueError, match="max_chars"):
        PromptBuilder("a", "b", 1, max_chars=0)


def test_alfworld_skill_lookup():
    bank = load_skill_bank("alfworld")
    assert set(bank.task_to_skill) == {
        "pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
        "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_two_obj_and_place",
    }  # fmt: skip
    g = "/data/json_2.1.1/train/pick_heat_then_place_in_recep-Mug-None-Cabinet-5/trial_T1/game.tw-pddl"
    assert bank.match(g, "text", "put a clean apple") == ["pick_heat_then_place_in_recep"]
    text = bank.skill_text(g, "text")
    assert text.startswith(bank.general) and text.endswith(bank.skills["heat_then_place"])
    assert text == bank.general + "\n\n" + bank.skills["heat_then_place"]
    # no task type in the path: keyword fallback over the lower-cased prompt, mapping order
    assert bank.match("/x/game.tw-pddl", "text", "Your task is to: put a clean apple in fridge.") == [
        "pick_and_place_simple", "pick_clean_then_place_in_recep",
    ]  # fmt: skip
    assert bank.skill_text(None, "text", "nothing relevant") == bank.general
    assert bank.skill_text(skill_all=True).count("# Skill:") == 6
    lookup = skill_lookup("alfworld")
    assert lookup({"gamefile": g, "data_source": "text", "prompt_text": "x"}) == text
    assert lookup({"gamefile": None, "data_source": "text", "prompt_text": "Put Two CDs"}).endswith(
        bank.skills["pick_two_and_place"]
    )
    assert skill_lookup("codeword") is None


def test_search_style_rules(tmp_path):
    folder = tmp_path / "search"
    folder.mkdir()
    names = ["entity_attribute_lookup", "direct_retrieval", "multi_hop_reasoning", "compare"]
    for n in ["general"] + names:
        (folder / f"{n}.md").write_text(f"SKILL {n}")
    mapping = {
        "skill_files": {"general_skills": "general.md", **{n: f"{n}.md" for n in names}},
        "task_to_skill": {n: n for n in names},
        "task_keywords": {"compare": ["older"], "direct_retrieval": ["when was"]},
    }
    (folder / "skill_mapping.json").write_text(json.dumps(mapping))
    bank = load_skill_bank("search", root=tmp_path)
    assert bank.match(None, "popqa", "x") == ["entity_attribute_lookup"]
    assert bank.match(None, "nq", "which is it, a or b") == ["direct_retrieval"]
    assert bank.match(None, "triviaqa", "") == ["direct_retrieval"]
    assert bank.match(None, "hotpotqa", "") == ["multi_hop_reasoning"]
    assert bank.match(None, "musique", "which came first, a or b") == ["compare"]
    assert bank.match(None, "musique", "which one for a or b") == ["multi_hop_reasoning"]
    assert bank.match(None, "bamboogle", "") == ["multi_hop_reasoning"]
    assert bank.match(None, "unknown", "when was it older") == []
    assert bank.match(None, "text", "when was it older") == ["compare", "direct_retrieval"]
    assert bank.skill_text(None, "popqa") == "SKILL general\n\nSKILL entity_attribute_lookup"
    assert bank.skill_text(None, "nq", "") == "SKILL general\n\nSKILL direct_retrieval"
    assert bank.skill_text(None, "x", "") == "SKILL general"
    (folder / "skill_mapping.json").write_text(json.dumps({**mapping, "task_to_skill": {"a": "missing"}}))
    with pytest.raises(ValueError, match="unknown skill"):
        load_skill_bank("search", root=tmp_path / ".." / tmp_path.name)
    with pytest.raises(ValueError, match="no skill bank"):
        load_skill_bank("nope", root=tmp_path)


@pytest.fixture(scope="module")
def tok():
    from alignopsd.engine.models.loading import load_tokenizer

    return load_tokenizer("tiny")


def test_teacher_prompts(tok):
    users = ["Observation: you see a fridge 1.", "Observation: a much longer observation " + "with words " * 10]
    texts = [chat_text(tok, u) for u in users]
    enc = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    assert enc["attention_mask"][0, 0] == 0  # left padded
    skills = ["SKILL ONE: clean things in the sinkbasin.", "SKILL TWO"]
    ids, mask, trunc = build_teacher_prompts(
        tok, enc["input_ids"], enc["attention_mask"], skills, 256, tok.pad_token_id
    )
    assert ids.shape == (2, 256) and mask.dtype == torch.long and trunc == 0
    for i in range(2):
        n = int(mask[i].sum())
        assert mask[i, : 256 - n].sum() == 0 and (ids[i, : 256 - n] == tok.pad_token_id).all()
        got = ids[i, 256 - n :].tolist()
        want_text = teacher_prompt_text(skills[i], texts[i])
        assert want_text.startswith(HEADER + skills[i] + "\n\n<|im_start|>")
        assert got == tok(want_text, add_special_tokens=False)["input_ids"]
        assert tok.convert_tokens_to_ids("<|im_start|>") in got  # markers stay special tokens
    short, smask, strunc = build_teacher_prompts(
        tok, enc["input_ids"], enc["attention_mask"], skills, 12, tok.pad_token_id
    )
    assert strunc == 2 and smask.sum() == 24
    full = tok(teacher_prompt_text(skills[1], texts[1]), add_special_tokens=False)["input_ids"]
    assert short[1].tolist() == full[-12:]  # left truncation keeps the tail; the skill text goes first
    with pytest.raises(ValueError, match="skill_texts"):
        build_teacher_prompts(tok, enc["input_ids"], enc["attention_mask"], skills[:1], 64, 0)
    with pytest.raises(ValueError, match="max_prompt_length"):
        build_teacher_prompts(tok, enc["input_ids"], enc["attention_mask"], skills, 0, 0)


def test_skills_dir_config_resolves_and_validates(tmp_path):
    """env.skills_dir: relative to the config file, checked at load time (the culprit named)."""
    from alignopsd.engine.config.schema import ConfigError, load_config

    cfg = load_config("configs/quickstart_cpu.yaml")
    bank = load_skill_bank("alfworld", cfg.env.skills_dir)
    assert cfg.env.skills_dir.endswith("configs/skills") and set(bank.skills) == {"general_skills", "pick_and_place"}
    text = skill_lookup("alfworld", cfg.env.skills_dir)({"gamefile": "x/pick_and_place_simple-Cd-None-Desk-1/g.z8"})
    assert text.startswith("# ALFWorld: compact") and "pick_and_place_simple" in text
    assert len(text) < len(skill_lookup("alfworld")({"gamefile": "x/pick_and_place_simple-Cd-None-Desk-1/g.z8"})) / 2
    with pytest.raises(ConfigError, match=r"env.skills_dir: no skill bank for 'alfworld'"):
        load_config("configs/quickstart_cpu.yaml", [f"env.skills_dir={tmp_path}"])


def test_skills_dir_reaches_the_teacher_prompts_of_a_training_rollout(tmp_path):
    """The configured bank is the one the rollout phase of a real run puts in the privileged prompts."""
    from alignopsd.engine.step.episodes import rollout_phase
    from learn_helpers import GUESS_OVERRIDES, TINY_CONFIG, build_trainer

    (tmp_path / "guess").mkdir()
    (tmp_path / "guess" / "general.md").write_text("ZEBRA-SKILL: pick the code word.")
    (tmp_path / "guess" / "skill_mapping.json").write_text(
        json.dumps({"skill_files": {"general_skills": "general.md"}, "task_to_skill": {}})
    )
    tr = build_trainer(str(TINY_CONFIG), [*GUESS_OVERRIDES, f"env.skills_dir={tmp_path}", f"output_dir={tmp_path}/r"])
    try:
        batch, _ = rollout_phase(tr.parts, tr.parts.train_tasks[:1], seed=0, validation=False, teacher_prompts=True)
        texts = tr.parts.tokenizer.batch_decode(batch.teacher_prompt_ids, skip_special_tokens=True)
        assert all(HEADER + "ZEBRA-SKILL: pick the code word." in t for t in texts)
        students = tr.parts.tokenizer.batch_decode(batch.prompt_ids, skip_special_tokens=True)
        assert not any("ZEBRA" in s for s in students)
    finally:
        tr.dist.close()


def test_skill_withheld_gives_the_last_siblings_the_general_skill_only():
    from alignopsd.engine.envs.skills import skill_withheld

    look = skill_withheld(lambda row: f"rule of {row['category']}", "general only", group_n=4, withheld=2)
    got = [look({"category": "shop", "rollout": k}) for k in range(4)]
    assert got == ["rule of shop", "rule of shop", "general only", "general only"]
    every = skill_withheld(lambda row: "rule", "general only", group_n=2, withheld=2)
    assert [every({"rollout": k}) for k in range(2)] == ["general only"] * 2
    with pytest.raises(ValueError, match="'rollout' must be in"):
        look({"category": "shop"})  # a row without its sibling index
    with pytest.raises(ValueError, match="'rollout' must be in"):
        look({"rollout": 4})
    for bad in (0, 5):
        with pytest.raises(ValueError, match=r"withheld: expected 1 to group_n \(4\)"):
            skill_withheld(lambda row: "", "", group_n=4, withheld=bad)
    with pytest.raises(ValueError, match="withheld: expected an int"):
        skill_withheld(lambda row: "", "", group_n=4, withheld=True)


def test_the_withheld_skill_reaches_the_teacher_prompts_of_a_training_rollout(tmp_path):
    """The control of ``alignopsd ablate --withhold-skill``: the rollout phase puts the general skill only in front of
    the last siblings' teacher prompts."""
    from dataclasses import replace

    from alignopsd.engine.envs.skills import skill_withheld
    from alignopsd.engine.step.episodes import rollout_phase
    from learn_helpers import GUESS_OVERRIDES, TINY_CONFIG, build_trainer

    tr = build_trainer(str(TINY_CONFIG), [*GUESS_OVERRIDES, f"output_dir={tmp_path}/r"])
    try:
        g = tr.parts.cfg.env.group_n
        parts = replace(tr.parts, skill_lookup=skill_withheld(lambda row: "ZEBRA-RULE", "GENERAL", g, 1))
        batch, _ = rollout_phase(parts, tr.parts.train_tasks[:2], seed=0, validation=False, teacher_prompts=True)
        texts = tr.parts.tokenizer.batch_decode(batch.teacher_prompt_ids, skip_special_tokens=True)
        for k, t in zip(batch.rollout.tolist(), texts):
            assert (HEADER + ("GENERAL" if k == g - 1 else "ZEBRA-RULE")) in t
        assert {k for k in batch.rollout.tolist()} == set(range(g))
    finally:
        tr.dist.close()
