"""What every environment's official-data check shares (``env.require_official_data``).

Each family's check (engine/envs/<family>/official.py, named by its registry entry's ``official_data``) mirrors where
its task loader looks and raises :func:`official_data_error` where that loader would instead generate its data. It is
handed the values it checks (:class:`OfficialDataQuery`, built from the run's config by the pre-flight,
engine/config/preflight.py), never the config itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from alignopsd.engine.infra.errors import README_HINT, ConfigError


@dataclass(frozen=True)
class OfficialDataQuery:
    """What an official-data check looks for: the run's ``env.data_dir``, the splits the run reads (``env.split``,
    then ``env.val_split``, each once) and its ``env.options``."""

    data_dir: str | None
    splits: tuple[str, ...]
    options: Mapping[str, object] = field(default_factory=dict)


def official_data_error(what: str, fix: str) -> ConfigError:
    """The error of an environment's official-data check: what is missing, and the fix."""
    return ConfigError(f"env.require_official_data: {what}; {fix} ({README_HINT})")
