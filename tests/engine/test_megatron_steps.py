"""Full training steps under the Megatron backend (run as ``torchrun --nproc_per_node=2 -m pytest -m distributed``).

A step here is ``engine.step.run_step``: rollout (guess environment, candidate-choice generator), old log-probs,
teacher pass, estimator, PPO update over mini/micro-batches, weight sync. The Hugging Face backend replays the
same generations (so it trains on the same batch) and is the reference for losses and updated weights.

Tolerances (fp32): tensor parallelism sums the row-parallel partial products and the vocabulary-parallel
log-sum-exp in another order than one full matmul, so log-probs differ by ~1e-6; the loss is compared at 1e-4
relative. The first Adam steps move each weight by about lr * g / (|g| + eps) (close to lr * sign(g)), so a
gradient that differs by rounding moves a weight by a small fraction of lr (two optimizer steps per update
here): weights are compared at 0.1 * lr.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace

import learn_helpers as lh
import pytest
import torch
from alignopsd.engine.generation.choice import ChoiceGenerator
from generator_double import GeneratorDouble

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(os.environ.get("WORLD_SIZE") != "2", reason="needs torchrun --nproc_per_node=2"),
]

LR = 1e-4
STEP = 1  # a step index whose batch has learnable signal (step 0's episodes all fail: no advantage)


class Recorder(GeneratorDouble):
    """The candidate-choice generator, recording every call (prompts, output)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: list = []

    def generate(self, prompts, sampling, *, keep_prompt_cache=False):
        out = self.inner.generate(prompts, sampling)
        self.calls.append((prompts, out))
        return out

    def load_weights(self, state_dict) -> None:
        self.inner.load_weights(state_dict)


class Replay(GeneratorDouble):
    """Returns recorded generations in order, checking that the prompts are the recorded ones."""

    def __init__(self, calls) -> None:
        self.calls = list(calls)

    def generate(self, prompts, sampling, *, keep_prompt_cache=False):
        recorded, out = self.calls.pop(0)
        assert recorded == prompts, "the replayed run asked for other prompts"
        return out

    def load_weights(self, state_dict) -> None:
        return None


def _config(backend_overrides: list[str], extra: list[str] = ()):
    from alignopsd.engine.config.schema import load_config

    lh.register_guess_env()
    out = os.path.join(tempfile.gettempdir(), f"alignopsd-mega-{os.environ.get('MASTER_PORT', '0')}")
    ov = [*lh.GUESS_OVERRIDES, "trainer.total_steps=1", f"output_dir={out}", *backend_overrides, *extra]
    return load_config(str(lh.TINY_CONFIG), ov)


def _parts(cfg, world_size: int, rank: int):
    import torch.distributed as dist
    from alignopsd.engine.run.components import build_components

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return build_components(cfg, device=torch.device("cpu"), rank=rank, world_size=world_size)


def _megatron_parts(extra: list[str], tp: int):
    """The run's parts; the candidate-choice generator samples from the Hugging Face copy that the run's own
    generator holds (on the first rank of each tensor-parallel group: the other ranks have neither)."""
    cfg = _config(["policy.backend=megatron", f"policy.tensor_parallel_size={tp}"], extra)
    parts = _parts(cfg, 2, int(os.environ["RANK"]))
    if parts.generator is not None:
        parts = replace(parts, generator=Recorder(ChoiceGenerator(parts.generator.model, parts.tokenizer)))
    return parts


def _hf_reference(extra: list[str], calls, world_size: int, rank: int):
    """One step of the Hugging Face backend replaying ``calls``: (step metrics, weights after the step)."""
    from alignopsd.engine.step.recipe import run_step

    parts = _parts(_config([], extra), world_size, rank)
    parts = replace(parts, generator=Replay(calls))
    out = run_step(parts, STEP)
    assert out.metrics.get("regions/errors", 0.0) == 0.0
    assert not parts.generator.calls, "the reference made fewer generation calls"
    return out.metrics, parts.policy.hf_state_dict()


def _digest(t: torch.Tensor) -> float:
    w = torch.arange(1, t.numel() + 1, dtype=torch.float64)
    return float((t.reshape(-1).double() * w).sum())


