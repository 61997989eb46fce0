"""HFPolicy: fused-head log-probs (shift, padding, temperature, entropy), gradients, AdamW step, clipping,
non-finite skip, checkpoints, and DDP under gloo (run with torchrun --nproc_per_node=2)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from alignopsd.engine.policy.hf import HFPolicy
from alignopsd.engine.policy.lm_head import token_logprobs
from alignopsd.engine.policy.mixed_precision import MasterAdamW
from transformers import LlamaConfig, LlamaForCausalLM

V = 97


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


def rows(seed: int = 0):
    """[left-padded prompt (width 6) | right-padded response (width 5)] rows with ragged lengths."""
    g = torch.Generator().manual_seed(seed)
    p_lens, r_lens = [6, 2, 4, 1], [5, 3, 1, 4]
    ids = torch.zeros(4, 11, dtype=torch.long)
    mask = torch.zeros(4, 11, dtype=torch.long)
    for i, (p, r) in enumerate(zip(p_lens, r_lens)):
        ids[i, 6 - p : 6] = torch.randint(1, V, (p,), generator=g)
        mask[i, 6 - p : 6] = 1
        ids[i, 6 : 6 + r] = torch.randint(1, V, (r,), generator=g)
        mask[i, 6 : 6 + r] = 1
    return ids, mask


def reference(model, ids, mask, lr, temperature):
    """Full-logits reference row by row (no padding at all)."""
    logp = torch.zeros(ids.shape[0], lr)
    ent = torch.zeros(ids.shape[0], lr)
    for b in range(ids.shape[0]):
        keep = mask[b].bool()
        x = ids[b][keep][None]
        n_r = int(mask[b, -lr:].sum())
        logits = model(input_ids=x).logits[0].float() / temperature
        ls = torch.log_softmax(logits, -1)
        n = x.shape[1]
        tgt = x[0, n - n_r :]
        logp[b, :n_r] = ls[n - n_r - 1 : n - 1].gather(-1, tgt[:, None]).squeeze(-1)
        p = ls[n - n_r - 1 : n - 1].exp()
        ent[b, :n_r] = -(p * ls[n - n_r - 1 : n - 1]).sum(-1)
    return logp, ent


def test_head_matches_full_and_grads():
    torch.manual_seed(0)
    h = torch.randn(13, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(29, 16, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 29, (13,))
    lp, en = token_logprobs(h, w, t, temperature=0.7, with_entropy=True, impl="torch")
    logits = (h @ w.t()) / 0.7
    ls = torch.log_softmax(logits, -1)
    ref_lp = ls.gather(-1, t[:, None]).squeeze(-1)
    ref_en = -(ls.exp() * ls).sum(-1)
    assert torch.allclose(lp.double(), ref_lp, atol=1e-6) and torch.allclose(en.double(), ref_en, atol=1e-6)
    g1 = torch.autograd.grad((lp * 0.3).sum() + en.sum(), (h, w))
    g2 = torch.autograd.grad((ref_lp * 0.3).sum() + ref_en.sum(), (h, w))
    for a, b in zip(g1, g2):
        assert torch.allclose(a.double(), b, atol=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(h, w, t, temperature=0.0)
    with pytest.raises(ValueError, match="impl"):
        token_logprobs(h, w, t, impl="fast")


@pytest.mark.parametrize("impl", ["auto", "torch"])
def test_response_logprobs_match_reference_with_entropy(impl):
    model = tiny_model()
    pol = HFPolicy(model, lr=1e-3, impl=impl)
    ids, mask = rows()
    lp, en = pol.response_logprobs(ids, mask, 5, temperature=0.6, with_entropy=True)
    with torch.no_grad():
        ref_lp, ref_en = reference(model, ids, mask, 5, 0.6)
    assert lp.shape == (4, 5) and lp.dtype == torch.float32
    assert (lp - ref_lp).abs().max() < 1e-5 and (en - ref_en).abs().max() < 1e-5
    assert bool((lp[mask[:, 6:] == 0] == 0).all())
    none_lp, none_en = pol.response_logprobs(ids, mask, 5)
    assert none_en is None and (none_lp - lp).abs().max() > 0  # temperature matters
    with pytest.raises(ValueError, match="response_length"):
        pol.response_logprobs(ids, mask, 11)
    with pytest.raises(ValueError, match="attention_mask"):
        pol.response_logprobs(ids, mask[:, 1:], 5)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_fused_loss_matches_autograd(with_entropy):
    """response_loss (gradients formed with the log-probs) equals autograd through response_logprobs."""
    from alignopsd.losses import entropy_bonus, ppo_loss

    ids, mask = rows(2)
    rmask = mask[:, 6:].float()
    g = torch.Generator().manual_seed(3)
    old = torch.randn(4, 5, generator=g) - 4.0
    adv = torch.randn(4, 5, generator=g)

    def loss_fn(lp, ent):
        loss, _ = ppo_loss(lp, old, adv, rmask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
        if ent is not None:
            loss = loss + entropy_bonus(ent, rmask, coef=0.01)
        return loss

    grads, lps = [], []
    for fused in (False, True):
        model = tiny_model(4)
        pol = HFPolicy(model, lr=1e-3)
        if fused:
            lp, ent, carrier = pol.response_loss(ids, mask, 5, loss_fn, loss_fill=old, temperature=0.8,
                                                 with_entropy=with_entropy)  # fmt: skip
            assert float(carrier.detach()) == 0.0 and not lp.requires_grad
            (carrier * 1.7).backward()
        else:
            lp, ent = pol.response_logprobs(ids, mask, 5, temperature=0.8, with_entropy=with_entropy, grad=True)
            (loss_fn(lp, ent) * 1.7).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        lps.append(lp.detach())
    assert (lps[1] - lps[0]).abs().max() < 1e-5
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for name, ga in grads[0].items():
        torch.testing.assert_close(grads[1][name], ga, atol=2e-6, rtol=1e-4, msg=name)
    assert max(float(gr.abs().max()) for gr in grads[0].values()) > 1e-4  # the comparison is not vacuous
    with pytest.raises(ValueError, match="loss_fn"):
        pol.response_loss(ids, mask, 5, None)
    with pytest.raises(ValueError, match="loss_fill"):
        pol.response_loss(ids, mask, 5, loss_fn, loss_fill=old[:, :3])


@pytest.mark.parametrize("impl", ["auto", "torch"])
def test_grad_step_clip_and_checkpoint(tmp_path, impl):
    model = tiny_model(1)
    pol = HFPolicy(model, lr=1e-2, weight_decay=0.0, impl=impl)
    ids, mask = rows(1)
    lp, en = pol.response_logprobs(ids, mask, 5, with_entropy=True, grad=True)
    loss = -(lp * mask[:, 6:]).sum() / mask[:, 6:].sum() - 0.01 * en.sum()
    loss.backward()
    # gradient equals the one of the full-logits reference
    ref_model = tiny_model(1)
    ref_lp, ref_en = reference(ref_model, ids, mask, 5, 1.0)
    (-(ref_lp * mask[:, 6:]).sum() / mask[:, 6:].sum() - 0.01 * ref_en.sum()).backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4), n
    norm = pol.grad_norm()
    before = {k: v.clone() for k, v in pol.hf_state_dict().items()}
    out = pol.optimizer_step(max_grad_norm=norm / 10)
    assert out["skipped"] is False and out["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert all(p.grad is None for p in model.parameters())
    after = pol.hf_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # checkpoint round trip: a second policy continues identically
    path = tmp_path / "ckpt.pt"
    torch.save({"weights": pol.hf_state_dict(), "optimizer": pol.optimizer_state()}, path)
    pol2 = HFPolicy(tiny_model(9), lr=1e-2, weight_decay=0.0)
    saved = torch.load(path, weights_only=False)
    pol2.load_hf_state_dict(saved["weights"])
    pol2.load_optimizer_state(saved["optimizer"])
    for p in (pol, pol2):
        lp, _ = p.response_logprobs(ids, mask, 5, grad=True)
        lp.sum().backward()
        p.optimizer_step(1.0)
    for k, v in pol.hf_state_dict().items():
        assert torch.equal(v, pol2.hf_state_dict()[k]), k
    with pytest.raises(ValueError, match="optimizer"):
        pol2.load_optimizer_state({"tp": 1, "tp_rank_states": []})  # another backend's state
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
        pol2.load_hf_state_dict({k: v for k, v in saved["weights"].items() if k != "model.norm.weight"})
    with pytest.raises(TypeError, match="cannot load it"):
        pol2.load_checkpoint(tmp_path)
    assert pol2.sharded_checkpoint is False


def test_non_finite_gradient_skips_step(caplog):
    model = tiny_model(2)
    pol = HFPolicy(model, lr=1e-2)
    ids, mask = rows(2)
    lp, _ = pol.response_logprobs(ids, mask, 5, grad=True)
    (lp.sum() * float("nan")).backward()
    before = {k: v.clone() for k, v in pol.hf_state_dict().items()}
    with caplog.at_level("WARNING"):
        out = pol.optimizer_step(1.0)
    assert out["skipped"] is True and not out["grad_norm"] == out["grad_norm"]
    assert "skipped" in caplog.text
    for k, v in pol.hf_state_dict().items():
        assert torch.equal(v, before[k])
    assert pol.skipped_steps == 1 and pol.steps == 0
    assert len(pol.optimizer.state) == 0  # no moment was touched


def _bf16_step(pol, ids, mask, clip=None):
    """One real update of ``pol`` (forward, backward, optimizer step); returns the model's gradients of it."""
    lp, _ = pol.response_logprobs(ids, mask, 5, grad=True)
    (-(lp * mask[:, 6:]).sum() / mask[:, 6:].sum()).backward()
    grads = [g.detach().clone() for g in pol.gradients()]  # the fp32 buffers (one backward: exact upcasts)
    out = pol.optimizer_step(clip)
    assert out["skipped"] is False
    return grads


