"""The custom CPU kernels are taken by measured speed, not by a CPU flag (kernels/native_choice.py).

The measured times are injected (a timer that reads them from a table), so every case runs on any CPU: the C++
kernels themselves are stood in for by their torch paths where this CPU cannot run them, and the tests assert which
path the real dispatch (``logprob``'s CPU forward, the decoding cache's prefill attention) took.
"""

from __future__ import annotations

import logging

import pytest
import torch
from alignopsd.engine.generation import decode_cache as dc
from alignopsd.engine.run import policy_builders as components
from alignopsd.engine.run.kernel_probe import choose_cpu_kernels
from alignopsd.kernels import attention_native as an
from alignopsd.kernels import native_choice
from alignopsd.kernels.head import bf16_gemm, cpu_partials, gemm_choice, torch_tiles
from alignopsd.kernels.head.logprob import logprob, logprob_ref
from alignopsd.kernels.native_choice import ATTENTION, HEAD, HEAD_GEMM, recorded
from test_attention_native import prefixed_cache

from alignopsd.testing import KernelChoice, record_kernel_choice


@pytest.fixture(autouse=True)
def _measured(monkeypatch):
    """These tests measure: the suite's pin to the torch paths (tests/conftest.py) is lifted."""
    monkeypatch.delenv(native_choice.PIN_ENV, raising=False)


def _timer(table: dict[str, float], calls: list[str] | None = None):
    """A timer that answers ``table[fn.__name__]`` (the paths are named ``native`` and ``torch_path``)."""

    def timer(fn):
        fn()  # the path must run on these operands
        if calls is not None:
            calls.append(fn.__name__)
        return table[fn.__name__]

    return timer


@pytest.fixture
def head(monkeypatch):
    """bf16 operands, the C++ head made to apply with the torch tiles standing in for it; the calls it got."""
    calls: list[torch.dtype] = []

    def stand_in(h, w, t, inv_t, vocab_start, need_u=True):
        calls.append(h.dtype)
        return torch_tiles.torch_partials(h, w, None, t, inv_t, vocab_start, need_u=need_u)

    monkeypatch.setattr(cpu_partials, "native_applies", lambda h, w, b: b is None and h.dtype == torch.bfloat16)
    monkeypatch.setattr(cpu_partials, "native_partials", stand_in)
    g = torch.Generator().manual_seed(0)
    hid = torch.randn(6, 32, generator=g).bfloat16()
    w = (torch.randn(90, 32, generator=g) * 0.2).bfloat16()
    t = torch.randint(0, 90, (6,), generator=g)
    return hid, w, t, calls


@pytest.mark.parametrize(("native_s", "torch_s", "takes"), [(0.3, 0.2, False), (0.1, 0.2, True), (0.2, 0.2, False)])
def test_head_kernel_taken_only_where_measured_faster(head, native_s, torch_s, takes):
    """An AMX Xeon (the kernel 211 GFLOP/s, the torch path 270): torch; an AVX512-BF16 CPU without AMX (410 against
    125): the kernel; a tie: torch. The log-probs are the same either way."""
    hid, w, t, calls = head
    c = cpu_partials.measure_head(hid, w, None, t, timer=_timer({"native": native_s, "torch_path": torch_s}))
    assert recorded(HEAD) is c and c.native is takes
    calls.clear()
    lp = logprob(hid, w, t, temperature=0.7)
    assert calls == ([torch.bfloat16] if takes else [])
    torch.testing.assert_close(lp, logprob_ref(hid, w, t, temperature=0.7), rtol=0, atol=3e-5)


def test_first_use_measures_once_on_the_operands_at_hand(head, monkeypatch):
    """Nothing measured before the first call: the dispatch measures then (both paths run on the call's operands),
    records it, and later calls read the record."""
    hid, w, t, calls = head
    timed: list[str] = []
    monkeypatch.setattr(native_choice, "best_seconds", _timer({"native": 1.0, "torch_path": 0.5}, timed))
    record_kernel_choice(KernelChoice(HEAD_GEMM, False, None, None, "chosen by the test"))  # the tiles' GEMMs: fp32
    assert recorded(HEAD) is None
    logprob(hid, w, t)
    logprob(hid, w, t)
    assert timed == ["native", "torch_path"]
    assert recorded(HEAD).native is False and recorded(HEAD).shape == "[6, 32] x [90, 32] bfloat16"
    assert calls == [torch.bfloat16]  # the measurement's own call; the two log-probs took the torch path


