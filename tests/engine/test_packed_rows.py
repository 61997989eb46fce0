"""Padding-free rows (``trainer.ppo.use_remove_padding``, engine/policy/lm_head.py): the attended positions of a
forward's rows packed into one sequence whose position ids restart per row give the padded forward's per-token
log-probs, entropies, loss and gradients (fp32, 1e-5), on the CPU and on the fake CUDA device (the packed path taken
there, its position ids and slots built on the device); the counts and ``actor/padding_fraction`` follow what was
pushed."""

from __future__ import annotations

import pytest
import torch
from alignopsd.engine.policy import lm_head
from alignopsd.engine.policy.hf import HFPolicy
from alignopsd.engine.policy.row_scoring import new_stats, score_plain
from alignopsd.engine.step.micro_batches import Footprint, RowGeometry
from alignopsd.kernels import native_choice
from fake_cuda import FakeCuda
from test_policy_hf import reference, rows, tiny_model

from alignopsd.losses import entropy_bonus, ppo_loss

LR = 5  # response width of test_policy_hf.rows: prompts of width 6, 11 columns


def _loss_inputs(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, LR, generator=g) - 4.0, torch.randn(4, LR, generator=g)


def _step(packed: bool, ids, mask, device="cpu", checkpointing: bool = False):
    """One fused-loss micro-step of a fresh tiny policy: (log-probs, entropies, loss, grad norm, grads)."""
    old, adv = (t.to(device) for t in _loss_inputs())
    rmask = mask[:, 6:].float()

    def loss_fn(lp, ent):
        loss, _ = ppo_loss(lp, old, adv, rmask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
        return loss + entropy_bonus(ent, rmask, coef=0.01)

    pol = HFPolicy(tiny_model(4).to(device), lr=1e-3, packed=packed, gradient_checkpointing=checkpointing)
    lp, ent, carrier = pol.response_loss(ids, mask, LR, loss_fn, loss_fill=old, temperature=0.8, with_entropy=True)
    carrier.backward()
    grads = {n: p.grad.detach().cpu() for n, p in pol.model.named_parameters() if p.grad is not None}
    norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])))
    return lp.detach().cpu(), ent.detach().cpu(), float(loss_fn(lp, ent)), norm, grads


def _assert_same(a, b):
    for x, y in zip(a[:2], b[:2]):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
    assert a[2] == pytest.approx(b[2], abs=1e-5) and a[3] == pytest.approx(b[3], abs=1e-5)
    assert a[4].keys() == b[4].keys() and a[3] > 1e-4  # the comparison is not vacuous
    for name, g in a[4].items():
        torch.testing.assert_close(b[4][name], g, rtol=0, atol=1e-5, msg=name)


def test_packed_inputs_restart_positions_per_row():
    ids = torch.tensor([[0, 0, 5, 6, 7], [0, 8, 9, 10, 0], [1, 2, 3, 4, 5]])
    mask = (ids > 0).long()
    ids_1n, pos_1n, slot = lm_head.packed_inputs(ids, mask)
    assert ids_1n.tolist() == [[5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5]]
    assert pos_1n.tolist() == [[0, 1, 2, 0, 1, 2, 0, 1, 2, 3, 4]]
    assert slot[mask.bool()].tolist() == list(range(11))


def test_packed_update_equals_padded_and_pushes_no_padding():
    """The update's fused-loss micro-step: same log-probs, entropies, loss, gradient norm and gradients; the packed
    forward pushes the attended positions only (the padded one pushes every column of the trimmed rows)."""
    ids, mask = rows(2)
    padded, packed = _step(False, ids, mask), _step(True, ids, mask)
    _assert_same(padded, packed)
    want_lp, _ = reference(tiny_model(4), ids, mask, LR, 0.8)
    torch.testing.assert_close(packed[0], want_lp, rtol=0, atol=1e-5)  # and both equal unpadded rows one by one
    model = tiny_model(4)
    p_ids, p_mask, r_ids, r_mask = ids[:, :6], mask[:, :6], ids[:, 6:], mask[:, 6:]
    *_, pushed_padded = lm_head.score_rows(model, p_ids, p_mask, r_ids, r_mask)
    *_, pushed_packed = lm_head.score_rows(model, p_ids, p_mask, r_ids, r_mask, packed=True)
    assert pushed_padded == 4 * (6 + 5 - 1)
    assert pushed_packed == int(p_mask.sum()) + int(r_mask[:, :-1].sum()) < pushed_padded


