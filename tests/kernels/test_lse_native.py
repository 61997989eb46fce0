"""The C++ bf16 LM-head partials (csrc/lm_head_bf16.cpp via kernels/head/cpu_partials.py): equal to the torch path up to
reassociation, routed to by the fused log-prob's CPU forward exactly when it applies, checked inputs.

Legend: N = tokens, H = hidden size, V = vocabulary size. Shapes cover the kernel's tails: N not a multiple of its
6-row micro-tile, V not a multiple of its 64-entry blocks, a vocabulary shard smaller than one block.
"""

from __future__ import annotations

import pytest
import torch
from alignopsd.kernels import cpp, logprob, logprob_ref
from alignopsd.kernels.head import cpu_partials
from alignopsd.kernels.head.partials import finish_partials
from alignopsd.kernels.head.torch_tiles import torch_partials
from alignopsd.kernels.native_choice import HEAD

from alignopsd.testing import KernelChoice, record_kernel_choice

needs_native = pytest.mark.skipif(
    not cpp.native_ready(), reason="the C++ extension or an AVX512-BF16 CPU is missing: torch path only"
)
needs_extension = pytest.mark.skipif(
    cpu_partials._C is None or not hasattr(cpu_partials._C, "head_partials_bf16"),
    reason="the C++ extension is not built",
)


def _operands(n, v, h, *, seed=0, scale=0.08):
    g = torch.Generator().manual_seed(seed)
    hid = torch.randn(n, h, generator=g).bfloat16()
    w = (torch.randn(v, h, generator=g) * scale).bfloat16()
    t = torch.randint(0, v, (n,), generator=g)
    return hid, w, t


def _close(a, b, rtol=2e-5, atol=2e-5):
    for name, x, y in zip(("m", "s", "u", "tz"), a, b):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


@needs_native
@pytest.mark.parametrize(("n", "v", "h"), [(1, 5, 2), (7, 1000, 64), (37, 4099, 576), (13, 64, 130)])
@pytest.mark.parametrize("inv_t", [1.0, 1 / 0.7])
@pytest.mark.parametrize("need_u", [True, False])
def test_native_equals_torch_path(n, v, h, inv_t, need_u):
    hid, w, t = _operands(n, v, h)
    got = cpu_partials.native_partials(hid, w, t, inv_t, 0, need_u=need_u)
    want = torch_partials(hid, w, None, t, inv_t, 0, need_u=need_u)
    _close(got, want)
    if not need_u:
        assert torch.equal(got[2], torch.zeros(n))
    lp, _, ent = finish_partials(*got)
    ref_lp, ref_ent = logprob_ref(hid, w, t, temperature=1 / inv_t, with_entropy=True)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=3e-5)
    if need_u:
        torch.testing.assert_close(ent, ref_ent, rtol=0, atol=3e-5)


@needs_native
def test_native_vocab_shard_targets_outside_are_zero():
    """A vocabulary shard (tensor parallel): targets outside [vocab_start, vocab_start + V) give tz = 0, as the
    torch path's; a shard of fewer entries than one 64-entry block."""
    hid, w, _ = _operands(11, 40, 96)
    t = torch.tensor([0, 99, 100, 120, 139, 140, 5000, 101, 100, 138, 3])
    got = cpu_partials.native_partials(hid, w, t, 1.0, 100, need_u=True)
    _close(got, torch_partials(hid, w, None, t, 1.0, 100, need_u=True))
    outside = (t < 100) | (t >= 140)
    assert torch.equal(got[3][outside], torch.zeros(int(outside.sum())))
    assert bool((got[3][~outside] != 0).all())


@needs_native
def test_native_threads_deterministic(monkeypatch):
    """Same thread count, same bits; another thread count splits the vocabulary elsewhere (reassociation only)."""
    hid, w, t = _operands(50, 3000, 128, seed=3)
    one = cpu_partials.native_partials(hid, w, t, 1.0, 0)
    assert all(torch.equal(a, b) for a, b in zip(one, cpu_partials.native_partials(hid, w, t, 1.0, 0)))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    _close(cpu_partials.native_partials(hid, w, t, 1.0, 0), one)


@needs_native
def test_logprob_cpu_forward_routes_to_native_exactly_when_it_applies(monkeypatch):
    calls = []
    real = cpu_partials.native_partials

    def spy(*a, **k):
        calls.append(a[0].dtype)
        return real(*a, **k)

    monkeypatch.setattr(cpu_partials, "native_partials", spy)
    record_kernel_choice(KernelChoice(HEAD, True, 0.1, 0.2, "injected: measured faster"))
    hid, w, t = _operands(9, 300, 32)
    lp = logprob(hid, w, t, temperature=0.5)
    assert calls == [torch.bfloat16]
    torch.testing.assert_close(lp, logprob_ref(hid, w, t, temperature=0.5), rtol=0, atol=3e-5)
    # fp32 operands, a bias, an odd hidden size: the torch path
    logprob(hid.float(), w.float(), t)
    logprob(hid, w, t, bias=torch.zeros(300, dtype=torch.bfloat16))
    h_odd, w_odd, t_odd = _operands(4, 50, 33)
    logprob(h_odd, w_odd, t_odd)
    assert calls == [torch.bfloat16]
    # gradients still flow (the backward is the torch path's)
    h2 = hid.clone().requires_grad_()
    logprob(h2, w, t).sum().backward()
    assert h2.grad is not None and bool(h2.grad.abs().sum() > 0)