def test_operands_the_kernel_cannot_take_never_reach_it(head):
    """fp32 operands or a bias: the torch path, whatever was recorded."""
    hid, w, t, calls = head
    record_kernel_choice(KernelChoice(HEAD, True, 0.1, 0.2, "injected"))
    logprob(hid.float(), w.float(), t)
    logprob(hid, w, t, bias=torch.zeros(90, dtype=torch.bfloat16))
    assert calls == []


def test_cache_prefill_attention_follows_the_choice(monkeypatch):
    """The decoding cache's bf16 prefill takes the C++ attention only where it was measured faster (the kernel made
    to apply, the torch path standing in for it); both give the torch path's output."""
    kv, q = prefixed_cache()
    calls = []

    def stand_in(*args):
        calls.append(args[0].shape[2])
        return an.torch_prefix_attention(*args)

    monkeypatch.setattr(dc, "prefix_attention_applies", lambda q, k, v, pk, pv: q.dtype == torch.bfloat16)
    monkeypatch.setattr(an, "prefix_attention_applies", lambda q, k, v, pk, pv: q.dtype == torch.bfloat16)
    monkeypatch.setattr(an, "prefix_attention", stand_in)
    monkeypatch.setattr(dc, "prefix_attention", stand_in)
    monkeypatch.setattr(native_choice, "best_seconds", _timer({"native": 0.02, "torch_path": 0.01}))
    slow = kv.attend(0, q, 0.125)
    assert recorded(ATTENTION).native is False and calls == [13]  # the first use measured, then the torch path
    record_kernel_choice(KernelChoice(ATTENTION, True, 0.01, 0.02, "injected"))
    fast = kv.attend(0, q, 0.125)
    assert calls == [13, 13]
    torch.testing.assert_close(fast, slow, rtol=0, atol=0)


def test_describe_states_both_times_and_rates():
    c = KernelChoice(HEAD, False, 0.02, 0.01, "[256, 576] x [32768, 576] bfloat16", flops=2e9)
    assert c.describe() == (
        "head partials: torch path (10.0 ms, 200 GFLOP/s) over C++ kernel (20.0 ms, 100 GFLOP/s) at "
        "[256, 576] x [32768, 576] bfloat16"
    )
    none = KernelChoice(ATTENTION, False, None, None, "x", why="this CPU has no AVX512-BF16")
    assert none.describe() == "prefix attention: torch path (this CPU has no AVX512-BF16)"
    with pytest.raises(ValueError, match="unknown custom kernel 'gemm'"):
        record_kernel_choice(KernelChoice("gemm", True, 1.0, 2.0, "x"))


class _Config:  # the shapes the probe reads from a model config (SmolLM2-135M's heads, a small vocabulary)
    hidden_size, vocab_size, num_attention_heads, num_key_value_heads = 576, 2048, 9, 3


def test_probe_states_each_kernel(monkeypatch):
    """A float32 model: nothing to measure; bf16 on a CPU that cannot run the kernels: the reason; bf16 where they
    run: both measured at the model's shapes (times injected) and the choices recorded for the run."""
    lines = choose_cpu_kernels(_Config, torch.float32)
    assert lines == [
        "head GEMMs: fp32 tiles (the model runs in float32; the custom path is for bf16)",
        "head partials: torch path (the model runs in float32; the custom path is for bf16)",
        "prefix attention: torch path (the model runs in float32; the custom path is for bf16)",
    ]
    assert recorded(HEAD) is None and recorded(ATTENTION) is None and recorded(HEAD_GEMM) is None
    assert choose_cpu_kernels(_Config, torch.bfloat16, torch.device("meta")) == []  # not a CPU: nothing to choose
    for mod in (cpu_partials, an):
        monkeypatch.setattr(mod, "why_not_ready", lambda: "this CPU has no AVX512-BF16")
    monkeypatch.setattr(cpu_partials, "native_applies", lambda h, w, b: False)
    monkeypatch.setattr(an, "prefix_attention_applies", lambda *a: False)
    monkeypatch.setattr(gemm_choice, "gemm_applies", lambda h, w, b=None: False)
    monkeypatch.setattr(gemm_choice, "why_no_gemm", lambda: "no bf16 GEMM here")
    assert choose_cpu_kernels(_Config, torch.bfloat16) == [
        "head GEMMs: fp32 tiles (no bf16 GEMM here)",
        "head partials: torch path (this CPU has no AVX512-BF16)",
        "prefix attention: torch path (this CPU has no AVX512-BF16)",
    ]
    native_choice.forget()
    monkeypatch.undo()
    monkeypatch.delenv(native_choice.PIN_ENV, raising=False)
    monkeypatch.setattr(cpu_partials, "native_applies", lambda h, w, b: True)
    monkeypatch.setattr(cpu_partials, "native_partials", lambda h, w, t, inv_t, v0: None)
    monkeypatch.setattr(an, "prefix_attention_applies", lambda *a: True)
    monkeypatch.setattr(an, "prefix_attention", lambda *a: None)
    monkeypatch.setattr(native_choice, "best_seconds", _timer({"native": 0.004, "torch_path": 0.008}))
    lines = choose_cpu_kernels(_Config, torch.bfloat16)
    if bf16_gemm.gemm_ready():  # torch's CPU library has the bf16 GEMM: measured like the kernels
        assert lines[0].startswith("head GEMMs: bf16 GEMM (4.0 ms, 453 GFLOP/s) over fp32 tiles (8.0 ms")
        assert lines[0].endswith("at [256, 576] x [2048, 576] bfloat16, forward and backward")
        assert recorded(HEAD_GEMM).native
    assert lines[1].startswith("head partials: C++ kernel (4.0 ms, 151 GFLOP/s) over torch path (8.0 ms")
    assert lines[1].endswith("at [256, 576] x [2048, 576] bfloat16")
    assert lines[2].startswith("prefix attention: C++ kernel (4.0 ms")
    assert "4 rows x 48 queries over 640 prefix + 48 own positions, 9/3 heads of 64" in lines[2]
    assert recorded(HEAD).native and recorded(ATTENTION).native


