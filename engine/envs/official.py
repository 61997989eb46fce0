"""What every environment's official-data check shares (``env.require_official_data``).

Each family's check (engine/envs/<family>/official.py, named by its registry entry's ``official_data``) mirrors where
its task loader looks and raises :func:`official_data_error` where that loader would instead generate its data.
"""

from __future__ import annotations

from alignopsd.engine.infra.errors import README_HINT, ConfigError


def official_data_error(what: str, fix: str) -> ConfigError:
    """The error of an environment's official-data check: what is missing, and the fix."""
    return ConfigError(f"env.require_official_data: {what}; {fix} ({README_HINT})")


def official_splits(cfg) -> tuple[str, ...]:
    """The splits a run reads (``env.split``, then ``env.val_split``), each once: what an official-data check checks."""
    return tuple(dict.fromkeys((cfg.env.split, cfg.env.val_split)))
