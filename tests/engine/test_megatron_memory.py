"""What a Megatron run holds per rank (run as ``torchrun --nproc_per_node=2 -m pytest -m distributed``).

No full Hugging Face model stays on a rank unless Hugging Face generation samples from it, the KL reference is a
frozen shard like the policy's, and its log-probs equal the Hugging Face backend's reference log-probs.

Tolerance (fp32, TP=2): the shards sum the row-parallel partial products and the vocabulary-parallel log-sum-exp
in another order than one full matmul, so the reference log-probs differ from the Hugging Face model's by ~1e-6;
compared at 1e-5 absolute.
"""

from __future__ import annotations

import gc
import os
import tempfile
from dataclasses import replace

import learn_helpers as lh
import pytest
import torch
from alignopsd.engine.generation.choice import ChoiceGenerator
from alignopsd.engine.parallel.tp_broadcast import LeadRankError
from generator_double import GeneratorDouble
from test_megatron_steps import Recorder, Replay

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(os.environ.get("WORLD_SIZE") != "2", reason="needs torchrun --nproc_per_node=2"),
]

STEP = 1  # a step index whose batch has learnable signal
# one mini-batch: every loss term of the step is computed before the (single) optimizer step
KL = ["algorithm.estimator=grpo", "algorithm.kl_coef=0.05", "trainer.ppo.mini_batch_size=64"]


def config(overrides: list[str]):
    from alignopsd.engine.config.schema import load_config

    lh.register_guess_env()
    out = os.path.join(tempfile.gettempdir(), f"alignopsd-megmem-{os.environ.get('MASTER_PORT', '0')}")
    return load_config(str(lh.TINY_CONFIG), [*lh.GUESS_OVERRIDES, "trainer.total_steps=1", f"output_dir={out}",
                                             *overrides])  # fmt: skip


def build(cfg, world_size: int, rank: int):
    import torch.distributed as dist
    from alignopsd.engine.run.components import build_components

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return build_components(cfg, device=torch.device("cpu"), rank=rank, world_size=world_size)


def live_hf_params() -> int:
    """Parameter elements held by the Hugging Face models alive in this process (each storage counted once)."""
    from transformers import PreTrainedModel

    gc.collect()
    seen: dict[int, int] = {}
    for o in gc.get_objects():
        if isinstance(o, PreTrainedModel):
            seen.update({p.data_ptr(): p.numel() for p in o.parameters()})
    return sum(seen.values())


@pytest.mark.parametrize("generation", ["vllm", "hf"])
def test_rank_holds_shards_and_a_hf_copy_only_for_hf_generation(generation):
    """The objects a TP=2 rank keeps after building its policy and reference (the CPU shim's real megatron-core
    modules): no Hugging Face model survives the build with vLLM generation, nor on rank 1 (which never
    generates), the policy and the reference are
    shards of S parameters each (``engine.memory.shard_params``: the report's arithmetic on the live objects),
    the reference's storage is its own, frozen and equal to the policy's initial shard."""
    from alignopsd.engine.lab.megatron_memory import full_params, shard_params
    from alignopsd.engine.policy.megatron.convert import Dims
    from alignopsd.engine.run.components import build_reference
    from alignopsd.engine.run.policy_builders import build_policy, hf_model_of

    cfg = config(["policy.backend=megatron", "policy.tensor_parallel_size=2", f"generation.backend={generation}", *KL])
    before = live_hf_params()
    policy = build_policy(cfg, torch.device("cpu"), 2)
    ref = build_reference(cfg, policy, torch.device("cpu"))
    kept = live_hf_params() - before
    dims = Dims.from_hf_config(policy.hf_config)
    s = shard_params(dims, 2)
    assert sum(p.numel() for p in policy.model.parameters()) == s < full_params(dims)
    assert sum(p.numel() for p in ref.model.parameters()) == s
    if generation == "vllm" or policy.tp_rank > 0:
        assert kept == 0 and getattr(policy, "hf_model", None) is None
        assert hf_model_of(policy) is policy.model
    else:  # Hugging Face generation samples from the one copy the group's first rank keeps
        assert kept == full_params(dims) and hf_model_of(policy) is policy.hf_model
    pol = dict(policy.model.named_parameters())
    ptrs = {p.data_ptr() for p in pol.values()}
    for name, p in ref.model.named_parameters():
        assert not p.requires_grad and p.data_ptr() not in ptrs
        assert torch.equal(p, pol[name]), name


