"""attempts.jsonl survives itself (engine/run/attempts.py): a torn write does not swallow the record after it, a line
whose fields have the wrong type is skipped and said instead of breaking the rule, concurrent appends stay whole
lines, and a rank that only saw a peer die (gloo's own words included) records a peer failure."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from alignopsd.engine.config.trainer_section import RestartsConfig
from alignopsd.engine.run import attempts, restarts

TWO_IN_A_ROW = RestartsConfig(window_s=0, backoff_s=0)  # the rule at its shortest: two attempts in a row stop


def _stops(out_dir, said: list[str]) -> bool:
    """Whether the restart rule stops a restart now (every start recorded without config, code: compare none)."""
    pasts = restarts.past_attempts(attempts.read_attempt_log(out_dir).records)
    msg = restarts.repeated_failure(pasts, TWO_IN_A_ROW, out_dir / attempts.ATTEMPTS_FILE)
    said.extend([] if msg is None else [msg])
    return msg is not None


BOOM = ValueError("targets: 17 ids fall in no vocabulary shard of 4096")
# what a surviving rank's collective raises under gloo (torch 2.x) when its peer died or stopped answering
GLOO_CLOSED = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:18087. This is "
    "typically caused by a remote worker crashing."
)
GLOO_RESET = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:589] Read error [10.0.0.2]:6011: Connection reset by peer"
)
GLOO_TIMEOUT = "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv"


def _lines(tmp_path) -> list[str]:
    return (tmp_path / attempts.ATTEMPTS_FILE).read_text().splitlines()


def test_a_torn_write_keeps_the_record_written_after_it_and_is_said(tmp_path):
    assert attempts.record_start(tmp_path) == 1
    attempts.record_failure(tmp_path, 0, 3, BOOM)
    with open(tmp_path / attempts.ATTEMPTS_FILE, "a") as f:
        f.write('{"cause": "ValueError: targ')  # a kill (or a full disk) cut this write before its newline
    assert attempts.record_start(tmp_path) == 2  # appended to the torn line: read all the same
    attempts.record_failure(tmp_path, 1, 3, BOOM)
    assert len(_lines(tmp_path)) == 4
    log = attempts.read_attempt_log(tmp_path)
    assert [(r["event"], r.get("attempt")) for r in log.records] == [
        ("start", 1),
        ("failure", None),
        ("start", 2),
        ("failure", None),
    ]
    assert log.damage == ["line 3: a torn record (27 characters) before a whole one, which is kept"]
    said: list[str] = []
    assert _stops(tmp_path, said) and said[0].startswith("attempts 1 and 2 both failed at step 3")  # saw attempt 2
    assert log.said(tmp_path) == f"{tmp_path}: 1 damaged line(s) skipped ({log.damage[0]})"


def test_a_line_with_a_wrong_field_is_skipped_and_said_not_raised(tmp_path, monkeypatch):
    """``"step": null`` is valid JSON: the rule once read it with ``int(...)`` outside the command's ``try``, so every
    restart crashed before it could record anything."""
    attempts.record_start(tmp_path)
    attempts.record_failure(tmp_path, 0, 4, BOOM)
    bad = {"event": "failure", "kind": "own", "rank": 0, "step": None, "cause": "ValueError: x", "time": 1.0}
    with open(tmp_path / attempts.ATTEMPTS_FILE, "a") as f:
        f.write(json.dumps(bad) + "\n")
        f.write("[1, 2]\n")
        f.write('{"event": "start", "attempt": true, "restart": 0, "time": 2.0}\n')
    attempts.record_start(tmp_path)
    attempts.record_failure(tmp_path, 0, 4, BOOM)
    said: list[str] = []
    assert _stops(tmp_path, said) and "attempts 1 and 2 both failed at step 4" in said[0]  # the records around count
    log = attempts.read_attempt_log(tmp_path)
    assert log.damage == [
        "line 3: 'step' of a failure is null",
        "line 4: a JSON list, not an object",
        "line 5: 'attempt' of a start is true",
    ]
    said.clear()  # the start of a restart: the damage said in one line, the rule applied, nothing raised
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    settings = RestartsConfig(window_s=1e9, backoff_s=0)
    assert restarts.begin_attempt(tmp_path, settings, restarts.Identity("c", "v"), 0, said.append) == 3
    assert len(said) == 1 and "3 damaged line(s) skipped" in said[0]
    assert [r["event"] for r in log.records] == ["start", "failure", "start", "failure"]


def _append_many(out_dir: str, rank: int, n: int) -> None:
    for i in range(n):  # causes of different lengths, so interleaved writes would show
        exc = RuntimeError(f"rank {rank} record {i} " + "x" * (37 * (i % 50)))
        attempts.record_failure(Path(out_dir), rank, i, exc)


def test_concurrent_appends_stay_whole_lines(tmp_path):
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_append_many, args=(str(tmp_path), r, 200)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    log = attempts.read_attempt_log(tmp_path)
    assert log.damage == [] and len(log.records) == 800 == len(_lines(tmp_path))
    for rank in range(4):
        assert [r["step"] for r in log.records if r["rank"] == rank] == list(range(200))


def test_a_peer_failure_is_recorded_as_one_and_does_not_stop_the_run(tmp_path):
    for message in (GLOO_CLOSED, GLOO_RESET, GLOO_TIMEOUT):
        assert attempts.peer_failure(RuntimeError(message)), message
    assert attempts.peer_failure(torch.distributed.DistBackendError("NCCL communicator was aborted"))
    try:  # raised while handling a peer's failure: still the peer's
        try:
            raise RuntimeError(GLOO_CLOSED)
        except RuntimeError as inner:
            raise ValueError(f"checkpoint step_000002: {inner}") from inner
    except ValueError as outer:
        assert attempts.peer_failure(outer)
    # this rank's own failures, whatever their words: a retriever that reset its connection, a plain timeout
    assert not attempts.peer_failure(RuntimeError("retrieval failed: [Errno 104] Connection reset by peer"))
    assert not attempts.peer_failure(TimeoutError("Timed out waiting for the environment worker"))
    for _ in range(2):
        attempts.record_start(tmp_path)
        attempts.record_failure(tmp_path, 0, 2, RuntimeError(GLOO_RESET))
    assert {r.get("kind") for r in attempts.read_attempts(tmp_path) if r["event"] == "failure"} == {"peer"}
    assert not _stops(tmp_path, [])  # the dead peer's failure is not this rank's to repeat


SURVIVOR = textwrap.dedent(
    """
    import os, sys
    from datetime import timedelta
    from pathlib import Path
    import torch, torch.distributed as dist
    from alignopsd.engine.run import attempts
    rank, port, out = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=3))
    t = torch.ones(4)
    dist.all_reduce(t)
    if rank == 1:
        os._exit(9)  # dies between two collectives
    try:
        dist.all_reduce(t)
    except BaseException as exc:
        print(attempts.record_failure(out, 0, 2, exc), str(exc)[:200])
    """
)


def test_a_surviving_ranks_real_gloo_error_is_a_peer_failure(tmp_path):
    """Two gloo processes on 127.0.0.1: rank 1 dies after the first collective; rank 0's next one fails with gloo's
    own error, which rank 0 records as a peer failure."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, "-c", SURVIVOR]
    peer = subprocess.Popen([*cmd, "1", port, str(tmp_path)], env=env)
    got = subprocess.run([*cmd, "0", port, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    peer.wait(60)
    assert got.returncode == 0 and got.stdout.startswith("True"), got.stdout + got.stderr[-2000:]
    (rec,) = attempts.read_attempts(tmp_path)
    assert rec["kind"] == "peer" and rec["cause"].startswith("RuntimeError: ["), rec
