"""A run that heals itself (engine/run/restarts.py): restarts under torchrun's elastic agent resume by themselves, back
off while the attempts before them failed at the same step, and a failure that recurs at the same step with the same
cause over the restart window stops the restarts with one message (the rule's clock and sleep are the tests' own).

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
from alignopsd.engine.config.trainer_section import RestartsConfig
from alignopsd.engine.observe.metrics import read_metrics
from alignopsd.engine.run import attempts, restarts
from test_preemption import TIMING

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
RUNNER = str(Path(__file__).with_name("sharded_run.py"))
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
GUESS = [a for kv in lh.GUESS_OVERRIDES for a in ("--set", kv)]


def _events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / attempts.ATTEMPTS_FILE).read_text().splitlines()]


class FakeTime:
    """The rule's clock and sleep: an attempt takes no real time."""

    def __init__(self) -> None:
        self.now, self.slept = 1_000_000.0, []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


ID = restarts.Identity("config-a", "code-a")
BOOM = ValueError("targets: 17 ids fall in no vocabulary shard of 4096")
OUTAGE = ConnectionRefusedError("[Errno 111] Connection refused")
LAUNCH_VARS = ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "SLURM_RESTART_COUNT", "SLURM_JOB_ID")


def _attempt(out, t, env, *, fail=None, step=0, ident=ID, settings=None, said=None):
    """One attempt as train.main runs it on rank 0 of a launch (``env``: its variables): the rule at its start,
    then 5 s of work and, with ``fail``, the failure at ``step``. Returns begin_attempt's answer."""
    with pytest.MonkeyPatch.context() as mp:
        for k in LAUNCH_VARS:
            mp.delenv(k, raising=False)
        for k, v in env.items():
            mp.setenv(k, str(v))
        say = (said if said is not None else []).append
        got = restarts.begin_attempt(out, settings or RestartsConfig(), ident, 0, say, clock=t.clock, sleep=t.sleep)
        if got is not None and fail is not None:
            t.now += 5.0
            attempts.record_failure(out, 0, step, fail, clock=t.clock)
        return got


def _other_rank(out, t, env) -> tuple[int | None, list[float]]:
    """Rank 1 of the same attempt, before rank 0 records the start: (its answer, what it slept)."""
    slept: list[float] = []
    with pytest.MonkeyPatch.context() as mp:
        for k in LAUNCH_VARS:
            mp.delenv(k, raising=False)
        for k, v in env.items():
            mp.setenv(k, str(v))
        got = restarts.begin_attempt(out, RestartsConfig(), ID, 1, lambda line: None, clock=t.clock, sleep=slept.append)
    return got, slept


def _restart(n: int) -> dict:
    return {"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": n}


def test_restart_count_is_read_once_for_the_group_and_the_attempt_records(monkeypatch):
    """The restart count comes from parallel/group.py (the store prefix and the attempt records read the same)."""
    from alignopsd.engine.parallel.group import restart_count

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert restart_count() is None and restarts.restarts_so_far() == 0 and not restarts.restarted()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "not a number")
    assert restart_count() == 0 and not restarts.restarted()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert restart_count() == restarts.restarts_so_far() == 2 and restarts.restarted()


def test_a_transient_failure_backs_off_and_the_run_goes_on(tmp_path):
    """The retrieval server (or a file system) is down for the first two attempts: each restart waits longer (10 s,
    then 20 s, said in the log), none is refused, and the third attempt runs."""
    t, said = FakeTime(), []
    assert _attempt(tmp_path, t, _restart(0), fail=OUTAGE, said=said) == 1
    assert _attempt(tmp_path, t, _restart(1), fail=OUTAGE, said=said) == 2
    assert _attempt(tmp_path, t, _restart(2), said=said) == 3  # the outage is over: this one trains
    assert t.slept == [10.0, 20.0]
    assert said == [
        f"[train] a restart after {k} failed attempt(s) in a row (before the first step): waiting {w} s before it "
        "starts (trainer.restarts: 10 s, doubled per failed attempt, at most 300 s)"
        for k, w in ((1, 10), (2, 20))
    ]
    starts = [e for e in _events(tmp_path) if e["event"] == "start"]
    assert [(e["attempt"], e["restart"], e["by_hand"]) for e in starts] == [(1, 0, True), (2, 1, False), (3, 2, False)]
    assert {(e["config"], e["code"]) for e in starts} == {(ID.config, ID.code)}


