"""Supervised warm start: expert data rendered exactly as the rollout renders prompts, the loss goes down on the
tiny model, the checkpoint is what a run loads, bad warm starts fail early and clearly; easy games."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from alignopsd.engine.commands.sft import (
    SFT_MARKER,
    check_warm_start,
    encode_turn,
    response_loss,
    save_warm_start,
    sft_train,
)
from alignopsd.engine.config.schema import load_config
from alignopsd.engine.envs.alfworld.env import collect_games
from alignopsd.engine.envs.alfworld.expert import expert_turns
from alignopsd.engine.envs.alfworld.gen import game_facts, generate_games
from alignopsd.engine.envs.manager import EnvManager
from alignopsd.engine.generation.base import GenerationOutput
from alignopsd.engine.models.loading import load_causal_lm, load_tokenizer
from alignopsd.engine.step.rollout import collect_rollouts
from generator_double import GeneratorDouble

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


@pytest.fixture(scope="module")
def games(tmp_path_factory):
    """Three easy games (pick-and-place, small rooms, walkthrough <= 8) in the official layout."""
    root = tmp_path_factory.mktemp("easy")
    generate_games(3, root, seed=5, task_types=("pick_and_place_simple",), max_steps=8, small=True)
    return root


@pytest.fixture(scope="module")
def expert(games, tok):
    """(tasks, expert turns, encoded examples) of the easy games, played through a real EnvManager."""
    env = EnvManager("alfworld", num_workers=0, history_length=1, max_steps=8, data_dir=str(games))
    try:
        tasks = env.task_source("train", None, 0)
        turns = expert_turns(env, tasks)
    finally:
        env.close()
    return tasks, turns, [encode_turn(tok, t, 1024) for t in turns]


def test_easy_games_are_small_and_short(games):
    files = collect_games(games, "train")
    assert len(files) == 3
    for f in files:
        facts = game_facts(f)
        assert facts["task_type"] == "pick_and_place_simple" and 0 < len(facts["walkthrough"]) <= 8
        assert facts["object"] and facts["parent"] and facts["object"] in facts["task"].lower()


def test_expert_turns_cover_walkthroughs(expert):
    tasks, turns, _ = expert
    for t in tasks:
        mine = [x for x in turns if x.task_key == t.key]
        assert [x.turn for x in mine] == list(range(len(game_facts(t.payload["gamefile"])["walkthrough"])))
        for x, action in zip(mine, game_facts(t.payload["gamefile"])["walkthrough"]):
            assert x.response.endswith(f"<action>{action}</action>") and x.response.startswith("<think>")
            assert "</think>" in x.response and "<think>" not in x.response[7:]
            assert "ALFRED" in x.user_text and "Your task is to" in x.user_text


def test_expert_thinking_reads_the_position_from_the_game(expert):
    """Each thought starts from where the agent stands: the receptacle of the last `go to`, which is also what
    the turn's observation reports ("You arrive at X"), and says whether the object is held."""
    tasks, turns, _ = expert
    for t in tasks:
        at, holding = None, False
        for x, action in zip(
            [x for x in turns if x.task_key == t.key], game_facts(t.payload["gamefile"])["walkthrough"]
        ):
            think = x.response[len("<think>") : x.response.index("</think>")]
            assert think.startswith(f"I am at {at}" if at else "I am in the middle of the room"), (think, at)
            if at:
                assert f"You arrive at {at}" in x.user_text
            if action.startswith("go to "):
                obj = game_facts(t.payload["gamefile"])["object"]
                assert (f"I hold the {obj}" in think) == holding, think
                at = action[len("go to ") :]
            holding = holding or action.startswith("take ")


def test_search_detours_win_and_show_what_to_do_where_the_object_is_not(games):
    """With detours the expert first visits other receptacles (opening closed ones) and still wins within the
    limit; each thought after a visit says the object is not here, unless one shows, which it then takes."""
    env = EnvManager("alfworld", num_workers=0, history_length=1, max_steps=12, data_dir=str(games))
    try:
        tasks = env.task_source("train", None, 0)
        turns = expert_turns(env, tasks, seed=3, detours=2, max_turns=12)  # raises unless every game is won
    finally:
        env.close()
    searched = 0
    for t in tasks:
        facts = game_facts(t.payload["gamefile"])
        mine = [x for x in turns if x.task_key == t.key]
        actions = [x.response.split("<action>")[1].split("</action>")[0] for x in mine]
        assert len(mine) <= 12 and actions[-1].startswith("move ")
        first_go = next(a for a in facts["walkthrough"] if a.startswith("go to "))
        assert actions[0].startswith("go to ") and actions[0] != first_go  # a detour comes first
        for x in mine:
            now = x.user_text.rsplit("current observation is:", 1)[-1].split("Your admissible actions")[0]
            if "is not here" in x.response:
                searched += 1
                assert not re.search(rf"\b{facts['object']} \d", now), (now, x.response)
    assert searched >= len(tasks)


