"""The kernels' one routing rule (kernels/_dispatch.py ``resolve_impl``): triton / torch / cpp for a call, from the
``impl`` asked for, the operands' device, and the call's custom CPU path with its measured choice."""

from __future__ import annotations

import pytest
import torch
from alignopsd.kernels import HAS_TRITON, NativePath, logprob, logprob_ref, resolve_impl, sibling_topk
from alignopsd.kernels.head import cpu_partials
from alignopsd.kernels.head.torch_tiles import torch_partials
from alignopsd.kernels.native_choice import HEAD, recorded

from alignopsd.testing import KernelChoice, force_kernels, record_kernel_choice


def _measured(native: bool, calls: list):
    def measure():
        calls.append(1)
        return record_kernel_choice(KernelChoice(HEAD, native, 1.0, 2.0, "measured by the test"))

    return measure


def test_forced_values_are_checked_and_auto_takes_a_custom_path_only_where_chosen():
    cpu = torch.zeros(2)
    with pytest.raises(ValueError, match="impl: unknown value 'cuda'"):
        resolve_impl("cuda", cpu)
    assert resolve_impl("torch", cpu, native=NativePath(True)) == "torch"
    with pytest.raises(ValueError, match="impl: 'cpp' requested but this call has no C\\+\\+ path"):
        resolve_impl("cpp", cpu)
    with pytest.raises(ValueError, match="impl: 'cpp' requested but it cannot run here: no AVX512-BF16"):
        resolve_impl("cpp", cpu, native=NativePath(False, why="no AVX512-BF16"))
    assert resolve_impl("cpp", cpu, native=NativePath(True)) == "cpp"
    assert resolve_impl("auto", cpu, native=NativePath(True)) == "cpp"  # no measured choice: wherever it applies
    assert resolve_impl("auto", cpu, native=NativePath(False)) == "torch"
    assert resolve_impl("auto", cpu) == "torch"
    with pytest.raises(ValueError, match="measure: the measured choice 'head partials' needs a way to measure it"):
        NativePath(True, HEAD)


def test_a_measured_choice_is_measured_once_then_read():
    """Nothing recorded: ``auto`` measures on the call (the path's ``measure``) and follows it; a path that does not
    apply is never measured."""
    cpu, calls = torch.zeros(2), []
    assert resolve_impl("auto", cpu, native=NativePath(False, HEAD, _measured(True, calls))) == "torch"
    assert calls == [] and recorded(HEAD) is None
    assert resolve_impl("auto", cpu, native=NativePath(True, HEAD, _measured(True, calls))) == "cpp"
    assert resolve_impl("auto", cpu, native=NativePath(True, HEAD, _measured(False, calls))) == "cpp"  # recorded
    assert calls == [1]
    record_kernel_choice(KernelChoice(HEAD, False, 2.0, 1.0, "slower"))
    assert resolve_impl("auto", cpu, native=NativePath(True, HEAD, _measured(True, calls))) == "torch"
    assert resolve_impl("cpp", cpu, native=NativePath(True, HEAD, _measured(True, calls))) == "cpp"  # forced
    assert calls == [1]


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_force_kernels_routes_the_core_only():
    """Under ``force_kernels`` (Triton interpreter) the core's question goes to Triton for CPU tensors; an entry's
    ``auto`` stays on its CPU path."""
    cpu = torch.zeros(2)
    assert resolve_impl("auto", cpu, core=True) == "torch"
    with force_kernels():
        assert resolve_impl("auto", cpu, core=True) == "triton"
        assert resolve_impl("auto", cpu) == "torch"
    assert resolve_impl("triton", cpu) == "triton"  # interpreter (conftest)


def test_entries_without_a_cpp_path_refuse_it():
    emb = torch.nn.functional.normalize(torch.randn(4, 8), dim=-1)
    ids, ok = torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.bool)
    with pytest.raises(ValueError, match="no C\\+\\+ path"):
        sibling_topk(emb, emb, ids, torch.arange(4), ids, ok, ok, gamma=0.1, top_k=1, impl="cpp")


def test_logprob_cpp_forces_the_cpp_forward_wherever_it_applies(monkeypatch):
    """``impl="cpp"`` takes the C++ forward even where the torch path was measured faster (the kernel made to apply,
    the torch tiles standing in for it); operands it cannot take are refused, naming ``impl``."""
    calls = []

    def stand_in(h, w, t, inv_t, vocab_start, need_u=True):
        calls.append(h.dtype)
        return torch_partials(h, w, None, t, inv_t, vocab_start, need_u=need_u)

    monkeypatch.setattr(cpu_partials, "native_applies", lambda h, w, b: b is None and h.dtype == torch.bfloat16)
    monkeypatch.setattr(cpu_partials, "native_partials", stand_in)
    record_kernel_choice(KernelChoice(HEAD, False, 0.2, 0.1, "injected: slower"))
    g = torch.Generator().manual_seed(0)
    hid, w = torch.randn(5, 16, generator=g).bfloat16(), (torch.randn(40, 16, generator=g) * 0.2).bfloat16()
    t = torch.randint(0, 40, (5,), generator=g)
    want = logprob_ref(hid, w, t)
    torch.testing.assert_close(logprob(hid, w, t), want, rtol=0, atol=3e-5)
    assert calls == []
    torch.testing.assert_close(logprob(hid, w, t, impl="cpp"), want, rtol=0, atol=3e-5)
    assert calls == [torch.bfloat16]
    with pytest.raises(ValueError, match="impl: 'cpp' requested but it cannot run here"):
        logprob(hid.float(), w.float(), t, impl="cpp")