def probe(scorer, seen: list):
    def call(cb, *a, **kw):
        out = scorer(cb, *a, **kw)
        seen.append((cb, out.old_logp.clone()))
        return out

    return call


@pytest.mark.slow
def test_tp2_reference_logprobs_equal_hf_backend_and_stay_initial():
    """TP=2, one grpo step with the KL term (one mini-batch): the frozen shard's reference log-probs equal the
    Hugging Face backend's reference model on the same batch (1e-5 absolute), the loss, policy-gradient and KL terms
    match (1e-4 relative), and after the update the reference still scores the initial weights while the policy has
    moved."""
    import torch.distributed as dist
    from alignopsd.engine.step.recipe import run_step

    rank = int(os.environ["RANK"])
    parts = build(config(["policy.backend=megatron", "policy.tensor_parallel_size=2", *KL]), 2, rank)
    if parts.generator is not None:  # rank 0: the candidate-choice generator on its generator's Hugging Face copy
        parts = replace(parts, generator=Recorder(ChoiceGenerator(parts.generator.model, parts.tokenizer)))
    ours: list = []
    parts = replace(parts, ref_scorer=probe(parts.ref_scorer, ours))
    out = run_step(parts, STEP)
    assert out.metrics.get("regions/errors", 0.0) == 0.0
    calls = [parts.generator.calls if parts.generator is not None else None]
    dist.broadcast_object_list(calls, src=0)

    hf = build(config(KL), 1, 0)
    theirs: list = []
    hf = replace(hf, generator=Replay(calls[0]), ref_scorer=probe(hf.ref_scorer, theirs))
    ref_out = run_step(hf, STEP)
    assert ref_out.metrics.get("regions/errors", 0.0) == 0.0
    assert len(ours) == len(theirs) == 1
    (cb, mine), (_, ref_logp) = ours[0], theirs[0]
    mask = cb.response_mask.bool()
    assert mask.any() and (ref_logp[mask] < 0).all()
    torch.testing.assert_close(mine, ref_logp, atol=1e-5, rtol=0)
    assert out.metrics["update/optimizer_steps"] == ref_out.metrics["update/optimizer_steps"] == 1.0
    for key in ("actor/loss", "actor/pg_loss", "actor/kl_loss"):
        assert abs(out.metrics[key] - ref_out.metrics[key]) <= 1e-4 * max(1e-3, abs(ref_out.metrics[key])), key
    again = parts.ref_scorer(cb, student=True, teacher=False).old_logp
    assert torch.equal(again, mine)  # frozen: the update did not reach the reference
    moved = parts.rescorer(cb, student=True, teacher=False).old_logp
    assert (moved - mine)[mask].abs().max() > 1e-6  # ... while the policy did move


class EngineStub(GeneratorDouble):
    """Stands in for the vLLM engine (which needs minutes to start on CPU): keeps a copy of every weight pushed."""

    def __init__(self) -> None:
        self.pushed: list[dict[str, torch.Tensor]] = []

    def load_weights(self, weights) -> None:
        self.pushed.append({k: v.clone() for k, v in weights})


