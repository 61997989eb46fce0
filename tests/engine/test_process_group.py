"""The process group (engine/parallel/group.py): its backend follows the device kind, NCCL on CUDA and gloo elsewhere,
for the trainer's processes and Megatron's alike."""

from __future__ import annotations

import pytest
from alignopsd.engine.parallel import group


@pytest.mark.parametrize("kind, backend", [("cuda", "nccl"), ("cpu", "gloo")])
def test_backend_follows_the_device_kind(kind, backend, monkeypatch):
    made = []
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setattr(group.dist, "init_process_group", lambda **kw: made.append(kw))
    group.start_process_group(kind)
    assert made == [{"backend": backend}]