def test_bf16_master_weights_keep_updates_below_bf16_resolution():
    """lr 1e-6 on bf16 weights: AdamW stepping the bf16 parameters themselves loses almost every update
    (each one is below half a bf16 ulp of its weight), the fp32 masters keep them, and the bf16 weights
    follow the masters: after the run they equal the bf16 rounding of an fp32 AdamW fed the same gradients."""
    model = tiny_model(5).to(torch.bfloat16)
    start = [p.detach().clone() for p in model.parameters()]
    pol = HFPolicy(model, lr=1e-6, weight_decay=0.01)
    assert isinstance(pol.optimizer, MasterAdamW) and all(m.dtype == torch.float32 for m in pol.optimizer.masters)
    fp32_ref = [p.detach().float().clone() for p in pol.params]
    ref_opt = torch.optim.AdamW(fp32_ref, lr=1e-6, weight_decay=0.01)
    pure = [p.detach().clone() for p in pol.params]  # today's behaviour: AdamW on the bf16 parameters
    pure_opt = torch.optim.AdamW(pure, lr=1e-6, weight_decay=0.01)
    ids, mask = rows(5)
    n_elem = sum(p.numel() for p in start)
    for step in range(30):
        grads = _bf16_step(pol, ids, mask)
        for r, q, g in zip(fp32_ref, pure, grads):
            r.grad, q.grad = g.clone(), g.to(torch.bfloat16)
        ref_opt.step()
        pure_opt.step()
        if step == 0:  # one step: every master with a gradient moved, the pure-bf16 weights barely did
            moved = sum(int((m != s.float()).sum()) for m, s in zip(pol.optimizer.masters, start))
            pure_moved = sum(int((q != s).sum()) for q, s in zip(pure, start))
            assert moved > 0.95 * n_elem and pure_moved < 0.1 * n_elem
        assert all(st["exp_avg"].dtype == torch.float32 for st in pol.optimizer.state.values())
    for p, m, r in zip(pol.params, pol.optimizer.masters, fp32_ref):
        assert p.dtype == torch.bfloat16 and torch.equal(m, r) and torch.equal(p, r.to(torch.bfloat16))
    changed = sum(int((p != s).sum()) for p, s in zip(pol.params, start))
    pure_changed = sum(int((q != s).sum()) for q, s in zip(pure, start))
    assert changed > 0.2 * n_elem and changed > 5 * pure_changed, (changed, pure_changed, n_elem)