def test_examples_render_prompts_exactly_as_the_rollout(expert, games, tok):
    """A rollout whose generator answers with the expert responses sees the same prompt ids, turn by turn."""
    tasks, _, examples = expert
    by_prompt = {tuple(p): r for (p, r) in examples}

    class Expert(GeneratorDouble):
        def generate(self, prompts, sampling, *, keep_prompt_cache=False):
            ids = [by_prompt[tuple(p)][:-1] for p in prompts]  # KeyError: a prompt the data does not hold
            texts = [tok.decode(i) for i in ids]
            return GenerationOutput(ids, texts, [[-0.1] * len(i) for i in ids], ["stop"] * len(ids))

        def load_weights(self, state_dict):
            pass

    env = EnvManager("alfworld", num_workers=0, history_length=1, max_steps=8, data_dir=str(games))
    try:
        batch = collect_rollouts(env, Expert(), tok, tasks, group_n=1, max_prompt_length=1024, max_response_length=64,
                                 teacher_prompts=False)  # fmt: skip
    finally:
        env.close()
    assert batch.size == len(examples)
    rows = zip(batch.prompt_ids.tolist(), batch.prompt_mask.tolist())
    got = [[t for t, m in zip(ids, mask) if m] for ids, mask in rows]
    assert sorted(map(tuple, got)) == sorted(tuple(p) for p, _ in examples)
    assert batch.extras["rollout_metrics"]["success_rate"] == 1.0  # every expert episode wins
    assert batch.extras["rollout_metrics"]["valid_action_rate"] == 1.0


def test_sft_lowers_the_loss_and_writes_a_checkpoint_the_trainer_loads(expert, tok, tmp_path):
    _, _, examples = expert
    model = load_causal_lm("tiny", dtype="float32")
    pad = int(tok.eos_token_id)
    with torch.no_grad():
        before = float(response_loss(model, examples, pad))
    losses = sft_train(model, examples, pad_id=pad, steps=30, lr=3e-3, batch_size=4, log_every=10,
                       compute_dtype=torch.bfloat16, stream=open("/dev/null", "w"))  # fmt: skip
    with torch.no_grad():
        after = float(response_loss(model, examples, pad))
    assert len(losses) == 30 and after < 0.7 * before
    out = save_warm_start(model, tok, tmp_path / "sft", base="tiny", meta={"steps": 30})
    assert json.loads((out / SFT_MARKER).read_text())["base"] == "tiny"
    assert check_warm_start(out, "tiny") == out

    from alignopsd.engine.run.trainer import Trainer

    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), [f"model.name={out}", f"output_dir={tmp_path / 'run'}"])
    trainer = Trainer(cfg)
    try:
        loaded = trainer.parts.policy.model.state_dict()
        for k, v in model.state_dict().items():
            assert torch.equal(loaded[k].float(), v.float()), k
        assert trainer.parts.tokenizer.chat_template == tok.chat_template
    finally:
        trainer.parts.close()


def test_bad_warm_start_fails_clearly(tmp_path):
    with pytest.raises(ValueError, match="not a checkpoint folder"):
        check_warm_start(tmp_path / "missing", "tiny")
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"")
    (other / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    with pytest.raises(ValueError, match="belongs to another model"):
        check_warm_start(other, "tiny")
    (other / SFT_MARKER).write_text(json.dumps({"base": "smollm2-135m"}))
    with pytest.raises(ValueError, match="fine-tuned from 'smollm2-135m'"):
        check_warm_start(other, "tiny")


def test_cli_rejects_a_missing_warm_start_before_loading(tmp_path, capsys, monkeypatch):
    import alignopsd.engine.commands.sft as sft

    monkeypatch.setattr(sft, "run_pipeline", lambda *a, **k: pytest.fail("pipeline started"))
    from alignopsd.engine.commands.cli import main

    rc = main(["sft", "--config", str(ROOT / "configs" / "tiny.yaml"), "--pipeline", "--warm-start",
               str(tmp_path / "nope")])  # fmt: skip
    assert rc == 2 and "not a checkpoint folder" in capsys.readouterr().err
