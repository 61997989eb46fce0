"""A run config as plain data: the mapping every checkpoint stores and the YAML a run writes beside its outputs."""

from __future__ import annotations

from typing import Any

import yaml
from alignopsd.engine.config.schema import RunConfig
from pydantic import BaseModel

from alignopsd.config import AlgorithmConfig, to_dict


def config_to_dict(cfg: Any) -> Any:
    """Plain, YAML-serialisable mapping of a config, in the fields' order (round-trips through load_config)."""
    if isinstance(cfg, BaseModel):
        return {name: config_to_dict(getattr(cfg, name)) for name in type(cfg).model_fields}
    if isinstance(cfg, AlgorithmConfig):
        # the algorithm section: its own to_dict leaves out the fields derived from other fields
        # (credit.gamma from rectify.gamma, ...), so a dumped config reloads with --set overrides
        return to_dict(cfg)
    if isinstance(cfg, (tuple, list)):
        return [config_to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: config_to_dict(v) for k, v in cfg.items()}
    return cfg


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
