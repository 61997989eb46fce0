"""Supervised warm start: expert data rendered exactly as the rollout renders prompts, the loss goes down on the
tiny model, the checkpoint is what a run loads, bad warm starts fail early and clearly; easy games."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from alignopsd.engine.commands.sft import SFT_MARKER, check_warm_start, derived_config, encode_turn
from alignopsd.engine.config.schema import load_config
from alignopsd.engine.envs.alfworld.env import collect_games
from alignopsd.engine.envs.alfworld.expert import expert_turns
from alignopsd.engine.envs.alfworld.gen import game_facts, generate_games
from alignopsd.engine.envs.manager import EnvManager
from alignopsd.engine.generation.base import GenerationOutput
from alignopsd.engine.models.loading import load_causal_lm, load_tokenizer
from alignopsd.engine.policy.hf import HFPolicy
from alignopsd.engine.run.warm_start import save_warm_start, train_supervised
from alignopsd.engine.step.rollout import collect_rollouts
from alignopsd.engine.step.supervised import example_micro_batches, example_rows, supervised_step
from generator_double import GeneratorDouble

ROOT = Path(__file__).resolve().parents[2]


def _response_nll(policy: HFPolicy, examples, *, pad_id: int) -> float:
    """The mean response-token cross entropy of ``examples`` under the policy, through its own scoring (no
    gradient)."""
    ids_BT, mask_BT, length = example_rows(examples, pad_id)
    logp_BL, _ = policy.response_logprobs(ids_BT, mask_BT, length)
    return float(-logp_BL.float().sum()) / sum(len(r) for _, r in examples)


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
    return tasks, turns, [encode_turn(tok, t, 1024, eos_id=tok.eos_token_id) for t in turns]


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
        batch = collect_rollouts(
            env, Expert(), tok, tasks, group_n=1, max_prompt_length=1024, max_response_length=64, teacher_prompts=False
        )
    finally:
        env.close()
    assert batch.size == len(examples)
    rows = zip(batch.prompt_ids.tolist(), batch.prompt_mask.tolist())
    got = [[t for t, m in zip(ids, mask) if m] for ids, mask in rows]
    assert sorted(map(tuple, got)) == sorted(tuple(p) for p, _ in examples)
    assert batch.extras["rollout_metrics"]["success_rate"] == 1.0  # every expert episode wins
    assert batch.extras["rollout_metrics"]["valid_action_rate"] == 1.0


def _reference_nll(model, examples, pad: int) -> torch.Tensor:
    """The mean response-token cross entropy by the plain route: right-padded rows, full logits, torch's loss."""
    width = max(len(p) + len(r) for p, r in examples)
    ids = torch.full((len(examples), width), pad)
    att = torch.zeros_like(ids)
    lab = torch.full_like(ids, -100)
    for b, (p, r) in enumerate(examples):
        ids[b, : len(p) + len(r)] = torch.tensor(p + r)
        att[b, : len(p) + len(r)] = 1
        lab[b, len(p) : len(p) + len(r)] = torch.tensor(r)
    logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab[:, 1:].reshape(-1))


def test_example_rows_lay_out_prompts_left_and_responses_right():
    ids, mask, length = example_rows([([5, 6], [7]), ([8], [9, 10, 11])], pad_id=0)
    assert length == 3
    assert ids.tolist() == [[5, 6, 7, 0, 0], [0, 8, 9, 10, 11]]
    assert mask.tolist() == [[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]]
    with pytest.raises(ValueError, match=r"examples\[1\]: the prompt and the response"):
        example_rows([([1], [2]), ([3], [])], pad_id=0)


