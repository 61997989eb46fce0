"""Megatron backend under tensor parallelism 2 (run as ``torchrun --nproc_per_node=2 -m pytest -m distributed``).

Each rank holds a shard; the results are compared with the Hugging Face backend computed on the full
model in the same process.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(os.environ.get("WORLD_SIZE") != "2", reason="needs torchrun --nproc_per_node=2"),
]


def _qwen2_tiny():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(3)
    return Qwen2ForCausalLM(cfg).float().eval()


def _llama_tiny():
    from alignopsd.engine.models.loading import build_tiny_model

    return build_tiny_model().float().eval()


MODELS = {"llama_tied": _llama_tiny, "qwen2_bias_gqa_untied": _qwen2_tiny}


def _rows(vocab: int, seed: int = 0):
    """Ragged [prompt (left-padded) | response (right-padded)] rows."""
    g = torch.Generator().manual_seed(seed)
    b, lp, lr = 4, 9, 7
    ids = torch.randint(3, vocab, (b, lp + lr), generator=g)
    mask = torch.ones(b, lp + lr, dtype=torch.long)
    for i, (pp, rr) in enumerate([(0, 0), (3, 2), (5, 0), (1, 5)]):
        mask[i, :pp] = 0
        if rr:
            mask[i, lp + lr - rr :] = 0
    ids = ids.masked_fill(mask == 0, 2)
    return ids, mask, lr


def _megatron(model, **kw):
    from alignopsd.engine.policy.megatron.backend import MegatronPolicy

    return MegatronPolicy(model.config, model.state_dict(), tp=2, **kw)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_roundtrip_conversion_is_exact(name):
    model = MODELS[name]()
    pol = _megatron(model)
    back = pol.hf_state_dict()
    ref = model.state_dict()
    for k, v in ref.items():
        assert k in back, k
        assert torch.equal(back[k], v), k


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logprobs_equal_hf_backend(name):
    from alignopsd.engine.policy.hf import HFPolicy

    model = MODELS[name]()
    ids, mask, lr = _rows(model.config.vocab_size)
    hf = HFPolicy(model, lr=1e-3, ddp=False)
    ref_lp, ref_ent = hf.response_logprobs(ids, mask, lr, temperature=0.7, with_entropy=True)
    pol = _megatron(model)
    lp, ent = pol.response_logprobs(ids, mask, lr, temperature=0.7, with_entropy=True)
    assert lp.shape == ref_lp.shape
    assert (lp[mask[:, -lr:] == 0] == 0).all()
    assert (lp - ref_lp).abs().max().item() <= 1e-4
    assert (ent - ref_ent).abs().max().item() <= 1e-4
    # both ranks see the same full result
    other = [torch.empty_like(lp) for _ in range(2)]
    torch.distributed.all_gather(other, lp.contiguous())
    assert torch.equal(other[0], other[1])


def _loss(policy, ids, mask, lr):
    lp, _ = policy.response_logprobs(ids, mask, lr, temperature=1.0, grad=True)
    m = mask[:, -lr:].float()
    return -(lp * m).sum() / m.sum()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_optimizer_step_matches_hf_backend(name):
    from alignopsd.engine.policy.hf import HFPolicy

    model = MODELS[name]()
    ids, mask, lr = _rows(model.config.vocab_size, seed=1)
    pol = _megatron(model, lr=1e-3, weight_decay=0.0)
    _loss(pol, ids, mask, lr).backward()
    out_m = pol.optimizer_step(max_grad_norm=1.0)
    hf = HFPolicy(model, lr=1e-3, weight_decay=0.0, ddp=False)
    _loss(hf, ids, mask, lr).backward()
    out_h = hf.optimizer_step(max_grad_norm=1.0)
    assert not out_m["skipped"] and not out_h["skipped"]
    assert abs(out_m["grad_norm"] - out_h["grad_norm"]) <= 1e-4 * max(1.0, out_h["grad_norm"])
    after_m = pol.hf_state_dict()
    after_h = hf.hf_state_dict()
    moved = 0.0
    for k, v in after_h.items():
        assert (after_m[k] - v).abs().max().item() <= 2e-5, k
        moved = max(moved, (v - MODELS[name]().state_dict()[k]).abs().max().item())
    assert moved > 1e-4  # the step really changed the weights


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fused_loss_gradients_equal_autograd(name):
    """response_loss (vocab-parallel fused head loss) gives autograd's gradients on every rank's shard."""
    from alignopsd.losses import entropy_bonus, ppo_loss

    model = MODELS[name]()
    ids, mask, lr = _rows(model.config.vocab_size, seed=2)
    m = mask[:, -lr:].float()
    g = torch.Generator().manual_seed(4)
    old, adv = torch.randn(4, lr, generator=g) - 6.0, torch.randn(4, lr, generator=g)

    def loss_fn(lp, ent):
        loss, _ = ppo_loss(lp, old, adv, m, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
        return loss + entropy_bonus(ent, m, coef=0.01)

    grads, lps = [], []
    for fused in (False, True):
        pol = _megatron(model, lr=1e-3)
        pol.zero_grad()
        if fused:
            lp, ent, carrier = pol.response_loss(ids, mask, lr, loss_fn, loss_fill=old, temperature=0.9,
                                                 with_entropy=True)  # fmt: skip
            carrier.backward()
        else:
            lp, ent = pol.response_logprobs(ids, mask, lr, temperature=0.9, with_entropy=True, grad=True)
            loss_fn(lp, ent).backward()
        lps.append(lp.detach())
        grads.append({n: p.main_grad.clone() for n, p in pol.model.named_parameters()})
    assert (lps[0] - lps[1]).abs().max().item() <= 1e-5
    for n, ga in grads[0].items():
        torch.testing.assert_close(grads[1][n], ga, atol=2e-6, rtol=1e-4, msg=n)
    assert max(v.abs().max().item() for v in grads[0].values()) > 1e-4  # not vacuous


def test_nonfinite_gradient_skips_step():
    model = _llama_tiny()
    ids, mask, lr = _rows(model.config.vocab_size)
    pol = _megatron(model, lr=1e-3)
    before = pol.hf_state_dict()
    (_loss(pol, ids, mask, lr) * float("nan")).backward()
    out = pol.optimizer_step(max_grad_norm=1.0)
    assert out["skipped"]
    after = pol.hf_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_checkpoint_saved_at_tp2_loads_and_continues(tmp_path_factory):
    model = _llama_tiny()
    ids, mask, lr = _rows(model.config.vocab_size, seed=2)
    pol = _megatron(model, lr=1e-3)
    _loss(pol, ids, mask, lr).backward()
    pol.optimizer_step(1.0)
    # one shared directory for both ranks
    path = [str(tmp_path_factory.mktemp("dcp")) if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(path, src=0)
    pol.save_checkpoint(path[0])
    saved = pol.hf_state_dict()
    _loss(pol, ids, mask, lr).backward()
    pol.optimizer_step(1.0)
    continued = pol.hf_state_dict()

    other = _llama_tiny()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.5)  # different starting weights: everything must come from the checkpoint
    fresh = _megatron(other, lr=1e-3)
    fresh.load_checkpoint(path[0])
    assert fresh.steps == 1
    loaded = fresh.hf_state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in saved.items())
    _loss(fresh, ids, mask, lr).backward()
    fresh.optimizer_step(1.0)
    again = fresh.hf_state_dict()
    for k, v in continued.items():
        assert (again[k] - v).abs().max().item() <= 1e-6, k
    # the folder is verified before DCP reads it (its .metadata is unpickled by the library)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        meta = Path(path[0]) / ".metadata"
        meta.write_bytes(meta.read_bytes()[:-8] + b"XXXXXXXX")
    torch.distributed.barrier()
    with pytest.raises(ValueError, match=r"\.metadata"):
        _megatron(_llama_tiny(), lr=1e-3).load_checkpoint(path[0])


def test_backend_scorer_equals_hf_rescoring():
    """Under Megatron the trainer scores old log-probs and teacher rows with the sharded model itself
    (backend_row_logprobs, row chunks); the results equal the Hugging Face copy's shared-prefix rescoring."""
    import functools

    from alignopsd.engine.policy.row_scoring import backend_row_logprobs
    from alignopsd.engine.step.batch import TurnBatch
    from alignopsd.engine.step.rescoring import Rescorer

    model = _llama_tiny()
    g = torch.Generator().manual_seed(5)
    m, lp, lr = 5, 6, 4
    cb = TurnBatch(
        task=torch.zeros(m, dtype=torch.long), rollout=torch.arange(m), turn=torch.zeros(m, dtype=torch.long),
        prompt_ids=torch.randint(3, 500, (m, lp), generator=g), prompt_mask=torch.ones(m, lp, dtype=torch.long),
        response_ids=torch.randint(3, 500, (m, lr), generator=g), response_mask=torch.ones(m, lr, dtype=torch.long),
        outcome=torch.zeros(m), action_valid=torch.ones(m, dtype=torch.bool),
        teacher_prompt_ids=torch.randint(3, 500, (m, lp + 2), generator=g),
        teacher_prompt_mask=torch.ones(m, lp + 2, dtype=torch.long),
    )  # fmt: skip
    cb.response_mask[1, 2:] = 0
    pairs = torch.tensor([[1, 0], [3, 2], [0, 4]])
    pol = _megatron(model)
    scorer = functools.partial(backend_row_logprobs, pol, temperature=0.9, device=torch.device("cpu"), max_tokens=25)
    ours = Rescorer(model, temperature=0.9, scorer=scorer)(cb, pairs, with_entropy=True)
    ref = Rescorer(model, temperature=0.9)(cb, pairs, with_entropy=True)
    assert (ours.old_logp - ref.old_logp).abs().max().item() <= 1e-4
    assert ((ours.entropy - ref.entropy) * cb.response_mask).abs().max().item() <= 1e-4
    assert (ours.diag - ref.diag).abs().max().item() <= 1e-4 and (ours.cross - ref.cross).abs().max().item() <= 1e-4


