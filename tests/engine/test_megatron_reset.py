"""``reset_optimizer`` of the Megatron backend (run as ``torchrun --nproc_per_node=2 -m pytest -m distributed``): after
updates, the reset policy's next update is the update of a policy built from the same weights with the same settings
(the quickstart pipeline's RL run continuing from the warm start in memory, at tensor parallelism 2)."""

from __future__ import annotations

import os

import learn_helpers as lh
import pytest
import torch

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(os.environ.get("WORLD_SIZE") != "2", reason="needs torchrun --nproc_per_node=2"),
]


def _update(policy, ids, mask) -> None:
    logp, _ = policy.response_logprobs(ids, mask, 4, grad=True)
    (-logp.mean()).backward()
    policy.optimizer_step(1.0)


def test_megatron_reset_optimizer_updates_as_a_fresh_policy_does():
    import torch.distributed as dist
    from alignopsd.engine.config.schema import load_config
    from alignopsd.engine.run.policy_builders import OptimizerSettings, build_policy

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    cfg = load_config(str(lh.TINY_CONFIG), ["policy.backend=megatron", "policy.tensor_parallel_size=2"])
    ids = torch.randint(5, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    cpu = torch.device("cpu")
    trained = build_policy(cfg, cpu, 2, optim=OptimizerSettings(lr=1e-2, weight_decay=0.0, warmup_steps=0))
    for _ in range(2):
        _update(trained, ids, mask)
    weights = trained.hf_state_dict()
    settings = OptimizerSettings(lr=1e-3, weight_decay=0.1, warmup_steps=3)
    fresh = build_policy(cfg, cpu, 2, optim=settings)
    fresh.load_hf_state_dict(weights)
    trained.reset_optimizer(lr=settings.lr, weight_decay=settings.weight_decay, warmup_steps=settings.warmup_steps)
    assert trained.steps == 0
    _update(trained, ids, mask)
    _update(fresh, ids, mask)
    got, want = trained.hf_state_dict(), fresh.hf_state_dict()
    moved = 0
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-7, msg=k)
        moved += int(not torch.equal(v, weights[k]))
    assert moved  # the update moved weights: the comparison compares updates
