"""A node lost and brought back: two torchrun agents on this machine as two nodes (``--nnodes=2 --nproc-per-node=1``,
c10d rendezvous on 127.0.0.1, ``--max-restarts``, ``--resume auto``); one node's agent and its rank are SIGKILLed in
step 2, the test starts that agent again (a node that rebooted, or that the scheduler replaced), and the run ends
bit-identical to an uninterrupted one, every step logged once.

The command line is the real one (tests/engine/sharded_run.py, as in test_restarts.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import learn_helpers as lh
import pytest
import torch
from alignopsd.engine.checkpoint import checkpoint as ck
from alignopsd.engine.observe.metrics import read_metrics
from alignopsd.engine.run import attempts
from alignopsd.engine.step import episodes

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
RUNNER = str(Path(__file__).with_name("sharded_run.py"))
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
GUESS = [a for kv in lh.GUESS_OVERRIDES for a in ("--set", kv)]
STEPS = 3
DEADLINE_S = 420  # the whole run, both nodes
# an elastic run (--nnodes=1:2) after a node is lost for good: the survivor's agent leaves the finished round and waits
# until the dead node's heartbeat is keep_alive_interval x keep_alive_max_attempt old (torch's defaults 5 s x 3), then
# opens the next round alone and closes it last_call_timeout (default 30 s) after min_nodes joined; the same wait at
# the first launch is the window in which the second node must join to be in the first round
SHRINK_CONF = "last_call_timeout=20,keep_alive_interval=2,keep_alive_max_attempt=3"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _agent(out: Path, port: int, name: str, *extra: str, kill: bool = False, nnodes: str = "2") -> subprocess.Popen:
    """One node: a torchrun agent with one worker (its output in ``out/../<name>.log``); ``nnodes`` "1:2": elastic,
    with the rendezvous settings of :data:`SHRINK_CONF`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(__file__).parent)])}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ALIGNOPSD_TEST_KILL_NODE"):
        env.pop(k, None)
    if kill:
        env["ALIGNOPSD_TEST_KILL_NODE"] = "1"
    # torch 2.13's agents share one TCP store for the workers, and a node that joins again meets a store that never
    # tells it the workers' address (the survivor, rank 0 of the rendezvous, publishes it once): each round needs its
    # own bootstrap store, as the README says for a run whose nodes may come back
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    cmd = [
        TORCHRUN,
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        *([f"--rdzv-conf={SHRINK_CONF}"] if nnodes != "2" else []),
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={out.name}",
        "--local-addr=127.0.0.1",
        "--max-restarts=3",
        RUNNER,
        "--config",
        TINY,
        *GUESS,
        "--set",
        "algorithm.estimator=grpo",
        "--set",
        f"trainer.total_steps={STEPS}",
        "--set",
        "trainer.checkpoint.save_freq=1",
        "--set",
        "trainer.checkpoint.keep_last=5",
        "--set",
        "trainer.restarts.backoff_s=1",
        "--set",
        f"output_dir={out}",
        "--resume",
        "auto",
        *extra,
    ]
    log = open(out.parent / f"{out.name}-{name}.log", "ab")  # noqa: SIM115 - the agent's, closed with it
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def _two_nodes(out: Path, *extra: str, kill: bool = False, nnodes: str = "2") -> tuple[int, int]:
    """Node a (the rendezvous' host: started first) and node b; with ``kill``, node b's agent and rank die in step
    2, and node b is started again once they are gone, except in an elastic run (``nnodes`` "1:2"), where it never
    comes back. Returns the exit statuses of a and of b's last agent."""
    port = _free_port()
    a = _agent(out, port, "a", *extra, nnodes=nnodes)
    deadline = time.monotonic() + DEADLINE_S
    while not _listening(port):
        assert a.poll() is None and time.monotonic() < deadline, "node a's agent did not start"
        time.sleep(0.2)
    b = _agent(out, port, "b", *extra, kill=kill, nnodes=nnodes)
    restarted = not kill or nnodes != "2"
    try:
        while a.poll() is None or b.poll() is None:
            assert time.monotonic() < deadline, f"the run did not end in {DEADLINE_S} s"
            if not restarted and b.poll() is not None:
                assert b.returncode == -9, b.returncode  # SIGKILLed with its rank
                b = _agent(out, port, "b", *extra, kill=True)  # the marker file stops a second fault
                restarted = True
            time.sleep(0.5)
        return a.returncode, b.returncode
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
def test_a_node_killed_and_started_again_ends_bit_identical(tmp_path):
    straight, healed = tmp_path / "straight", tmp_path / "healed"
    assert _two_nodes(straight) == (0, 0), (tmp_path / "straight-a.log").read_text()[-3000:]
    marker = tmp_path / "killed"
    got = _two_nodes(healed, "--kill-node-at", f"2:{marker}", kill=True)
    logs = "".join((tmp_path / f"healed-{n}.log").read_text(errors="replace")[-3000:] for n in "ab")
    assert got == (0, 0) and marker.exists(), logs
    events = [json.loads(line) for line in (healed / attempts.ATTEMPTS_FILE).read_text().splitlines()]
    assert [e["event"] for e in events if e["event"] != "failure"] == ["start", "start"], events
    assert all(e["kind"] == "peer" for e in events if e["event"] == "failure"), events  # the survivor saw it die
    assert [r["step"] for r in read_metrics(healed / "metrics.jsonl")] == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        wa = ck.load_weights(straight / "checkpoints" / ck.step_dir_name(step))
        wb = ck.load_weights(healed / "checkpoints" / ck.step_dir_name(step))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), step