def test_packed_rows_with_gradient_checkpointing_recompute_under_the_same_attention():
    """``policy.gradient_checkpointing`` with packed rows on the CPU: the backward's recomputation of each layer runs
    the row-by-row attention the forward ran (not the model's own, which would attend across rows of the packed
    sequence), so the gradients equal the padded update's, checkpointed or not."""
    ids, mask = rows(2)
    padded = _step(False, ids, mask)
    _assert_same(padded, _step(True, ids, mask, checkpointing=True))
    _assert_same(padded, _step(False, ids, mask, checkpointing=True))


def test_packed_rows_on_the_cpu_attend_row_by_row_with_grouped_heads(monkeypatch):
    """On the CPU a packed forward runs each row's causal attention on its own (no [N, N] mask is built or read),
    with grouped key/value heads, and gives the padded forward's log-probs; the model's own attention is restored."""
    from alignopsd.engine.policy import varlen_attention as va
    from transformers import LlamaConfig, LlamaForCausalLM

    calls = []
    real = va.varlen_attention

    def spy(module, q, k, v, mask, *args, **kwargs):
        calls.append((q.shape[1], k.shape[1], mask, va.segment_starts(kwargs["position_ids"])))
        return real(module, q, k, v, mask, *args, **kwargs)

    monkeypatch.setattr(va, "varlen_attention", spy)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).eval()
    ids, mask = rows(2)
    ids = ids % 64
    args = (model, ids[:, :6], mask[:, :6], ids[:, 6:], mask[:, 6:])
    padded = lm_head.score_rows(*args, packed=False)[0]
    assert not calls  # the padded forward keeps the model's own attention
    packed = lm_head.score_rows(*args, packed=True)[0]
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-5)
    assert len(calls) == 2 and all(c[:3] == (4, 2, None) for c in calls)  # one call per layer, no mask
    lengths = [b - a for a, b in zip(calls[0][3][:-1], calls[0][3][1:])]
    assert lengths == mask[:, :-1].sum(1).tolist()  # one segment per row: its attended positions
    assert model.config._attn_implementation == "sdpa"


def test_segment_starts_refuse_what_is_not_one_packed_sequence():
    from alignopsd.engine.policy.varlen_attention import segment_starts

    assert segment_starts(torch.tensor([[0, 1, 2, 0, 1, 0]])) == [0, 3, 5, 6]
    with pytest.raises(ValueError, match="start a row at position 0"):
        segment_starts(torch.tensor([[1, 2, 0]]))
    with pytest.raises(ValueError, match=r"one packed sequence \[1, N\]"):
        segment_starts(torch.tensor([[0, 1], [0, 1]]))


def test_a_response_with_a_hole_is_scored_padded():
    """A masked column between attended response columns: packing would read the wrong predicting position, so the
    forward is padded (same result as packed=False)."""
    ids, mask = rows(2)
    mask[0, 8] = 0  # row 0's response: attended, hole, attended...
    p, r = (ids[:, :6], mask[:, :6]), (ids[:, 6:], mask[:, 6:])
    assert not lm_head.packable(r[1]) and lm_head.packable(rows(2)[1][:, 6:])
    model = tiny_model(4)
    lp0, _, n0 = lm_head.score_rows(model, *p, *r)
    lp1, _, n1 = lm_head.score_rows(model, *p, *r, packed=True)
    assert n1 == n0 and torch.equal(lp0, lp1)


