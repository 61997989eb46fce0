"""A run restarted without a person: torchrun's elastic agent (``--max-restarts``) and Slurm requeues.

``torchrun --max-restarts=N ... -m alignopsd.engine train --config C --resume auto`` restarts the whole worker group
when any worker dies, and every restarted attempt resumes from the newest verified checkpoint (``--resume auto``;
nothing verified and nothing ever saved: a fresh start, said in the log). A requeued Slurm job is the same command
run again. Every attempt is recorded in ``<output_dir>/attempts.jsonl`` (engine/run/attempts.py); what this module
adds is what a restarted attempt makes of the attempts before it (:func:`begin_attempt`, at the start of every
attempt, on every rank, before anything heavy), with the settings of ``trainer.restarts``:

- who launched it. A person: a launch that is no restart (``TORCHELASTIC_RESTART_COUNT`` and ``SLURM_RESTART_COUNT``
  0), or a new launch (torchrun's count 0) of a run that the rule below had stopped (only a person relaunches a
  stopped run: the Slurm requeue of it that a person asked for counts up ``SLURM_RESTART_COUNT`` like a machine's).
  Such an attempt is never refused and never waits, and the attempts before it are not held against those after it.
- what changed. The attempts held against this one are the latest in a row with this one's config and code (the
  digests of the resolved config and of the package's Python sources, :func:`launch_identity`): a person who
  changed either started over.
- waiting (backoff): a restart whose predecessors failed at the same step, k in a row (an attempt that got further
  ends the row; one killed without a record continues it), waits ``backoff_s`` x 2^(k-1), at most
  ``backoff_max_s``, and says so: a file system, a node or a server that is down gets time to come back.
- stopping: a failure of a rank's own (same step, same cause) that recurred in every attempt of a row of at least
  two, over at least ``window_s`` seconds from its first record to its last, would recur again (a deterministic bug,
  a config the run cannot use, a corrupt input): the attempt stops with one message (exit status
  :data:`EXIT_REPEATED`), records the stop and, under torchrun, asks its agent to stop restarting instead of
  spending every restart on it. A peer's failure seen through a collective is never held against a rank.

Every rank reads the same file and decides alike (the failures' recorded times, not the clock, decide a stop);
rank 0 says what it decided and records it. Clock and sleep are parameters (tests pass their own)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from alignopsd.engine.config.schema import RunConfig
from alignopsd.engine.config.trainer_section import RestartsConfig
from alignopsd.engine.parallel.group import restart_count
from alignopsd.engine.run.attempts import ATTEMPTS_FILE, read_attempt_log, record_start, record_stop
from alignopsd.engine.run.resume import stored_config

EXIT_REPEATED = 3  # the same failure at the same step over the restart window: not restarted again
PACKAGES = ("alignopsd", "alignopsd.engine", "alignopsd.kernels")  # whose Python sources make the code's digest


def _env_count(name: str) -> int:
    try:
        return max(0, int(os.environ.get(name, "0")))
    except ValueError:
        return 0


def restarts_so_far() -> int:
    """This attempt's place in its launch: torchrun's restart count (``parallel.group.restart_count``, read there
    only; 0 outside torchrun or on a new launch)."""
    return restart_count() or 0


def restarted() -> bool:
    """Whether this attempt was started by a machine: a torchrun restart (``TORCHELASTIC_RESTART_COUNT`` > 0) or a
    requeued Slurm job (``SLURM_RESTART_COUNT`` > 0). Only such an attempt can be stopped by a repeated failure."""
    return restarts_so_far() > 0 or _env_count("SLURM_RESTART_COUNT") > 0


def launch_key() -> str:
    """The launch this process belongs to: torchrun's run id, the Slurm job and its requeue count."""
    env = os.environ
    return f"{env.get('TORCHELASTIC_RUN_ID', '-')}/{env.get('SLURM_JOB_ID', '-')}/{_env_count('SLURM_RESTART_COUNT')}"


@dataclass(frozen=True)
class Identity:
    """What a person changes between launches: the digests of the resolved config and of the code."""

    config: str
    code: str


def code_version() -> str:
    """``<version>+<digest>``: the package's version and a SHA-256 of its Python sources, each file named by its
    module (the same in a checkout and an installed wheel)."""
    import alignopsd

    files: dict[str, Path] = {}
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        for root in (spec.submodule_search_locations or []) if spec is not None else []:
            for path in Path(root).rglob("*.py"):
                name = ".".join((package, *path.relative_to(root).with_suffix("").parts))
                files.setdefault(name, path)
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(f"{name}\0".encode() + files[name].read_bytes() + b"\0")
    return f"{alignopsd.__version__}+{digest.hexdigest()[:16]}"


def launch_identity(cfg: RunConfig) -> Identity:
    """This attempt's :class:`Identity`: its resolved config as a checkpoint stores it, and :func:`code_version`."""
    text = json.dumps(stored_config(cfg), sort_keys=True)
    return Identity(hashlib.sha256(text.encode()).hexdigest()[:16], code_version())


@dataclass
class PastAttempt:
    """One recorded attempt: its start and the failures recorded after it."""

    start: dict
    failures: list[dict] = field(default_factory=list)

    def own(self) -> set[tuple[int, str]]:
        return {(f["step"], f["cause"]) for f in self.failures if f.get("kind", "own") == "own"}

    def step(self) -> int | None:
        """The furthest step any of its ranks recorded failing at (None: no record; a kill leaves none)."""
        return max((f["step"] for f in self.failures), default=None)