def _main_and_model_params(pol):
    """(fp32 main params, their bf16/fp16 model params) of megatron-core's mixed-precision optimizer."""
    opts = getattr(pol.optimizer, "chained_optimizers", [pol.optimizer])
    main = [m for o in opts for g in o.fp32_from_float16_groups for m in g]
    model = [p for o in opts for g in o.float16_groups for p in g]
    return main, model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_trains_through_fp32_main_params(dtype):
    """lr 1e-6 on bf16/fp16 shards: the fp32 main params keep updates below the weights' resolution, which
    then move the low-precision weights (AdamW on those weights themselves loses them: see the Hugging Face
    backend's test); the main params travel with the optimizer state."""
    first_step_max = 0.05 if dtype == torch.bfloat16 else 0.2  # fp16 resolves 8x finer than bf16
    model = _qwen2_tiny().to(dtype)
    ids, mask, lr = _rows(model.config.vocab_size, seed=4)
    pol = _megatron(model, lr=1e-6, weight_decay=0.01, params_dtype=dtype)
    main, params = _main_and_model_params(pol)
    assert main and all(m.dtype == torch.float32 for m in main) and all(p.dtype == dtype for p in params)
    start = [m.clone() for m in main]
    n = sum(m.numel() for m in main)
    for step in range(30):
        _loss(pol, ids, mask, lr).backward()
        assert not pol.optimizer_step(max_grad_norm=1.0)["skipped"]
        if step == 0:
            moved = sum(int((m != s).sum()) for m, s in zip(main, start))
            low_moved = sum(int((p != s.to(dtype)).sum()) for p, s in zip(params, start))
            # main params of tokens that never occur get no gradient (hence 0.5, not 1)
            assert moved > 0.5 * n and low_moved < first_step_max * n, (moved, low_moved, n)
    opts = getattr(pol.optimizer, "chained_optimizers", [pol.optimizer])
    assert all(st["exp_avg"].dtype == torch.float32 for o in opts for st in o.optimizer.state.values())
    for p, m in zip(params, main):
        assert torch.equal(p, m.to(dtype))  # the model's weights are the rounding of the main params
    changed = sum(int((p != s.to(dtype)).sum()) for p, s in zip(params, start))
    assert changed > 0.2 * n, (changed, n)
    # resume: weights and optimizer state (with the main params) into a policy built from other weights
    state, weights = pol.optimizer_state(), pol.hf_state_dict()
    fresh = _megatron(_qwen2_tiny().to(dtype), lr=1e-6, weight_decay=0.01, params_dtype=dtype)
    fresh.load_hf_state_dict(weights)
    fresh.load_optimizer_state(state)
    for a, b in zip(_main_and_model_params(fresh)[0], main):
        assert torch.equal(a, b)
