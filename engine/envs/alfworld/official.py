"""ALFWorld's official data: the downloaded games of each split.

The check of ``env.require_official_data`` (engine/config/preflight.py): it mirrors where the task loader looks
and raises a ConfigError where that loader would instead generate its games (or fail later, after the models loaded).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from alignopsd.engine.envs.alfworld.env import SPLITS
from alignopsd.engine.envs.official import OfficialDataQuery, official_data_error

DEFAULT_DATA = "~/.cache/alfworld"  # where alfworld (alfworld.info) and alfworld-download put the data


def alfworld_official_data(data_dir: str | None, splits: tuple[str, ...], env: Mapping[str, str]) -> Path:
    """The ALFWorld data root the loader will read: ``env.data_dir``, else ``$ALFWORLD_DATA``
    (engine/envs/alfworld/env.py official_data_dir), holding ``json_2.1.1/<split>/`` games of each split."""

    where = "env.data_dir" if data_dir else "ALFWORLD_DATA"
    raw = data_dir or env.get("ALFWORLD_DATA")
    layout = "json_2.1.1/{train,valid_seen,valid_unseen}/<task>/<trial>/game.tw-pddl, as `alfworld-download` writes it"
    if not raw:
        default = Path(DEFAULT_DATA).expanduser()
        if (default / "json_2.1.1").is_dir():
            raise official_data_error(
                f"ALFWorld's data is in alfworld's default folder {default}, but neither env.data_dir nor "
                "ALFWORLD_DATA is set, so the run would train on generated games",
                f"export ALFWORLD_DATA={default} or set env.data_dir",
            )
        raise official_data_error(
            "ALFWorld's official data not found (env.data_dir and ALFWORLD_DATA are unset)",
            f"run `alfworld-download` (it fills {DEFAULT_DATA}, or $ALFWORLD_DATA when set), then point "
            f"ALFWORLD_DATA or env.data_dir at the folder holding {layout}",
        )
    root = Path(raw).expanduser()
    if not (root / "json_2.1.1").is_dir():
        raise official_data_error(
            f"{where}={raw} has no json_2.1.1 folder", f"point {where} at the folder holding {layout}"
        )
    for split in splits:
        folder = root / "json_2.1.1" / split
        if split in SPLITS and next(folder.glob("*/*/game.tw-pddl"), None) is None:
            raise official_data_error(
                f"no ALFWorld games of split {split!r} in {folder}", f"{where} must hold the full download ({layout})"
            )
    return root


def check_official_data(query: OfficialDataQuery, environ: Mapping[str, str]) -> None:
    """The registry entry's ``official_data`` check: the run's data place and splits (``query``)."""
    alfworld_official_data(query.data_dir, query.splits, environ)
