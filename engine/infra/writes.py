"""Write failures: a full disk, a file size limit or an I/O error ends the run with one message.

Any write of a run (checkpoint files and their manifest, the Hugging Face export, the warm start's output, audit
records, ``metrics.jsonl`` and the run's side files) goes through :func:`writing`, which turns an ``OSError`` (or
a safetensors error carrying one) whose errno is in :data:`WRITE_ERRNOS` into :class:`WriteFailure`, naming the
file and the cause. The command-line entry points (``alignopsd train``, ``eval``, ``sft``) print its message and
exit with status 1 (:func:`report`), no traceback. Every other error passes through unchanged.

A file size limit (``ulimit -f``) fails a write with EFBIG: the Python interpreter ignores SIGXFSZ from its start,
so the kernel's signal does not kill the process first.
"""

from __future__ import annotations

import errno
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# a full disk or quota, a file size limit, an I/O error of the device
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})
# how libraries that wrap the OS error in their own exception spell its number: safetensors (Rust) "os error 28",
# Python's text of an OSError "[Errno 28]" (inside torch.distributed.checkpoint's CheckpointException)
_ERRNO_IN_TEXT = re.compile(r"os error (\d+)|\[Errno (\d+)\]")


class WriteFailure(RuntimeError):
    """A file of the run could not be written (disk full, file too large, I/O error); names the file and cause."""

    def __init__(self, path: str | os.PathLike, code: int, note: str = "") -> None:
        self.path = Path(path)
        self.code = code
        cause = f"{os.strerror(code)} ({errno.errorcode.get(code, code)})"
        super().__init__(f"cannot write {self.path}: {cause}{'; ' + note if note else ''}")

    def with_note(self, note: str) -> WriteFailure:
        """The same failure with ``note`` appended to its message."""
        return WriteFailure(self.path, self.code, note)


def write_errno(exc: BaseException) -> int | None:
    """The errno of ``exc`` when it is a write failure of :data:`WRITE_ERRNOS`, else None."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno if exc.errno in WRITE_ERRNOS else None
    for m in _ERRNO_IN_TEXT.finditer(str(exc)):
        code = int(m.group(1) or m.group(2))
        if code in WRITE_ERRNOS:
            return code
    return None


@contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Run the block that writes ``path``; a write failure in it becomes :class:`WriteFailure` naming ``path``."""
    try:
        yield
    except WriteFailure:
        raise
    except Exception as exc:
        code = write_errno(exc)
        if code is None:
            raise
        raise WriteFailure(path, code) from None


def report(exc: WriteFailure, prog: str) -> int:
    """Print the one-line message of a write failure on stderr; returns the exit status (1)."""
    print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
    return 1
