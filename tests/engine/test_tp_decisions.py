"""Under tensor parallelism the M1 pair selection and the M2 segmentation are decided once per group, on its first
rank: a training step where rank 1 computes a perturbed similarity matrix H still trains both ranks on rank 0's
pairs, spans and advantages (run as ``torchrun --nproc_per_node=2 -m pytest -m distributed``)."""

from __future__ import annotations

import faulthandler
import os
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(os.environ.get("WORLD_SIZE") != "2", reason="needs torchrun --nproc_per_node=2"),
]
TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")


def test_rank1_with_perturbed_H_trains_on_rank0_pairs_and_spans(monkeypatch):
    import torch.distributed as dist
    from alignopsd.engine.config.schema import load_config
    from alignopsd.engine.run.trainer import Trainer
    from alignopsd.engine.step import recipe as step_mod
    from alignopsd.engine.step import teacher_pass

    faulthandler.dump_traceback_later(180, exit=True)  # diverging forwards would hang the group
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(tempfile.gettempdir()) / f"alignopsd-tp-decide-{os.environ.get('MASTER_PORT', '0')}"
    sets = ["policy.backend=megatron", "policy.tensor_parallel_size=2", "env.max_turns=2", "env.group_n=4",
            "generation.max_response_length=8", "env.teacher_max_response_length=8", "algorithm.kl_coef=0.0",
            "algorithm.estimator=alignopsd", "trainer.logging.audit=false", "algorithm.rectify.gamma=-0.99",
            "algorithm.rectify.top_k=1", f"output_dir={out}"]  # fmt: skip
    tr = Trainer(load_config(TINY, sets))
    # the tiny model writes no valid thinking: every turn is made eligible so that pairs exist to select from
    elig = teacher_pass.eligibility
    monkeypatch.setattr(teacher_pass, "eligibility", lambda t, r, sv, tv: elig(t, r, sv | True, tv | True))
    if rank == 1:  # this rank's H is not the lead's: noise on every similarity

        def perturbed(*a, **k):
            h = real(*a, **k)
            noise = torch.rand(h.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
            return (h + noise.to(h.device, h.dtype)).clamp(-1.0, 1.0)

        real = teacher_pass.similarity_matrix
        monkeypatch.setattr(teacher_pass, "similarity_matrix", perturbed)
    seen: dict = {}
    scorer = tr.parts.rescorer.teacher_logprobs

    def record_pairs(cb, pairs, **kw):
        seen["pairs"] = None if pairs is None else pairs.detach().cpu().clone()
        return scorer(cb, pairs, **kw)

    monkeypatch.setattr(tr.parts.rescorer, "teacher_logprobs", record_pairs)
    update = step_mod.ppo_update

    def record_update(parts, cb, old_logp, ref_logp, adv_ML, aux):
        seen["adv"] = adv_ML.detach().cpu().clone()
        return update(parts, cb, old_logp, ref_logp, adv_ML, aux)

    monkeypatch.setattr(step_mod, "ppo_update", record_update)
    res = step_mod.run_step(tr.parts, 0)
    seen["spans"] = list(res.span_lengths)
    both: list = [None, None]
    dist.all_gather_object(both, seen)
    faulthandler.cancel_dump_traceback_later()
    a, b = both
    assert a["pairs"] is not None and a["pairs"].shape[0] > 0, "the step selected no pair: nothing is tested"
    assert torch.equal(a["pairs"], b["pairs"])
    assert a["spans"] == b["spans"] and len(a["spans"]) > 0
    assert torch.equal(a["adv"], b["adv"])