@pytest.mark.parametrize(("fused", "budget"), [(True, 0), (False, 0), (True, 1)])
def test_supervised_step_is_the_response_cross_entropy_and_its_gradient(expert, tok, fused, budget):
    """The backend's loss and update equal the plain route's: cross entropy over full logits of right-padded rows,
    one AdamW step at the same settings (the same clipping), in one forward or (``token_budget``) one micro-batch per
    example, whose gradients add up to the batch's. Weights are compared at 0.1 * lr (Adam's first step
    moves each weight by about lr * g / |g|, so a gradient that differs by rounding moves a weight by a fraction of
    lr), the loss and the gradient norm at 1e-5 and 1e-4 relative."""
    _, _, examples = expert
    batch, pad = examples[:3], int(tok.eos_token_id)
    ours = load_causal_lm("tiny", dtype="float32")
    ref = load_causal_lm("tiny", dtype="float32")
    policy = HFPolicy(ours, lr=1e-3, weight_decay=0.0)
    with torch.no_grad():
        want = float(_reference_nll(ref, batch, pad))
    assert _response_nll(policy, batch, pad_id=pad) == pytest.approx(want, rel=1e-5)
    assert len(example_micro_batches(batch, budget)) == (3 if budget else 1)
    out = supervised_step(policy, batch, pad_id=pad, max_grad_norm=1.0, fused=fused, token_budget=budget)
    loss = _reference_nll(ref, batch, pad)
    assert out["loss"] == pytest.approx(float(loss.detach()), rel=1e-5) and not out["skipped"]
    assert out["tokens"] == sum(len(r) for _, r in batch)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)
    loss.backward()
    assert out["grad_norm"] == pytest.approx(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)), rel=1e-4)
    opt.step()
    theirs = ref.state_dict()
    for k, v in ours.state_dict().items():  # Adam's first step moves a weight by ~lr whatever its gradient's size:
        assert (v - theirs[k]).abs().max().item() <= 0.1 * 1e-3, k  # a rounding of a tiny gradient moves it less


def test_warm_start_times_packed_against_padded_rows(expert, tok, monkeypatch):
    """Auto rows on a CPU (the policy's rows undecided): the warm start's first two steps run both ways at half scale
    (seconds injected through the trial's clock: packed rows faster here), set the faster on the policy and take it
    for the rest; the losses are the padded-only run's."""
    from alignopsd.engine.policy import lm_head
    from alignopsd.engine.step import packing_trial
    from alignopsd.kernels import native_choice

    monkeypatch.delenv(native_choice.PIN_ENV, raising=False)
    _, _, examples = expert
    pad = int(tok.eos_token_id)
    calls, real = [], lm_head.packed_forward
    monkeypatch.setattr(lm_head, "packed_forward", lambda *a: calls.append(1) or real(*a))
    losses = {}
    for packed in (None, False):
        policy = HFPolicy(load_causal_lm("tiny", dtype="float32"), lr=1e-3, weight_decay=0.0, packed=packed)

        now = [0.0]

        def clock(policy=policy, now=now):  # one read per call's start and end: end - start = that path's seconds
            now[0] += 0.5 if policy.rows.packs() else 1.0
            return now[0]

        monkeypatch.setattr(packing_trial, "clock", clock)
        losses[packed] = train_supervised(
            policy, examples, pad_id=pad, steps=4, batch_size=4, log_every=10, stream=open("/dev/null", "w")
        )
        if packed is None:
            chose = policy.rows.choice
            assert chose.packed and (chose.packed_s, chose.padded_s) == (1.0, 2.0)
            assert chose.measured_on == "the first 2 micro-batches of the warm start (8 rows), forward and backward"
            assert len(calls) == 4  # two in the trial, then every step packed
    assert calls == [1] * 4  # the padded-only run packs nothing
    assert losses[None] == pytest.approx(losses[False], rel=1e-5)


def test_sft_lowers_the_loss_and_writes_a_checkpoint_the_trainer_loads(expert, tok, tmp_path):
    _, _, examples = expert
    model = load_causal_lm("tiny", dtype="float32")
    policy = HFPolicy(model, lr=3e-3, weight_decay=0.0, warmup_steps=3)
    pad = int(tok.eos_token_id)
    before = _response_nll(policy, examples, pad_id=pad)
    losses = train_supervised(
        policy, examples, pad_id=pad, steps=30, batch_size=4, log_every=10, stream=open("/dev/null", "w")
    )
    after = _response_nll(policy, examples, pad_id=pad)
    assert len(losses) == 30 and after < 0.7 * before
    out = save_warm_start(policy, tok, tmp_path / "sft", base="tiny", meta={"steps": 30})
    assert json.loads((out / SFT_MARKER).read_text())["base"] == "tiny"
    assert json.loads((out / "config.json").read_text())["architectures"] == [type(model).__name__]
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


