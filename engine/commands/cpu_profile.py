"""``python -m alignopsd.engine.commands.cpu_profile NAME -- COMMAND ...``: run ``COMMAND`` as if the CPU had only
the instruction sets of profile ``NAME`` (``make run-avx2``). The profiles and what each variable holds:
engine/parallel/cpu_profile.py.
"""

from __future__ import annotations

import os
import sys

from alignopsd.engine.parallel.cpu_profile import PROFILES, profile_env

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``cpu_profile NAME -- COMMAND ...``: replace this process by ``COMMAND`` under the profile (exit code 2 with
    a one-line message for a bad call)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[1] != "--":
        print(f"usage: cpu_profile {{{','.join(sorted(PROFILES))}}} -- COMMAND [ARGS ...]", file=sys.stderr)
        return 2
    try:
        env = profile_env(args[0])
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"[cpu profile] {args[0]}: " + " ".join(f"{k}={v!r}" for k, v in PROFILES[args[0]].items()), flush=True)
    os.execvpe(args[2], args[2:], env)
    return 0  # not reached: execvpe replaces the process or raises


if __name__ == "__main__":
    sys.exit(main())