def test_torch_capability_below_avx512_turns_native_off(monkeypatch):
    """``ATEN_CPU_CAPABILITY=avx2`` (torch behaving like an AVX2-only CPU) keeps the head on the torch path."""
    monkeypatch.setattr(cpp, "_READY", None)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not cpp.native_ready()
    hid, w, _ = _operands(3, 70, 8)
    assert not cpu_partials.native_applies(hid, w, None)


def test_native_partials_rejects_what_it_cannot_run(monkeypatch):
    hid, w, t = _operands(3, 70, 8)
    with pytest.raises(ValueError, match="bf16 CPU hidden"):
        cpu_partials.native_partials(hid.float(), w.float(), t, 1.0, 0)
    monkeypatch.setattr(cpp, "_READY", False)
    with pytest.raises(ValueError, match="kernel ready: False"):
        cpu_partials.native_partials(hid, w, t, 1.0, 0)


@needs_extension
def test_extension_checks_its_arguments():
    """The C++ boundary checks every argument, the buffers' sizes among them, before it asks the CPU (so on any
    CPU): sizes that would read past a buffer are refused, naming it."""
    hid, w, t = _operands(2, 10, 8)
    out = torch.empty(4, 2)
    ptrs = [hid.data_ptr(), w.data_ptr(), t.data_ptr(), *(r.data_ptr() for r in out)]
    held = [16, 80, 2, 2]  # elements of hidden, weight, targets, each output

    def call(n=2, v=10, h=8, inv_t=1.0, threads=1, elements=held):
        return cpu_partials._C.head_partials_bf16(*ptrs, n, v, h, inv_t, True, threads, elements)

    with pytest.raises(ValueError, match="hidden_size: must be even"):
        call(h=7)
    with pytest.raises(ValueError, match="inv_t"):
        call(inv_t=float("inf"))
    with pytest.raises(ValueError, match="threads"):
        call(threads=0)
    with pytest.raises(ValueError, match="weight: the sizes and strides given reach 96 elements, the buffer holds 80"):
        call(v=12)  # a vocabulary larger than the weight
    with pytest.raises(ValueError, match="hidden: .* reach 20 elements, the buffer holds 16"):
        call(h=10, v=8)  # a hidden size larger than the rows hold
    with pytest.raises(ValueError, match="targets: .* reach 3 elements, the buffer holds 2"):
        call(n=3, elements=[24, 80, 2, 3])
    with pytest.raises(ValueError, match="elements: expected 4 counts"):
        call(elements=held[:3])
    if not cpp.native_ready():
        with pytest.raises(ValueError, match="no AVX512-BF16"):
            call()  # valid arguments: then the CPU is asked


def test_native_partials_checks_shapes_before_anything_runs():
    """Mismatched shapes are named by the wrapper before any native call (on any CPU)."""
    hid, w, t = _operands(3, 70, 8)
    with pytest.raises(ValueError, match="w_VH: hidden size 6 does not match h_NH's 8"):
        cpu_partials.native_partials(hid, w[:, :6], t, 1.0, 0)
    with pytest.raises(ValueError, match="t_N: expected 3 targets"):
        cpu_partials.native_partials(hid, w, t[:2], 1.0, 0)
    with pytest.raises(ValueError, match=r"h_NH, w_VH: expected hidden \[N, H\]"):
        cpu_partials.native_partials(hid[None], w, t, 1.0, 0)


def test_impl_torch_forces_the_torch_tiles(monkeypatch):
    """``impl="torch"`` never takes the C++ forward; ``impl="auto"`` takes it where it applies (here made to apply,
    with the torch tiles standing in for the kernel this CPU cannot run)."""
    calls = []

    def stand_in(h, w, t, inv_t, vocab_start, need_u=True):
        calls.append(h.dtype)
        return torch_partials(h, w, None, t, inv_t, vocab_start, need_u=need_u)

    monkeypatch.setattr(cpu_partials, "native_applies", lambda h, w, b: b is None and h.dtype == torch.bfloat16)
    monkeypatch.setattr(cpu_partials, "native_partials", stand_in)
    record_kernel_choice(KernelChoice(HEAD, True, 0.1, 0.2, "injected: measured faster"))
    hid, w, t = _operands(5, 90, 16)
    want = logprob_ref(hid, w, t)
    torch.testing.assert_close(logprob(hid, w, t, impl="torch"), want, rtol=0, atol=3e-5)
    assert calls == []
    torch.testing.assert_close(logprob(hid, w, t), want, rtol=0, atol=3e-5)
    assert calls == [torch.bfloat16]
