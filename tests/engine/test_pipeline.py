"""The quickstart pipeline's session (engine/run/session.py, engine/run/pipeline.py): the RL run continues from the
warm-started policy in memory and computes what it computes after loading the warm start's folder back; the
optimizer is started afresh through the policy backend; the environment brings its own expert data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from alignopsd.engine.config.schema import load_config
from alignopsd.engine.envs.manager import EnvManager
from alignopsd.engine.envs.registry import expert_data_of
from alignopsd.engine.run.session import open_session
from alignopsd.engine.run.trainer import Trainer
from alignopsd.engine.run.warm_start import save_warm_start, train_supervised, warm_start_optimizer
from learn_helpers import register_guess_env

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
RUN = [
    "generation.backend=choice",
    "env.name=guess",
    "env.max_turns=2",
    "env.history_length=1",
    "env.group_n=4",
    "env.tasks_per_step=2",
    "env.num_games=4",
    "env.val_tasks=2",
    "trainer.total_steps=2",
    "trainer.validation.before_train=false",
    "trainer.validation.after_train=false",
    "trainer.logging.report=false",
]
COMPARED = ("actor/", "loss", "logp", "kl", "episode/")  # metric names (prefixes or parts) of what the step computed


def _warm_started(tmp_path: Path):
    """A session of the tiny model warm-started for 3 supervised steps on made-up examples, its folder written."""
    register_guess_env()
    cfg = load_config(TINY, [*RUN, f"output_dir={tmp_path / 'base'}"])
    session = open_session(cfg, optim=warm_start_optimizer(3e-3, 3))
    g = torch.Generator().manual_seed(0)
    examples = [
        (torch.randint(5, 200, (9,), generator=g).tolist(), torch.randint(5, 200, (4,), generator=g).tolist())
        for _ in range(4)
    ]
    with open(os.devnull, "w") as quiet:
        losses = train_supervised(session.policy, examples, pad_id=session.ids.pad, steps=3, batch_size=2, stream=quiet)
    assert losses[-1] < losses[0]
    folder = save_warm_start(session.policy, session.tokenizer, tmp_path / "sft", base="tiny", meta={"steps": 3})
    return session, folder


def _second_step(trainer: Trainer) -> dict[str, float]:
    """What the run's second step computed (its weights are the first update's: the optimizer's start shows)."""
    last = trainer.fit()
    return {
        k: v
        for k, v in last.items()
        if any(part in k for part in COMPARED) and "time" not in k and not k.startswith("memory/")
    }


def test_the_in_memory_handoff_computes_what_the_disk_round_trip_computes(tmp_path):
    session, folder = _warm_started(tmp_path)
    try:
        mem_cfg = load_config(TINY, [*RUN, f"model.name={folder}", f"output_dir={tmp_path / 'mem'}"])
        rl = session.for_run(mem_cfg)
        assert rl.policy is session.policy and rl.policy.steps == 0  # the optimizer started afresh
        in_memory = _second_step(Trainer.from_session(rl))
    finally:
        session.close()
    disk_cfg = load_config(TINY, [*RUN, f"model.name={folder}", f"output_dir={tmp_path / 'disk'}"])
    from_disk = _second_step(Trainer(disk_cfg))
    assert any("loss" in k for k in in_memory) and any("logp" in k or "kl" in k for k in in_memory), sorted(in_memory)
    assert in_memory.keys() == from_disk.keys()
    for k, v in from_disk.items():
        assert in_memory[k] == pytest.approx(v, rel=1e-6, abs=1e-7), k
    # the checkpoint the in-memory run wrote names the folder as its model, as a run started from it would
    import json

    state = json.loads(next((tmp_path / "mem" / "checkpoints").glob("*/trainer_state.json")).read_text())
    assert state["run_config"]["model"]["name"] == str(folder)


