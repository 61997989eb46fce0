"""The per-rank memory report (engine/lab/megatron_memory.py): its arithmetic on a small shape worked out by
hand, the shard
size against the weight converter, and the command on the test config."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from alignopsd.engine.commands.memory import layout_from_config, main
from alignopsd.engine.lab.megatron_memory import (
    Layout,
    format_table,
    full_params,
    shard_params,
)
from alignopsd.engine.policy.megatron.convert import Dims, hf_to_megatron
from generator_double import GeneratorDouble

# 2 layers, hidden 8, MLP 16, 4 query heads and 2 key/value heads of dim 2, vocabulary 32, untied, q/k/v biases
SMALL = Dims(num_layers=2, hidden=8, ffn=16, heads=4, groups=2, head_dim=2, vocab=32, tied=False, qkv_bias=True)


def test_parameter_counts_by_hand():
    # per layer: norms 2*8 = 16, qkv (4+2+2)*2*8 = 128, its bias 16, o_proj 8*8 = 64, MLP 3*8*16 = 384 -> 608
    # P = 2*608 + embedding 32*8 + head 32*8 + final norm 8 = 1736
    assert full_params(SMALL) == 1736
    # tp = 2: per layer 16 + (128+16+64)/2 + 384/2 = 312; 2*312 + (256+256)/2 + 8 = 888
    assert shard_params(SMALL, 2) == 888
    tied = Dims(**{**SMALL.__dict__, "tied": True})
    assert full_params(tied) == 1736 - 256 and shard_params(tied, 2) == 888 - 128


def _hf_state(d: Dims) -> dict[str, torch.Tensor]:
    q, kv = d.heads * d.head_dim, d.groups * d.head_dim
    sd = {"model.embed_tokens.weight": torch.zeros(d.vocab, d.hidden), "model.norm.weight": torch.zeros(d.hidden)}
    if not d.tied:
        sd["lm_head.weight"] = torch.zeros(d.vocab, d.hidden)
    for i in range(d.num_layers):
        p = f"model.layers.{i}."
        shapes = {"input_layernorm.weight": (d.hidden,), "post_attention_layernorm.weight": (d.hidden,),
                  "self_attn.q_proj.weight": (q, d.hidden), "self_attn.k_proj.weight": (kv, d.hidden),
                  "self_attn.v_proj.weight": (kv, d.hidden), "self_attn.o_proj.weight": (d.hidden, q),
                  "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
                  "mlp.gate_proj.weight": (d.ffn, d.hidden), "mlp.up_proj.weight": (d.ffn, d.hidden),
                  "mlp.down_proj.weight": (d.hidden, d.ffn)}  # fmt: skip
        sd.update({p + k: torch.zeros(s) for k, s in shapes.items()})
    return sd


@pytest.mark.parametrize("tp", [1, 2])
def test_shard_size_is_the_converters(tp):
    """S equals the element count of the shard the weight converter cuts (tensor-parallel rank 0 of tp)."""
    shard = hf_to_megatron(_hf_state(SMALL), SMALL, tp, 0)
    assert sum(v.numel() for v in shard.values()) == shard_params(SMALL, tp)


def test_rows_before_and_after_by_hand():
    """Columns: before (every rank), after on the first rank of a tensor-parallel group (training phases,
    generating), after on the group's other ranks (no generation engine, no Hugging Face copy, no gather)."""
    lay = Layout(dims=SMALL, dtype_bytes=2, tp=2, dp=2, distributed_optimizer=True, reference=True,
                 hf_generation=False, vllm=True, vllm_sleep=True, gpu_bytes=1000,
                 gpu_memory_utilization=0.5)  # fmt: skip
    rows = {name: vals for name, *vals in lay.rows()}
    assert rows["policy shard (weights)"] == [1776] * 4  # 888 * 2 bytes
    assert rows["gradients (fp32 buffer)"] == [3552] * 4  # 888 * 4
    assert rows["optimizer (fp32 main + Adam moments)"] == [5328] * 4  # 888 * 12 / dp 2
    assert rows["reference model"] == [3472, 1776, 1776, 1776]  # full 1736 * 2, then the shard
    assert rows["Hugging Face copy of the policy"] == [3472, 0, 0, 0]
    assert rows["vLLM (weights + KV cache)"] == [500, 0, 500, 0]  # 0.5 of 1000 bytes, asleep while training
    # before: the full model on every rank; after: twice the largest part (a layer: 608 > 264 > 256) on rank 0
    assert rows["weight-sync gather (transient)"] == [3472, 2432, 2432, 0]
    hf_gen = Layout(**{**lay.__dict__, "hf_generation": True, "vllm": False, "vllm_sleep": False,
                       "distributed_optimizer": False, "dtype_bytes": 4})  # fmt: skip
    rows = {name: vals for name, *vals in hf_gen.rows()}
    assert rows["Hugging Face copy of the policy"] == [6944, 6944, 6944, 0]  # kept where Hugging Face generates
    assert rows["optimizer (fp32 main + Adam moments)"] == [8 * 888] * 4  # fp32 weights: no separate main copy
    table = format_table(lay)
    assert "| **resident total** | **0.00** |" in table and table.count("\n") == 10
    assert "| weight-sync gather (transient) | 0.00 | 0.00 | 0.00 | 0.00 |" in table
    single = format_table(Layout(**{**lay.__dict__, "tp": 1}))  # every rank is its group's first: no last column
    assert single.splitlines()[-1].endswith("| – |")


