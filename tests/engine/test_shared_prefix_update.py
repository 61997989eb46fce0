"""Shared prompt prefixes in the update (engine/policy/shared_prefix.py): rows whose prompts share a prefix push it
once, in a packed prefix tree, forward and backward, and give the unshared forward's log-probs, entropies, loss and
every gradient (fp32, 1e-5), padded or packed, with grouped key/value heads, LoRA and gradient checkpointing; the
update's counts (``update/token_forwards`` beside ``update/row_tokens``) are what the forwards pushed."""

from __future__ import annotations

import pytest
import torch
from alignopsd.engine.policy import lm_head, shared_prefix
from alignopsd.engine.policy.base import RowLayout
from alignopsd.engine.policy.hf import HFPolicy
from alignopsd.engine.policy.varlen_attention import TREE_NAME, tree_segments
from alignopsd.engine.step.micro_batches import Footprint, RowGeometry
from alignopsd.kernels import native_choice
from test_policy_hf import V, reference, tiny_model

from alignopsd.losses import entropy_bonus, ppo_loss

P, R = 44, 8  # prompt and response widths of :func:`_rows`
R_LENS = [8, 3, 5, 1, 6, 4, 7]


def _rows(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``[prompt (width P, left-padded) | response (width R, right-padded)]`` rows: 0-2 share a 24-token prefix and
    diverge after it, 3-4 have one identical prompt of 30 tokens, 5 shares nothing, 6 shares 12 tokens with 0 (under
    ``MIN_SHARED``)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, V, (30,), generator=g)
    same = torch.randint(3, V, (30,), generator=g)
    prompts = [torch.cat([base[:24], torch.randint(3, V, (6 + 3 * i,), generator=g)]) for i in range(3)]
    prompts += [same, same.clone(), torch.randint(3, V, (20,), generator=g)]
    prompts.append(torch.cat([base[:12], torch.randint(3, V, (9,), generator=g)]))
    ids = torch.zeros(len(prompts), P + R, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, n) in enumerate(zip(prompts, R_LENS)):
        ids[i, P - len(p) : P], mask[i, P - len(p) : P] = p, 1
        ids[i, P : P + n], mask[i, P : P + n] = torch.randint(3, V, (n,), generator=g), 1
    return ids, mask


def test_plan_groups_rows_by_their_longest_common_prompt_prefix():
    prompts = [[1] * 20 + [2, 3], [1] * 20 + [4], [5] * 30, [5] * 30, [1] * 10 + [9], [7] * 40]
    lengths = [len(p) + 3 for p in prompts]
    plan = shared_prefix.plan_shared(prompts, lengths)
    assert plan.prefix == [0, 20, 0, 30, 0, 0] or plan.prefix == [20, 0, 0, 30, 0, 0]
    assert plan.root[3] == 2 and plan.root[4] == 4 and plan.root[5] == 5  # 4 shares 10 < MIN_SHARED: alone
    assert plan.row_tokens == sum(lengths) and plan.saved == 20 + 30 and plan.positions == sum(lengths) - 50
    assert shared_prefix.takes(plan, plan.row_tokens) and not shared_prefix.takes(plan, plan.positions)
    with pytest.raises(ValueError, match="lengths: 1 rows, prompts has 2"):
        shared_prefix.plan_shared([[1], [2]], [3])


def test_tree_inputs_push_each_prefix_once_and_map_every_row_position():
    ids, mask = _rows()
    plan = shared_prefix.plan_rows(ids, mask, P)
    assert plan.saved == 2 * 24 + 30 and plan.prefix[6] == 0  # 0-2 over 24, 3-4 over 30 (all of it), 6 alone
    ids_1n, pos_1n, slot = shared_prefix.tree_inputs(ids, mask, plan)
    assert ids_1n.shape[1] == plan.positions == int(mask.sum()) - plan.saved
    keep = mask.bool()
    for r in range(ids.shape[0]):  # every attended position of every row reads its own token at its own position
        assert ids_1n[0, slot[r][keep[r]]].tolist() == ids[r][keep[r]].tolist()
        assert pos_1n[0, slot[r][keep[r]]].tolist() == list(range(int(keep[r].sum())))
    segs = tree_segments(pos_1n)
    assert sum(n for n, _ in segs) == plan.positions and sorted(f for _, f in segs if f) == [24, 24, 30]


