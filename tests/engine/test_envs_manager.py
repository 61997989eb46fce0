"""EnvManager: sibling groups, seeding, validity flags, and fault tolerance (raise / hang / dead worker)."""

from __future__ import annotations

import pytest
from alignopsd.engine.envs.manager import EnvManager, load_tasks

WAIT = "<think>the word is hidden, wait</think><action>wait</action>"


def _say(word: str) -> str:
    return f"<think>I remember it</think><action>say {word}</action>"


def _play_perfect(mgr: EnvManager, tasks, group_n: int, seed: int):
    obs0, infos0 = mgr.reset(tasks, group_n, seed)
    trace = [list(obs0)]
    n = len(obs0)
    for t in range(4):
        if t < 3:
            resp = [WAIT] * n
        else:
            resp = [_say(tasks[i // group_n].payload["code"]) for i in range(n)]
        obs, rew, done, infos = mgr.step(resp)
        trace.append(list(obs))
    return trace, rew, done, infos


@pytest.fixture(scope="module")
def inproc():
    mgr = EnvManager("codeword", num_workers=0)
    yield mgr
    mgr.close()


def test_groups_seeding_and_rewards(inproc):
    tasks = load_tasks("codeword", "train", 3, seed=5)
    assert [t.key for t in tasks] == [t.key for t in load_tasks("codeword", "train", 3, seed=5)]
    assert [t.key for t in tasks] != [t.key for t in load_tasks("codeword", "train", 3, seed=6)]
    trace, rew, done, infos = _play_perfect(inproc, tasks, 2, seed=1)
    assert len(trace[0]) == 6
    assert trace[0][0] == trace[0][1] and trace[0][0] != trace[0][2]  # siblings consecutive, same start
    assert tasks[0].payload["code"] in trace[0][0]
    assert rew == [10.0] * 6 and all(done)
    assert all(i["won"] and i["is_action_valid"] and not i["failed"] for i in infos)
    assert [i["task_key"] for i in infos] == [t.key for t in tasks for _ in range(2)]
    assert infos[0]["category"] == "codeword" and infos[0]["data_source"] == "text"
    trace2, *_ = _play_perfect(inproc, tasks, 2, seed=1)
    assert trace2 == trace  # same seed -> same observations
    # history (length 4 for the toy) keeps the code word visible at the answer turn
    assert tasks[0].payload["code"] in trace[3][0] and "step 4" in trace[3][0]


def test_malformed_actions_are_invalid_never_raise(inproc):
    tasks = load_tasks("codeword", "train", 1, seed=0)
    bad = [
        "wait",  # no tags
        "<think>x</think><action>wait</action><action>wait</action>",  # two actions
        "<think>x</think><action>dance wildly</action>",  # unknown command
        "<think>我想等待</think><action>等待</action>",  # Chinese
        "",  # empty
        None,  # not a string
        "<think>x</think><action>WAIT</action>",  # upper-case: lower-cased, valid
    ]
    obs, infos = inproc.reset(tasks, len(bad), 0)
    before = inproc.metrics()["invalid_actions"]
    obs, rew, done, infos = inproc.step(bad)
    assert [i["is_action_valid"] for i in infos] == [False] * 6 + [True]
    assert not any(done) and rew == [0.0] * 7
    assert infos[2]["action"] == "dance wildly" and "Nothing happens." in infos[2]["observation"]
    assert infos[0]["observation"] == "Nothing happens."  # malformed -> no-op step, still a step
    assert all(i["step"] == 1 for i in infos)
    assert inproc.metrics()["invalid_actions"] - before == 6
    with pytest.raises(ValueError, match="responses"):
        inproc.step([WAIT])


def test_bad_arguments():
    with pytest.raises(ValueError, match="env_name"):
        EnvManager("nope", num_workers=0)
    with pytest.raises(ValueError, match="num_workers"):
        EnvManager("codeword", num_workers=-1)
    mgr = EnvManager("codeword", num_workers=0)
    with pytest.raises(ValueError, match="group_n"):
        mgr.reset(load_tasks("codeword", "train", 1), 0, 0)
    with pytest.raises(ValueError, match="before reset"):
        mgr.step([WAIT])


@pytest.mark.slow
def test_faults_are_contained_and_reported(faulty_env):
    """One worker pool; episodes raise, hang past the timeout, or kill their worker mid-batch."""
    healthy = faulty_env.tasks(None, 0, n=2, seed=0)
    tasks = healthy[:1] + faulty_env.tasks("raise", 1, seed=1) + faulty_env.tasks("hang", 1, seed=2)
    tasks += faulty_env.tasks("die", 2, seed=3) + healthy[1:] + faulty_env.tasks("raise", -1, seed=4)
    group = 2
    with EnvManager(faulty_env.NAME, num_workers=2, step_timeout=1.5, hang_seconds=60) as mgr:
        obs, infos = mgr.reset(tasks, group, seed=0)
        n = len(obs)
        # the reset fault fails its two episodes right away
        assert [i["failed"] for i in infos][-2:] == [True, True] and "injected fault" in infos[-1]["failure"]
        codes = [tasks[i // group].payload["code"] for i in range(n)]
        for t in range(4):
            resp = [WAIT] * n if t < 3 else [_say(c) for c in codes]
            obs, rew, done, infos = mgr.step(resp)
        assert all(done)
        failed = [i["failed"] for i in infos]
        assert failed == [False, False, True, True, True, True, True, True, False, False, True, True]
        assert "injected fault at step 1" in infos[2]["failure"]
        assert "timed out" in infos[4]["failure"]
        assert "died" in infos[6]["failure"]
        assert [r for r, f in zip(rew, failed) if not f] == [10.0] * 4
        assert all(infos[i]["won"] for i in (0, 1, 8, 9))
        m = mgr.metrics()
        assert m["failed_episodes"] == 8 and m["timeouts"] == 2 and m["worker_deaths"] >= 1
        assert m["env_errors"] >= 4 and m["worker_restarts"] >= 3
        healthy_trace = [obs[i] for i in (0, 1, 8, 9)]
        # the healthy episodes saw exactly what a fault-free run shows
        clean, *_ = _play_perfect(mgr, healthy, group, seed=0)
        assert clean[-1] == healthy_trace
        assert mgr.metrics()["failed_episodes"] == 8


def _play(mgr: EnvManager, tasks, group: int):
    obs, infos = mgr.reset(tasks, group, seed=0)
    codes = [tasks[i // group].payload["code"] for i in range(len(obs))]
    for t in range(4):
        resp = [WAIT] * len(obs) if t < 3 else [_say(c) for c in codes]
        obs, rew, done, infos = mgr.step(resp)
    return obs, rew, done, infos


def test_non_finite_reward_fails_its_episode_and_is_counted(inproc, faulty_env):
    tasks = faulty_env.tasks(None, 0, n=1, seed=0) + faulty_env.tasks("nan", 1, seed=1)
    with EnvManager(faulty_env.NAME, num_workers=0) as mgr:
        before = mgr.metrics()
        obs, rew, done, infos = _play(mgr, tasks, 2)
        m = mgr.metrics()
    assert [i["failed"] for i in infos] == [False, False, True, True]
    assert "non-finite reward" in infos[2]["failure"] and infos[2]["step"] == 2  # failed at its second step
    assert rew == [10.0, 10.0, 0.0, 0.0] and all(done)
    assert m["nonfinite_rewards"] - before["nonfinite_rewards"] == 2
    assert m["failed_episodes"] - before["failed_episodes"] == 2
    assert [r["reward"] for r in mgr.episode_results()] == [10.0, 10.0, 0.0, 0.0]


@pytest.mark.slow
def test_hanging_siblings_cost_about_one_timeout_per_round(faulty_env):
    """All four siblings of one task hang at step 1; dealt round robin, they sit on four different workers and
    time out together: the round costs one timeout (before: one per sibling, 4), each fails on its own timeout,
    the healthy work queued behind them is re-dispatched to the relaunched workers, and every healthy episode
    plays to the end exactly as without the fault."""
    hang = faulty_env.tasks("hang", 1, seed=2)
    healthy = faulty_env.tasks(None, 0, n=3, seed=0)
    group = 4
    with EnvManager(faulty_env.NAME, num_workers=4, step_timeout=1.0, hang_seconds=60) as mgr:
        obs, rew, done, infos = _play(mgr, hang + healthy, group)
        m = mgr.metrics()
        assert all(done) and len(infos) == 16  # every episode is accounted for
        assert [i["failed"] for i in infos] == [True] * 4 + [False] * 12
        assert all("timed out" in infos[i]["failure"] and infos[i]["step"] == 2 for i in range(4))
        assert rew[4:] == [10.0] * 12 and all(i["won"] for i in infos[4:])
        assert m["timeouts"] == 4 and m["failed_episodes"] == 4
        assert m["timeout_waves"] == 1  # one per sibling before: 4
        assert m["redispatched_ops"] == 12 and m["worker_restarts"] == 4
        assert m["rebuilt_episodes"] == 12  # the healthy episodes of the killed workers, rebuilt by replay
        clean, *_ = _play_perfect(mgr, healthy, group, seed=0)
        assert clean[-1] == obs[4:]


@pytest.mark.slow
def test_worker_relaunched_with_nothing_to_do_serves_the_next_batch(faulty_env):
    """The hung worker hosted only the hung episode: it is relaunched with no work, still starting when the
    round ends; the next batch's ops sent to it wait for its start and run normally."""
    hang, healthy = faulty_env.tasks("hang", 1, seed=2), faulty_env.tasks(None, 0, n=2, seed=0)
    with EnvManager(faulty_env.NAME, num_workers=2, step_timeout=1.0, hang_seconds=60) as mgr:
        mgr.reset(hang + healthy[:1], 1, seed=0)
        mgr.step([WAIT, WAIT])
        _, _, _, infos = mgr.step([WAIT, WAIT])
        assert [i["failed"] for i in infos] == [True, False]
        assert mgr.metrics()["redispatched_ops"] == 0 and mgr.metrics()["worker_restarts"] == 1
        obs, rew, done, infos = _play(mgr, healthy, 2)  # episodes on both workers
        assert rew == [10.0] * 4 and not any(i["failed"] for i in infos)
        assert mgr.metrics()["timeouts"] == 1
