"""RNG on resume: a rank the checkpoint has no state for derives its own from (seed, rank, step) instead of
copying rank 0's; CUDA states are restored only for devices that are visible; the teacher has its own seed."""

from __future__ import annotations

from pathlib import Path

import learn_helpers as lh
import torch
from alignopsd.engine.checkpoint import checkpoint as ck
from alignopsd.engine.checkpoint.rng_state import restore_rng_state
from alignopsd.engine.step.teacher_pass import teacher_sampling, teacher_seed

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")


def test_new_rank_on_resume_gets_its_own_rng_state(tmp_path):
    tr = lh.build_trainer(TINY, [f"output_dir={tmp_path}", "env.name=guess", "trainer.logging.audit=false"])
    tr.step = 1
    path = tr.save()  # written by a world of one: only rng_rank0
    assert ck.load_checkpoint(path, rank=1, restore_rng=False).rng_state is None

    def draws_after_load(rank: int) -> torch.Tensor:
        tr.rank = rank
        tr.load(path)
        return torch.rand(8)

    rank0, rank1, rank1_again, rank2 = (draws_after_load(r) for r in (0, 1, 1, 2))
    assert not torch.equal(rank0, rank1) and not torch.equal(rank1, rank2)  # not a copy of rank 0's stream
    assert torch.equal(rank1, rank1_again)  # reproducible from (seed, rank, step)
    torch.manual_seed(tr.cfg.trainer.seed + 1000)  # nor the new rank's state at the start of a run
    assert not torch.equal(rank1, torch.rand(8))


def test_cuda_rng_restored_only_for_visible_devices(monkeypatch):
    """A checkpoint written with 2 GPUs visible, resumed with 1: device 0's state is restored, nothing more."""
    calls = []

    def set_state(state, device=0):
        if int(device) >= 1:
            raise RuntimeError(f"invalid device ordinal {device}")
        calls.append(int(device))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
    monkeypatch.setattr(torch.cuda.random, "set_rng_state", set_state)
    state = {"python": __import__("random").getstate(), "numpy": __import__("numpy").random.get_state(),
             "torch": torch.get_rng_state(), "cuda": [torch.zeros(16, dtype=torch.uint8)] * 2}  # fmt: skip
    restore_rng_state(state)
    assert calls == [0]


def test_teacher_sampling_has_its_own_seed():
    from alignopsd.engine.config.schema import load_config

    cfg = load_config(TINY)
    ids = torch.arange(12).reshape(3, 4)
    s0, s1 = teacher_seed(cfg.trainer.seed, 0, ids), teacher_seed(cfg.trainer.seed, 1, ids)
    assert s0 != s1 and s0 == teacher_seed(cfg.trainer.seed, 0, ids.clone())
    assert s0 != teacher_seed(cfg.trainer.seed, 0, ids + 1)  # another step's prompts, another stream
    assert teacher_sampling(cfg, s0).seed == s0
