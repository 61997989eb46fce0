"""Graceful preemption (engine/run/preemption.py): SIGTERM / SIGUSR1 end a run after the current step with a complete
checkpoint and exit status 143; a second signal or the end of the grace exits at once (124) leaving the previous
checkpoint; ``--resume auto`` continues bit-identically.

The signal-handling tests send real signals to this process (the watch's exit is recorded instead of taken); the
slow ones run the train command line (tests/engine/sharded_run.py: guess environment, choice generator) as a
subprocess, single-process and under ``torchrun`` at DP=2 (the signal to the agent, as a scheduler sends it, and
to one worker), and compare with a run that was never stopped.
"""

from __future__ import annotations

import os
import signal
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
from alignopsd.engine.run.preemption import EXIT_FORCED, EXIT_PREEMPTED, REPEAT_AFTER_S, PreemptionWatch

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
RUNNER = str(Path(__file__).with_name("sharded_run.py"))
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
TIMING = ("wall_time", "audit/seconds", "rollout/generation_tokens_per_s")


def _until(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.02)
    return cond()


@pytest.fixture
def watch():
    said, codes = [], []
    w = PreemptionWatch(0.5, say=said.append, exit=codes.append).install()
    w.said, w.codes = said, codes
    yield w
    w.close()


def test_signal_requests_a_stop_and_the_grace_forces_exit(watch):
    os.kill(os.getpid(), signal.SIGUSR1)
    assert _until(lambda: watch.requested) and watch.cause == "SIGUSR1" and watch.codes == []
    assert "stopping after the current step" in watch.said[0]
    assert _until(lambda: watch.codes == [EXIT_FORCED], 3.0)  # 0.5 s grace, no checkpoint: out at once
    assert "grace of 0.5 s ran out" in watch.said[-1]


def test_second_signal_exits_at_once_a_repeat_does_not(watch):
    watch.grace_s = 60.0
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # the same request (scheduler and torchrun agent both signal)
    assert _until(lambda: watch.requested)
    time.sleep(0.2)
    assert watch.codes == []
    time.sleep(REPEAT_AFTER_S)
    os.kill(os.getpid(), signal.SIGTERM)
    assert _until(lambda: watch.codes == [EXIT_FORCED], 2.0)
    assert "SIGTERM again" in watch.said[-1]


def test_after_the_checkpoint_signals_and_the_clock_end_the_process_with_143(watch):
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    watch.agree("another rank was signalled")  # a rank that was not signalled starts the clock too
    watch.mark_saved()
    os.kill(os.getpid(), signal.SIGTERM)
    assert _until(lambda: watch.codes == [EXIT_PREEMPTED], 2.0)  # a signal now only ends the process
    watch.close()  # the clock keeps running: a slow shutdown still ends within the grace, with 143
    assert _until(lambda: watch.codes == [EXIT_PREEMPTED] * 2, 2.0) and "is over" in watch.said[-1]
    handler = signal.getsignal(signal.SIGTERM)
    for sig, h in before.items():
        signal.signal(sig, h)
    assert handler not in before.values() and callable(handler)  # a later signal exits with 143, not -15


def test_close_restores_the_handlers():
    before = signal.getsignal(signal.SIGTERM)
    w = PreemptionWatch(5.0).install()
    assert signal.getsignal(signal.SIGTERM) is not before
    w.close()
    assert signal.getsignal(signal.SIGTERM) is before and signal.set_wakeup_fd(-1) == -1


# ---------------------------------------------------------------------------------------------------------------------
# the train command line, single-process and under torchrun

GUESS = [a for kv in lh.GUESS_OVERRIDES for a in ("--set", kv)]


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(__file__).parent)])}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _args(out: Path, steps: int, *extra: str) -> list[str]:
    return ["--config", TINY, *GUESS, "--set", "algorithm.estimator=grpo", "--set", f"trainer.total_steps={steps}",
            "--set", f"output_dir={out}", "--set", "trainer.checkpoint.keep_last=5", *extra]  # fmt: skip


