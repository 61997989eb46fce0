"""A run that heals itself (engine/run/restarts.py): restarts under torchrun's elastic agent resume by themselves, and a
failure that repeats at the same step with the same cause stops the restarts with one message.

The command line is the real one (tests/engine/sharded_run.py: ``alignopsd.engine.commands.train.main`` with the
guess environment and the candidate-choice generator); its fault hooks live in that test runner, not in the engine.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import learn_helpers as lh
import numpy as np
import pytest
import torch
from alignopsd.engine.checkpoint import checkpoint as ck
from alignopsd.engine.commands import train as train_cmd
from alignopsd.engine.observe.metrics import read_metrics
from alignopsd.engine.run import restarts
from test_preemption import TIMING

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
RUNNER = str(Path(__file__).with_name("sharded_run.py"))
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
GUESS = [a for kv in lh.GUESS_OVERRIDES for a in ("--set", kv)]


def _events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / restarts.ATTEMPTS_FILE).read_text().splitlines()]


def test_repeated_failure_needs_the_same_step_and_cause_in_two_attempts_in_a_row(tmp_path):
    boom = ValueError("targets: 17 ids fall in no vocabulary shard of 4096")
    assert restarts.cause_of(boom) == "ValueError: targets: # ids fall in no vocabulary shard of #"
    assert restarts.repeated_failure(tmp_path) is None  # no file: a first attempt
    assert restarts.record_start(tmp_path) == 1
    restarts.record_failure(tmp_path, 0, 3, boom)
    assert restarts.repeated_failure(tmp_path) is None  # one failed attempt is not a repetition
    assert restarts.record_start(tmp_path) == 2
    restarts.record_failure(tmp_path, 1, 4, boom)  # another step: progress was made
    assert restarts.repeated_failure(tmp_path) is None
    restarts.record_start(tmp_path)
    restarts.record_failure(tmp_path, 0, 4, ValueError("targets: 9 ids fall in no vocabulary shard of 4096"))
    msg = restarts.repeated_failure(tmp_path)
    assert msg.startswith("attempts 2 and 3 both failed at step 4 with the same cause (ValueError: targets: #")
    assert "resume with --resume auto" in msg
    restarts.record_start(tmp_path)  # an attempt without a failure of its own clears it
    assert restarts.repeated_failure(tmp_path) is None
    # a rank that saw a peer die records a peer failure, which the rule does not count; a torn last line is skipped
    assert restarts.record_failure(tmp_path, 1, 5, torch.distributed.DistBackendError("Connection closed by peer"))
    with open(tmp_path / restarts.ATTEMPTS_FILE, "a") as f:
        f.write('{"event": "failure", "st')
    assert [e["event"] for e in restarts.read_attempts(tmp_path)] == ["start", "failure"] * 2 + ["start", "failure"] + [
        "start",
        "failure",
    ]
    assert restarts.read_attempts(tmp_path)[-1]["kind"] == "peer"


def test_a_config_failure_that_repeats_stops_the_third_attempt(tmp_path, capsys, monkeypatch):
    """The real command line: a checkpoint folder that does not verify makes --resume auto refuse (exit 2, before
    any model loads) in two attempts; the third, a restart, stops at once with one message and exit status 3."""
    bad = tmp_path / "checkpoints" / ck.step_dir_name(2)
    bad.mkdir(parents=True)
    (bad / "manifest.json").write_text("{}")
    argv = ["--config", TINY, "--set", f"output_dir={tmp_path}", "--resume", "auto"]
    assert train_cmd.main(argv) == 2
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # restarts, as torchrun's agent makes them
    assert train_cmd.main(argv) == 2
    capsys.readouterr()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert train_cmd.main(argv) == restarts.EXIT_REPEATED == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "attempts 1 and 2 both failed before its first step" in err
    assert [e["event"] for e in _events(tmp_path)] == ["start", "failure", "start", "failure"]
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")  # a person's launch is never refused: it fails on its own
    assert train_cmd.main(argv) == 2


def _torchrun(out: Path, steps: int, *extra: str, restarts_n: int) -> subprocess.CompletedProcess:
    with socket.socket() as sock:  # a free port for torchrun's store
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(__file__).parent)])}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [
        TORCHRUN,
        "--nproc_per_node=2",
        f"--master_port={port}",
        f"--max-restarts={restarts_n}",
        RUNNER,
        "--config",
        TINY,
        *GUESS,
        "--set",
        "algorithm.estimator=grpo",
        "--set",
        f"trainer.total_steps={steps}",
        "--set",
        "trainer.save_freq=1",
        "--set",
        "trainer.keep_last=5",
        "--set",
        f"output_dir={out}",
        "--resume",
        "auto",
        *extra,
    ]  # later settings override earlier ones
    return subprocess.run(cmd, env=env, cwd=ROOT, text=True, capture_output=True, timeout=900)


@pytest.mark.slow
def test_torchrun_restarts_after_a_killed_worker_and_ends_bit_identical(tmp_path):
    """DP=2 under ``torchrun --max-restarts=2 ... --resume auto``: rank 1 is SIGKILLed in step 2; the agent restarts
    both workers, the new attempt resumes from step 1's checkpoint by itself, and the run ends with the weights and
    metrics of a run that was never interrupted, every step logged once."""
    straight, healed = tmp_path / "straight", tmp_path / "healed"
    done = _torchrun(straight, 3, restarts_n=0)
    assert done.returncode == 0, done.stderr[-3000:]
    got = _torchrun(healed, 3, "--kill-at", f"2:1:{tmp_path / 'killed'}", restarts_n=2)
    assert got.returncode == 0, got.stderr[-3000:]
    assert (tmp_path / "killed").exists()  # the fault did hit
    assert [e["event"] for e in _events(healed)] == ["start", "start"]  # a SIGKILL leaves no record of its own
    assert _events(healed)[1]["restart"] == 1 and "resumed from" in got.stdout + got.stderr
    assert [r["step"] for r in read_metrics(healed / "metrics.jsonl")] == [1, 2, 3]
    for step in (1, 2, 3):
        wa = ck.load_weights(straight / "checkpoints" / ck.step_dir_name(step))
        wb = ck.load_weights(healed / "checkpoints" / ck.step_dir_name(step))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), step


@pytest.mark.slow
def test_torchrun_stops_restarting_a_deterministic_failure(tmp_path):
    """Every attempt raises the same error in step 2: two attempts fail there, the third (a restart) stops at once
    with one message and asks the agent to stop, so the 5 allowed restarts are not all spent."""
    got = _torchrun(tmp_path, 3, "--fail-at", "2", restarts_n=5)
    assert got.returncode != 0
    events = _events(tmp_path)
    assert [e["event"] for e in events if e["event"] == "start"] == ["start"] * 2  # the third stopped before its own
    assert {(e["step"], e["cause"]) for e in events if e["event"] == "failure"} == {
        (2, "ValueError: an injected deterministic failure in step #")
    }
    # said once: the agent stopped there, not after spending restarts 3 to 5 on attempts that stop at once
    assert got.stderr.count("attempts 1 and 2 both failed at step 2 with the same cause") == 1, got.stderr[-3000:]


@pytest.mark.slow
def test_save_every_s_checkpoints_by_wall_time_and_says_the_cost(tmp_path):
    """``trainer.save_every_s``: a step that ends past the interval checkpoints (here every step) besides
    ``save_freq``, and the log says what each save cost; without it only the last step is saved."""
    import io

    stream = io.StringIO()
    ov = [*lh.GUESS_OVERRIDES, "algorithm.estimator=grpo", "trainer.total_steps=2", "trainer.keep_last=5",
          "trainer.save_every_s=0.001", f"output_dir={tmp_path}"]  # fmt: skip
    tr = lh.build_trainer(TINY, ov)
    tr.stream = stream
    tr.fit()
    assert [p.name for p in ck.list_checkpoints(tmp_path / "checkpoints")] == ["step_000001", "step_000002"]
    said = [line for line in stream.getvalue().splitlines() if line.startswith("[train] checkpoint of step")]
    assert [line.split(":")[0] for line in said] == ["[train] checkpoint of step 1", "[train] checkpoint of step 2"]
    assert all(float(line.split(": ")[1].removesuffix(" s")) > 0 for line in said)


# the chaos soak: a fixed schedule (drawn once from random.Random(45): steps, ranks and phases), each fault once
CHAOS = [
    {"id": "kill-rollout", "step": 4, "rank": 1, "kind": "kill", "at": "rollout_generation"},
    {"id": "kill-teacher", "step": 9, "rank": 0, "kind": "kill", "at": "teacher_generation"},
    {"id": "kill-update", "step": 13, "rank": 1, "kind": "kill", "at": "update"},
    {"id": "kill-save", "step": 16, "rank": 0, "kind": "kill", "at": "save"},
    {"id": "preempt", "step": 21, "rank": 0, "kind": "term_agent", "at": "old_logprob"},
    {"id": "disk-full", "step": 26, "rank": 0, "kind": "disk_full", "at": "save"},
]
SOAK_STEPS = 30
SOAK = ["--set", "algorithm.estimator=alignopsd", "--set", "trainer.loggers=[jsonl,tensorboard]"]


def _tb_steps(out: Path) -> list[int]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    steps = []
    for f in sorted((out / "tb").rglob("events.out.tfevents.*")):
        for e in EventFileLoader(str(f)).Load():
            if e.WhichOneof("what") == "summary" and any(v.tag == "actor/loss" for v in e.summary.value):
                steps.append(e.step)
    return sorted(steps)


@pytest.mark.slow
def test_chaos_soak_ends_bit_identical_with_every_step_logged_once(tmp_path):
    """DP=2, AlignOPSD, 30 steps, a checkpoint every 2, under ``torchrun --max-restarts=5 ... --resume auto``; six
    faults of different kinds at fixed steps and phases (SIGKILL of one rank in the rollout, the teacher pass, the
    update and in the middle of a checkpoint write; SIGTERM of the agent, a preemption that ends the launch, after
    which the job is launched again as a scheduler requeues it; a full disk during a checkpoint write). No other
    action: the end state (weights, optimizer state, every rank's RNG) is bit-identical to an uninterrupted run's,
    and metrics.jsonl and the TensorBoard events hold every step exactly once."""
    import time

    schedule = tmp_path / "chaos.json"
    schedule.write_text(json.dumps(CHAOS))
    straight, healed = tmp_path / "straight", tmp_path / "healed"
    t0 = time.monotonic()
    done = _torchrun(straight, SOAK_STEPS, *SOAK, "--set", "trainer.save_freq=2", restarts_n=0)
    straight_s = time.monotonic() - t0
    assert done.returncode == 0, done.stderr[-3000:]
    t0, launches = time.monotonic(), 0
    while launches < 3:  # the scheduler: a launch that ended (the preemption) is launched again, unchanged
        launches += 1
        got = _torchrun(
            healed, SOAK_STEPS, *SOAK, "--set", "trainer.save_freq=2", "--chaos", str(schedule), restarts_n=5
        )
        if got.returncode == 0:
            break
    healed_s = time.monotonic() - t0
    assert got.returncode == 0, got.stderr[-3000:]
    fired = sorted(f["id"] for f in CHAOS if Path(f"{schedule}.{f['id']}").exists())
    assert fired == sorted(f["id"] for f in CHAOS)  # every fault hit
    starts = [e for e in _events(healed) if e["event"] == "start"]
    # launch 1: the first attempt and a restart after each of the four kills, ended by the preemption; launch 2: its
    # first attempt and a restart after the full disk
    assert launches == 2 and len(starts) == 7 and [e["restart"] for e in starts] == [0, 1, 2, 3, 4, 0, 1]
    last = ck.step_dir_name(SOAK_STEPS)
    wa, wb = ck.load_weights(straight / "checkpoints" / last), ck.load_weights(healed / "checkpoints" / last)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    from alignopsd.engine.checkpoint.statefile import load_state

    for name in ("optimizer.safetensors", "rng_rank0.safetensors", "rng_rank1.safetensors"):
        a, b = load_state(straight / "checkpoints" / last / name), load_state(healed / "checkpoints" / last / name)
        assert _same_state(a, b), name
    rows = read_metrics(healed / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, SOAK_STEPS + 1))
    keep = [k for k in rows[0] if not k.startswith("time/") and k not in TIMING]
    straight_rows = read_metrics(straight / "metrics.jsonl")
    assert [{k: r.get(k) for k in keep} for r in rows] == [{k: r.get(k) for k in keep} for r in straight_rows]
    assert _tb_steps(healed) == list(range(1, SOAK_STEPS + 1))
    lost = _time_lost(healed, schedule, starts)
    (tmp_path.parent / "chaos_soak_faults.json").write_text(json.dumps(lost, indent=1))  # for the results file
    for f in lost:
        print(f"fault {f['id']} ({f['kind']} at {f['at']}, step {f['step']}): next attempt started "
              f"{f['to_start_s']:.1f} s later, its first new step ended {f['to_first_step_s']:.1f} s after the fault, "
              f"{f['steps_redone']} step(s) run again")  # fmt: skip
    print(f"chaos soak: {len(fired)} faults, {launches} launches, {len(starts)} attempts "
          f"({len(starts) - launches} restarts by the agent), {healed_s:.0f} s against {straight_s:.0f} s "
          f"uninterrupted (+{healed_s - straight_s:.0f} s)")  # fmt: skip


def _time_lost(out: Path, schedule: Path, starts: list[dict]) -> list[dict]:
    """Per fault (its marker file's time is when it hit): the start of the next attempt, the end of its first new
    step (the first audit file written after the start: every step writes one per rank), and the steps run again
    (the fault's step against the step that first new step was)."""
    ends = sorted(
        (p.stat().st_mtime, int(p.name.split("_")[1].split(".")[0])) for p in (out / "audit").glob("step_*.rank0.jsonl")
    )
    out_rows = []
    for f in CHAOS:
        hit = Path(f"{schedule}.{f['id']}").stat().st_mtime
        start = min(e["time"] for e in starts if e["time"] > hit)
        first_end, first_step = min((t, s) for t, s in ends if t > start)
        out_rows.append({**f, "to_start_s": start - hit, "to_first_step_s": first_end - hit,
                         "steps_redone": f["step"] - first_step + 1})  # fmt: skip
    return out_rows


def _same_state(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    return a == b
