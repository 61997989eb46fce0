"""One writer per output folder: the run's exclusive lock on ``<output_dir>/run.lock``.

A training run takes the lock before it writes anything into its folder and holds it until it ends. The lock is
an ``fcntl.flock`` on ``run.lock``, whose text names the holder (``host``, ``pid``, start time); the kernel
releases a flock when its holder exits in any way, SIGKILL included, so a lock left by a dead process is taken
over (the new holder says whose it was) and a live holder is never displaced. A second run on the same folder is
refused at once with :class:`OutputLockedError` (a ConfigError: exit code 2) naming the holder. Processes forked
by the holder (environment workers) do not keep the lock: the child's copy of the descriptor is closed at fork.
On release the file is removed while still locked, so a clean exit leaves no ``run.lock`` behind.

Distributed runs take the lock once: rank 0 acquires it and every rank learns the outcome through one gather of
a Python object (:func:`claim_output_dir`), so all ranks raise together when it is refused, or when rank 0's
attempt fails with an I/O error (permission, ``ENOLCK`` on NFS, ``ENOSPC``: :class:`OutputFolderError`, with
that error's message, on every rank), and none writes before rank 0 holds it. Network file systems: Linux NFS
clients implement flock as a whole-file POSIX lock held on the server, so runs on different hosts of one cluster
exclude each other there too.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from alignopsd.engine.config.schema import ConfigError

LOCK_FILE = "run.lock"
_HELD: dict[int, str] = {}  # fd -> lock path of the locks this process holds (closed in forked children)


class OutputLockedError(ConfigError):
    """Another live process holds the output folder's lock."""


class OutputFolderError(OSError):
    """An I/O error on one rank while it prepared the run's output folder (taking the lock, setting history
    aside), raised on every rank of the run with that rank's message."""


def agree_on_failure(work: Callable[[], Any], *, run_here: bool, gather: Callable[[Any], list[Any]] | None, what: str):
    """Run ``work`` where ``run_here`` (rank 0) and let every rank learn its outcome in one gather: an
    OutputLockedError or OSError there ends every rank at once with its message (no rank is left waiting in a
    later collective). Returns ``work()``'s result where it ran, None elsewhere."""
    result, failure = None, None
    if run_here:
        try:
            result = work()
        except OutputLockedError as exc:
            failure = ("locked", str(exc), None)
        except OSError as exc:
            failure = ("io", f"{what}: {exc}", exc.errno)
    if gather is not None:
        failure = next((f for f in gather(failure) if f is not None), None)
    if failure is not None:
        kind, message, err = failure
        if kind == "locked":
            raise OutputLockedError(message)
        raise OutputFolderError(err, message) if err is not None else OutputFolderError(message)
    return result


def _close_in_child() -> None:
    for fd in list(_HELD):
        try:
            os.close(fd)  # the child's duplicate only: the parent's lock stays (flock belongs to the open file)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


def describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "an unknown process (the lock file names no holder)"
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if isinstance(started, (int, float)) else "?"
    return f"host {holder.get('host', '?')} pid {holder.get('pid', '?')} (since {when})"


def _read_holder(fd: int) -> dict[str, Any] | None:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 4096)
    try:
        holder = json.loads(raw.decode()) if raw.strip() else None
    except (UnicodeDecodeError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


class OutputLock:
    """The exclusive lock of one output folder (see the module docstring); :meth:`release` is idempotent."""

    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.path = Path(out_dir) / LOCK_FILE
        self.fd: int | None = None
        self.previous: dict[str, Any] | None = None  # the holder named in a stale lock file this lock took over

    def acquire(self) -> OutputLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = _read_holder(fd)
                os.close(fd)
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
                raise OutputLockedError(
                    f"output folder {self.path.parent} is in use by another run: {describe(holder)} holds "
                    f"{self.path}; wait for it to end, stop it, or choose another output_dir"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the previous holder removed the file while we waited for it: lock the new one
        self.previous = _read_holder(fd)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        os.fsync(fd)
        self.fd = fd
        _HELD[fd] = str(self.path)
        return self

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is None:
            return
        _HELD.pop(fd, None)
        try:
            os.unlink(self.path)  # while locked: a waiter that opened the old file sees it is gone and retries
        except OSError:
            pass
        os.close(fd)

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def claim_output_dir(
    out_dir: str | os.PathLike,
    *,
    rank: int = 0,
    gather: Callable[[Any], list[Any]] | None = None,
    say: Callable[[str], None] | None = None,
) -> OutputLock | None:
    """Rank 0 takes the folder's lock (returned; None on other ranks); with ``gather`` (all-gather of a Python
    object, every rank calls this) every rank raises OutputLockedError when rank 0 was refused, and
    OutputFolderError (an OSError) with rank 0's message when its attempt failed with an I/O error."""
    lock = agree_on_failure(
        lambda: OutputLock(out_dir).acquire(),
        run_here=rank == 0,
        gather=gather,
        what=f"cannot take the lock of output folder {out_dir}",
    )
    if lock is not None and lock.previous and say is not None:
        say(f"[lock] took over the stale lock of {describe(lock.previous)}: that process no longer holds it")
    return lock