class BatchProbe:
    """Wraps the rescorer: a fingerprint of every batch the step scores (old log-probs and teacher forcing)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.seen: list[float] = []

    def __call__(self, cb, *a, **kw):
        self.seen.append(_digest(cb.input_ids()) + _digest(cb.outcome) + _digest(cb.action_valid.long()))
        return self.inner(cb, *a, **kw)

    def teacher_logprobs(self, cb, pairs, *a, **kw):
        self.seen.append(_digest(cb.teacher_prompt_ids) + (_digest(pairs) if pairs is not None else 0.0))
        return self.inner.teacher_logprobs(cb, pairs, *a, **kw)

    def __getattr__(self, name):  # everything else the step asks of the rescorer (e.g. reads_prompt_cache)
        return getattr(self.inner, name)


def _compare_weights(ours: dict, ref: dict, start: dict) -> None:
    moved = 0.0
    for k, v in ref.items():
        assert (ours[k] - v).abs().max().item() <= 0.1 * LR, k
        moved = max(moved, (v - start[k]).abs().max().item())
    assert moved > 0.5 * LR  # the step really moved the weights


def _reset_parallel_state() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def test_tp_group_trains_on_its_first_ranks_batch():
    """Only the group's first rank has a generator (rank 1 holds none, and no Hugging Face copy), yet both ranks
    of the group score and train on one batch (rank 0's), and both end with the same replicated weights."""
    import torch.distributed as dist
    from alignopsd.engine.step.recipe import run_step

    rank = int(os.environ["RANK"])
    parts = _megatron_parts(["algorithm.estimator=alignopsd"], tp=2)
    assert (parts.generator is None) == (rank == 1)
    assert (getattr(parts.policy, "hf_model", None) is None) == (rank == 1)
    probe = BatchProbe(parts.rescorer)
    parts = replace(parts, rescorer=probe)
    out = run_step(parts, 0)
    assert out.metrics.get("regions/errors", 0.0) == 0.0
    calls = len(parts.generator.calls) if parts.generator is not None else None
    seen: list = [None, None]
    dist.all_gather_object(seen, (probe.seen, out.metrics["episode/reward_mean"], calls))
    assert seen[0][2] >= 2 and seen[1][2] is None  # rollout + teacher generation on rank 0 only
    assert len(seen[0][0]) >= 2 and seen[0][0] == seen[1][0]  # the same student and teacher rows on both
    assert seen[0][1] == seen[1][1]
    assert parts.encoder_factory.cache_info().currsize == (rank == 0)  # only rank 0 loads the encoder
    norms = {n: p.detach().clone() for n, p in parts.policy.model.named_parameters() if "layernorm" in n}
    assert norms
    both: list = [None, None]
    dist.all_gather_object(both, norms)
    for n, v in both[0].items():
        assert torch.equal(v, both[1][n]), n  # replicated weights stayed identical


@pytest.mark.parametrize("estimator", ["grpo", "alignopsd"])
def test_tp2_step_equals_hf_backend(estimator):
    """TP=2, one full step (micro-batches of 8 rows in mini-batches of 16): the loss and the updated weights of
    the Hugging Face backend on the same batch; the weight sync refreshes rank 0's generator with exactly the
    gathered shards."""
    import torch.distributed as dist
    from alignopsd.engine.step.recipe import run_step

    extra = [f"algorithm.estimator={estimator}"]
    parts = _megatron_parts(extra, tp=2)
    start = parts.policy.hf_state_dict()
    out = run_step(parts, STEP)
    assert out.metrics.get("regions/errors", 0.0) == 0.0
    ours = parts.policy.hf_state_dict()
    calls = [parts.generator.calls if parts.generator is not None else None]  # rank 0 generated for the group
    dist.broadcast_object_list(calls, src=0)
    if parts.generator is not None:  # rank 0: the generator's model got the new weights (rank 1 has none)
        synced = parts.generator.inner.model.state_dict()
        assert synced.keys() == ours.keys() and all(torch.equal(synced[k], v) for k, v in ours.items())
    ref_metrics, ref = _hf_reference(extra, calls[0], 1, 0)
    m = out.metrics
    assert m["update/optimizer_steps"] == ref_metrics["update/optimizer_steps"] == 2.0
    for key in ("actor/loss", "actor/pg_loss", "adv/token_advantage_abs_mean"):
        assert abs(m[key] - ref_metrics[key]) <= 1e-4 * max(1e-3, abs(ref_metrics[key])), key
    _compare_weights(ours, ref, start)


def test_warmup_schedule_follows_hf_backend_and_resumes():
    """trainer.optimizer.warmup_ratio reaches the backend: the learning rate of each optimizer step is the Hugging Face
    backend's (lr / 3, 2 lr / 3, lr, lr for three warm-up steps), and the schedule resumes from a checkpoint."""
    import torch.distributed as dist

    parts = _megatron_parts(
        ["trainer.optimizer.warmup_ratio=0.3", "trainer.total_steps=10", "trainer.optimizer.lr=1e-3"], tp=2
    )
    pol = parts.policy
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)

    def step(p):
        lp, _ = p.response_logprobs(ids, mask, 5, grad=True)
        (-lp.mean()).backward()
        return p.optimizer_step(1.0)["lr"]

    lrs = [step(pol)]
    state = pol.optimizer_state()
    lrs += [step(pol) for _ in range(3)]
    expected = [1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3]
    assert lrs == pytest.approx(expected, rel=1e-9)
    from alignopsd.engine.models.loading import build_tiny_model
    from alignopsd.engine.policy.hf import HFPolicy

    hf = HFPolicy(build_tiny_model(), lr=1e-3, warmup_steps=3, ddp=False)
    hf_lrs = []
    for _ in range(4):
        hf_lrs.append(hf.optimizer.param_groups[0]["lr"])
        hf.optimizer.step()
        hf.scheduler.step()
    assert lrs == pytest.approx(hf_lrs, rel=1e-9)
    pol.load_optimizer_state(state)  # back to after the first step: the next one uses 2 lr / 3 again
    assert step(pol) == pytest.approx(2e-3 / 3, rel=1e-9)
    dist.barrier()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_recomputes_and_keeps_gradients(mode):
    """policy.gradient_checkpointing with policy.recompute: the recomputed module runs its forward twice per
    training step (once more in the backward pass) and the gradients equal those without recomputation."""
    from alignopsd.engine.run.policy_builders import build_policy

    ids = torch.randint(3, 200, (3, 14), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    grads, counts = [], []
    for ckpt in (False, True):
        cfg = _config(["policy.backend=megatron", "policy.tensor_parallel_size=2"],
                      [f"policy.gradient_checkpointing={str(ckpt).lower()}", f"policy.recompute={mode}"])  # fmt: skip
        pol = build_policy(cfg, torch.device("cpu"), 2)
        layer = pol.model.decoder.layers[0]
        target = layer if mode == "full" else layer.self_attention.core_attention
        n = [0]
        target.register_forward_hook(lambda *_, n=n: n.__setitem__(0, n[0] + 1))
        pol.zero_grad()
        lp, _ = pol.response_logprobs(ids, mask, 6, grad=True)
        (-lp.mean()).backward()
        counts.append(n[0])
        grads.append({k: p.main_grad.clone() for k, p in pol.model.named_parameters()})
    assert counts == [1, 2]
    for k, g in grads[0].items():
        torch.testing.assert_close(grads[1][k], g, atol=1e-7, rtol=1e-5, msg=k)


@pytest.mark.parametrize(
    "distributed_optimizer",
    [
        False,
        pytest.param(True, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="megatron-core's "
                                                    "distributed optimizer only wraps CUDA parameters")),
    ],
)  # fmt: skip
def test_dp2_step_equals_hf_ddp(distributed_optimizer):
    """TP=1 x DP=2 (with the distributed optimizer: each rank keeps half of the Adam state): one full grpo step
    gives the weights of the Hugging Face backend under DDP on the same batches, and the replicas agree."""
    import torch.distributed as dist
    from alignopsd.engine.step.recipe import run_step

    _reset_parallel_state()
    try:
        rank = int(os.environ["RANK"])
        extra = ["algorithm.estimator=grpo", f"policy.distributed_optimizer={str(distributed_optimizer).lower()}"]
        parts = _megatron_parts(extra, tp=1)
        pol = parts.policy
        assert parts.world_size == 2 and pol.distributed_optimizer == distributed_optimizer
        kind = "DistributedOptimizer" if distributed_optimizer else "FP32Optimizer"
        assert all(type(o).__name__ == kind for o in pol.optimizers())
        start = pol.hf_state_dict()
        out = run_step(parts, STEP)
        assert out.metrics.get("regions/errors", 0.0) == 0.0
        ours = pol.hf_state_dict()
        ref_metrics, ref = _hf_reference(["algorithm.estimator=grpo"], parts.generator.calls, 2, rank)
        assert abs(out.metrics["actor/loss"] - ref_metrics["actor/loss"]) <= 1e-4 * max(
            1e-3, abs(ref_metrics["actor/loss"])
        )
        _compare_weights(ours, ref, start)
        both: list = [None, None]
        dist.all_gather_object(both, float(sum(v.double().sum() for v in ours.values())))
        assert both[0] == both[1]
    finally:
        _reset_parallel_state()