@pytest.mark.parametrize("generation", ["vllm", "hf"])
def test_only_the_groups_first_rank_builds_a_generator(generation, monkeypatch):
    """build_components at TP=2: rank 0 builds the generation engine (vLLM: it receives the policy's weights,
    gathered from the shards, exactly; Hugging Face: its model is the one Hugging Face copy), rank 1 builds none
    and holds no Hugging Face parameters."""
    from alignopsd.engine.generation import vllm_backend as vb
    from alignopsd.engine.generation.hf import HFGenerator
    from alignopsd.engine.lab.megatron_memory import full_params
    from alignopsd.engine.policy.megatron.convert import Dims

    monkeypatch.setattr(vb.VLLMBackend, "from_settings", classmethod(lambda cls, s, tokenizer=None: EngineStub()))
    rank = int(os.environ["RANK"])
    before = live_hf_params()
    parts = build(config(["policy.backend=megatron", "policy.tensor_parallel_size=2",
                          f"generation.backend={generation}", *KL]), 2, rank)  # fmt: skip
    kept = live_hf_params() - before
    gathered = parts.policy.hf_state_dict()
    if rank == 1:
        assert parts.generator is None and kept == 0 and getattr(parts.policy, "hf_model", None) is None
    elif generation == "vllm":
        assert isinstance(parts.generator, EngineStub) and kept == 0
        (pushed,) = parts.generator.pushed  # the first sync, at build
        assert pushed.keys() == gathered.keys() and all(torch.equal(pushed[k], v) for k, v in gathered.items())
    else:
        assert isinstance(parts.generator, HFGenerator) and parts.generator.model is parts.policy.hf_model
        assert kept == full_params(Dims.from_hf_config(parts.policy.hf_config))


def test_weight_sync_gathers_one_part_at_a_time_to_rank_0():
    """After the shards change, ``sync_weights`` gives rank 0's generator exactly the gathered shards, streamed
    one conversion part at a time: when a part's first weight arrives, every weight of the parts before it has
    been freed. Rank 1 receives nothing. A generator that leaves weights unread is an error, not a hang."""
    import weakref

    import torch.distributed as dist

    class PartWatcher(GeneratorDouble):
        """Loads nothing (keeps a checksum); records, per weight, how many earlier parts' weights are alive."""

        def __init__(self, tied: bool, stop_after: int | None = None) -> None:
            self.tied = tied
            self.refs: list = []
            self.names: list[str] = []
            self.stale = 0
            self.sums: dict[str, float] = {}
            self.stop_after = stop_after

        def load_weights(self, weights) -> None:
            for i, (name, value) in enumerate(weights):
                if self.stop_after is not None and i == self.stop_after:
                    return
                hf_part = (name.split(".")[2] if name.startswith("model.layers.") else "embedding"
                           if name == "model.embed_tokens.weight" or (name == "lm_head.weight" and self.tied)
                           else "final")  # fmt: skip
                self.stale += sum(r() is not None for r, p in self.refs if p != hf_part)
                self.refs = [(r, p) for r, p in self.refs if p == hf_part] + [(weakref.ref(value), hf_part)]
                self.names.append(name)
                self.sums[name] = float(value.double().sum())

    rank = int(os.environ["RANK"])
    parts = build(config(["policy.backend=megatron", "policy.tensor_parallel_size=2", "generation.backend=hf"]),
                  2, rank)  # fmt: skip
    with torch.no_grad():
        for i, p in enumerate(parts.policy.model.parameters()):
            p.add_(0.01 * (i + 1) * (rank + 1))  # shards now differ from the Hugging Face copy
    parts.sync_weights()
    gathered = parts.policy.hf_state_dict()
    if rank == 0:
        synced = parts.generator.model.state_dict()
        assert synced.keys() == gathered.keys() and all(torch.equal(synced[k], v) for k, v in gathered.items())
    tied = parts.policy.dims.tied
    watcher = PartWatcher(tied) if rank == 0 else None
    parts = replace(parts, generator=watcher)
    parts.sync_weights()
    if rank == 0:
        assert watcher.names == list(gathered) and watcher.stale == 0
        assert watcher.sums == {k: float(v.double().sum()) for k, v in gathered.items()}
    parts = replace(parts, generator=PartWatcher(tied, stop_after=3) if rank == 0 else None)
    # the first rank raises its error; the group's other rank learns it and raises too (no rank is left waiting)
    expected = RuntimeError if rank == 0 else LeadRankError
    with pytest.raises(expected, match="left .* weights of the sync unread"):
        parts.sync_weights()
    dist.barrier()
