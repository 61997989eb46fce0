"""Whether other work holds the CPUs a run is about to use: a run's first lines name a busy machine.

On a machine of a few cores, two heavy jobs slow each other far more than twice (thread pools oversubscribe: on 2
cores a held-out evaluation took 17 minutes beside another job instead of about 5). :func:`busy_line` compares the
1-minute load average (the processes running or waiting to run, this one's own start included, which is small) with
the CPUs this process may use less the threads the run will keep busy, and returns one line saying so when the rest
is exceeded by half a core or more; None on an idle machine or where the system reports no load average.
"""

from __future__ import annotations

import os

SLACK = 0.5  # cores of load the run tolerates beyond the CPUs its threads leave free (a shell, a logger)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the system has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def busy_line(threads: int, *, load: float | None = None, cpus: int | None = None) -> str | None:
    """One line when the machine is busy for a run of ``threads`` compute threads (``load``: the 1-minute load
    average, ``cpus``: the usable CPUs; both read from the system when None), else None."""
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            return None
    cpus = usable_cpus() if cpus is None else cpus
    free = max(0, cpus - threads)
    if load <= free + SLACK:
        return None
    return (
        f"[machine] busy: load {load:.1f} (1-minute average) on {cpus} CPU(s), and this run keeps {threads} "
        f"thread(s) busy: other work holds about {load - free:.1f} of its cores, so its times will be slower than an "
        "idle machine's (on a few cores, two heavy jobs slow each other more than twice); run it alone to compare times"
    )
