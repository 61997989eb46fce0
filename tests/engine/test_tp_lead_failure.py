"""A failing first rank of a tensor-parallel group does not hang its group: the rollout broadcast and the
part-by-part weight sync carry its error to every rank, which raises it at once (run as ``torchrun
--nproc_per_node=2 -m pytest -m distributed``)."""

from __future__ import annotations

import faulthandler
import os
import time
from types import SimpleNamespace

import pytest
import torch
from generator_double import GeneratorDouble

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(os.environ.get("WORLD_SIZE") != "2", reason="needs torchrun --nproc_per_node=2"),
]


@pytest.fixture(scope="module")
def policy():
    from alignopsd.engine.models.loading import build_tiny_model
    from alignopsd.engine.policy.megatron.backend import MegatronPolicy

    model = build_tiny_model().float().eval()
    return MegatronPolicy(model.config, model.state_dict(), tp=2)


@pytest.fixture(autouse=True)
def watchdog():
    """A hang (the bug) ends the process with its stacks after 120 s instead of the collective's 30 minutes."""
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def test_failing_lead_rollout_raises_on_every_rank(policy):
    from alignopsd.engine.parallel.tp_broadcast import LeadRankError
    from alignopsd.engine.step.group_sampling import group_rollout

    calls = []

    def run():
        calls.append(policy.tp_rank)
        raise ValueError("prompt of 900 tokens is over max_prompt_length 512 (truncation 'error')")

    t0 = time.monotonic()
    expected = ValueError if policy.tp_rank == 0 else LeadRankError
    with pytest.raises(expected, match="over max_prompt_length 512"):
        group_rollout(SimpleNamespace(policy=policy), run)
    assert time.monotonic() - t0 < 60
    assert calls == ([0] if policy.tp_rank == 0 else [])  # only the first rank samples
    # the group is still in step: the next broadcast delivers the first rank's result everywhere
    assert group_rollout(SimpleNamespace(policy=policy), lambda: ("batch", {"n": 3.0})) == ("batch", {"n": 3.0})


class _Engine(GeneratorDouble):
    """A generation engine on the first rank that runs out of memory after ``fail_after`` weights."""

    def __init__(self, fail_after: int | None) -> None:
        self.fail_after = fail_after
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights) -> None:
        for name, t in weights:
            if self.fail_after is not None and len(self.loaded) == self.fail_after:
                raise RuntimeError("CUDA out of memory (injected while loading weights)")
            self.loaded[name] = t


def test_failing_lead_weight_sync_raises_on_every_rank(policy):
    from alignopsd.engine.parallel.tp_broadcast import LeadRankError
    from alignopsd.engine.step.components import Components

    lead = policy.tp_rank == 0
    parts = SimpleNamespace(policy=policy, generator=_Engine(fail_after=3) if lead else None)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError if lead else LeadRankError, match="out of memory"):
        Components.sync_weights(parts)
    assert time.monotonic() - t0 < 60
    # every gather of the failed sync completed: a full sync right after loads every weight
    parts.generator = _Engine(fail_after=None) if lead else None
    Components.sync_weights(parts)
    if lead:
        assert len(parts.generator.loaded) >= 3 and "model.embed_tokens.weight" in parts.generator.loaded
