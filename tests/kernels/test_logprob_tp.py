"""Vocab-parallel log-prob under ``torchrun --nproc_per_node=2`` (gloo): each rank's shard against
the single-process fp32 reference (forward, entropy, and gradients of hidden and of its shard).

Legend: N = tokens, H = hidden size, V = full vocabulary, V_r = this rank's shard.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from alignopsd.kernels import logprob_ref, logprob_vocab_parallel
from kernel_helpers import IMPLS

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(os.environ.get("WORLD_SIZE") != "2", reason="needs torchrun --nproc_per_node=2"),
]

N, H, V = 37, 72, 1031
SPLIT = 517  # uneven shards: [0, 517) and [517, 1031)
TEMP = 0.8


@pytest.fixture(scope="module")
def group():
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    g = dist.new_group(ranks=[0, 1], backend="gloo")
    yield g


def _full_inputs():
    g = torch.Generator().manual_seed(11)
    h = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.3
    b = torch.randn(V, generator=g) * 0.5
    t = torch.randint(0, V, (N,), generator=g)
    t[:4] = torch.tensor([0, SPLIT - 1, SPLIT, V - 1])  # shard edges
    return h, w, b, t


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduce_in_kernel", [True, False])
def test_vocab_parallel_matches_single_process(group, impl, reduce_in_kernel):
    rank = dist.get_rank(group)
    h, w, b, t = _full_inputs()
    lo, hi = (0, SPLIT) if rank == 0 else (SPLIT, V)

    # single-process reference (identical on both ranks)
    hr, wr, br = (x.clone().requires_grad_() for x in (h, w, b))
    ref_lp, ref_ent = logprob_ref(hr, wr, t, bias=br, temperature=TEMP, with_entropy=True)
    gen = torch.Generator().manual_seed(3)
    g_lp, g_ent = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    ((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum()).backward()

    hs = h.clone().requires_grad_()
    ws = w[lo:hi].clone().requires_grad_()
    bs = b[lo:hi].clone().requires_grad_()
    lp, ent = logprob_vocab_parallel(
        hs,
        ws,
        t,
        group=group,
        vocab_start=lo,
        bias_shard=bs,
        temperature=TEMP,
        with_entropy=True,
        all_reduce_grad_hidden=reduce_in_kernel,
        impl=impl,
    )
    torch.testing.assert_close(lp, ref_lp.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent.detach(), atol=2e-5, rtol=1e-5)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    dh = hs.grad.clone()
    if not reduce_in_kernel:  # the caller's all-reduce (Megatron's copy_to_tensor_model_parallel_region)
        dist.all_reduce(dh, group=group)
    torch.testing.assert_close(dh, hr.grad, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(ws.grad, wr.grad[lo:hi], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(bs.grad, br.grad[lo:hi], atol=2e-5, rtol=1e-4)


def test_vocab_parallel_rejects_uncovered_targets(group):
    rank = dist.get_rank(group)
    h, w, _, t = _full_inputs()
    lo, hi = (0, SPLIT) if rank == 0 else (SPLIT, V)
    bad = t.clone()
    bad[0] = V + 5  # in no shard
    with pytest.raises(ValueError, match="targets"):
        logprob_vocab_parallel(h, w[lo:hi], bad, group=group, vocab_start=lo, impl="torch")
