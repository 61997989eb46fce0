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

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
RUNNER = str(Path(__file__).with_name("sharded_run.py"))
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
GUESS = [a for kv in lh.GUESS_OVERRIDES for a in ("--set", kv)]
STEPS = 3
DEADLINE_S = 420  # the whole run, both nodes


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _agent(out: Path, port: int, name: str, *extra: str, kill: bool = False) -> subprocess.Popen:
    """One node: a torchrun agent with one worker (its output in ``out/../<name>.log``)."""
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
        "--nnodes=2",
        "--nproc-per-node=1",
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
        "trainer.save_freq=1",
        "--set",
        "trainer.keep_last=5",
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


def _two_nodes(out: Path, *extra: str, kill: bool = False) -> tuple[int, int]:
    """Node a (the rendezvous' host: started first) and node b; with ``kill``, node b's agent and rank die in step
    2 and node b is started again once they are gone. Returns the exit statuses of a and of b's last agent."""
    port = _free_port()
    a = _agent(out, port, "a", *extra)
    deadline = time.monotonic() + DEADLINE_S
    while not _listening(port):
        assert a.poll() is None and time.monotonic() < deadline, "node a's agent did not start"
        time.sleep(0.2)
    b = _agent(out, port, "b", *extra, kill=kill)
    restarted = not kill
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
