"""The int8 generator (``generation.quantize``): a quantized copy the trainer never reads, re-quantized at every weight
sync, its log-prob gap measured by the step's mismatch metrics and corrected by the rollout correction."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from alignopsd.engine.config.schema import ConfigError, load_config
from alignopsd.engine.generation.base import SamplingParams, samples_from
from alignopsd.engine.generation.int8 import Int8Generator, quantized_copy
from alignopsd.engine.models.loading import load_causal_lm, load_tokenizer
from alignopsd.engine.run.components import generation_int8
from torch import nn
from torch.ao.nn.quantized.dynamic import Linear as Int8Linear

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")


def teacher_forced_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of ``response`` after ``prompt``, one fp32 forward. [len(response)]"""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


def _prompts(tok):
    texts = ["go north", "take the apple from the table and put it in the fridge"]
    return [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"]
        for t in texts
    ]


def test_samples_from_an_int8_copy_close_to_the_fp32_model(tok):
    torch.set_num_threads(1)
    model = load_causal_lm("tiny", dtype="float32")
    g = Int8Generator(model, tok)
    assert not samples_from(g, model) and not g.keeps_prompt_cache
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))  # the trainer's untouched
    q = [m for m in g.model.modules() if isinstance(m, Int8Linear)]
    assert len(q) == 7 * model.config.num_hidden_layers + 1  # q k v o gate up down per layer, and the LM head
    prompts = _prompts(tok)
    out = g.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.7, seed=5))
    gaps = []
    for p, r, lp in zip(prompts, out.token_ids, out.logprobs):
        ref = teacher_forced_logprobs(model, p, r, 0.7)
        gaps.append((torch.tensor(lp) - ref).abs())
    gap = torch.cat(gaps)
    assert 0 < float(gap.mean()) < 0.3  # int8, not the fp32 model, but near it (random weights: the worst case)


