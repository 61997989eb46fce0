"""The engine's on-disk cache folder and how a cached folder is built once.

``cache_root()``: ``$ALIGNOPSD_CACHE``, else ``$XDG_CACHE_HOME/alignopsd`` (``~/.cache/alignopsd``): converted models
(``models/``), generated knowledge bases and indexes, retriever logs. ``atomic_cached_dir``: a cached folder built
once even when several worker processes race for it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    """User cache folder of the engine (``$ALIGNOPSD_CACHE``, else ``$XDG_CACHE_HOME/alignopsd``)."""
    env = os.environ.get("ALIGNOPSD_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "alignopsd"


def atomic_cached_dir(target: Path, build: Callable[[Path], None]) -> Path:
    """Return ``target``; if it does not exist, ``build`` it in a temporary sibling and rename it into place.

    Several worker processes may race here; the loser discards its copy, so readers never see half a folder.
    """
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        build(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race
            if not target.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