def test_reset_optimizer_starts_over_as_a_fresh_policy_does():
    """After steps, ``reset_optimizer`` gives the optimizer a policy built from the same weights starts with: the same
    next update."""
    from alignopsd.engine.models.loading import load_causal_lm
    from alignopsd.engine.policy.hf import HFPolicy

    ids = torch.randint(5, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)

    def update(policy: HFPolicy) -> None:
        logp, _ = policy.response_logprobs(ids, mask, 4, grad=True)
        (-logp.mean()).backward()
        policy.optimizer_step(1.0)

    trained = HFPolicy(load_causal_lm("tiny", dtype="float32"), lr=1e-2, weight_decay=0.0, warmup_steps=0)
    for _ in range(2):
        update(trained)
    fresh = HFPolicy(load_causal_lm("tiny", dtype="float32"), lr=1e-3, weight_decay=0.1, warmup_steps=3)
    fresh.load_hf_state_dict(trained.hf_state_dict())
    trained.reset_optimizer(lr=1e-3, weight_decay=0.1, warmup_steps=3)
    assert trained.steps == 0 and not trained.optimizer.state
    update(trained)
    update(fresh)
    for (k, a), b in zip(trained.hf_state_dict().items(), fresh.hf_state_dict().values()):
        assert torch.equal(a, b), k
    with pytest.raises(ValueError, match="lr: must be > 0"):
        trained.reset_optimizer(lr=0.0, weight_decay=0.0, warmup_steps=0)


def test_an_environment_without_expert_data_is_refused_by_name():
    assert callable(expert_data_of("alfworld"))
    with pytest.raises(ValueError, match="environment 'codeword' brings none.*alfworld"):
        expert_data_of("codeword")


def test_sft_refuses_an_environment_without_expert_data_before_loading(capsys):
    from alignopsd.engine.commands.cli import main

    assert main(["sft", "--config", TINY, "--set", "env.name=codeword"]) == 2
    assert "brings none" in capsys.readouterr().err


def test_step_limit_holds_inside_the_block_only():
    register_guess_env()
    env = EnvManager("guess", num_workers=0, max_steps=1)
    try:
        tasks = env.task_source("train", 1, 0)
        with env.step_limit(2):
            env.reset(tasks)
            _, _, done, _ = env.step(["<action>right</action>"])
            assert done == [False]
        assert env.max_steps == 1
        env.reset(tasks)
        assert env.step(["<action>right</action>"])[2] == [True]
        with pytest.raises(ValueError, match="max_steps"):
            with env.step_limit(0):
                pass
    finally:
        env.close()


@pytest.mark.slow
def test_the_pipeline_from_a_given_warm_start_evaluates_and_trains_its_policy(tmp_path, capsys):
    """``sft --pipeline --warm-start DIR``: the base model evaluated, the given folder's policy built once (a generator
    over it), evaluated and trained; the RL run's checkpoint names the folder as its model."""
    import json

    from alignopsd.engine.commands.cli import main
    from alignopsd.engine.envs.alfworld.gen import generate_games
    from alignopsd.engine.models.loading import load_causal_lm, load_tokenizer
    from alignopsd.engine.policy.hf import HFPolicy

    games = tmp_path / "games"
    for split, seed in (("train", 5), ("valid_seen", 6)):
        generate_games(2, games, seed=seed, split=split, task_types=("pick_and_place_simple",), max_steps=8, small=True)
    policy = HFPolicy(load_causal_lm("tiny", dtype="float32"), ddp=False)
    folder = save_warm_start(policy, load_tokenizer("tiny"), tmp_path / "given", base="tiny", meta={"steps": 0})
    sets = [
        "env.name=alfworld",
        f"env.data_dir={games}",
        "env.split=train",
        "env.num_games=2",
        "env.val_split=valid_seen",
        "env.val_tasks=1",
        "env.max_turns=8",
        "env.group_n=2",
        "env.tasks_per_step=1",
        "generation.max_response_length=8",
        "env.teacher_max_response_length=8",
        "trainer.total_steps=1",
        "trainer.logging.report=false",
        f"output_dir={tmp_path / 'run'}",
    ]
    argv = ["sft", "--config", TINY, "--pipeline", "--warm-start", str(folder)]
    assert main([*argv, *[a for s in sets for a in ("--set", s)]]) == 0
    out = capsys.readouterr().out
    for row in ("| base (tiny) |", "| after warm start |", "| after 1 RL steps |"):
        assert row in out, out[-2000:]
    state = json.loads(next((tmp_path / "run" / "checkpoints").glob("*/trainer_state.json")).read_text())
    assert state["run_config"]["model"]["name"] == str(folder)