def past_attempts(records: list[dict]) -> list[PastAttempt]:
    out: list[PastAttempt] = []
    for r in records:
        if r["event"] == "start":
            out.append(PastAttempt(r))
        elif r["event"] == "failure" and out:
            out[-1].failures.append(r)
    return out


def by_hand(records: list[dict]) -> bool:
    """Whether a person launched this attempt: no restart, or a new launch of a run the rule had stopped (the last
    start or stop of the file is a stop of another launch)."""
    if not restarted():
        return True
    if restarts_so_far() > 0:  # torchrun's agent restarted the group: a machine
        return False
    last = next((r for r in reversed(records) if r["event"] in ("start", "stop")), None)
    return last is not None and last["event"] == "stop" and last["launch"] != launch_key()


def held_against(records: list[dict], identity: Identity) -> list[PastAttempt]:
    """The attempts a restart is judged by: the latest in a row with its config and code, back to (and with) the
    last one a person launched."""
    out: list[PastAttempt] = []
    for past in reversed(past_attempts(records)):
        if (past.start.get("config"), past.start.get("code")) != (identity.config, identity.code):
            break
        out.append(past)
        if past.start.get("by_hand"):
            break
    return out[::-1]


def repeated_failure(pasts: list[PastAttempt], settings: RestartsConfig, where: Path) -> str | None:
    """The message that stops a restart judged by ``pasts`` (:func:`held_against`), or None: a rank's own failure
    (same step, same cause) in each of the last two or more attempts, from its first record to its last over at least
    ``settings.window_s`` seconds."""
    if not pasts:
        return None
    for step, cause in sorted(pasts[-1].own()):
        k = 0
        while k < len(pasts) and (step, cause) in pasts[-1 - k].own():
            k += 1
        if k < 2:
            continue
        times = [[f["time"] for f in p.failures if (f["step"], f["cause"]) == (step, cause)] for p in pasts[-k:]]
        span = max(times[-1]) - min(times[0])
        if span < settings.window_s:
            continue
        first, last = pasts[-k].start["attempt"], pasts[-1].start["attempt"]
        which = f"attempts {first} and {last} both" if k == 2 else f"attempts {first} to {last} all"
        at = f"at step {step}" if step else "before its first step"
        return (
            f"{which} failed {at} with the same cause ({cause}), over {span:.0f} s (trainer.restarts.window_s: "
            f"{settings.window_s:g} s); a restart would fail again, so this one stops: fix the cause, then resume "
            f"with --resume auto (attempts: {where})"
        )
    return None


def backoff(pasts: list[PastAttempt], settings: RestartsConfig) -> tuple[float, int]:
    """(seconds to wait, k): k the attempts in a row at the end of ``pasts`` that failed at the same step (an attempt
    that got further than the one before it ends the row; one without a record continues it)."""
    k, later = 0, None
    for past in reversed(pasts):
        step = past.step()
        if step is not None and later is not None and step < later:
            break
        k += 1
        later = step if step is not None else later
    if k == 0:
        return 0.0, 0
    return min(settings.backoff_max_s, settings.backoff_s * 2 ** (k - 1)), k


def begin_attempt(
    out_dir: Path,
    settings: RestartsConfig,
    identity: Identity,
    rank: int,
    say: Callable[[str], None],
    *,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> int | None:
    """The start of an attempt, on every rank: None when the rule stops it (rank 0 said why and recorded the stop;
    exit with :data:`EXIT_REPEATED`); else, after the backoff, its number (rank 0, which records its start; 0 on the
    other ranks). Damaged lines of the file are skipped and said."""
    log = read_attempt_log(out_dir)
    damage = log.said(out_dir / ATTEMPTS_FILE)
    if damage:
        say(f"[train] {damage}")
    hand = by_hand(log.records)
    if not hand:
        pasts = held_against(log.records, identity)
        stop = repeated_failure(pasts, settings, out_dir / ATTEMPTS_FILE)
        if stop is not None:
            say(f"[train] {stop}")
            if rank == 0:
                record_stop(out_dir, launch_key(), clock=clock)
            return None
        wait, k = backoff(pasts, settings)
        if wait > 0:
            step = pasts[-1].step()
            at = "" if step is None else f" (at step {step})" if step else " (before the first step)"
            say(
                f"[train] a restart after {k} failed attempt(s) in a row{at}: waiting {wait:g} s before it starts "
                f"(trainer.restarts: {settings.backoff_s:g} s, doubled per failed attempt, at most "
                f"{settings.backoff_max_s:g} s)"
            )
            sleep(wait)
    if rank != 0:
        return 0
    context = {
        "restart": restarts_so_far(),
        "slurm_restart": _env_count("SLURM_RESTART_COUNT"),
        "launch": launch_key(),
        "by_hand": hand,
        "config": identity.config,
        "code": identity.code,
    }
    return record_start(out_dir, context, clock=clock)


def stop_agent() -> None:
    """Under torchrun, ask the local elastic agent (this worker's parent) to stop the worker group instead of
    restarting it; outside torchrun, nothing."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            parent = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return
    if "torch.distributed.run" in parent or "torchrun" in parent:
        os.kill(os.getppid(), signal.SIGTERM)
