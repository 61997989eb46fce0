"""Where a benchmark's numbers come from: the commit of the checkout that measured them."""

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
