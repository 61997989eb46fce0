"""The data-parallel split: work dealt to data-parallel groups comes in whole, equal shares.

A step deals ``env.tasks_per_step`` whole tasks to the data-parallel groups (engine/step/episodes.py), the warm start
deals each batch's examples to its ranks (engine/step/supervised.py), and the plan sizes a step per group
(engine/lab/step_plan.py): each share must be the same whole number. :func:`check_split` is that rule, with the
one message every place gives.
"""

from __future__ import annotations

from alignopsd.engine.infra.errors import ConfigError


def check_split(count: int, groups: int, *, key: str, items: str, groups_from: str = "") -> None:
    """Refuse ``count`` ``items`` that do not split evenly over ``groups`` data-parallel groups: ConfigError naming
    ``key``, the setting to change (``groups_from``: how the group count came about, said in brackets)."""
    if groups < 1:
        raise ValueError(f"groups: expected >= 1 data-parallel group, got {groups}")
    if count % groups:
        how = f" ({groups_from})" if groups_from else ""
        raise ConfigError(
            f"{key}: {count} {items} do not split evenly over {groups} data-parallel groups{how}; "
            f"allowed: a multiple of {groups}"
        )
