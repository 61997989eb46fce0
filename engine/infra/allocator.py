"""The process's memory allocator: which one a run uses, and the environment that gives a new process another.

An allocator is fixed when a process starts (the dynamic linker reads ``LD_PRELOAD``, glibc its tunables), so a
choice is applied by starting a process with :func:`allocator_env`; :func:`active_allocator` says which one the
current process has, for the run's first lines. The choices (:data:`ALLOCATORS`):

- ``default``: glibc's malloc as the system sets it up. A freed block above its (dynamic) mmap threshold goes back
  to the system at once, and the next tensor of that size faults its pages in again;
- ``glibc``: glibc's malloc with tunables that keep freed memory for reuse (:data:`GLIBC_TUNABLES`: a fixed 32 MiB
  mmap threshold, the largest glibc accepts, and the heap's top trimmed only above 1 GiB);
- ``mimalloc``: mimalloc preloaded from the ``cmeel-mimalloc`` wheel (a dependency of the package on Linux x86-64,
  so ``make install`` brings it; no system package). Not available where the wheel is not installed.

Which one a run takes is a measured choice (bench/allocator.py, bench/results/allocator-*.md); the variable
``ALIGNOPSD_ALLOCATOR`` names another one for a run.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

ALLOCATORS = ("default", "glibc", "mimalloc")
# The measured choice (bench/results/allocator-2026-12-07.md): mimalloc's peak resident memory and page faults were
# the smallest on the quickstart's sampling and update steps; glibc's tunables cut the kernel time but grew the peak.
DEFAULT = "mimalloc"
CHOICE_VAR = "ALIGNOPSD_ALLOCATOR"
GLIBC_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824"
_MAPS = Path("/proc/self/maps")


def mimalloc_path() -> Path | None:
    """The installed ``cmeel-mimalloc`` wheel's shared library, or None."""
    for folder in (sysconfig.get_paths()["platlib"], *sys.path):
        lib = Path(folder or ".") / "cmeel.prefix" / "lib" / "libmimalloc.so"
        if lib.is_file():
            return lib.resolve()
    return None


def available() -> tuple[str, ...]:
    """The choices this installation can start a process with."""
    return tuple(a for a in ALLOCATORS if a != "mimalloc" or mimalloc_path() is not None)


def allocator_env(name: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) set up to start a process with allocator ``name``; the
    other choices' settings are removed. ValueError naming the choices for an unknown or unavailable one."""
    if name not in ALLOCATORS:
        raise ValueError(f"allocator: unknown {name!r}; known: {', '.join(ALLOCATORS)}")
    env = dict(os.environ if base is None else base)
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p and "libmimalloc" not in p]
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and not t.startswith("glibc.malloc.")]
    if name == "glibc":
        tunables.append(GLIBC_TUNABLES)
    elif name == "mimalloc":
        lib = mimalloc_path()
        if lib is None:
            raise ValueError("allocator: 'mimalloc' needs the cmeel-mimalloc wheel (pip install cmeel-mimalloc)")
        preload.insert(0, str(lib))
    for var, parts in (("LD_PRELOAD", preload), ("GLIBC_TUNABLES", tunables)):
        if parts:
            env[var] = ":".join(parts)
        else:
            env.pop(var, None)
    env[CHOICE_VAR] = name
    return env


def active_allocator() -> str:
    """The allocator of this process: ``mimalloc`` when its library is mapped, ``glibc`` when the tunables of
    :data:`GLIBC_TUNABLES` are set, else ``default``."""
    try:
        if "libmimalloc" in _MAPS.read_text():
            return "mimalloc"
    except OSError:
        pass
    return "glibc" if GLIBC_TUNABLES in os.environ.get("GLIBC_TUNABLES", "") else "default"


APPLIED_VAR = "ALIGNOPSD_ALLOCATOR_APPLIED"


def wanted_allocator(env: dict[str, str] | None = None) -> str:
    """The allocator a run asks for: ``ALIGNOPSD_ALLOCATOR`` when set (ValueError naming the choices for an unknown
    one), else :data:`DEFAULT` where this installation has it, else ``default``."""
    env = os.environ if env is None else env
    name = env.get(CHOICE_VAR) or DEFAULT
    if name not in ALLOCATORS:
        raise ValueError(f"{CHOICE_VAR}={name!r}: unknown allocator; known: {', '.join(ALLOCATORS)}")
    if name not in available():
        return "default" if CHOICE_VAR not in env else name
    return name


def restart_under(argv: list[str], module: str) -> None:
    """Start this command again (``python -m module argv...``, same process id) under the wanted allocator when the
    process does not have it; returns when it has it, or when one restart already tried (then the process goes
    on with what it has and :func:`allocator_line` says so)."""
    wanted = wanted_allocator()
    if wanted == active_allocator() or os.environ.get(APPLIED_VAR) == wanted:
        return
    env = allocator_env(wanted)
    env[APPLIED_VAR] = wanted
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)


def allocator_line() -> str:
    """``allocator NAME`` for the run's first lines, with the wanted one where the process could not get it."""
    active, wanted = active_allocator(), os.environ.get(APPLIED_VAR)
    if wanted and wanted != active:
        return f"allocator {active} ({wanted} was asked for and could not be loaded)"
    return f"allocator {active}"
