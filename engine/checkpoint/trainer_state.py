"""``trainer_state.json`` of a checkpoint: read and checked field by field (types, ranges) before it is used.

The file is written by checkpoint.py (this folder) and verified against the checkpoint's manifest before it is read; a
field of the wrong type or out of range (``"step": "two"``) is refused as a damaged checkpoint would be
(ManifestError naming the file and the field): ``--resume auto`` falls back past it, and the commands exit with
code 2.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from alignopsd.engine.checkpoint.manifest import ManifestError

STATE_FILE = "trainer_state.json"

# trainer_state.json: field -> (accepted types, lowest value or None, required)
_STATE_FIELDS: dict[str, tuple[tuple[type, ...], int | None, bool]] = {
    "step": ((int,), 0, True),
    "world_size": ((int,), 1, False),
    "span_lengths_count": ((int,), 0, False),
    "sharded": ((bool,), None, False),
    "complete": ((bool,), None, False),
    "config_name": ((str,), None, False),
    "run_config": ((dict,), None, False),
    "data_position": ((dict,), None, False),
}


def read_trainer_state(path: str | os.PathLike) -> dict[str, Any]:
    """``trainer_state.json`` of checkpoint ``path``, its fields checked (types, ranges); ManifestError naming the
    file and the first bad field otherwise. The caller has verified the file against the manifest."""
    where = Path(path) / STATE_FILE
    try:
        state = json.loads(where.read_bytes())
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{where}: unreadable ({exc})") from None
    if not isinstance(state, dict):
        raise ManifestError(f"{where}: expected a JSON object, got {type(state).__name__}")
    for key, (types, low, required) in _STATE_FIELDS.items():
        if key not in state:
            if required:
                raise ManifestError(f"{where}: {key!r} is missing")
            continue
        value = state[key]
        ok = isinstance(value, types) and (bool not in types) == (not isinstance(value, bool))
        if not ok or (low is not None and value < low):
            want = "/".join(t.__name__ for t in types) + ("" if low is None else f" >= {low}")
            raise ManifestError(f"{where}: {key!r} must be {want}, got {str(json.dumps(value))[:80]}")
    return state
