"""The process's peak resident memory per scope (engine/observe/memory.py), per profiler phase and step, per
pipeline stage, and on the progress lines."""

from __future__ import annotations

import pytest
import torch
from alignopsd.engine.observe import memory
from alignopsd.engine.observe.memory import GIB, PeakScope, StageLog, gib
from alignopsd.engine.observe.metrics import progress_line
from alignopsd.engine.observe.profiler import StepProfiler, format_table, summarize
from alignopsd.engine.observe.report import heldout_table

from alignopsd.reduction import Reduce

MB = 1 << 20


def _touch(n_bytes: int) -> torch.Tensor:
    return torch.ones(n_bytes // 4)  # written: resident


@pytest.mark.skipif(not memory.reset_peak(), reason="this system keeps no resettable peak resident size")
def test_nested_scopes_keep_each_peak():
    """A block that allocated 256 MiB and freed it before an inner scope began still peaks 256 MiB above the start in
    the outer scope, though the inner scope reset the process's peak; the inner one does not see it."""
    base = memory.rss_bytes()
    with PeakScope() as outer:
        big = _touch(256 * MB)
        del big
        with PeakScope() as inner:
            small = _touch(64 * MB)
            del small
        assert outer.read() >= base + 250 * MB
    assert inner.peak <= outer.peak  # the inner scope began after the 256 MiB were freed (its own 64 MiB may reuse
    # pages the allocator kept, so how far it rises above the start depends on the allocator's state)
    assert outer.peak >= base + 250 * MB and outer not in memory._OPEN and inner not in memory._OPEN


@pytest.mark.skipif(not memory.reset_peak(), reason="this system keeps no resettable peak resident size")
def test_the_profiler_gives_each_phase_and_the_step_its_peak():
    prof = StepProfiler()
    prof.start_step()
    with prof.phase("update"):
        x = _touch(192 * MB)
        del x
    with prof.phase("rollout_generation"):
        pass
    m = prof.end_step()
    step = m["memory/peak_rss_gib"]
    update, rollout = (m[f"memory/phase_peak_rss_gib/{k}"] for k in ("update", "rollout_generation"))
    assert step >= update >= rollout + 180 * MB / GIB
    assert m["memory/peak_rss_gib"].how is Reduce.MAX  # the largest rank's, over the ranks
    s = summarize(prof.history, prof.step_seconds, peaks=prof.peak_history)
    assert s["peak_rss_gib"]["update"] == pytest.approx(update) and s["peak_rss_gib"]["step"] == pytest.approx(step)
    assert "peak resident memory (GiB): step" in format_table(s)
    assert "peak mem" in progress_line(1, 3, {"memory/peak_rss_gib": 2.25}) and "2.2 GiB" in progress_line(
        1, 3, {"memory/peak_rss_gib": 2.25}
    )


def test_stage_log_and_the_end_of_run_table():
    log = StageLog()
    with log.stage("warm start"):
        x = _touch(32 * MB)
        del x
    with log.stage("RL steps"):
        pass
    assert list(log.seconds) == list(log.peaks) == ["warm start", "RL steps"]
    assert log.peak() == max(log.peaks.values()) > 0
    table = heldout_table({"base": {"episodes": 2, "success": 0.5}}, log.seconds, log.peaks)
    assert "| stage | seconds | peak resident memory |" in table
    assert f"| warm start | {log.seconds['warm start']:.0f} | {gib(log.peaks['warm start'])} |" in table
    assert gib(None) == "-" and gib(3 * GIB) == "3.0 GiB"


def test_micro_batches_are_cut_to_the_activations_memory(caplog):
    """``trainer.ppo.activation_memory_gib``: auto caps the update's and the warm start's positions per micro-batch on a
    CPU (not on an accelerator), a number caps them anywhere, null and fixed-row micro-batches not at all; the cut
    is said in the log. SmolLM2-135M keeps 1.30 MiB per token in fp32 (the count ModelShape gives)."""
    import logging

    from alignopsd.engine.config.schema import load_config
    from alignopsd.engine.models.shapes import KNOWN_SHAPES
    from alignopsd.engine.run import policy_builders

    smol = hf = KNOWN_SHAPES["smollm2-135m"]
    assert smol.activation_bytes_per_token(4) / (1 << 20) == pytest.approx(1.30, abs=0.01)
    cfg = load_config("configs/quickstart_cpu.yaml", [])
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert cfg.update_token_budget == 8 * (1024 + 64)
    with caplog.at_level(logging.INFO, logger=policy_builders.__name__):
        capped = policy_builders.micro_batch_tokens(cfg, hf, torch.float32, cpu)
    assert capped == int(1.5 * GIB // smol.activation_bytes_per_token(4)) < cfg.update_token_budget
    assert any(
        r.getMessage().startswith(f"memory: micro-batches of at most {capped} positions") for r in caplog.records
    )
    assert (
        policy_builders.micro_batch_tokens(cfg, hf, torch.bfloat16, cpu) == 2 * capped
        or abs(policy_builders.micro_batch_tokens(cfg, hf, torch.bfloat16, cpu) - 2 * capped) <= 1
    )
    assert policy_builders.micro_batch_tokens(cfg, hf, torch.float32, cuda) == cfg.update_token_budget
    none = load_config("configs/quickstart_cpu.yaml", ["trainer.ppo.activation_memory_gib=null"])
    assert policy_builders.micro_batch_tokens(none, hf, torch.float32, cpu) == none.update_token_budget
    half = load_config("configs/quickstart_cpu.yaml", ["trainer.ppo.activation_memory_gib=0.5"])
    assert policy_builders.micro_batch_tokens(half, hf, torch.float32, cuda) == int(
        0.5 * GIB // smol.activation_bytes_per_token(4)
    )
    rows = load_config("configs/quickstart_cpu.yaml", ["trainer.ppo.max_token_len_per_gpu=0"])
    assert policy_builders.micro_batch_tokens(rows, hf, torch.float32, cpu) == 0


def test_the_estimate_says_the_expected_peak():
    """The estimate's peak: the process, the policy's weights + gradients + AdamW moments (+ fp32 masters in bf16),
    the reference and one micro-batch's activations; a LoRA policy keeps only its base weights and no reference."""
    from alignopsd.engine.config.schema import load_config
    from alignopsd.engine.lab.estimate import peak_memory_line
    from alignopsd.engine.models.shapes import KNOWN_SHAPES

    cfg = load_config("configs/quickstart_cpu.yaml", [])
    smol = KNOWN_SHAPES["smollm2-135m"]
    line = peak_memory_line(cfg, smol, torch.float32, 1000, int(GIB), reference=True)
    want = GIB + smol.params * 16 + smol.params * 4 + 1000 * smol.activation_bytes_per_token(4)
    assert line.startswith(f"[estimate] peak resident memory: ~{want / GIB:.1f} GiB (the process 1.0,")
    bf16 = peak_memory_line(cfg, smol, torch.bfloat16, 1000, 0, reference=False)
    assert f"optimizer {smol.params * 16 / GIB:.1f}, the reference 0.0" in bf16  # 2 + 2 + 8 + 4 bytes a weight
    lora = load_config("configs/quickstart_cpu.yaml", ["model.lora.enabled=true"])
    assert "the reference 0.0" in peak_memory_line(lora, smol, torch.float32, 1000, 0, reference=True)