def test_load_weights_quantizes_the_new_weights(tok):
    model = load_causal_lm("tiny", dtype="float32")
    g = Int8Generator(model, tok)
    new = {k: v.clone() for k, v in model.state_dict().items()}
    new["model.layers.0.mlp.up_proj.weight"].mul_(-2.0)
    g.load_weights(new)
    assert g.quantizations == 2
    w = g.model.model.layers[0].mlp.up_proj.weight().dequantize()
    ref = new["model.layers.0.mlp.up_proj.weight"]
    step = ref.abs().amax(1, keepdim=True) / 127  # one int8 step per output channel
    assert bool(((w - ref).abs() <= step).all())
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, ref)  # the trainer's model is not written
    with pytest.raises(ValueError, match="unknown parameter"):
        g.load_weights({"nope.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="float32"):
        quantized_copy(load_causal_lm("tiny", dtype="bfloat16"))


def test_quantize_auto_follows_the_policy_dtype():
    fp32, bf16 = nn.Linear(2, 2), nn.Linear(2, 2).to(torch.bfloat16)
    assert generation_int8("auto", fp32) and not generation_int8("auto", bf16)
    assert generation_int8("int8", bf16) and not generation_int8("off", fp32)
    with pytest.raises(ConfigError, match="generation.quantize"):
        load_config(TINY, ["generation.quantize=int8", "generation.backend=choice"])


def test_a_step_with_int8_rollouts_measures_and_corrects_the_gap(tmp_path):
    from alignopsd.engine.run.trainer import Trainer

    torch.set_num_threads(1)
    ov = ["trainer.total_steps=1", f"output_dir={tmp_path}", "generation.quantize=int8", "env.tasks_per_step=1"]
    cfg = load_config(TINY, [*ov, "trainer.ppo.rollout_is=token_truncate", "generation.max_response_length=8"])
    tr = Trainer(cfg)
    assert isinstance(tr.parts.generator, Int8Generator)
    before = tr.parts.generator.quantizations
    rec = tr.fit()  # the last step's metrics
    assert tr.parts.generator.quantizations > before  # the update's weights were pushed and quantized
    assert rec["mismatch/tokens"] > 0 and rec["mismatch/abs_diff_max"] > 0
    assert "rollout_is/mean" in rec


def test_logprob_reuse_only_where_the_generator_samples_from_the_policy(tok, tmp_path):
    """``trainer.ppo.logprob_reuse`` would make the sampler's log-probs PPO's old log-probs: refused at load where the
    generator is known to sample from another model (int8, ``auto`` on a float32 CPU policy, Megatron's Hugging Face
    copy), and, where the parts are built, whenever the generator does not sample from the scoring model itself."""
    from alignopsd.engine.run.components import build_generator, build_rescorer
    from alignopsd.engine.run.policy_builders import build_policy

    reuse = ["trainer.ppo.logprob_reuse=true", "trainer.device=cpu", f"output_dir={tmp_path}"]
    for extra, other in (
        (["generation.quantize=int8"], "generation.quantize='int8'"),
        (["generation.quantize=auto", "model.dtype=float32"], "generation.quantize='auto'"),
        (["policy.backend=megatron"], "policy.backend='megatron'"),
    ):
        with pytest.raises(ConfigError, match=rf"^trainer\.ppo\.logprob_reuse: [^\n]*{re.escape(other)}[^\n]*$"):
            load_config(TINY, [*reuse, *extra])
    assert not load_config(TINY, [*reuse, "generation.quantize=auto", "model.dtype=bfloat16"]).samples_int8()
    cpu = torch.device("cpu")
    cfg = load_config(TINY, reuse)
    policy = build_policy(cfg, cpu)
    own = build_generator(cfg, policy, tok, cpu)
    assert samples_from(own, policy.model) and build_rescorer(cfg, policy, cpu, own).reuse_rollout_logp
    copy = Int8Generator(policy.model, tok)
    with pytest.raises(ConfigError, match=r"^trainer\.ppo\.logprob_reuse: .*\(Int8Generator\) does not"):
        build_rescorer(cfg, policy, cpu, copy)
    assert not build_rescorer(load_config(TINY, reuse[1:]), policy, cpu, copy).reuse_rollout_logp


def test_logprob_reuse_with_int8_sampling_exits_2_naming_both_settings(tmp_path, capsys):
    from alignopsd.engine.commands.cli import main

    sets = ["trainer.ppo.logprob_reuse=true", "generation.quantize=int8", f"output_dir={tmp_path}"]
    assert main(["train", "--config", TINY, *[x for s in sets for x in ("--set", s)]]) == 2
    err = capsys.readouterr().err
    line = [ln for ln in err.splitlines() if "trainer.ppo.logprob_reuse" in ln]
    assert len(line) == 1 and "generation.quantize" in line[0], err
    assert not any(tmp_path.iterdir())  # refused before the run wrote anything


@pytest.mark.slow
def test_a_lora_policy_samples_from_an_int8_copy_of_its_merged_weights(tmp_path):
    """LoRA with int8 generation end to end: the int8 copy is made from the merged weights in the plain architecture
    (no LoRA layers), every update's merged weights are pushed and quantized again, and the run trains."""
    pytest.importorskip("peft")
    from alignopsd.engine.run.trainer import Trainer

    torch.set_num_threads(1)
    lora = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8", "trainer.optimizer.lr=1e-3"]
    ov = ["trainer.total_steps=2", f"output_dir={tmp_path}", "generation.quantize=int8", "env.tasks_per_step=1"]
    tr = Trainer(load_config(TINY, [*lora, *ov, "generation.max_response_length=8"]))
    gen, policy = tr.parts.generator, tr.parts.policy
    assert isinstance(gen, Int8Generator) and policy.adapter is not None
    assert not any("lora" in name for name, _ in gen.float_model.named_modules())
    assert any(isinstance(m, Int8Linear) for m in gen.model.modules())
    before = gen.quantizations
    rec = tr.fit()
    assert gen.quantizations == before + 2  # one sync per update
    merged = policy.hf_state_dict()
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in policy.model.state_dict().items())  # adapters trained
    for name, value in gen.float_model.state_dict().items():
        assert torch.equal(value, merged[name]), name  # the sampler holds the trained (merged) weights
    assert rec["mismatch/tokens"] > 0 and math.isfinite(rec["actor/loss"])
