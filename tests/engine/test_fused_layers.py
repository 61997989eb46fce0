"""The fused element-wise work swapped into the Hugging Face Llama/Qwen2 layers (engine/policy/fused_layers.py):
a model computes the same values and gradients through it as through its stock modules (fp32 to 1e-5, bf16 to its
rounding, with gradient checkpointing), takes it only where chosen and with a graph, and the run's trial states it."""

from __future__ import annotations

import logging

import pytest
import torch
from alignopsd.engine.policy import fused_layers
from alignopsd.engine.run import policy_builders
from alignopsd.kernels import fused_ops, native_choice
from alignopsd.kernels.native_choice import FUSED_OPS, RMS_NORM, ROTARY, SWIGLU, recorded
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from alignopsd.testing import KernelChoice, forget_kernel_choices, record_kernel_choice

SHAPES = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
)


def _model(arch: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SHAPES, attn_implementation="sdpa"))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPES, attn_implementation="sdpa"))
    return model.to(dtype).train()


@pytest.fixture
def choices():
    """Record every fused op as taken (True) or not (False); the choices forgotten after the test."""

    def take(native: bool) -> None:
        for op in FUSED_OPS:
            record_kernel_choice(KernelChoice(op, native, None, None, ""))

    forget_kernel_choices()
    yield take
    forget_kernel_choices()


@pytest.fixture
def calls(monkeypatch):
    """The fused ops' calls through the layers, by op."""
    seen = {op: 0 for op in FUSED_OPS}
    for op, name in ((RMS_NORM, "rms_norm"), (SWIGLU, "swiglu"), (ROTARY, "rotary")):
        real = vars(fused_layers)[name]

        def counted(*args, _real=real, _op=op, **kwargs):
            seen[_op] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(fused_layers, name, counted)
    return seen


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    (logits.float().square().mean()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layers_give_the_stock_values_and_gradients_under_checkpointing(arch, dtype, choices, calls):
    model = _model(arch, dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    fused_layers.install(model)
    ids = torch.randint(0, 64, (3, 21), generator=torch.Generator().manual_seed(1))
    choices(False)
    want_logits, want = _loss_and_grads(model, ids)
    assert calls == {op: 0 for op in FUSED_OPS}
    choices(True)
    got_logits, got = _loss_and_grads(model, ids)
    # two layers, each called in the forward and again in the checkpointed recomputation
    assert calls == {RMS_NORM: 2 * 2 * 2 + 1, SWIGLU: 2 * 2, ROTARY: 2 * 2}
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_logits.float(), want_logits.float(), **tol)
    for name, g in want.items():
        torch.testing.assert_close(got[name].float(), g.float(), **tol, msg=lambda m, n=name: f"{n}: {m}")


def test_forwards_without_a_graph_take_the_stock_modules(choices, calls):
    model = _model("llama", torch.float32)
    fused_layers.install(model)
    choices(True)
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 5, dtype=torch.long))
    assert calls == {op: 0 for op in FUSED_OPS}


def test_other_architectures_are_left_alone():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert fused_layers.install(model) is None
    assert fused_layers.choose_fused_ops(model) == []


def test_the_run_measures_each_op_once_and_states_it(choices, calls, monkeypatch, caplog):
    """The trial (its clock injected: the fused op faster for RMSNorm and rotary, slower for SwiGLU) states every op
    in the run's first lines, takes the faster path per op in training forwards, and a second build reads it back."""
    forget_kernel_choices()
    monkeypatch.delenv(native_choice.PIN_ENV, raising=False)
    monkeypatch.setattr(fused_layers, "PROBE_ROWS", 2)
    monkeypatch.setattr(fused_layers, "PROBE_POSITIONS", 7)
    faster = {RMS_NORM: True, ROTARY: True, SWIGLU: False}
    timed: list[str] = []

    def measure_op(op, fused, stock, shape):
        def timer(fn):
            fn()  # both paths run on the probe's operands
            timed.append(op)
            return 1.0 if (fn is fused) == faster[op] else 2.0

        return fused_ops.measure_op(op, fused, stock, shape, timer=timer)

    monkeypatch.setattr(fused_layers, "measure_op", measure_op)
    model = _model("llama", torch.float32)
    with caplog.at_level(logging.INFO, logger=policy_builders.__name__):
        policy_builders.choose_cpu_paths(model, torch.device("cpu"))
    lines = [r.getMessage().removeprefix("kernels: ") for r in caplog.records if "fused" in r.getMessage()]
    assert [line.split(": ")[1].split(" (")[0] for line in lines] == ["compiled", "stock module", "compiled"]
    assert "at [14, 64] float32, forward and backward" in lines[0]
    assert [recorded(op).native for op in FUSED_OPS] == [True, False, True]
    assert len(timed) == 6
    calls.update(dict.fromkeys(FUSED_OPS, 0))  # the trial's own calls
    _loss_and_grads(model, torch.zeros(1, 5, dtype=torch.long))
    assert calls[RMS_NORM] > 0 and calls[ROTARY] > 0 and calls[SWIGLU] == 0
    assert len(fused_layers.choose_fused_ops(model)) == 3 and len(timed) == 6  # chosen once per process
