"""A run config as plain data: the mapping every checkpoint stores and the YAML a run writes beside its outputs."""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml
from alignopsd.engine.config.schema import RunConfig


def config_to_dict(cfg: Any) -> Any:
    """Plain, YAML-serialisable mapping of a config (round-trips through load_dataclass)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        if type(cfg).__module__ == "alignopsd.config":
            # the algorithm section: its own to_dict leaves out the fields derived from other fields
            # (credit.gamma from rectify.gamma, ...), so a dumped config reloads with --set overrides
            from alignopsd.config import to_dict

            return to_dict(cfg)
        out = {}
        for f in dataclasses.fields(cfg):
            if not f.init:
                continue
            out[f.name] = config_to_dict(getattr(cfg, f.name))
        return out
    if isinstance(cfg, tuple):
        return [config_to_dict(v) for v in cfg]
    if isinstance(cfg, list):
        return [config_to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: config_to_dict(v) for k, v in cfg.items()}
    if hasattr(cfg, "value") and type(cfg).__module__ != "builtins" and not isinstance(cfg, (int, float, str)):
        return cfg.value  # enums
    return cfg


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