def test_bf16_master_weights_checkpoint_resumes_exactly(tmp_path):
    pol = HFPolicy(tiny_model(6).to(torch.bfloat16), lr=1e-6, weight_decay=0.01)
    ids, mask = rows(6)
    _bf16_step(pol, ids, mask, clip=1.0)
    torch.save({"weights": pol.hf_state_dict(), "optimizer": pol.optimizer_state()}, tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    state = saved["optimizer"]
    assert all(torch.equal(a, b) for a, b in zip(state["optimizer"]["master_params"], pol.optimizer.masters))
    pol2 = HFPolicy(tiny_model(7).to(torch.bfloat16), lr=1e-6, weight_decay=0.01)
    pol2.load_hf_state_dict(saved["weights"])
    pol2.load_optimizer_state(state)
    for a, b in zip(pol.optimizer.masters, pol2.optimizer.masters):
        assert torch.equal(a, b)
    # the masters hold more than their bf16 rounding (so resuming from the bf16 weights alone would differ)
    assert any(not torch.equal(m, p.float()) for m, p in zip(pol.optimizer.masters, pol.params))
    for p in (pol, pol2):
        _bf16_step(p, ids, mask, clip=1.0)
    for a, b in zip(pol.optimizer.masters, pol2.optimizer.masters):
        assert torch.equal(a, b)
    # a state saved without masters (an fp32 run) seeds them from the loaded weights
    fp32 = HFPolicy(tiny_model(8), lr=1e-6)
    pol2.load_hf_state_dict(fp32.hf_state_dict())
    pol2.load_optimizer_state(fp32.optimizer_state())
    for m, p in zip(pol2.optimizer.masters, pol2.params):
        assert torch.equal(m, p.float())
    bad = dict(state, optimizer={**state["optimizer"], "master_params": state["optimizer"]["master_params"][:-1]})
    with pytest.raises(ValueError, match="master_params"):
        pol2.load_optimizer_state(bad)


def test_fp32_model_keeps_plain_adamw():
    pol = HFPolicy(tiny_model(), lr=1e-6)
    assert type(pol.optimizer) is torch.optim.AdamW


def test_bad_constructor_args():
    with pytest.raises(ValueError, match="lr"):
        HFPolicy(tiny_model(), lr=0)
    with pytest.raises(ValueError, match="betas"):
        HFPolicy(tiny_model(), betas=(0.9, 1.0))


@pytest.mark.distributed
def test_ddp_gradients_are_averaged():
    if os.environ.get("WORLD_SIZE") != "2":
        pytest.skip("run under torchrun --nproc_per_node=2")
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    ids, mask = rows(3)
    model = tiny_model(4)
    pol = HFPolicy(model, lr=1e-2, ddp=True)
    assert pol.distributed
    half = slice(2 * rank, 2 * rank + 2)
    lp, _ = pol.response_logprobs(ids[half], mask[half], 5, grad=True)
    lp.sum().backward()
    # single-process reference: mean of the two halves' gradients
    ref = tiny_model(4)
    ref_pol = HFPolicy(ref, lr=1e-2, ddp=False)
    for h in (slice(0, 2), slice(2, 4)):
        lp, _ = ref_pol.response_logprobs(ids[h], mask[h], 5, grad=True)
        (lp.sum() / 2).backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), n
    out = pol.optimizer_step(1.0)
    ref_out = ref_pol.optimizer_step(1.0)
    assert out["grad_norm"] > 0 and out["grad_norm"] == pytest.approx(ref_out["grad_norm"], rel=1e-5)
    for k, v in pol.hf_state_dict().items():
        assert torch.allclose(v, ref_pol.hf_state_dict()[k], atol=1e-6), k