def _audited_tasks(out: Path, step: int) -> tuple[int, dict[int, str]]:
    """(the world size, {task id in the step's batch: task key}) of one step, from the audit's files of every rank
    (engine/observe/audit.py: each data-parallel rank writes the turns of its own tasks); a task id in two ranks'
    files fails."""
    files = sorted((out / "audit").glob(f"step_{step:06d}.rank*.jsonl"))
    seen: dict[int, tuple[int, str]] = {}
    worlds = set()
    for f in files:
        recs = [json.loads(line) for line in f.read_text().splitlines()]
        worlds.add(recs[0]["world_size"])
        assert not recs[0]["skipped"], f"step {step}: the update was skipped; its audit names no task"
        for r in recs[1:]:
            if r["kind"] == "turn":
                assert seen.setdefault(r["task"], (r["rank"], r["task_key"])) == (r["rank"], r["task_key"]), (step, r)
    (world,) = worlds
    assert sorted(int(f.name.split(".rank")[1].split(".")[0]) for f in files) == list(range(world)), files
    return world, {task: key for task, (_, key) in seen.items()}


@pytest.mark.slow
def test_a_node_lost_for_good_the_survivor_finishes_alone_each_sample_once(tmp_path):
    """Elastic ``--nnodes=1:2``: node b's agent and rank are SIGKILLed in step 2 and never come back; node a's agent
    restarts its worker in a round of its own (SHRINK_CONF), which resumes at data-parallel size 1 from step 1's
    checkpoint (written by two ranks) and finishes. The data order is the engine's: step s's ``tasks_per_step`` tasks
    (engine/step/episodes.py tasks_for_step at world size 1; a rank takes its slice), so each step's audited task ids
    are 0..n-1 once over its ranks, with the task keys of that order: every position of the order is seen once."""
    out, marker = tmp_path / "shrunk", tmp_path / "killed"
    got = _two_nodes(out, "--kill-node-at", f"2:{marker}", kill=True, nnodes="1:2")
    logs = "".join((tmp_path / f"shrunk-{n}.log").read_text(errors="replace")[-3000:] for n in "ab")
    assert got == (0, -9) and marker.exists(), logs
    events = [json.loads(line) for line in (out / attempts.ATTEMPTS_FILE).read_text().splitlines()]
    assert [e["event"] for e in events if e["event"] != "failure"] == ["start", "start"], events
    assert all(e["kind"] == "peer" and e["rank"] == 0 for e in events if e["event"] == "failure"), events
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(1, STEPS + 1))
    ov = dict(kv.split("=") for kv in lh.GUESS_OVERRIDES)
    tasks = lh.load_tasks("train", int(ov["env.num_games"]))
    per = int(ov["env.tasks_per_step"])
    for step in range(1, STEPS + 1):
        world, keys = _audited_tasks(out, step)
        assert world == (2 if step == 1 else 1), (step, world)
        assert sorted(keys) == list(range(per)), (step, keys)
        expected = [t.key for t in episodes.tasks_for_step(tasks, step - 1, per, seed=0)]
        assert [keys[i] for i in range(per)] == expected, (step, keys, expected)
