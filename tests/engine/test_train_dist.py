"""Data-parallel training under ``torchrun --nproc_per_node=2`` (gloo on CPU)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import learn_helpers as lh
import pytest
import torch
from test_train import GUESS

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")


@pytest.mark.distributed
def test_two_rank_training_keeps_replicas_identical():
    if os.environ.get("WORLD_SIZE") != "2":
        pytest.skip("run under torchrun --nproc_per_node=2")
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(tempfile.gettempdir()) / f"alignopsd-dist-{os.environ.get('MASTER_PORT', '0')}"
    ov = [*GUESS, "algorithm.estimator=grpo", "trainer.total_steps=2",
          f"output_dir={out}", "env.tasks_per_step=4", "trainer.ppo_micro_batch_size=4"]  # fmt: skip
    tr = lh.build_trainer(TINY, ov)
    assert tr.world_size == 2 and tr.parts.policy.distributed
    last = tr.fit()
    sums = [float(sum(v.double().sum() for v in tr.parts.policy.model.state_dict().values()))]
    got: list = [None, None]
    dist.all_gather_object(got, sums)
    assert got[0] == got[1]  # DDP kept both replicas identical
    assert last["update/optimizer_steps"] >= 1
    from alignopsd.engine.checkpoint import latest_checkpoint

    ck = latest_checkpoint(out / "checkpoints")
    assert ck is not None and (ck / "rng_rank0.pt").is_file() and (ck / "rng_rank1.pt").is_file()
    # each data-parallel rank writes the audit records of its own batch, its rank in the file name
    from alignopsd.engine.audit import audit_file, read_audit

    rank = dist.get_rank()
    assert all(audit_file(out / "audit", s, rank).is_file() for s in (1, 2))
    dist.barrier()
    heads = read_audit(out / "audit", 2, kind="step")
    assert sorted(h["rank"] for h in heads) == [0, 1] and all(h["world_size"] == 2 for h in heads)