def _launch(out: Path, steps: int, *extra: str, nproc: int = 0, prelude: str = "") -> subprocess.Popen:
    """The train command line (nproc 0: plain python; else torchrun) as a subprocess."""
    if nproc:
        with socket.socket() as sock:  # a free port for torchrun's store
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [TORCHRUN, f"--nproc_per_node={nproc}", f"--master_port={port}", RUNNER]
    else:
        code = f"import sys, sharded_run\n{prelude}\nsys.exit(sharded_run.main(sys.argv[1:]))"
        cmd = [sys.executable, "-c", code]
    return subprocess.Popen(cmd + _args(out, steps, *extra), env=_env(), cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def _first_row(proc: subprocess.Popen, out: Path) -> None:
    assert _until(lambda: read_metrics(out / "metrics.jsonl") or proc.poll() is not None, 300)
    assert proc.poll() is None, proc.communicate()[1][-3000:]


def _metrics(out: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/")) and k not in TIMING}
            for r in read_metrics(out / "metrics.jsonl")]  # fmt: skip


def _same_run(a: Path, b: Path, step: int) -> None:
    assert _metrics(a) == _metrics(b)
    wa = ck.load_weights(a / "checkpoints" / ck.step_dir_name(step))
    wb = ck.load_weights(b / "checkpoints" / ck.step_dir_name(step))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _preempted_at(out: Path) -> int:
    (last,) = ck.list_checkpoints(out / "checkpoints")[-1:]
    return int(last.name.split("_")[1])


@pytest.mark.slow
def test_sigterm_saves_exits_143_and_resume_is_exact(tmp_path, capsys):
    """3 steps straight == SIGTERM during the run (exit 143 with the checkpoint of the step it ended) + --resume
    auto; meanwhile a second run on the folder is refused with exit code 2 naming the holder."""
    from alignopsd.engine.commands.train import main

    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    torch.set_num_threads(1)
    ov = [*lh.GUESS_OVERRIDES, "algorithm.estimator=grpo", "trainer.total_steps=3", "trainer.checkpoint.keep_last=5"]
    lh.build_trainer(TINY, [*ov, f"output_dir={straight}"]).fit()
    proc = _launch(stopped, 3)
    _first_row(proc, stopped)
    assert main(_args(stopped, 3, "--resume", "auto")) == 2
    assert f"pid {proc.pid}" in capsys.readouterr().err
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    k = _preempted_at(stopped)
    assert 1 <= k < 3 and ck.verify_checkpoint(stopped / "checkpoints" / ck.step_dir_name(k))
    assert f"preempted (SIGTERM) after step {k}" in err and "Traceback" not in err
    assert not (stopped / "run.lock").exists()
    proc = _launch(stopped, 3, "--resume", "auto")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    _same_run(straight, stopped, 3)


SLOW_STEP = """
import pathlib, time
from alignopsd.engine.run import trainer as train
_step = train.run_step
def _slow(parts, step):
    if step == 1:
        pathlib.Path(parts.cfg.out_dir, "in_step_2").touch()
        time.sleep(60)
    return _step(parts, step)
train.run_step = _slow
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["grace", "second"])
def test_grace_or_second_signal_exits_at_once_keeping_the_last_checkpoint(tmp_path, how):
    """A step that outlasts the grace (or a second SIGTERM) ends the process at once with 124; the checkpoint of
    step 1 stays complete and --resume auto would take it."""
    grace = "1" if how == "grace" else "60"
    proc = _launch(tmp_path, 3, "--set", "trainer.checkpoint.save_freq=1", "--set", f"trainer.preempt_grace_s={grace}",
                   prelude=SLOW_STEP)  # fmt: skip
    assert _until(lambda: (tmp_path / "in_step_2").exists() or proc.poll() is not None, 300)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    if how == "second":
        time.sleep(REPEAT_AFTER_S + 0.5)
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == EXIT_FORCED, err[-3000:]
    assert time.monotonic() - t0 < 10
    assert ("ran out" if how == "grace" else "SIGTERM again") in err
    assert [p.name for p in ck.list_checkpoints(tmp_path / "checkpoints")] == ["step_000001"]
    assert ck.resolve_resume("auto", tmp_path / "checkpoints").name == "step_000001"


def _worker(agent: int, rank: int) -> int:
    """The pid of the torchrun worker of ``rank`` (a child of the agent)."""
    kids = Path(f"/proc/{agent}/task/{agent}/children").read_text().split()
    for pid in kids:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            return int(pid)
    raise AssertionError(f"no worker of rank {rank} among {kids}")


def _no_worker_traceback(err: str, agent: int) -> bool:
    """No worker printed a traceback: the only ones are the agent's own reports (torchrun prints the signal it got,
    or the summary of its workers' exit codes)."""
    agents = err.count(f"SignalException: Process {agent} got signal") + err.count("errors.ChildFailedError:")
    return err.count("Traceback (most recent call last)") == agents


@pytest.fixture(scope="module")
def dp2_straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp2") / "straight"
    proc = _launch(out, 3, nproc=2)
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("target", ["agent", "worker"])
def test_dp2_preemption_under_torchrun_resumes_exactly(tmp_path, dp2_straight, target):
    """torchrun DP=2: SIGTERM to the agent (it forwards to both workers) or to the rank-1 worker alone: both ranks
    stop after the same step, the checkpoint is complete with both ranks' generator state, every worker exits
    143, and --resume auto at DP=2 ends bit-identical to the run that was never stopped."""
    out = tmp_path / "stopped"
    proc = _launch(out, 3, nproc=2)
    _first_row(proc, out)
    os.kill(proc.pid if target == "agent" else _worker(proc.pid, 1), signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    k = _preempted_at(out)
    files = ck.verify_checkpoint(out / "checkpoints" / ck.step_dir_name(k))
    assert 1 <= k < 3 and {"rng_rank0.safetensors", "rng_rank1.safetensors"} <= set(files)
    assert f"after step {k}" in err and _no_worker_traceback(err, proc.pid)
    if target == "worker":
        assert "exitcode  : 143" in err  # torchrun's summary of the workers
    proc = _launch(out, 3, "--resume", "auto", nproc=2)
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    _same_run(dp2_straight, out, 3)
    if target == "agent":  # the DP=2 history resumed at DP=1 from step k: no rank-1 file of a later step stays
        proc = _launch(out, 3, "--resume", str(out / "checkpoints" / ck.step_dir_name(k)))
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-3000:]
        names = sorted(p.name for p in (out / "audit").iterdir())
        assert names == [f"step_{s:06d}.rank{r}.jsonl" for s in range(1, k + 1) for r in (0, 1)] + [
            f"step_{s:06d}.rank0.jsonl" for s in range(k + 1, 4)]  # fmt: skip
        assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.slow
def test_tp2_megatron_preemption_resumes_exactly(tmp_path):
    """Megatron TP=2 under torchrun: SIGTERM to the agent after the first step; the sharded checkpoint of the step
    both ranks finished resumes to the same final weights and metrics as a run that was never stopped."""
    tp = ("--set", "policy.backend=megatron", "--set", "policy.tensor_parallel_size=2")
    straight, out = tmp_path / "straight", tmp_path / "stopped"
    proc = _launch(straight, 3, *tp, nproc=2)
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    proc = _launch(out, 3, *tp, nproc=2)
    _first_row(proc, out)
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    k = _preempted_at(out)
    assert 1 <= k < 3 and ck.verify_checkpoint(out / "checkpoints" / ck.step_dir_name(k))
    assert f"after step {k}" in err and _no_worker_traceback(err, proc.pid)
    proc = _launch(out, 3, *tp, "--resume", "auto", nproc=2)
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    _same_run(straight, out, 3)
