"""Where a benchmark's numbers come from: the commit of the checkout that measured them, and the machine."""

from __future__ import annotations

import subprocess
from pathlib import Path


def commit_line() -> str:
    """The checked-out commit, marked when tracked files differ from it (call it before the run writes its own
    results: a results file tracked from an earlier run would count as a change)."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def machine() -> tuple[str, str]:
    """The CPU's ``lscpu`` model name and its vector-extension flags (avx*, amx*, fma)."""
    try:
        txt = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown", "unknown"
    field = dict(ln.split(":", 1) for ln in txt.splitlines() if ":" in ln)
    flags = [f for f in field.get("Flags", "").split() if f.startswith(("avx", "amx")) or f == "fma"]
    return field.get("Model name", "unknown").strip(), " ".join(flags) or "none listed"