def _sft_argv(games: Path, out: Path, *extra: str) -> list[str]:
    return [
        "sft",
        "--config",
        str(ROOT / "configs" / "tiny.yaml"),
        "--set",
        "env.name=alfworld",
        "--set",
        f"env.data_dir={games}",
        "--set",
        "env.split=train",
        "--set",
        "env.num_games=3",
        "--set",
        "env.val_split=train",
        "--set",
        "env.val_tasks=2",
        "--set",
        "env.max_turns=8",
        "--set",
        f"output_dir={out.parent / 'run'}",
        "--out",
        str(out),
        "--steps",
        "12",
        "--batch-size",
        "4",
        "--lr",
        "3e-3",
        *extra,
    ]


def test_lora_warm_start_end_to_end(games, tok, tmp_path, capsys):
    """``alignopsd sft`` with ``model.lora``: only the adapters train (the targeted layers' merged weights move,
    nothing else does), the loss goes down, and the folder (merged weights) is what a LoRA RL run starts from."""
    from alignopsd.engine.commands.cli import main
    from alignopsd.engine.run.trainer import Trainer

    out = tmp_path / "sft"
    rc = main(
        _sft_argv(
            games,
            out,
            "--set",
            "model.lora.enabled=true",
            "--set",
            "model.lora.rank=8",
            "--set",
            "model.lora.target_modules=[q_proj,v_proj]",
        )
    )
    assert rc == 0, capsys.readouterr().err
    meta = json.loads((out / SFT_MARKER).read_text())
    assert meta["base"] == "tiny" and meta["loss_last"] < meta["loss_first"]
    base = load_causal_lm("tiny", dtype="float32").state_dict()
    tuned = load_causal_lm(str(out), dtype="float32").state_dict()
    assert set(tuned) == set(base)
    moved = {k for k in base if not torch.equal(base[k], tuned[k])}
    assert moved and all(".q_proj." in k or ".v_proj." in k for k in moved), sorted(moved)[:4]
    assert check_warm_start(out, "tiny") == out
    cfg = load_config(
        str(ROOT / "configs" / "tiny.yaml"),
        [f"model.name={out}", f"output_dir={tmp_path / 'run'}", "model.lora.enabled=true"],
    )
    trainer = Trainer(cfg)
    try:
        assert trainer.parts.policy.adapter is not None
        merged = trainer.parts.policy.hf_state_dict()
        for k in moved:
            assert torch.equal(merged[k].float(), tuned[k]), k
    finally:
        trainer.parts.close()


def test_derived_config_is_the_loaded_config_with_the_overrides():
    """The pipeline derives its RL config from the one it parsed; it equals reading the file with the overrides."""
    path = str(ROOT / "configs" / "quickstart_cpu.yaml")
    cfg = load_config(path, ["trainer.total_steps=2"])
    validation = cfg.trainer.validation.model_copy(update={"after_train": False})
    got = derived_config(cfg, model={"name": "/tmp/x/sft"}, trainer={"validation": validation}, env={"data_dir": "/d"})
    want = load_config(
        path,
        ["trainer.total_steps=2", "model.name=/tmp/x/sft", "trainer.validation.after_train=false", "env.data_dir=/d"],
    )
    from alignopsd.engine.config.dump import dump_config

    assert got == want and dump_config(got) == dump_config(want)  # the stored config too
    from alignopsd.engine.config.schema import ConfigError

    with pytest.raises(ConfigError, match="trainer.total_steps"):
        derived_config(cfg, trainer={"total_steps": 0})


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

    rc = main(
        ["sft", "--config", str(ROOT / "configs" / "tiny.yaml"), "--pipeline", "--warm-start", str(tmp_path / "nope")]
    )
    assert rc == 2 and "not a checkpoint folder" in capsys.readouterr().err
