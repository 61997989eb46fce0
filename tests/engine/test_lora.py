"""LoRA (model.lora): tiny.yaml trained two steps through peft adapters, for GRPO and AlignOPSD (both with the KL
reference pass): only the adapters change, the reference is the frozen base of the same module, the checkpoint holds
the adapter in peft's layout beside the merged export, which reproduces the adapted model's log-probs, and a resume
from step 1 reaches step 2 bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import learn_helpers as lh
import pytest
import torch
from alignopsd.engine.checkpoint.checkpoint import load_checkpoint
from alignopsd.engine.checkpoint.statefile import load_state
from alignopsd.engine.config.errors import ConfigError
from alignopsd.engine.config.schema import load_config
from alignopsd.engine.observe.metrics import read_metrics

pytest.importorskip("peft")

TINY = str(lh.TINY_CONFIG)
LORA = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8", "algorithm.kl_coef=0.01"]
MERGE_ATOL = 1e-5  # fp32 (the suite's dtype): W x + s B (A x) against (W + s B A) x, rounding only


def _rows(n: int = 3, prompt: int = 7, response: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``[prompt | response]`` rows of the tiny vocabulary, the first row's prompt left-padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 400, (n, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return ids, mask


@torch.no_grad()
def _logprobs(model, ids: torch.Tensor, mask: torch.Tensor, response: int = 5) -> torch.Tensor:
    """[B, L] response log-probs of ``model`` (in eval mode) through the engine's fused head, as the policy scores."""
    from alignopsd.engine.policy.lm_head import score_rows

    p = ids.shape[1] - response
    return score_rows(model.eval(), ids[:, :p], mask[:, :p], ids[:, p:], mask[:, p:])[0]


def _train(out: Path, overrides: list[str], steps: int = 2, resume: str | None = None):
    """(trainer, the policy's state before training, metric records) of tiny.yaml with LoRA, a checkpoint a step."""
    torch.set_num_threads(1)
    ov = [*lh.GUESS_OVERRIDES, *LORA, *overrides, f"trainer.total_steps={steps}", "trainer.checkpoint.save_freq=1"]
    tr = lh.build_trainer(TINY, [*ov, "trainer.checkpoint.keep_last=3", f"output_dir={out}"])
    before = {k: v.detach().clone() for k, v in tr.parts.policy.model.state_dict().items()}
    tr.fit(resume=resume)
    return tr, before, read_metrics(out / "metrics.jsonl")


@pytest.fixture(scope="module", params=["grpo", "alignopsd"])
def lora_run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"lora_{request.param}")
    return (out, *_train(out, [f"algorithm.estimator={request.param}"]))


@pytest.mark.slow
def test_lora_trains_only_the_adapters(lora_run):
    out, tr, before, recs = lora_run
    policy = tr.parts.policy
    after = policy.model.state_dict()
    lora_keys = [k for k in after if ".lora_" in k]
    assert lora_keys and all(torch.equal(before[k], after[k]) for k in after if ".lora_" not in k)  # base untouched
    assert any(not torch.equal(before[k], after[k]) for k in lora_keys if ".lora_B." in k)  # the adapters learned
    held = [p for g in policy.optimizer.param_groups for p in g["params"]]
    adapters = {id(p) for n, p in policy.model.named_parameters() if ".lora_" in n}
    assert {id(p) for p in held} == adapters and all(p.dtype == torch.float32 for p in held)
    assert all(r["time/reference"] > 0 and "actor/kl_loss" in r for r in recs)  # the KL reference pass ran
    # through the fused head loss and, for AlignOPSD's teacher forcing, the shared-prefix scoring
    assert tr.cfg.trainer.ppo.fused_head_loss and tr.cfg.trainer.rescoring_mode == "shared_prefix"
    if tr.cfg.algorithm.estimator == "alignopsd":
        assert all(r["time/teacher_forcing"] > 0 and r["m1/teacher_forcing_row_count"] > 0 for r in recs)
    ref = tr.parts.ref_scorer
    assert ref.model is policy.model  # the frozen base of the same module: no second copy of the weights
    ids, mask = _rows()
    with policy.adapter.disabled():
        base_lp, _ = policy.response_logprobs(ids, mask, 5)
    adapted_lp, _ = policy.response_logprobs(ids, mask, 5)
    assert not torch.equal(base_lp, adapted_lp)
    from transformers import LlamaForCausalLM

    initial = LlamaForCausalLM(policy.model.config)
    initial.load_state_dict({k.replace(".base_layer.", "."): v for k, v in before.items() if ".lora_" not in k})
    assert torch.equal(_logprobs(initial, ids, mask), base_lp)


