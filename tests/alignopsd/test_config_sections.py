"""AlgorithmConfig's typed section accessors: each built-in estimator's section as a typed attribute."""

from __future__ import annotations

import typing

import pytest

from alignopsd.config import AlgorithmConfig
from alignopsd.estimators import ESTIMATOR_SECTIONS


def test_the_built_in_sections_are_typed_attributes():
    """Each built-in estimator's section is a typed property (its registered dataclass), read and replaced by
    attribute; the same object as ``section(key)``."""
    cfg = AlgorithmConfig()
    for key in ("rectify", "credit", "alignment", "sdar", "rlsd", "opsd"):
        prop = vars(AlgorithmConfig)[key]
        assert isinstance(prop, property)
        assert typing.get_type_hints(prop.fget)["return"] is ESTIMATOR_SECTIONS[key]
        assert getattr(cfg, key) is cfg.section(key)
    cfg.opsd = ESTIMATOR_SECTIONS["opsd"](mix=0.25)
    assert cfg.section("opsd").mix == 0.25
    with pytest.raises(ValueError, match="^sdar: expected SdarConfig, got OpsdConfig"):
        cfg.sdar = ESTIMATOR_SECTIONS["opsd"]()