def _micro_grads(pol, seeds):
    """Per micro-batch bf16 gradients (``autograd.grad``, which accumulates nothing), then the real backward of
    each micro-batch through the policy (which accumulates into its buffers)."""
    per_micro = []
    for s in seeds:
        ids, mask = rows(s)
        lp, _ = pol.response_logprobs(ids, mask, 5, grad=True)
        loss = -(lp * mask[:, 6:]).sum() / mask[:, 6:].sum()
        per_micro.append(torch.autograd.grad(loss, pol.params, retain_graph=True))
        loss.backward()
    return per_micro


def test_bf16_gradients_accumulate_in_fp32_over_16_micro_batches():
    """16 micro-batches on a bf16 model: the policy's gradient buffers equal the fp32 sum of the micro-batches'
    gradients to fp32 rounding; the same sum taken in bf16 (what ``p.grad`` held) misses that bound."""
    pol = HFPolicy(tiny_model(11).to(torch.bfloat16), lr=1e-6)
    per_micro = _micro_grads(pol, range(100, 116))
    assert all(p.grad is None for p in pol.params)  # nothing accumulates in bf16
    bufs = pol.gradients()
    assert len(bufs) == len(pol.params) and all(b.dtype == torch.float32 for b in bufs)
    bf16_sum = [sum(gs[1:], gs[0].clone()) for gs in zip(*per_micro)]  # bf16 accumulation

    def within_fp32_rounding(got, ref):  # 16 fp32 additions: a few ulp of the largest partial sum
        tol = 32 * 2.0**-24 * float(ref.abs().max())
        return float((got.double() - ref).abs().max()) <= tol

    exact, bf16_ok = 0, 0
    for buf, b16, gs in zip(bufs, bf16_sum, zip(*per_micro)):
        ref = sum(g.double() for g in gs)
        exact += within_fp32_rounding(buf, ref)
        bf16_ok += within_fp32_rounding(b16, ref)
    assert exact == len(bufs)
    assert bf16_ok < len(bufs) // 4, (bf16_ok, len(bufs))
    out = pol.optimizer_step(None)  # the step reads the buffers and clears them
    ref_norm = torch.cat([sum(g.double() for g in gs).reshape(-1) for gs in zip(*per_micro)]).norm()
    assert out["grad_norm"] == pytest.approx(float(ref_norm), rel=1e-5)
    assert all(m.grad is None for m in pol.optimizer.masters)


