"""Graceful preemption: SIGTERM or SIGUSR1 ends the run at the next step boundary with a complete checkpoint.

Schedulers (SLURM, Kubernetes) send SIGTERM, often SIGUSR1 earlier as a warning, then kill the job after a grace
period. During :meth:`Trainer.fit` the first of these signals only records the request and starts a clock of
``trainer.preempt_grace_s`` seconds. At the end of every step the ranks agree through one all-reduce (max) of
their request flags, so every rank stops after the same step whichever rank was signalled; they then write the
checkpoint of that step together (the trainer's ordinary, verified, atomic save; none when that step's
checkpoint was just written) and the run ends with :class:`Preempted`, which the ``train`` command turns into
exit status :data:`EXIT_PREEMPTED` (143). ``--resume auto`` continues from that checkpoint exactly as an
uninterrupted run would have gone on (the checkpoint holds every rank's generator state at the step boundary).
The process ends within the grace: should its shutdown after the checkpoint still be running when the clock runs
out, it exits with 143 then.

When the clock runs out first, or when the signal comes again (more than :data:`REPEAT_AFTER_S` after the first:
a scheduler that signals every process of a job and a ``torchrun`` agent that forwards the same signal make one
request, not two), the process exits at once with :data:`EXIT_FORCED` (124): the checkpoint being written, if
any, stays an unfinished ``.tmp-*`` folder and the previous checkpoint is intact. Signals are read by a watcher
thread through :func:`signal.set_wakeup_fd`, so the clock runs even while the main thread waits in a collective
or a long kernel; the signal handlers are installed only for the duration of ``fit`` (main thread only).

Under ``torchrun`` send the signal to the agent (it forwards SIGTERM to every worker and waits its
``--shutdown_timeout``, 30 s by default, before killing them: keep the grace below it) or to any worker. The agent
forwards SIGUSR1 only when told to (``torchrun --signals_to_handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

EXIT_PREEMPTED = 143  # a complete checkpoint of the last finished step was written: resume with --resume auto
EXIT_FORCED = 124  # the grace ran out or the signal came again: exited at once, the previous checkpoint is intact
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
REPEAT_AFTER_S = 1.0


class Preempted(Exception):
    """The run stopped on a preemption signal after writing the checkpoint of ``step`` (``path``)."""

    def __init__(self, step: int, path: Path | None, cause: str) -> None:
        self.step, self.path, self.cause = step, path, cause
        where = f"checkpoint {path}" if path is not None else "no checkpoint"
        super().__init__(
            f"preempted ({cause}) after step {step}: {where} is complete; continue with --resume auto "
            f"(exit status {EXIT_PREEMPTED})"
        )


def _exit_preempted(signum, frame) -> None:
    os._exit(EXIT_PREEMPTED)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class PreemptionWatch:
    """The signal handling of one ``fit`` (see the module docstring). ``exit`` ends the process (``os._exit``)."""

    def __init__(
        self, grace_s: float, *, say: Callable[[str], None] = _stderr, exit: Callable[[int], None] = os._exit
    ) -> None:
        self.grace_s = float(grace_s)
        self.say, self._exit = say, exit
        self.cause: str | None = None  # what asked to stop (a signal's name, or another rank)
        self.first_at: float | None = None
        self.saved = False
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._old: dict[int, object] = {}
        self._old_fd: int | None = None
        self._pipe: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None

    @property
    def requested(self) -> bool:
        return self.cause is not None

    def install(self) -> PreemptionWatch:
        """Catch SIGTERM and SIGUSR1 until :meth:`close`; does nothing outside the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return self
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._pipe = (r, w)
        self._old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        for sig in SIGNALS:
            self._old[sig] = signal.signal(sig, lambda signum, frame: None)  # the watcher thread acts
        self._thread = threading.Thread(target=self._watch, name="preemption-watch", daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        r = self._pipe[0]
        while True:
            data = os.read(r, 64)
            if not data or b"\0" in data:
                return
            for num in data:
                if num in SIGNALS:
                    self.on_signal(signal.Signals(num).name)

    def on_signal(self, name: str) -> None:
        """A preemption signal arrived (called by the watcher thread)."""
        with self._lock:
            if self.saved:
                self._stop(EXIT_PREEMPTED, f"{name} after the preemption checkpoint was written: exiting")
            elif self.first_at is None:
                self.say(f"[preempt] {name}: stopping after the current step (grace {self.grace_s:g} s)")
                self._arm(name)
            elif time.monotonic() - self.first_at >= REPEAT_AFTER_S:
                self._stop(EXIT_FORCED, f"{name} again: exiting at once; the previous checkpoint is intact")

    def agree(self, cause: str) -> None:
        """Every rank stops: start the clock on a rank that was not signalled itself."""
        with self._lock:
            if self.first_at is None:
                self._arm(cause)

    def _arm(self, cause: str) -> None:
        self.cause, self.first_at = cause, time.monotonic()
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        with self._lock:
            if self.saved:  # the run's own shutdown (closing workers, the process group) outlasted the grace
                self._stop(EXIT_PREEMPTED, f"grace of {self.grace_s:g} s is over; the checkpoint is complete")
            else:
                self._stop(
                    EXIT_FORCED,
                    f"grace of {self.grace_s:g} s ran out before the checkpoint was complete: exiting at once; "
                    "the previous checkpoint is intact",
                )

    def _stop(self, code: int, why: str) -> None:
        self.say(f"[preempt] {why} (exit status {code})")
        self._exit(code)

    def mark_saved(self) -> None:
        """The preemption checkpoint is complete: from now on a further signal, or the end of the grace, exits with
        EXIT_PREEMPTED (the process ends within the grace even when its shutdown is slow)."""
        with self._lock:
            self.saved = True

    def close(self) -> None:
        """Restore the previous signal handling and cancel the clock; after a preemption checkpoint the clock keeps
        running (the process exits with EXIT_PREEMPTED at the end of the grace at the latest) and SIGTERM and
        SIGUSR1 end the process with EXIT_PREEMPTED (a torchrun agent signals the workers still shutting down when
        the first one exits)."""
        with self._lock:
            if self._timer is not None and not self.saved:
                self._timer.cancel()
        if self._pipe is None:
            return
        for sig, old in self._old.items():  # once the checkpoint is written a signal only ends the process
            signal.signal(sig, _exit_preempted if self.saved else old)
        signal.set_wakeup_fd(self._old_fd if self._old_fd is not None else -1)
        r, w = self._pipe
        os.write(w, b"\0")
        self._thread.join(timeout=5)
        os.close(r)
        os.close(w)
        self._pipe, self._old = None, {}