@pytest.mark.slow
def test_lora_checkpoint_holds_the_adapter_and_the_merged_export(lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out, tr, before, _ = lora_run
    policy = tr.parts.policy
    step1, step2 = out / "checkpoints" / "step_000001", out / "checkpoints" / "step_000002"
    assert (step1 / "adapter" / "adapter_model.safetensors").is_file() and not (step1 / "model.safetensors").exists()
    assert json.loads((step2 / "adapter" / "adapter_config.json").read_text())["r"] == 4
    ids, mask = _rows(seed=1)
    adapted, _ = policy.response_logprobs(ids, mask, 5)
    merged = AutoModelForCausalLM.from_pretrained(step2, dtype=torch.float32).eval()  # the merged export
    torch.testing.assert_close(_logprobs(merged, ids, mask), adapted, atol=MERGE_ATOL, rtol=0)
    base = AutoModelForCausalLM.from_config(policy.model.config)  # peft reads the adapter folder as it is
    base.load_state_dict({k.replace(".base_layer.", "."): v for k, v in before.items() if ".lora_" not in k})
    loaded = PeftModel.from_pretrained(base, step2 / "adapter").get_base_model()
    assert torch.equal(_logprobs(loaded, ids, mask), adapted)
    ck = load_checkpoint(step2, restore_rng=False)
    assert ck.model_state is None and set(ck.adapter_state) == set(policy.adapter.adapter_state())


@pytest.mark.slow
def test_lora_resume_is_bit_identical(lora_run, tmp_path):
    out, tr, _, straight = lora_run
    if tr.cfg.algorithm.estimator != "grpo":
        pytest.skip("one resume suffices (the GRPO run's)")
    _, _, resumed = _train(tmp_path, ["algorithm.estimator=grpo"], resume=str(out / "checkpoints" / "step_000001"))
    assert [r["step"] for r in resumed] == [2]
    for k in ("actor/loss", "actor/grad_norm", "episode/reward_mean", "actor/kl_loss"):
        assert resumed[0][k] == straight[1][k], k
    a, b = (load_checkpoint(p / "checkpoints" / "step_000002", restore_rng=False) for p in (out, tmp_path))
    assert all(torch.equal(a.adapter_state[k], b.adapter_state[k]) for k in a.adapter_state)
    oa, ob = (load_state(p / "checkpoints" / "step_000002" / "optimizer.safetensors") for p in (out, tmp_path))
    sa, sb = oa["optimizer"]["state"], ob["optimizer"]["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]) for i in sa)


@pytest.mark.slow
def test_full_weights_into_a_lora_policy_reset_the_adapters(lora_run):
    """``load_hf_state_dict`` (evaluation of an export): the weights become the base, the adapters zero."""
    _, tr, _, _ = lora_run
    policy = tr.parts.policy
    ids, mask = _rows(seed=2)
    merged, trained = policy.hf_state_dict(), policy.adapter.adapter_state()
    base = {k: v.clone() for k, v in policy.model.state_dict().items() if ".base_layer." in k}
    want, _ = policy.response_logprobs(ids, mask, 5)
    policy.load_hf_state_dict(merged)
    assert all(not p.any() for n, p in policy.model.named_parameters() if ".lora_B." in n)
    torch.testing.assert_close(policy.response_logprobs(ids, mask, 5)[0], want, atol=MERGE_ATOL, rtol=0)
    policy.model.load_state_dict(base, strict=False)  # the module fixture's run as it was, for the other tests
    policy.adapter.load_adapter_state(trained)


def test_lora_with_megatron_is_refused_at_load():
    with pytest.raises(ConfigError, match="model.lora.enabled: LoRA is not supported with policy.backend='megatron'"):
        load_config(TINY, ["model.lora.enabled=true", "policy.backend=megatron"])


def test_lora_without_peft_is_refused_at_load(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(ConfigError, match=r"model.lora.enabled: LoRA needs the peft package"):
        load_config(TINY, ["model.lora.enabled=true"])
    assert not load_config(TINY).model.lora.enabled  # off by default, and then peft is not asked for


def _perturbed_base(tr) -> None:
    """Another base under the same model.name (a new revision of the weights): one base weight nudged."""
    name, param = next((n, p) for n, p in tr.parts.policy.model.named_parameters() if ".base_layer." in n)
    with torch.no_grad():
        param.add_(1e-3)


@pytest.mark.slow
def test_a_lora_checkpoint_names_its_base_and_refuses_another(lora_run, tmp_path):
    """The checkpoint names the base its adapter was trained over (model.name and the digest of its weights); a
    resume over other weights is refused naming both, or let through by --allow-config-change (said); a checkpoint
    written before checkpoints named their base resumes as before, with a one-line warning."""
    import io
    import shutil

    from alignopsd.engine.checkpoint.manifest import manifest_field, write_manifest
    from alignopsd.engine.run.resume import ResumeConfigError

    out, tr, _, straight = lora_run
    if tr.cfg.algorithm.estimator != "grpo":
        pytest.skip("one run's checkpoints suffice (the GRPO run's)")
    step1 = out / "checkpoints" / "step_000001"
    base = json.loads((step1 / "trainer_state.json").read_text())["lora_base"]
    digest = tr.parts.policy.adapter.base_digest()
    assert base == {"model": "tiny", "digest": digest} and len(digest) == len("sha256:") + 64
    ov = [
        *lh.GUESS_OVERRIDES,
        *LORA,
        "algorithm.estimator=grpo",
        "trainer.total_steps=2",
        "trainer.checkpoint.save_freq=1",
    ]

    other = lh.build_trainer(TINY, [*ov, f"output_dir={tmp_path / 'other'}"])
    _perturbed_base(other)
    moved = other.parts.policy.adapter.base_digest()
    assert moved != digest
    with pytest.raises(ResumeConfigError) as refused:
        other.fit(resume=str(step1))
    msg = str(refused.value)
    assert f"the LoRA adapter of {step1} belongs to another base: it was trained over tiny ({digest[:19]})" in msg
    assert f"this run's base is tiny ({moved[:19]})" in msg and "--allow-config-change" in msg

    allowed = lh.build_trainer(TINY, [*ov, f"output_dir={tmp_path / 'allowed'}"])
    _perturbed_base(allowed)
    allowed.stream = io.StringIO()
    allowed.fit(resume=str(step1), allow_config_change=True)
    said = allowed.stream.getvalue()
    assert f"[resume] LoRA base: it was trained over tiny ({digest[:19]})" in said
    assert "(overridden: --allow-config-change)" in said and allowed.step == 2

    old = tmp_path / "old" / "step_000001"  # as checkpoints were written before they named their base
    shutil.copytree(step1, old)
    state = json.loads((old / "trainer_state.json").read_text())
    del state["lora_base"]
    (old / "trainer_state.json").write_text(json.dumps(state, indent=2))
    write_manifest(old, fields={"format_version": manifest_field(step1, "format_version")})
    resumed = lh.build_trainer(TINY, [*ov, f"output_dir={tmp_path / 'resumed'}"])
    resumed.stream = io.StringIO()
    resumed.fit(resume=str(old))
    warned = [line for line in resumed.stream.getvalue().splitlines() if "does not name the base" in line]
    assert warned == [
        f"[resume] warning: {old} does not name the base its LoRA adapter was trained over (written before "
        f"checkpoints did); resuming over tiny ({digest[:19]}) unchecked"
    ]
    again = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in again] == [2] and again[0]["actor/loss"] == straight[1]["actor/loss"]