def test_a_deterministic_failure_stops_once_its_window_has_passed_and_is_said_once(tmp_path):
    """The same failure at step 2 in every attempt: the restarts back off up to the ceiling, and the first restart
    after the failure has recurred over trainer.restarts.window_s (30 min) stops, said once (rank 0; rank 1 decides
    the same from the same file). A further restart by the agent stops too; the person's Slurm requeue of the
    stopped run, and a restart after a change of config or code, are not refused."""
    t, said, n = FakeTime(), [], 0
    while True:
        other, other_slept = _other_rank(tmp_path, t, _restart(n))
        got = _attempt(tmp_path, t, _restart(n), fail=BOOM, step=2, said=said)
        assert other == (None if got is None else 0) and other_slept == t.slept[len(t.slept) - len(other_slept) :]
        if got is None:
            break
        assert got == n + 1
        n += 1
    assert n == 11 and t.slept == [10, 20, 40, 80, 160, 300, 300, 300, 300, 300]
    fails = [e["time"] for e in _events(tmp_path) if e["event"] == "failure"]
    assert fails[-2] - fails[0] < 1800 <= fails[-1] - fails[0]  # stopped at the first restart past the window
    assert [line for line in said if "stops" in line] == [
        f"[train] attempts 1 to 11 all failed at step 2 with the same cause (ValueError: targets: # ids fall in no "
        f"vocabulary shard of #), over {fails[-1] - fails[0]:.0f} s (trainer.restarts.window_s: 1800 s); a restart "
        f"would fail again, so this one stops: fix the cause, then resume with --resume auto (attempts: "
        f"{tmp_path / attempts.ATTEMPTS_FILE})"
    ]
    assert [e["event"] for e in _events(tmp_path)].count("stop") == 1
    assert _attempt(tmp_path, t, _restart(n + 1)) is None and len(t.slept) == 10  # the agent went on: stopped again
    requeue = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": 1}  # a person asked Slurm to requeue the stopped run
    assert _attempt(tmp_path, t, requeue, fail=BOOM, step=2) == 12 and len(t.slept) == 10
    assert _attempt(tmp_path, t, {**requeue, "TORCHELASTIC_RESTART_COUNT": 1}, fail=BOOM, step=2) == 13
    assert t.slept[10:] == [10] and _events(tmp_path)[-4]["by_hand"] is True  # a new row from the person's attempt
    changed = restarts.Identity("config-b", ID.code)  # a person changed the config: not refused, no wait
    assert _attempt(tmp_path, t, _restart(n + 2), ident=changed, fail=BOOM, step=2) == 14
    assert _attempt(tmp_path, t, _restart(n + 3), ident=restarts.Identity(ID.config, "code-b")) == 15
    assert t.slept[10:] == [10]


def test_the_row_needs_the_same_own_failure_and_ends_where_an_attempt_got_further(tmp_path):
    """window_s 0: two attempts in a row with the same failure at the same step stop the next (the rule as it was
    before the window). Another step, another cause, or an attempt whose only failure is a peer's in between is no
    repetition; an attempt that got further than the one before it starts the backoff over."""
    t, said, short = FakeTime(), [], RestartsConfig(window_s=0)
    assert attempts.cause_of(BOOM) == "ValueError: targets: # ids fall in no vocabulary shard of #"
    peer = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [::1]:9")
    other = ValueError("the tokenizer has no pad token")
    for n, (fail, step) in enumerate([(BOOM, 3), (BOOM, 4), (peer, 4), (BOOM, 4), (other, 4), (other, 4)]):
        assert _attempt(tmp_path, t, _restart(n), fail=fail, step=step, settings=short, said=said) == n + 1
    assert not said or not any("stops" in line for line in said)
    assert t.slept == [10, 10, 20, 40, 80]  # step 4 got further than step 3: the row started over at attempt 2
    assert _attempt(tmp_path, t, _restart(6), settings=short, said=said) is None
    assert said[-1].startswith(
        "[train] attempts 5 and 6 both failed at step 4 with the same cause (ValueError: the tokenizer has no pad"
    )