def test_plain_rescoring_packed_counts_real_positions():
    """The old log-prob / reference pass in plain mode: the same log-probs packed, and its counts say no padding."""
    ids, mask = rows(1)
    prompts, pmask, resp, rmask = ids[:, :6], mask[:, :6], ids[:, 6:], mask[:, 6:]
    model, rp = tiny_model(1), torch.arange(4)
    out = {}
    for packed in (False, True):
        stats = new_stats()
        out[packed] = score_plain(model, prompts, pmask, rp, resp, rmask, with_entropy=True, stats=stats, packed=packed)
        out[packed] += (stats,)
    torch.testing.assert_close(out[True][0], out[False][0], rtol=0, atol=1e-5)
    padded, packed = out[False][2], out[True][2]
    assert packed["token_forwards"] == packed["real_tokens"] == padded["real_tokens"] < padded["token_forwards"]
    assert packed["prompt_tokens"] == int(pmask.sum())
    assert packed["prompt_tokens"] + packed["response_tokens"] == packed["token_forwards"]


def test_footprint_of_packed_micro_batches_has_no_padding():
    _, mask = rows(0)
    geo = RowGeometry.of(mask[:, :6], mask[:, 6:])
    padded, packed = Footprint(), Footprint()
    padded.add(geo, [0, 1, 2, 3])
    packed.add(geo, [0, 1, 2, 3], packed=True)
    assert padded.padding_fraction > 0.3 and packed.padding_fraction == 0.0 and packed.real == padded.real
    single = Footprint()
    single.add(geo, [1], packed=True)  # one row: nothing to pack, its own trimmed width
    assert single.computed == single.real


def test_auto_forwards_take_padded_rows_until_the_policy_chooses(monkeypatch):
    """Auto rows on a CPU (the policy's ``RowLayout`` undecided): a forward measures nothing (the update times both,
    forward and backward, engine/step/packing_trial.py); padded rows until a choice is set on the policy, then the
    chosen rows, in the policy's forwards and in a rescorer that holds the same layout. A configured layout keeps
    what was configured; a backend without packed rows refuses them."""
    from alignopsd.engine.checkpoint.trainer_state import RowsChoice
    from alignopsd.engine.policy import hf
    from alignopsd.engine.policy.base import RowLayout
    from alignopsd.engine.policy.hf import HFPolicy
    from alignopsd.engine.step.rescoring import Rescorer

    monkeypatch.delenv(native_choice.PIN_ENV, raising=False)
    ids, mask = rows(0)
    policy = HFPolicy(tiny_model(0), lr=1e-3, packed=None)
    scorer = Rescorer(policy.model, mode="plain", rows=policy.rows)
    pushed = []
    real = lm_head.score_rows
    monkeypatch.setattr(hf, "score_rows", lambda *a, **k: pushed.append(k["packed"]) or real(*a, **k))
    policy.response_logprobs(ids, mask, LR)
    assert policy.rows.undecided and pushed == [False] and not scorer.packs()
    policy.rows.choose(RowsChoice(True, 1.0, 2.0, "injected"))
    policy.response_logprobs(ids, mask, LR)
    assert pushed == [False, True] and scorer.packs() and policy.rows.choice.measured_on == "injected"
    fixed = RowLayout(False)
    fixed.choose(RowsChoice(True))
    assert fixed.packed is False and fixed.choice is None and not fixed.packs()
    with pytest.raises(ValueError, match="no packed rows"):
        RowLayout(False, can_pack=False).choose(RowsChoice(True))
    with pytest.raises(ValueError, match="no packed rows"), RowLayout(False, can_pack=False).forced(True):
        pass


def test_packed_rows_on_the_fake_cuda_device(monkeypatch):
    """On CUDA the packed path is taken (``use_remove_padding: auto``), its position ids and slots are built on the
    device, and the micro-step equals the padded one."""
    built = []
    real = lm_head.packed_inputs

    def spy(ids, mask):
        out = real(ids, mask)
        built.append(tuple(t.device.type for t in out))
        return out

    monkeypatch.setattr(lm_head, "packed_inputs", spy)
    ids, mask = rows(2)
    with FakeCuda():
        from alignopsd.engine.config.schema import load_config
        from alignopsd.engine.run.policy_builders import packed_rows

        assert packed_rows(load_config("configs/tiny.yaml", []), torch.device("cuda", 0)) is True
        dev_ids, dev_mask = ids.to("cuda"), mask.to("cuda")
        packed = _step(True, dev_ids, dev_mask, device="cuda")
        assert built == [("cuda", "cuda", "cuda")]
        padded = _step(False, dev_ids, dev_mask, device="cuda")
        assert len(built) == 1
    _assert_same(padded, packed)