def test_policy_build_states_the_choice_in_the_run_log(caplog, monkeypatch):
    """The policy build (the run's, the warm start's, the calibration's) states the kernels' choice in the run's
    first lines: the tiny config runs in float32 in the suite."""
    from alignopsd.engine.config.schema import load_config

    cfg = load_config("configs/tiny.yaml", [])
    with caplog.at_level(logging.INFO, logger=components.__name__):
        components.build_policy(cfg, torch.device("cpu"))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels: ")]
    assert said[:3] == [
        "kernels: head GEMMs: fp32 tiles (the model runs in float32; the custom path is for bf16)",
        "kernels: head partials: torch path (the model runs in float32; the custom path is for bf16)",
        "kernels: prefix attention: torch path (the model runs in float32; the custom path is for bf16)",
    ]
    # trainer.ppo.use_remove_padding auto on a CPU: padded rows until the first update has timed both (packing_trial)
    assert said[3] == "kernels: packed rows: padded rows (until the first update has timed both, forward and backward)"
    monkeypatch.setenv(native_choice.PIN_ENV, "torch")  # pinned: padded rows, chosen at the build, timed never
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=components.__name__):
        policy = components.build_policy(cfg, torch.device("cpu"))
    assert "kernels: packed rows: padded rows (ALIGNOPSD_CPU_PATHS=torch)" in [r.getMessage() for r in caplog.records]
    assert policy.rows.packed is False and policy.rows.choice.why == "ALIGNOPSD_CPU_PATHS=torch"


def test_pinned_process_measures_nothing_and_restores_what_it_is_given(head, monkeypatch):
    """``ALIGNOPSD_CPU_PATHS=torch``: no timing, the torch path, said so; a checkpoint's (or rank 0's) choices are
    taken as given, and only known names with true/false."""
    hid, w, t, calls = head
    monkeypatch.setenv(native_choice.PIN_ENV, "torch")
    monkeypatch.setattr(native_choice, "best_seconds", lambda fn: pytest.fail("a pinned process timed a path"))
    logprob(hid, w, t)
    assert calls == [] and recorded(HEAD).describe() == "head partials: torch path (ALIGNOPSD_CPU_PATHS=torch)"
    assert native_choice.choices_state() == {HEAD: False, HEAD_GEMM: False}  # the torch tiles asked for theirs
    (c,) = native_choice.restore_choices({HEAD: True}, "as the run that wrote the checkpoint measured")
    assert c.describe() == "head partials: C++ kernel (as the run that wrote the checkpoint measured)"
    logprob(hid, w, t)
    assert calls == [torch.bfloat16]
    with pytest.raises(ValueError, match="paths: unknown choice 'gemm'"):
        native_choice.restore_choices({"gemm": True}, "x")
    monkeypatch.setenv(native_choice.PIN_ENV, "fast")
    with pytest.raises(ValueError, match="ALIGNOPSD_CPU_PATHS: expected 'torch' or 'measured', got 'fast'"):
        native_choice.pinned()
