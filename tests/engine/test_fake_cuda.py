"""The strict fake-CUDA mode (tests/engine/fake_cuda.py) itself: placement, the device check, host-sync counting, the
torch.cuda answers, autograd and an optimiser step on fake CUDA parameters."""

from __future__ import annotations

import pytest
import torch
from alignopsd.engine.observe.profiler import StepProfiler
from alignopsd.kernels import HAS_TRITON, core_uses_kernels, logprob, resolve_impl, sibling_topk
from fake_cuda import FakeCuda, FakeCudaTensor

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


# Each device rule of the mode: (rule, op on a CUDA tensor x [3, 4] and a CUDA generator g, what CUDA does, the torch
# source it follows). None: the op runs; a string: it raises a RuntimeError matching it.
TI = "aten/src/ATen/TensorIterator.cpp compute_types: CPU scalars on non-CPU kernels (tensor_iterator_test CPUScalar)"
DEVCHECK = "torchgen device_check (c10/core/impl: check_and_update_common_device) of ops not marked NoCheck"
GEN = "aten/src/ATen/core/Generator.h check_generator: a draw's generator must be of the draw's device type"
SETITEM = "torch/csrc/autograd/python_variable_indexing.cpp THPVariable_setitem: basic indexing copies (copy_to)"
INDEX = "aten/src/ATen/native/TensorAdvancedIndexing.cpp: index/index_put_ move CPU indices; a 0-dim value is read"
RULES = [
    ("elementwise op, 0-dim CPU operand", lambda x, g: x * torch.tensor(2.0), None, TI),
    ("elementwise op via operator, reflected", lambda x, g: torch.tensor(2.0) - x, None, TI),
    ("elementwise in-place, 0-dim CPU operand", lambda x, g: x.clone().add_(torch.tensor(1.0)), None, TI),
    ("where, 0-dim CPU branch", lambda x, g: torch.where(x > 0, x, torch.tensor(0.0)), None, TI),
    ("masked_fill, 0-dim CPU value", lambda x, g: x.masked_fill(x > 0, torch.tensor(1.0)), None, TI),
    ("elementwise op, 1-dim CPU operand", lambda x, g: x + torch.ones(4), MIXED, TI),
    ("stack with a 0-dim CPU tensor", lambda x, g: torch.stack([x[0, 0], torch.tensor(1.0)]), MIXED, DEVCHECK),
    ("cat with a CPU tensor", lambda x, g: torch.cat([x, torch.zeros(1, 4)]), MIXED, DEVCHECK),
    ("index_select with a 0-dim CPU index", lambda x, g: x.index_select(0, torch.tensor(1)), MIXED, DEVCHECK),
    ("gather with a CPU index", lambda x, g: x.gather(1, torch.zeros(3, 1, dtype=torch.long)), MIXED, DEVCHECK),
    ("matmul with a CPU matrix", lambda x, g: x @ torch.ones(4, 2), MIXED, DEVCHECK),
    ("cuda[cpu_index]", lambda x, g: x[torch.tensor([0, 2])], None, INDEX),
    ("cpu[cuda_index]", lambda x, g: torch.ones(5)[torch.tensor([0], device="cuda")], "indices should be", INDEX),
    (
        "cuda[cpu_index] = 0-dim CPU value",
        lambda x, g: x.clone().__setitem__(torch.tensor([0]), torch.tensor(1.0)),
        None,
        INDEX,
    ),  # fmt: skip
    (
        "cuda[cpu_index] = 1-dim CPU value",
        lambda x, g: x.clone().__setitem__(torch.tensor([0]), torch.ones(4)),
        MIXED,
        INDEX,
    ),  # fmt: skip
    ("cuda[a:b] = 1-dim CPU value", lambda x, g: x.clone().__setitem__(slice(0, 2), torch.ones(4)), None, SETITEM),
    ("cpu[a:b] = CUDA value", lambda x, g: torch.zeros(3, 4).__setitem__(slice(0, 2), x[:2]), None, SETITEM),
    ("rand on CUDA with the CUDA generator", lambda x, g: torch.rand(3, device="cuda", generator=g), None, GEN),
    ("multinomial on CUDA with the CUDA generator", lambda x, g: torch.multinomial(x.abs(), 1, generator=g), None, GEN),
    (
        "rand on CUDA with a CPU generator",
        lambda x, g: torch.rand(3, device="cuda", generator=torch.Generator()),
        "Expected a 'cuda' device type for generator but found 'cpu'",
        GEN,
    ),  # fmt: skip
    (
        "multinomial on CUDA with a CPU generator",
        lambda x, g: torch.multinomial(x.abs(), 1, generator=torch.Generator()),
        "found 'cpu'",
        GEN,
    ),  # fmt: skip
    (
        "rand on the CPU with the CUDA generator",
        lambda x, g: torch.rand(3, generator=g),
        "Expected a 'cpu' device type for generator but found 'cuda'",
        GEN,
    ),  # fmt: skip
    ("randperm on the CPU with the CUDA generator", lambda x, g: torch.randperm(4, generator=g), "found 'cuda'", GEN),
]


