"""One writer per output folder (engine/run/runlock.py) and the history a resume rewrites (engine/run/history.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import learn_helpers as lh
import pytest
import torch
from alignopsd.engine.observe.metrics import read_metrics
from alignopsd.engine.run.history import set_aside
from alignopsd.engine.run.runlock import LOCK_FILE, OutputLock, OutputLockedError, claim_output_dir

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")


def _holder(out: Path, *, fork_child: bool = False) -> subprocess.Popen:
    """A process that takes the folder's lock (and optionally forks a child that outlives it), then waits."""
    code = textwrap.dedent(f"""
        import os, sys, time
        from alignopsd.engine.run.runlock import OutputLock
        lock = OutputLock({str(out)!r}).acquire()
        child = os.fork() if {fork_child!r} else None
        if child == 0:
            print("child", flush=True)  # its copy of the lock's descriptor is closed by now (at fork)
            time.sleep(60)
            os._exit(0)
        print(child or 0, flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    lines = [proc.stdout.readline().strip() for _ in range(2 if fork_child else 1)]  # the lock is held by then
    proc.child = int(next(x for x in lines if x != "child"))  # a forked child has run past its at-fork handler
    return proc


def test_second_run_is_refused_with_exit_2_naming_the_holder(tmp_path, capsys):
    from alignopsd.engine.commands.train import main

    holder = _holder(tmp_path)
    try:
        code = main(["--config", TINY, "--output-dir", str(tmp_path), "--resume", "auto"])
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"pid {holder.pid}" in err and socket.gethostname() in err and "is in use by another run" in err
    assert "Traceback" not in err
    assert not (tmp_path / "config.yaml").exists() and not (tmp_path / "metrics.jsonl").exists()  # wrote nothing


def test_lock_excludes_in_process_and_is_released(tmp_path):
    first = OutputLock(tmp_path).acquire()
    with pytest.raises(OutputLockedError, match=f"pid {os.getpid()}"):
        OutputLock(tmp_path).acquire()
    first.release()
    first.release()  # idempotent
    assert not (tmp_path / LOCK_FILE).exists()
    with OutputLock(tmp_path) as again:
        assert again.previous is None  # a clean release leaves nothing to take over
    assert not (tmp_path / LOCK_FILE).exists()


@pytest.mark.parametrize("fork_child", [False, True])
def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path, fork_child):
    """SIGKILL leaves the lock file behind; the next run takes it over and names the dead holder. A child the
    holder forked (an environment worker) does not keep the lock alive."""
    holder = _holder(tmp_path, fork_child=fork_child)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    try:
        said: list[str] = []
        lock = claim_output_dir(tmp_path, say=said.append)
        assert lock.previous["pid"] == holder.pid
        assert said and "took over the stale lock" in said[0] and f"pid {holder.pid}" in said[0]
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
        lock.release()
    finally:
        if holder.child:
            os.kill(holder.child, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------------------------------
# history


def _event_steps(tb: Path) -> list[tuple[str, int]]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    out = []
    for p in sorted(tb.iterdir()):
        for e in EventFileLoader(str(p)).Load():
            out += [(v.tag, e.step) for v in e.summary.value]
    return sorted(out)


def _fake_run(out: Path, steps: int, ranks: int) -> None:
    from torch.utils.tensorboard import SummaryWriter

    rows = [{"kind": k, "step": s, "x": 1.0} for s in range(1, steps + 1) for k in ("train", "val")]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "tra')  # a cut line
    (out / "audit").mkdir()
    for s in range(1, steps + 1):
        for r in range(ranks):
            (out / "audit" / f"step_{s:06d}.rank{r}.jsonl").write_text("{}\n")
    (out / "audit" / f"step_{steps:06d}.rank0.jsonl.tmp").write_text("{")
    tb = SummaryWriter(str(out / "tb"))
    for s in range(1, steps + 1):
        tb.add_scalar("loss", float(s), s)
        tb.add_scalar("val/success", float(s), s)
    tb.close()
    for s in (2, 4):
        (out / "checkpoints" / f"step_{s:06d}").mkdir(parents=True)


def test_set_aside_moves_the_records_after_the_checkpoint(tmp_path):
    """Train and validation rows, audit files of every rank, TensorBoard events and checkpoints of steps after the
    checkpoint go to abandoned/<time>/; everything of steps up to it stays, once."""
    _fake_run(tmp_path, 4, ranks=2)
    where, moved = set_aside(tmp_path, 2)
    assert where is not None and where.parent == tmp_path / "abandoned"
    assert [(r["kind"], r["step"]) for r in read_metrics(tmp_path / "metrics.jsonl", None)] == [
        ("train", 1), ("val", 1), ("train", 2), ("val", 2)]  # fmt: skip
    assert [r["step"] for r in read_metrics(where / "metrics.jsonl", None)] == [3, 3, 4, 4]
    assert sorted(p.name for p in (tmp_path / "audit").iterdir()) == [
        f"step_{s:06d}.rank{r}.jsonl" for s in (1, 2) for r in (0, 1)]  # fmt: skip
    assert len(list((where / "audit").iterdir())) == 5  # steps 3-4 of both ranks and the unfinished file
    assert _event_steps(tmp_path / "tb") == [("loss", 1), ("loss", 2), ("val/success", 1), ("val/success", 2)]
    assert len(_event_steps(where / "tb")) == 8  # the original file, whole
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000002"]
    assert [p.name for p in (where / "checkpoints").iterdir()] == ["step_000004"]
    assert set_aside(tmp_path, 2) == (None, [])  # nothing left to move
    # a fresh run moves all of an earlier run's records aside
    where2, _ = set_aside(tmp_path, None)
    assert where2 != where and not (tmp_path / "metrics.jsonl").exists()
    assert not list((tmp_path / "audit").iterdir()) and not list((tmp_path / "tb").iterdir())
    assert not list((tmp_path / "checkpoints").iterdir())


@pytest.mark.slow
def test_resume_rewrites_the_run_history(tmp_path):
    """A run that logged steps 1-4 (validation every step, TensorBoard, audit) and a DP=2 run's rank-1 audit file,
    resumed from its step-2 checkpoint: every step's rows, audit files and events appear once, the abandoned ones
    are kept aside, and the lock file is gone after the run."""
    torch.set_num_threads(1)
    ov = [
        *lh.GUESS_OVERRIDES,
        "algorithm.estimator=grpo",
        "trainer.checkpoint.save_freq=2",
        "trainer.checkpoint.keep_last=3",
        "trainer.validation.freq=1",
        "env.val_tasks=2",
        "trainer.logging.loggers=[jsonl,tensorboard]",
        f"output_dir={tmp_path}",
    ]
    lh.build_trainer(TINY, [*ov, "trainer.total_steps=4"]).fit()
    (tmp_path / "audit" / "step_000003.rank1.jsonl").write_text("{}\n")  # as a DP=2 run leaves it
    before = read_metrics(tmp_path / "metrics.jsonl", None)
    lh.build_trainer(TINY, [*ov, "trainer.total_steps=4"]).fit(resume=str(tmp_path / "checkpoints" / "step_000002"))
    recs = read_metrics(tmp_path / "metrics.jsonl", None)
    assert sorted((r["kind"], r["step"]) for r in recs) == sorted(
        (k, s) for s in (1, 2, 3, 4) for k in ("train", "val")
    )
    assert recs[:4] == before[:4]  # steps 1-2 untouched
    assert sorted(p.name for p in (tmp_path / "audit").iterdir()) == [f"step_{s:06d}.rank0.jsonl" for s in (1, 2, 3, 4)]
    steps = _event_steps(tmp_path / "tb")
    assert sorted(s for t, s in steps if t == "actor/loss") == [1, 2, 3, 4]
    assert sorted(s for t, s in steps if t == "val/episode/success_rate") == [1, 2, 3, 4]
    (aside,) = (tmp_path / "abandoned").iterdir()
    assert [r["step"] for r in read_metrics(aside / "metrics.jsonl", None)] == [3, 3, 4, 4]
    assert "step_000003.rank1.jsonl" in {p.name for p in (aside / "audit").iterdir()}
    assert [p.name for p in (aside / "checkpoints").iterdir()] == ["step_000004"]
    assert not (tmp_path / LOCK_FILE).exists()