def test_tree_segments_refuse_what_is_not_a_tree():
    with pytest.raises(ValueError, match="must start a root at position 0"):
        tree_segments(torch.tensor([[3, 4, 0, 1]]))
    with pytest.raises(ValueError, match="one packed sequence"):
        tree_segments(torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.parametrize("packed", [False, True])
def test_scored_rows_equal_the_unshared_forward_and_count_what_was_pushed(packed):
    model = tiny_model(3).eval()
    ids, mask = _rows()
    args = (model, ids[:, :P], mask[:, :P], ids[:, P:], mask[:, P:])
    plain = lm_head.score_rows(*args, packed=packed, with_entropy=True, temperature=0.8)
    shared = lm_head.score_rows(*args, packed=packed, share=True, with_entropy=True, temperature=0.8)
    assert plain.shared == 0 and shared.shared == 2 * 24 + 30
    row_tokens = int(mask[:, :P].sum()) + int(mask[:, P : P + R - 1].sum())
    assert shared.pushed == row_tokens - shared.shared < plain.pushed
    torch.testing.assert_close(shared.logp, plain.logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(shared.entropy, plain.entropy, rtol=0, atol=1e-5)
    want, _ = reference(model, ids, mask, R, 0.8)  # and both equal the rows one by one, unpadded
    torch.testing.assert_close(shared.logp, want, rtol=0, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"  # the model's own attention restored


def test_rows_sharing_too_little_keep_their_layout():
    """A forward whose rows share under ``MIN_SAVED`` of its positions is not laid out as a tree."""
    model = tiny_model(3).eval()
    ids, mask = _rows()
    sel = [0, 5, 6]  # 6 shares 12 tokens with 0: under MIN_SHARED, no group
    out = lm_head.score_rows(model, ids[sel, :P], mask[sel, :P], ids[sel, P:], mask[sel, P:], share=True)
    assert out.shared == 0


def _policy(share: bool, *, lora: bool, checkpointing: bool) -> HFPolicy:
    model = tiny_model(4)
    adapter = None
    if lora:
        from alignopsd.engine.policy.lora import LoraAdapter

        adapter = LoraAdapter.wrap(model, rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"])
        with torch.no_grad():  # lora_B starts at zero: give the adapters a gradient through A as well
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    pol = HFPolicy(model, lr=1e-3, packed=True, gradient_checkpointing=checkpointing, adapter=adapter)
    pol.rows.share_prefixes = share
    return pol


def _step(share: bool, *, fused: bool, lora: bool = False, checkpointing: bool = False):
    """One micro-step of the update (fused head loss or autograd through the log-probs): (log-probs, entropies, loss,
    grads)."""
    ids, mask = _rows()
    g = torch.Generator().manual_seed(5)
    old, adv = torch.randn(ids.shape[0], R, generator=g) - 4.0, torch.randn(ids.shape[0], R, generator=g)
    rmask = mask[:, P:].float()

    def loss_fn(lp, ent):
        loss, _ = ppo_loss(lp, old, adv, rmask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
        return loss + entropy_bonus(ent, rmask, coef=0.01)

    pol = _policy(share, lora=lora, checkpointing=checkpointing)
    if fused:
        lp, ent, carrier = pol.response_loss(ids, mask, R, loss_fn, loss_fill=old, temperature=0.8, with_entropy=True)
        carrier.backward()
        loss = float(loss_fn(lp, ent))
    else:
        lp, ent = pol.response_logprobs(ids, mask, R, temperature=0.8, with_entropy=True, grad=True)
        loss_t = loss_fn(lp, ent)
        loss_t.backward()
        loss = float(loss_t.detach())
    grads = {n: p.grad.detach().clone() for n, p in pol.model.named_parameters() if p.grad is not None}
    return lp.detach(), ent.detach(), loss, grads


@pytest.mark.parametrize(
    ("fused", "lora", "checkpointing"),
    [(True, False, False), (False, False, False), (True, False, True), (True, True, False), (False, True, True)],
)
def test_shared_update_equals_the_unshared_update(monkeypatch, fused, lora, checkpointing):
    """Log-probs, entropies, loss and every gradient of the update's micro-step equal the unshared (packed) one's,
    through the fused head loss and through autograd, with LoRA and with gradient checkpointing (the recomputation
    runs the prefix tree's attention the forward ran)."""
    if lora:
        pytest.importorskip("peft")
    calls = []
    real = lm_head.tree_forward
    monkeypatch.setattr(lm_head, "tree_forward", lambda *a: calls.append(1) or real(*a))
    plain = _step(False, fused=fused, lora=lora, checkpointing=checkpointing)
    assert not calls
    shared = _step(True, fused=fused, lora=lora, checkpointing=checkpointing)
    assert calls == [1]  # the tree was taken
    for x, y in zip(plain[:2], shared[:2]):
        torch.testing.assert_close(y, x, rtol=0, atol=1e-5)
    assert shared[2] == pytest.approx(plain[2], abs=1e-5)
    assert plain[3].keys() == shared[3].keys() and len(plain[3]) > 0
    if lora:
        assert all("lora_" in n for n in plain[3])  # only the adapters train
    assert max(float(g.abs().max()) for g in plain[3].values()) > 1e-4  # the comparison is not vacuous
    for name, gp in plain[3].items():
        torch.testing.assert_close(shared[3][name], gp, rtol=0, atol=1e-5, msg=name)


def test_grouped_heads_share_prefixes_too():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shapes = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "head_dim": 16}
    cfg = LlamaConfig(vocab_size=V, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      attn_implementation="sdpa", **shapes)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    ids, mask = _rows()
    args = (model, ids[:, :P], mask[:, :P], ids[:, P:], mask[:, P:])
    shared = lm_head.score_rows(*args, share=True)
    assert shared.shared > 0
    torch.testing.assert_close(shared.logp, lm_head.score_rows(*args).logp, rtol=0, atol=1e-5)


def test_footprint_counts_what_the_shared_forward_pushed():
    """The update's count (``Footprint`` with ``share``) equals the forward's own, on every subset of rows."""
    model = tiny_model(3).eval()
    ids, mask = _rows()
    geo = RowGeometry.of(mask[:, :P], mask[:, P:], ids[:, :P])
    for rows in ([0, 1, 2, 3, 4, 5, 6], [3, 4], [0, 5, 6], [1, 2, 4], [5]):
        for packed in (False, True):
            fp = Footprint()
            fp.add(geo, rows, packed, share=True)
            with torch.no_grad():
                out = lm_head.score_rows(model, ids[rows, :P], mask[rows, :P], ids[rows, P:], mask[rows, P:],
                                         packed=packed, share=True)  # fmt: skip
            assert fp.computed == out.pushed and fp.row_tokens - fp.real == out.shared, (rows, packed)
    with pytest.raises(ValueError, match="needs the rows' prompts"):
        Footprint().add(RowGeometry.of(mask[:, :P], mask[:, P:]), [0, 1], share=True)


def test_row_layout_shares_where_the_policy_may_and_never_while_forced(monkeypatch):
    rows = RowLayout(None, share_prefixes=True)
    assert rows.shares()
    with rows.forced(True):
        assert not rows.shares()
    with pytest.raises(ValueError, match="share_prefixes"):
        RowLayout(False, can_pack=False, share_prefixes=True)
    monkeypatch.delenv(native_choice.PIN_ENV, raising=False)
    assert HFPolicy(tiny_model(), packed=None).rows.share_prefixes
    assert not HFPolicy(tiny_model(), packed=False).rows.share_prefixes  # padded rows by configuration
    monkeypatch.setenv(native_choice.PIN_ENV, "torch")
    assert not HFPolicy(tiny_model(), packed=None).rows.share_prefixes  # the torch paths pinned
    assert TREE_NAME != tiny_model().config._attn_implementation


@pytest.mark.parametrize("fused", [True, False])
def test_update_metrics_give_token_forwards_beside_row_tokens(fused):
    """``ppo_update`` with prefixes shared: the same optimiser-step gradients as unshared packed rows, and
    ``update/token_forwards`` below ``update/row_tokens`` by the shared positions (equal where nothing is shared)."""
    from alignopsd.engine.step.batch import TurnBatch
    from test_update_tokens import _update

    ids, mask = _rows()
    m = ids.shape[0]
    cb = TurnBatch(
        task=torch.zeros(m, dtype=torch.long),
        rollout=torch.arange(m),
        turn=torch.zeros(m, dtype=torch.long),
        prompt_ids=ids[:, :P],
        prompt_mask=mask[:, :P],
        response_ids=ids[:, P:],
        response_mask=mask[:, P:],
        outcome=torch.zeros(m),
        action_valid=torch.ones(m, dtype=torch.bool),
    )
    g = torch.Generator().manual_seed(2)
    old = -4.0 + 0.1 * torch.randn(m, R, generator=g) * mask[:, P:]
    adv = torch.randn(m, R, generator=g)
    over = {"trainer.ppo.mini_batch_size": 8, "trainer.ppo.micro_batch_size": 8, "trainer.ppo.max_token_len_per_gpu": 0,
            "trainer.ppo.fused_head_loss": fused}  # fmt: skip
    out, steps = {}, {}
    for share in (False, True):
        out[share], steps[share] = _update(_policy(share, lora=False, checkpointing=False), cb, old, adv, **over)
    rows = int(mask[:, :P].sum()) + int(mask[:, P : P + R - 1].sum())
    assert out[False]["update/row_tokens"] == out[True]["update/row_tokens"] == rows
    assert out[False]["update/token_forwards"] == rows
    assert out[True]["update/token_forwards"] == rows - (2 * 24 + 30)
    assert out[True]["actor/padding_fraction"] == 0.0
    assert len(steps[True]) == len(steps[False]) == 1
    for a, b in zip(steps[False][0], steps[True][0]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