def test_a_config_failure_that_repeats_stops_the_third_attempt(tmp_path, capsys, monkeypatch):
    """The real command line (trainer.restarts: no wait, no window): a checkpoint folder that does not verify makes
    --resume auto refuse (exit 2, before any model loads) in two attempts; the third, a restart, stops at once with
    one message, a stop record and exit status 3. A restart with another config, and a person's launch, are never
    refused: they fail on their own."""
    bad = tmp_path / "checkpoints" / ck.step_dir_name(2)
    bad.mkdir(parents=True)
    (bad / "manifest.json").write_text("{}")
    now = ["--set", "trainer.restarts.window_s=0", "--set", "trainer.restarts.backoff_s=0"]
    argv = ["--config", TINY, "--set", f"output_dir={tmp_path}", "--resume", "auto", *now]
    assert train_cmd.main(argv) == 2
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # restarts, as torchrun's agent makes them
    assert train_cmd.main(argv) == 2
    capsys.readouterr()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert train_cmd.main(argv) == restarts.EXIT_REPEATED == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "attempts 1 and 2 both failed before its first step" in err
    assert [e["event"] for e in _events(tmp_path)] == ["start", "failure", "start", "failure", "stop"]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    assert train_cmd.main([*argv, "--set", "trainer.optimizer.lr=2e-4"]) == 2  # the config changed: judged afresh
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
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
        "trainer.checkpoint.save_freq=1",
        "--set",
        "trainer.checkpoint.keep_last=5",
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
    events = _events(healed)  # a SIGKILL leaves no record of its own; rank 0 may record its peer's (if it saw it)
    assert [e["event"] for e in events if e["event"] != "failure"] == ["start", "start"]
    assert all((e["kind"], e["rank"], e["step"]) == ("peer", 0, 2) for e in events if e["event"] == "failure")
    starts = [e for e in events if e["event"] == "start"]
    assert starts[1]["restart"] == 1 and "resumed from" in got.stdout + got.stderr
    assert "a restart after 1 failed attempt(s) in a row" in got.stderr and "waiting 10 s" in got.stderr
    assert [r["step"] for r in read_metrics(healed / "metrics.jsonl")] == [1, 2, 3]
    for step in (1, 2, 3):
        wa = ck.load_weights(straight / "checkpoints" / ck.step_dir_name(step))
        wb = ck.load_weights(healed / "checkpoints" / ck.step_dir_name(step))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), step


@pytest.mark.slow
def test_torchrun_stops_restarting_a_deterministic_failure(tmp_path):
    """Every attempt raises the same error in step 2: two attempts fail there, the third (a restart) stops at once
    with one message and asks the agent to stop, so the 5 allowed restarts are not all spent."""
    now = ["--set", "trainer.restarts.window_s=0", "--set", "trainer.restarts.backoff_s=0"]
    got = _torchrun(tmp_path, 3, "--fail-at", "2", *now, restarts_n=5)
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
    """``trainer.checkpoint.save_every_s``: a step that ends past the interval checkpoints (here every step) besides
    ``save_freq``, and the log says what each save cost; without it only the last step is saved."""
    import io

    stream = io.StringIO()
    ov = [*lh.GUESS_OVERRIDES, "algorithm.estimator=grpo", "trainer.total_steps=2", "trainer.checkpoint.keep_last=5",
          "trainer.checkpoint.save_every_s=0.001", f"output_dir={tmp_path}"]  # fmt: skip
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
SOAK = ["--set", "algorithm.estimator=alignopsd", "--set", "trainer.logging.loggers=[jsonl,tensorboard]"]


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
    done = _torchrun(straight, SOAK_STEPS, *SOAK, "--set", "trainer.checkpoint.save_freq=2", restarts_n=0)
    straight_s = time.monotonic() - t0
    assert done.returncode == 0, done.stderr[-3000:]
    t0, launches = time.monotonic(), 0
    while launches < 3:  # the scheduler: a launch that ended (the preemption) is launched again, unchanged
        launches += 1
        got = _torchrun(
            healed, SOAK_STEPS, *SOAK, "--set", "trainer.checkpoint.save_freq=2", "--chaos", str(schedule), restarts_n=5
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
    keep = [k for k in rows[0] if not k.startswith(("time/", "memory/")) and k not in TIMING]
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
