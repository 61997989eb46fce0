"""Checkpoints of the project's first format (no ``format_version``; committed under tests/assets/checkpoint_v1,
written by that format's code) still load and resume."""

from __future__ import annotations

from pathlib import Path

import torch
from alignopsd.engine.checkpoint import checkpoint as ck
from alignopsd.engine.config.schema import load_config
from alignopsd.engine.run.resume import check_resume

ROOT = Path(__file__).resolve().parents[2]
V1 = ROOT / "tests" / "assets" / "checkpoint_v1" / "step_000002"


def test_a_first_format_checkpoint_loads():
    got = ck.load_checkpoint(V1, restore_rng=False)
    assert torch.equal(got["model_state"]["w"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert torch.equal(got["optimizer_state"]["state"][0]["exp_avg"], torch.full((2, 3), 0.5))
    assert got["trainer_state"]["step"] == 2 and got["trainer_state"]["data_position"]["step"] == 2
    assert got["rng_state"] is not None and got["shards"] is None


def test_a_first_format_checkpoint_resumes_its_config():
    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), [])
    assert check_resume(V1, cfg) == []