@pytest.mark.parametrize("rule,op,raises,source", RULES, ids=[r[0] for r in RULES])
def test_device_rules_follow_cuda(rule, op, raises, source):
    assert source  # each rule names the torch source it follows
    with FakeCuda():
        x = torch.randn(3, 4, device="cuda")
        g = torch.Generator(device="cuda")
        g.manual_seed(0)
        if raises is None:
            out = op(x, g)
            assert out is None or out.is_cuda or out.device.type == "cpu"
        else:
            with pytest.raises(RuntimeError, match=raises):
                op(x, g)


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
        assert torch.Generator(device="cuda").device.type == "cuda" and torch.Generator().device.type == "cpu"
        torch.cuda.synchronize()
        assert fc.syncs[("(outside a phase)", "synchronize")] == 1
        # the engine takes the kernel branches it takes on a GPU (the launches are served on the host)
        assert resolve_impl("auto", torch.zeros(2, device="cuda")) == ("triton" if HAS_TRITON else "torch")
        assert core_uses_kernels(torch.zeros(2, device="cuda")) == HAS_TRITON
    with FakeCuda(kernels=False):  # the kernels' torch paths instead
        assert resolve_impl("auto", torch.zeros(2, device="cuda")) == "torch"
        assert not core_uses_kernels(torch.zeros(2, device="cuda"))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable: no kernel branch to take")
def test_kernel_launches_on_the_fake_device_write_the_callers_memory():
    """The fused log-prob (forward and backward: launch references) and the sibling top-K (Triton interpreter) on
    fake CUDA tensors give the torch paths' results, through their launch code, counted per kernel."""
    torch.manual_seed(0)
    h, w, t = (
        torch.randn(6, 16, requires_grad=True),
        torch.randn(300, 16, requires_grad=True),
        torch.randint(0, 300, (6,)),
    )
    lp_ref, ent_ref = logprob(h, w, t, with_entropy=True, impl="torch")
    (lp_ref.sum() + ent_ref.sum()).backward()
    m = 6
    emb = torch.nn.functional.normalize(torch.randn(m, 8), dim=-1)
    ids = [torch.tensor(v) for v in ([0, 0, 0, 1, 1, 1], [0, 1, 2, 0, 1, 2], [0] * m)]
    ok = torch.ones(m, dtype=torch.bool)
    top_ref = sibling_topk(emb, emb.flip(0), *ids, ok, ok, gamma=-1.0, top_k=2, impl="torch")
    with FakeCuda() as fc:
        hc, wc = h.detach().cuda().requires_grad_(True), w.detach().cuda().requires_grad_(True)
        lp, ent = logprob(hc, wc, t.cuda(), with_entropy=True)
        (lp.sum() + ent.sum()).backward()
        assert lp.is_cuda and hc.grad.is_cuda and wc.grad.is_cuda
        top = sibling_topk(emb.cuda(), emb.flip(0).cuda(), *(i.cuda() for i in ids), ok.cuda(), ok.cuda(), gamma=-1.0,
                           top_k=2)  # fmt: skip
        got = (lp.cpu(), ent.cpu(), hc.grad.cpu(), wc.grad.cpu(), top.selected.cpu())
    assert fc.launches["_lp_fwd_kernel"] == 1 and fc.launches["_lp_bwd_kernel"] == 1
    assert sum(n for k, n in fc.launches.items() if "sibling" in k or "profiles" in k) >= 1, fc.launches
    for a, b in zip(got[:4], (lp_ref, ent_ref, h.grad, w.grad)):
        torch.testing.assert_close(a, b.detach(), atol=1e-5, rtol=1e-5)
    assert torch.equal(got[4], top_ref.selected)


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