def test_sync_part_is_the_largest_conversion_part():
    """Q counts the largest unit that the weight sync converts at once, as the converter cuts them."""
    from alignopsd.engine.lab.megatron_memory import sync_part_params
    from alignopsd.engine.policy.megatron.convert import conversion_parts, megatron_part_to_hf

    for d in (SMALL, Dims(**{**SMALL.__dict__, "tied": True, "vocab": 160})):
        shard = hf_to_megatron(_hf_state(d), d, 1, 0)
        sizes = []
        for part in conversion_parts(d):
            hf = megatron_part_to_hf([shard], d, part)
            sizes.append(sum(v.numel() for v in {id(v): v for v in hf.values()}.values()))
        assert sync_part_params(d) == max(sizes)


def test_command_on_the_test_config(capsys):
    """``alignopsd memory`` reads the tiny model's config.json and prints the table; errors name the culprit."""
    from alignopsd.engine.config.schema import load_config

    over = ["policy.backend=megatron", "policy.tensor_parallel_size=2", "generation.backend=vllm"]
    assert main(["--config", "configs/tiny.yaml", *[a for o in over for a in ("--set", o)], "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "config.json" in out and "tp 2 x dp 2" in out and "reference on" in out and "sleep on" in out
    cfg = load_config("configs/tiny.yaml", over)
    lay, _ = layout_from_config(cfg, 4, 80.0)
    assert lay.dims.hidden == 64 and lay.dims.tied
    with pytest.raises(ValueError, match="--world-size"):
        layout_from_config(cfg, 3, 80.0)
    with pytest.raises(ValueError, match="policy.backend"):
        layout_from_config(load_config("configs/tiny.yaml", []), 1, 80.0)
    with pytest.raises(ValueError, match="model.name"):
        layout_from_config(load_config("configs/tiny.yaml", [*over, "model.name=nobody/none-1b"]), 2, 80.0)


class PhaseLog(GeneratorDouble):
    """The run's generator (the candidate-choice generator on the policy's own model) with a ``sleep`` like the
    vLLM engine's, logging the order of generation, sleep and weight pushes."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.events: list[str] = []

    def generate(self, prompts, sampling, *, keep_prompt_cache=False):
        self.events.append("generate")
        return self.inner.generate(prompts, sampling)

    def sleep(self) -> None:
        self.events.append("sleep")

    def load_weights(self, state_dict) -> None:
        self.events.append("load_weights")
        self.inner.load_weights(state_dict)


@pytest.mark.slow
def test_step_puts_the_engine_to_sleep_after_each_generation_phase(tmp_path):
    """A training step releases the generation engine when the rollout ends and when the teacher generation ends,
    so old log-probs, teacher forcing and the update run with it asleep; the weight sync then wakes it."""
    import learn_helpers as lh
    from alignopsd.engine.step.recipe import run_step

    torch.set_num_threads(1)
    ov = [*lh.GUESS_OVERRIDES, "trainer.total_steps=1", "trainer.ppo.skip_no_signal=false", f"output_dir={tmp_path}",
          "algorithm.estimator=alignopsd"]  # fmt: skip
    tr = lh.build_trainer(str(lh.TINY_CONFIG), ov)
    gen = PhaseLog(tr.parts.generator)
    tr.parts = replace(tr.parts, generator=gen)
    run_step(tr.parts, 1)
    tr.parts.close()
    ev = gen.events
    rollout_end = ev.index("sleep")
    assert rollout_end > 0 and set(ev[:rollout_end]) == {"generate"}  # the rollout's turns, then sleep
    teacher = ev[rollout_end + 1 :]
    assert teacher == ["generate", "sleep", "load_weights"]  # one teacher call, sleep, the sync after the update
