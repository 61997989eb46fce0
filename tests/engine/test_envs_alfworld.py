"""ALFWorld on alfworld's TextWorld engine: generated games, the official-data adapter, metrics."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from alignopsd.engine.envs.alfworld import env as A
from alignopsd.engine.envs.alfworld.gen import CATEGORY, TASK_TYPES, sample_game
from alignopsd.engine.envs.alfworld.textworld import make_textworld_env, memoize_textworld_parsers
from alignopsd.engine.envs.manager import EnvManager

FIXTURE = Path(__file__).resolve().parents[1] / "assets" / "alfworld_fixture"


@pytest.fixture(scope="session")
def generated(tmp_path_factory):
    """Six generated games (one per task type) through the embedded-default cache path."""
    cache = tmp_path_factory.mktemp("alfcache")
    tasks = A.load_tasks("train", None, 0, cache_dir=cache, pool_size=6)
    return cache, tasks


def _walkthrough(gamefile: str) -> list[str]:
    return json.loads(Path(gamefile).read_text())["walkthrough"]


def test_generated_split_layout_and_cache(generated):
    cache, tasks = generated
    assert sorted(t.category for t in tasks) == sorted(CATEGORY.values())
    for t in tasks:
        game = Path(t.payload["gamefile"])
        assert game.name == "game.tw-pddl" and "json_2.1.1/train" in str(game)
        traj = json.loads((game.parent / "traj_data.json").read_text())
        assert traj["task_type"] in TASK_TYPES and CATEGORY[traj["task_type"]] == t.category
        data = json.loads(game.read_text())
        assert data["solvable"] and 0 < len(data["walkthrough"]) <= 50
        assert "(define (domain alfred)" in data["pddl_domain"] and "UNKNOWN GOAL" not in data["grammar"]
        assert t.data_source == "text" and traj["task_type"] in t.payload["gamefile"]
    marker = next(cache.glob("train-*/COMPLETE"))
    stamp = marker.stat().st_mtime_ns
    again = A.load_tasks("train", 3, 7, cache_dir=cache, pool_size=6)  # cached: no regeneration
    assert marker.stat().st_mtime_ns == stamp
    assert [t.key for t in again] == [t.key for t in A.load_tasks("train", 3, 7, cache_dir=cache, pool_size=6)]
    assert {t.key for t in again} <= {t.key for t in tasks}


def test_generator_is_seeded():
    for tt in TASK_TYPES:
        a, b = sample_game(tt, 123), sample_game(tt, 123)
        assert a == b and a is not None and a["traj_data"]["task_type"] == tt
        assert sample_game(tt, 124)["problem"] != a["problem"]
    with pytest.raises(ValueError, match="task_type"):
        sample_game("juggle", 0)


def test_expert_wins_random_policy_mostly_loses(generated):
    _, tasks = generated
    env = A.AlfWorldEnv()
    random_wins = 0
    for t in tasks:
        obs, info = env.reset(t, seed=0)
        r = None
        assert info["task"] and info["task"] in obs and "help" in info["admissible_actions"]
        for action in _walkthrough(t.payload["gamefile"]):
            assert action in info["admissible_actions"]
            r = env.step(action)
            info = r.info
        assert r.done and info["won"] and r.reward == 10.0, t.key
        rng = random.Random(0)
        for _ in range(2):
            obs, info = env.reset(t, seed=1)
            r = A.StepResult(obs, 0.0, False, info)
            n_steps = 0
            while not r.done:
                r = env.step(rng.choice(info["admissible_actions"]))
                info, n_steps = r.info, n_steps + 1
            assert n_steps <= 50
            random_wins += int(info["won"])
    assert random_wins <= 3, f"a random admissible policy won {random_wins}/12 episodes"


def test_speedups_do_not_change_the_engine(generated):
    _, tasks = generated

    def play(fast: bool):
        memoize_textworld_parsers(fast)
        env = make_textworld_env(fast=fast)
        out, rng = [], random.Random(5)
        for t in tasks[:2]:
            env.load(t.payload["gamefile"])
            s = env.reset()
            out.append((s["feedback"], s["admissible_commands"]))
            for _ in range(12):
                s, _, _ = env.step(rng.choice(s["admissible_commands"]))
                out.append((s["feedback"], s["admissible_commands"], s["won"]))
        return out

    try:
        assert play(True) == play(False)
    finally:
        memoize_textworld_parsers(True)


def test_official_adapter_on_fixture(monkeypatch):
    train = A.load_tasks("train", None, 0, data_dir=FIXTURE)
    assert len(train) == 2  # the movable-receptacle and the unsolvable game are skipped
    assert all("movable" not in t.payload["gamefile"] and "unsolvable" not in t.payload["gamefile"] for t in train)
    assert [t.payload["source"] for t in train] == ["official", "official"]
    assert len(A.load_tasks("valid_seen", None, 0, data_dir=FIXTURE)) == 1
    assert A.load_tasks("eval_out_of_distribution", None, 0, data_dir=FIXTURE)[0].category == "cool"
    monkeypatch.setenv("ALFWORLD_DATA", str(FIXTURE))
    assert [t.key for t in A.load_tasks("train", None, 0)] == [t.key for t in train]
    with pytest.raises(ValueError, match="data_dir"):
        A.load_tasks("train", None, 0, data_dir=FIXTURE / "json_2.1.1")
    with pytest.raises(ValueError, match="split"):
        A.load_tasks("dev", None, 0, data_dir=FIXTURE)


@pytest.mark.slow
def test_manager_plays_fixture_games_in_workers():
    tasks = A.load_tasks("valid_seen", None, 0, data_dir=FIXTURE) + A.load_tasks("train", 1, 0, data_dir=FIXTURE)
    with EnvManager("alfworld", num_workers=2, step_timeout=60, data_dir=str(FIXTURE)) as mgr:
        obs, infos = mgr.reset(tasks, 2, seed=0)
        first = list(obs)
        assert obs[0] == obs[1] and "Your task is to:" in obs[0] and "'help'" not in obs[0]
        walks = [_walkthrough(t.payload["gamefile"]) for t in tasks]
        dones = [False] * 4
        while not all(dones):
            resp = []
            for i, info in enumerate(infos):
                w = walks[i // 2]
                if i % 2 == 0:
                    a = w[info["step"]].upper() if info["step"] < len(w) else "look"
                    resp.append(f"<think>follow the plan</think><action>{a}</action>")
                else:
                    resp.append("<think>hmm</think><action>fly to the moon</action>")
            obs, rew, dones, infos = mgr.step(resp)
            assert [i["is_action_valid"] for i, d in zip(infos, dones)][1::2] == [False, False]
            if dones[0] and dones[2]:
                break
        res = mgr.episode_results()
        assert res[0]["won"] and res[2]["won"] and res[0]["reward"] == 10.0
        assert res[0]["steps"] == len(walks[0]) and infos[0]["gamefile"] == tasks[0].payload["gamefile"]
        assert infos[1]["observation"] == "Nothing happens." and not res[1]["won"]
        assert infos[0]["category"] == "look" and infos[2]["category"] == tasks[1].category
        assert mgr.metrics()["failed_episodes"] == 0
        again, _ = mgr.reset(tasks, 2, seed=0)
        assert again == first  # same seed, same tasks -> same observations


def test_max_steps_and_category_success():
    t = A.load_tasks("valid_unseen", None, 0, data_dir=FIXTURE)[0]
    env = A.AlfWorldEnv(max_steps=3)
    env.reset(t, 0)
    done = [env.step("look").done for _ in range(3)]
    assert done == [False, False, True]
    res = [{"category": "pick", "won": True}, {"category": "pick", "won": False},
           {"category": "pick_two_obj_and_place", "won": True}, {"category": "heat", "won": False}]  # fmt: skip
    assert A.category_success(res) == {"Pick": 50.0, "Heat": 0.0, "Pick2": 100.0, "All": 50.0}
    with pytest.raises(ValueError, match="category"):
        A.category_success([{"category": "juggle", "won": True}])
    with pytest.raises(ValueError, match="max_steps"):
        A.AlfWorldEnv(max_steps=0)
