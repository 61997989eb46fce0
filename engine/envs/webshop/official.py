"""WebShop's official data: the original product and instruction files.

The check of ``env.require_official_data`` (engine/config/preflight.py): it mirrors where the task loader looks
and raises a ConfigError where that loader would instead use its generated catalogue
(or fail later, after the models loaded).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from alignopsd.engine.envs.official import OfficialDataQuery, official_data_error
from alignopsd.engine.envs.webshop.env import find_original_files


def webshop_official_data(data_dir: str | None) -> dict[str, str]:
    """WebShop's original files in ``env.data_dir`` (engine/envs/webshop/env.py find_original_files): products
    ``items_shuffle*.json``, instruction attributes ``items_ins_v2*.json`` and human instructions
    ``items_human_ins*.json``."""

    files = "items_shuffle.json, items_ins_v2.json and items_human_ins.json from WebShop's setup.sh -d all"
    if not data_dir:
        raise official_data_error(
            "env.data_dir is unset, so the run would train on the generated catalogue",
            f"set env.data_dir to the folder holding {files}",
        )
    try:
        found = find_original_files(Path(data_dir).expanduser())
    except ValueError as exc:
        raise official_data_error(str(exc), f"env.data_dir must hold {files}") from None
    names = {"attributes": "items_ins_v2*.json", "human_goals": "items_human_ins*.json"}
    for key, pattern in names.items():
        if found[key] is None:
            raise official_data_error(f"env.data_dir: no {pattern} in {data_dir}", f"env.data_dir must hold {files}")
    return {k: str(v) for k, v in found.items()}


def check_official_data(query: OfficialDataQuery, environ: Mapping[str, str]) -> None:
    """The registry entry's ``official_data`` check: the run's data place and splits (``query``)."""
    webshop_official_data(query.data_dir)
