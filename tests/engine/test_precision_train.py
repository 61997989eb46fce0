"""A bf16 policy through the whole trainer: fp32 master weights in the optimizer, saved with the checkpoint,
so a resumed run continues exactly (the bf16 weights alone would not carry the masters' low bits)."""

from __future__ import annotations

from pathlib import Path

import learn_helpers as lh
import pytest
import torch
from alignopsd.engine.observe.metrics import read_metrics
from alignopsd.engine.policy.mixed_precision import MasterAdamW

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")


def _overrides(out: Path) -> list[str]:
    return [
        "env.name=guess",
        "env.max_turns=2",
        "env.history_length=1",
        "env.group_n=4",
        "env.tasks_per_step=4",
        "env.num_games=8",
        "algorithm.kl_coef=0.0",
        "algorithm.estimator=grpo",
        "trainer.optimizer.lr=1e-5",
        "trainer.ppo.mini_batch_size=16",
        "trainer.ppo.micro_batch_size=8",
        "model.dtype=bfloat16",
        "trainer.total_steps=3",
        "trainer.checkpoint.save_freq=1",
        "trainer.checkpoint.keep_last=3",
        f"output_dir={out}",
    ]


@pytest.mark.slow
def test_bf16_run_keeps_fp32_masters_and_resumes_exactly(tmp_path):
    torch.set_num_threads(1)
    straight = lh.build_trainer(TINY, _overrides(tmp_path / "a"))
    policy = straight.parts.policy
    assert next(policy.model.parameters()).dtype == torch.bfloat16 and isinstance(policy.optimizer, MasterAdamW)
    straight.fit()
    masters = [m.clone() for m in policy.optimizer.masters]
    assert any(not torch.equal(m, p.float()) for m, p in zip(masters, policy.params))  # finer than bf16

    resumed = lh.build_trainer(TINY, _overrides(tmp_path / "b"))
    resumed.fit(resume=str(tmp_path / "a" / "checkpoints" / "step_000002"))
    for a, b in zip(masters, resumed.parts.policy.optimizer.masters):
        assert torch.equal(a, b)
    last_a = read_metrics(tmp_path / "a" / "metrics.jsonl")[-1]
    last_b = read_metrics(tmp_path / "b" / "metrics.jsonl")[-1]
    assert last_a["step"] == last_b["step"] == 3
    for k in ("actor/loss", "actor/grad_norm", "episode/reward_mean"):
        assert last_a[k] == last_b[k], k


def test_weights_loaded_without_optimizer_state_reseed_the_masters(tmp_path):
    """A checkpoint with weights and no optimizer file: the fp32 masters start from the loaded weights, so the
    first optimizer step moves the loaded weights (not the stale masters written back over them)."""
    from alignopsd.engine.checkpoint.checkpoint import save_checkpoint

    tr = lh.build_trainer(TINY, _overrides(tmp_path / "run"))
    policy = tr.parts.policy
    loaded = {k: (v + 0.25 * torch.ones_like(v)).to(v.dtype) for k, v in policy.model.state_dict().items()}
    path = save_checkpoint(tmp_path / "ck", 1, model_state=loaded, optimizer_state=None,
                           hf_config=policy.model.config)  # fmt: skip
    tr.load(path)
    named = dict(policy.model.named_parameters())
    for m, p in zip(policy.optimizer.masters, policy.params):
        assert torch.equal(m, p.float())
    for g in policy.optimizer.param_groups:
        g["lr"] = 1e-9  # a step far below the 0.25 the loaded weights moved by
    for p in policy.params:
        p.grad = torch.ones_like(p)
    assert policy.optimizer_step(None)["skipped"] is False
    for name, p in named.items():  # stale masters would put the weights back 0.25 away
        assert float((p.float() - loaded[name].float()).abs().max()) < 1e-6, name
