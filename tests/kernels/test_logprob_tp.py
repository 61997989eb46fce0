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
    dist.barrier()  # both ranks here before the new group connects (a rank still in an earlier test's tail refused it)
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


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("tile_bytes", [None, 4 * 517 * 5])
def test_fused_loss_vocab_parallel_matches_single_process(group, with_entropy, tile_bytes):
    """logprob_loss_and_grad over vocabulary shards: log-probs, loss and gradients equal the single process."""
    from alignopsd.kernels import fused_token_loss, logprob_loss_and_grad

    rank = dist.get_rank(group)
    h, w, b, t = _full_inputs()
    lo, hi = (0, SPLIT) if rank == 0 else (SPLIT, V)
    gen = torch.Generator().manual_seed(5)
    old, adv = torch.randn(N, generator=gen) - 6.0, torch.randn(N, generator=gen)

    def token_loss(lp, ent, idx):
        r = torch.exp(lp - old[idx])
        out = -torch.minimum(r * adv[idx], r.clamp(0.8, 1.28) * adv[idx])
        return out - 0.1 * ent if ent is not None else out

    full = logprob_loss_and_grad(h, w, t, token_loss, bias=b, temperature=TEMP, with_entropy=with_entropy)
    shard = logprob_loss_and_grad(
        h, w[lo:hi].contiguous(), t, token_loss, bias=b[lo:hi].contiguous(), temperature=TEMP,
        with_entropy=with_entropy, tile_bytes=tile_bytes, group=group, vocab_start=lo,
    )  # fmt: skip
    torch.testing.assert_close(shard.loss, full.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shard.logp, full.logp, atol=2e-6, rtol=1e-6)  # |logp| ~ 16: 1 ulp is 1.9e-6
    if with_entropy:
        torch.testing.assert_close(shard.entropy, full.entropy, atol=1e-5, rtol=0)
    torch.testing.assert_close(shard.grad_hidden, full.grad_hidden, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(shard.grad_weight, full.grad_weight[lo:hi], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(shard.grad_bias, full.grad_bias[lo:hi], atol=1e-6, rtol=1e-5)

    # autograd form under the same shards
    hs, ws = h.clone().requires_grad_(), w[lo:hi].clone().requires_grad_()
    loss, lp, _ = fused_token_loss(
        hs, ws, t, token_loss, temperature=TEMP, with_entropy=with_entropy, group=group, vocab_start=lo
    )
    loss.backward()
    ref = logprob_loss_and_grad(h, w, t, token_loss, temperature=TEMP, with_entropy=with_entropy)
    torch.testing.assert_close(hs.grad, ref.grad_hidden, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ws.grad, ref.grad_weight[lo:hi], atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="targets"):
        logprob_loss_and_grad(h, w[lo:hi], t, token_loss, group=group, vocab_start=lo + 1)