@pytest.mark.distributed
def test_bf16_gradients_are_averaged_over_ranks_in_fp32():
    """Two ranks, two bf16 micro-batches each: the all-reduce runs on the fp32 buffers, so every rank's gradient
    is the fp32 mean of the four micro-batches' gradients (to fp32 rounding) and the replicas stay identical."""
    if os.environ.get("WORLD_SIZE") != "2":
        pytest.skip("run under torchrun --nproc_per_node=2")
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)  # a different start on each rank: the policy must broadcast rank 0's weights
    model = tiny_model(12 if rank == 0 else 13).to(torch.bfloat16)
    pol = HFPolicy(model, lr=1e-3, ddp=True)
    assert pol.distributed and pol.module is pol.scorer
    ref = HFPolicy(tiny_model(12).to(torch.bfloat16), lr=1e-3, ddp=False)
    for a, b in zip(pol.params, ref.params):
        assert torch.equal(a, b)
    seeds = [200, 201, 202, 203]
    mine = _micro_grads(pol, seeds[2 * rank : 2 * rank + 2])
    all_micro = _micro_grads(ref, seeds)
    assert len(mine) == 2
    pol.optimizer.all_reduce_grads()  # as optimizer_step does first (averaging equal buffers again changes nothing)
    expect = [sum(g.double() for g in gs) / 2 for gs in zip(*all_micro)]
    for buf, e in zip(pol.gradients(), expect):
        assert buf.dtype == torch.float32
        assert float((buf.double() - e).abs().max()) <= 16 * 2.0**-24 * float(e.abs().max())
    out = pol.optimizer_step(None)
    norm = float(torch.cat([e.reshape(-1) for e in expect]).norm())
    assert out["grad_norm"] == pytest.approx(norm, rel=1e-5)
    gathered = [None, None]
    dist.all_gather_object(gathered, [p.detach().clone() for p in pol.params])
    assert all(torch.equal(a, b) for a, b in zip(*gathered))
