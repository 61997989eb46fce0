"""The strict fake-CUDA mode (engine/observe/fake_cuda.py) itself: placement, the device check, host-sync counting, the
torch.cuda answers, autograd and an optimiser step on fake CUDA parameters."""

from __future__ import annotations

import pytest
import torch
from alignopsd.engine.observe.fake_cuda import FakeCuda, FakeCudaTensor
from alignopsd.engine.observe.profiler import StepProfiler
from alignopsd.kernels import core_uses_kernels, resolve_impl

MIXED = "Expected all tensors to be on the same device"


def test_placement_reports_cuda():
    with FakeCuda():
        for t in (
            torch.randn(3).to("cuda"),
            torch.randn(3).cuda(),
            torch.zeros(2, 3, device="cuda"),
            torch.arange(4, device=torch.device("cuda", 0)),
            torch.tensor([1.0, 2.0], device="cuda"),
            torch.full((2,), 3.0, device="cuda"),
        ):
            assert isinstance(t, FakeCudaTensor) and t.device == torch.device("cuda", 0) and t.is_cuda
        x = torch.ones(3, device="cuda")
        assert (x + 1).is_cuda and x.sum().is_cuda and x.new_zeros(2).is_cuda and torch.zeros_like(x).is_cuda
        assert not x.cpu().is_cuda and x.cpu().device.type == "cpu"
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            torch.zeros(1, device="cuda:1")
    assert not torch.cuda.is_available()  # restored on exit


def test_mixing_devices_raises_as_cuda_does():
    with FakeCuda():
        x = torch.randn(3, 4, device="cuda")
        for op in (
            lambda: x + torch.ones(3, 4),
            lambda: torch.ones(4) * x,
            lambda: torch.cat([x, torch.zeros(1, 4)]),
            lambda: torch.where(torch.ones(3, 4, dtype=torch.bool), x, x),
            lambda: torch.ones(5)[torch.tensor([0, 1], device="cuda")],
            lambda: x.masked_fill(torch.zeros(3, 4, dtype=torch.bool), 0.0),
        ):
            with pytest.raises(RuntimeError, match="same device|indices should be"):
                op()
        # allowed on CUDA: 0-dim CPU scalars, CPU indices into a CUDA tensor, copies across devices
        assert (x * torch.tensor(2.0)).is_cuda
        assert x[torch.tensor([0, 2])].shape == (2, 4) and x[torch.tensor([0, 2])].is_cuda
        host = torch.empty(3, 4)
        host.copy_(x)
        assert torch.equal(host, x.cpu())
        x.copy_(torch.zeros(3, 4))
        assert float(x.abs().sum()) == 0.0


def test_host_syncs_are_counted_by_phase():
    prof = StepProfiler()
    with FakeCuda() as fc:
        x = torch.randn(5, device="cuda")
        prof.start_step()
        with prof.phase("update"):
            x.sum().item()
            x.tolist()
            float(x[0])
        with prof.phase("rectify"):
            x.cpu()
            x.to("cpu", torch.float64)
            x[x > 0]  # boolean-mask indexing: the output size comes from the device
            torch.empty(5).copy_(x)
        (x * 2).exp()  # no sync
        with pytest.raises(TypeError, match="cuda:0 device type tensor to numpy"):
            x.numpy()
    by_phase = fc.syncs_by_phase(exclude=("synchronize",))
    assert by_phase == {"update": 3, "rectify": 4}, by_phase
    assert fc.syncs[("update", "item")] == 2 and fc.syncs[("update", "tolist")] == 1
    assert fc.syncs[("rectify", "to_host")] == 3 and fc.syncs[("rectify", "data_dependent")] == 1
    assert fc.syncs_by_phase()["update"] >= 3  # the profiler's own edge synchronisations count as "synchronize"


def test_autograd_and_optimizer_on_fake_cuda_parameters():
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 2)
    data = torch.randn(6, 4)
    with FakeCuda():
        m = torch.nn.Linear(4, 2)
        m.load_state_dict(ref.state_dict())
        m.to("cuda")
        assert all(p.is_cuda and isinstance(p, torch.nn.Parameter) for p in m.parameters())
        opt = torch.optim.AdamW(m.parameters(), lr=0.1)
        m(data.to("cuda")).pow(2).sum().backward()
        assert m.weight.grad.is_cuda
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        got = m.weight.detach().cpu()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.1)
    ref(data).pow(2).sum().backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    opt_ref.step()
    assert torch.allclose(got, ref.weight.detach(), atol=1e-6)


def test_torch_cuda_answers_and_kernel_dispatch():
    with FakeCuda() as fc:
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1 and torch.cuda.current_device() == 0
        torch.cuda.set_device(0)
        with pytest.raises(RuntimeError, match="ordinal"):
            torch.cuda.set_device(1)
        torch.cuda.manual_seed(3)
        state = torch.cuda.get_rng_state_all()
        torch.cuda.set_rng_state_all(state)
        assert torch.cuda.is_bf16_supported() and torch.cuda.memory_allocated() == 0
        assert isinstance(torch.Generator(device="cuda"), torch.Generator)
        torch.cuda.synchronize()
        assert fc.syncs[("(outside a phase)", "synchronize")] == 1
        # Triton kernels cannot launch on the fake device: the torch paths run
        assert resolve_impl("auto", torch.zeros(2, device="cuda")) == "torch"
        assert not core_uses_kernels(torch.zeros(2, device="cuda"))


def test_factories_inside_a_backward_are_placed_on_the_fake_device():
    """A custom autograd backward (run by the C++ engine, below the Python API) that allocates on ``grad.device``."""

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            out = torch.zeros(g.shape, device=g.device)
            assert out.is_cuda
            return out + 2 * g

    with FakeCuda():
        x = torch.ones(3, device="cuda").requires_grad_(True)
        Twice.apply(x).sum().backward()
        assert x.grad.is_cuda and torch.equal(x.grad.cpu(), torch.full((3,), 2.0))


def test_profiler_books_host_syncs_to_phases():
    from alignopsd.engine.observe.profiler import format_table, summarize

    prof = StepProfiler()
    with FakeCuda():
        x = torch.randn(4, device="cuda")
        for _ in range(2):
            prof.start_step()
            with prof.phase("update"):
                x.sum().item()
                x.tolist()
            with prof.phase("m2"):
                x.cpu()
            x.max().item()  # outside every phase
            m = prof.end_step()
    assert m["host_syncs/update"] == 2 and m["host_syncs/m2"] == 1 and m["host_syncs/other"] == 1
    assert m["host_syncs/step"] == 4 and m["host_syncs/rectify"] == 0
    s = summarize(prof.history, prof.step_seconds, syncs=prof.sync_history)
    assert s["host_syncs"] == {"update": 2, "m2": 1, "(outside a phase)": 1} and s["host_syncs_total"] == 4
    assert "host syncs per step" in format_table(s)
    plain = StepProfiler()  # without a counter (a real run without the mode): no sync metrics
    plain.start_step()
    assert not any(k.startswith("host_syncs/") for k in plain.end_step())
