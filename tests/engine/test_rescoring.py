"""Rescoring engine: cross inputs (§6 case 11), shared-prefix == plain, token-forward counts, log-prob reuse."""

from __future__ import annotations

import pytest
import torch
from alignopsd.engine.policy.lm_head import score_rows
from alignopsd.engine.policy.row_scoring import score_plain, score_shared_prefix
from alignopsd.engine.step.batch import TurnBatch
from alignopsd.engine.step.rescoring import Rescorer
from transformers import LlamaConfig, LlamaForCausalLM

from alignopsd import cross_inputs

V = 211


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).eval()


def left_pad(rows: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
    return ids, mask


def right_pad(rows: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
    return ids, mask


def make_batch(seed: int = 0, m: int = 7, same_first: bool = True) -> TurnBatch:
    """Ragged student/teacher prompts and responses; rows 0 and 1 share their prompts (sibling turn 0)."""
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(1, V, (n,), generator=g).tolist()

    p_lens = [5, 5, 9, 3, 12, 7, 4][:m]
    t_lens = [11, 11, 6, 14, 8, 10, 5][:m]
    r_lens = [6, 6, 1, 9, 3, 0, 8][:m]  # row 5: empty response
    prompts = [rand(n) for n in p_lens]
    teachers = [rand(n) for n in t_lens]
    if same_first:
        prompts[1] = list(prompts[0])
        teachers[1] = list(teachers[0])
    responses = [rand(n) for n in r_lens]
    p_ids, p_mask = left_pad(prompts, 13)
    t_ids, t_mask = left_pad(teachers, 15)
    r_ids, r_mask = right_pad(responses, 10)
    return TurnBatch(
        task=torch.tensor([0, 0, 0, 0, 1, 1, 1][:m]),
        rollout=torch.tensor([0, 1, 2, 0, 0, 1, 2][:m]),
        turn=torch.tensor([0, 0, 0, 1, 0, 0, 0][:m]),
        prompt_ids=p_ids,
        prompt_mask=p_mask,
        response_ids=r_ids,
        response_mask=r_mask,
        outcome=torch.zeros(m),
        action_valid=torch.ones(m, dtype=torch.bool),
        teacher_prompt_ids=t_ids,
        teacher_prompt_mask=t_mask,
    )


def full_logits_reference(model, prompt_ids, prompt_mask, response_ids, response_mask, temperature=1.0):
    """Naive reference: full [B, T, V] logits of the whole row, log_softmax, gather (row by row, no padding)."""
    out = torch.zeros(response_ids.shape, dtype=torch.float32)
    for b in range(prompt_ids.shape[0]):
        p = prompt_ids[b][prompt_mask[b].bool()]
        r = response_ids[b][response_mask[b].bool()]
        if r.numel() == 0:
            continue
        ids = torch.cat([p, r])[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float() / temperature
        lp = torch.log_softmax(logits[p.numel() - 1 : -1], -1).gather(-1, r[:, None]).squeeze(-1)
        out[b, : r.numel()] = lp
    return out


def test_score_rows_matches_full_logits_reference():
    model = tiny_model()
    b = make_batch()
    out = score_rows(
        model, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask, temperature=0.7, with_entropy=True
    )
    lp, ent, pushed = out.logp, out.entropy, out.pushed
    assert out.shared == 0 and out.carrier is None
    ref = full_logits_reference(model, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask, 0.7)
    assert (lp - ref).abs().max() < 1e-5
    assert bool((lp[~b.response_mask.bool()] == 0).all())
    assert bool((ent[b.response_mask.bool()] > 0).all()) and bool((ent[~b.response_mask.bool()] == 0).all())
    # the last response column is never pushed, all-padding prompt columns are trimmed
    assert pushed == b.size * (12 + 9 - 1)


@pytest.mark.parametrize("max_tokens,max_prefix_tokens", [(40, None), (100000, None), (100, 30)])
def test_shared_prefix_equals_plain(max_tokens, max_prefix_tokens):
    model = tiny_model(1)
    b = make_batch(seed=3)
    # repeated sources (0 twice, 4 twice), a pair onto the empty response (target 5), turns 2, 6 without pairs
    pairs = [(1, 0), (2, 0), (0, 1), (0, 3), (3, 1), (4, 5), (5, 4), (4, 6), (6, 4), (1, 3)]
    plain = Rescorer(model, mode="plain", max_tokens=max_tokens)(b, pairs, with_entropy=True)
    shared = Rescorer(model, mode="shared_prefix", max_tokens=max_tokens, max_prefix_tokens=max_prefix_tokens)(
        b, pairs, with_entropy=True
    )
    for name in ("old_logp", "diag", "cross", "entropy"):
        a, c = getattr(plain, name), getattr(shared, name)
        assert a.dtype == torch.float32 and a.shape == c.shape
        assert (a - c).abs().max() <= 1e-5, name
    assert plain.cross.shape == (len(pairs), b.response_length)
    # empty response: zero log-probs in both modes
    assert bool((shared.diag[5] == 0).all()) and bool((shared.cross[5] == 0).all())
    # independent check of the cross rows against full logits
    ids, _, _ = cross_inputs(
        b.teacher_prompt_ids, b.teacher_prompt_mask, b.response_ids, b.response_mask, torch.tensor(pairs)
    )
    src = torch.tensor([p[0] for p in pairs])
    tgt = torch.tensor([p[1] for p in pairs])
    ref = full_logits_reference(
        model, b.teacher_prompt_ids[src], b.teacher_prompt_mask[src], b.response_ids[tgt], b.response_mask[tgt]
    )
    assert (shared.cross - ref).abs().max() <= 1e-5
    # the shared mode pushes fewer tokens through the model
    tp, ts = plain.stats["teacher/token_forwards"], shared.stats["teacher/token_forwards"]
    assert ts < tp


def test_no_pairs_and_temperature():
    model = tiny_model(2)
    b = make_batch(seed=5)
    for mode in ("plain", "shared_prefix"):
        out = Rescorer(model, mode=mode, temperature=0.4)(b, None)
        assert out.cross.shape == (0, b.response_length)
        ref = full_logits_reference(
            model, b.teacher_prompt_ids, b.teacher_prompt_mask, b.response_ids, b.response_mask, 0.4
        )
        assert (out.diag - ref).abs().max() <= 1e-5


def test_token_forward_counts_exact():
    """Two distinct teacher prompts of 4 tokens, 3 rows with 3-token responses."""
    model = tiny_model(3)
    t_ids, t_mask = left_pad([[1, 2, 3, 4], [5, 6, 7, 8]], 4)
    r_ids, r_mask = right_pad([[9, 10, 11], [12, 13, 14], [15, 16, 17]], 3)
    src = torch.tensor([0, 1, 0])
    st_p, st_s = {}, {}
    st_p = {"prompt_tokens": 0, "response_tokens": 0, "token_forwards": 0, "forwards": 0, "rows": 0}
    st_s = dict(st_p)
    a, _ = score_plain(model, t_ids, t_mask, src, r_ids, r_mask, stats=st_p)
    c, _ = score_shared_prefix(model, t_ids, t_mask, src, r_ids, r_mask, stats=st_s)
    assert (a - c).abs().max() <= 1e-5
    assert st_p["token_forwards"] == 3 * (4 + 2)  # each row: prompt + response minus its last token
    assert st_s["prompt_tokens"] == 2 * 4 and st_s["response_tokens"] == 3 * 2
    assert st_s["token_forwards"] == 14


def test_identical_prompts_are_merged():
    model = tiny_model(4)
    t_ids, t_mask = left_pad([[1, 2, 3], [1, 2, 3], [7, 1, 2, 3]], 4)
    r_ids, r_mask = right_pad([[9, 10], [12, 13], [15, 16]], 2)
    src = torch.tensor([0, 1, 2])
    st = {"prompt_tokens": 0, "response_tokens": 0, "token_forwards": 0, "forwards": 0, "rows": 0}
    c, _ = score_shared_prefix(model, t_ids, t_mask, src, r_ids, r_mask, stats=st)
    a, _ = score_plain(model, t_ids, t_mask, src, r_ids, r_mask)
    assert (a - c).abs().max() <= 1e-5
    assert st["prompt_tokens"] == 2 * 4  # prompts 0 and 1 are one prompt


def test_bad_inputs():
    model = tiny_model()
    b = make_batch()
    with pytest.raises(ValueError, match="mode"):
        Rescorer(model, mode="fast")
    no_teacher = TurnBatch(**{**b.__dict__, "teacher_prompt_ids": None, "teacher_prompt_mask": None})
    with pytest.raises(ValueError, match="teacher_prompt"):
        Rescorer(model).teacher_logprobs(no_teacher, None)
    right_padded = b.teacher_prompt_mask.flip(1)
    bad = TurnBatch(**{**b.__dict__, "teacher_prompt_mask": right_padded})
    for mode in ("plain", "shared_prefix"):
        with pytest.raises(ValueError, match="left-padded"):
            Rescorer(model, mode=mode).teacher_logprobs(bad, None)


def test_rollout_logp_reuse_and_mismatch(caplog):
    model = tiny_model(5)
    b = make_batch(seed=7)
    exact, _, _ = Rescorer(model).student_logprobs(b)
    noisy = exact + 0.01 * b.response_mask
    b.rollout_logp = noisy
    out = Rescorer(model, reuse_rollout_logp=True, check_reuse=True)(b, None, teacher=False, with_entropy=True)
    assert out.stats["student/reused"] is True and out.entropy is None
    assert torch.equal(out.old_logp, noisy)
    assert out.stats["mismatch/abs_diff_max"] == pytest.approx(0.01, abs=1e-5)
    assert out.stats["mismatch/abs_diff_mean"] == pytest.approx(0.01, abs=1e-5)
    computed = Rescorer(model)(b, None, teacher=False)  # not reused: the step measures the mismatch itself
    assert (computed.old_logp - exact).abs().max() <= 1e-6
    assert not any(k.startswith("mismatch/") for k in computed.stats)


def _kept_teacher_prompts(model, b: TurnBatch, max_batch_size=None):
    """The teacher generation's path: privileged prompts in turn order, their keys and values kept."""
    from alignopsd.engine.generation.base import SamplingParams
    from alignopsd.engine.generation.hf import HFGenerator
    from alignopsd.engine.generation.teacher import generate_teacher
    from alignopsd.engine.models.loading import load_tokenizer
    from alignopsd.engine.step.rescoring import unpadded_prompts

    gen = HFGenerator(model, load_tokenizer("tiny"), max_batch_size=max_batch_size, eos_token_ids=[V + 1])
    prompts = unpadded_prompts(b.teacher_prompt_ids, b.teacher_prompt_mask)
    out = generate_teacher(gen, prompts, SamplingParams(max_new_tokens=3, seed=1), None, False, keep_prompt_cache=True)
    return gen, out.prompt_cache


@pytest.mark.parametrize("max_tokens,max_batch_size", [(100000, None), (40, 3)])
def test_teacher_forcing_behind_the_kept_prompt_cache_equals_scoring_the_prompts(max_tokens, max_batch_size):
    """Teacher forcing that reads the teacher generation's kept keys/values (engine/generation/prompt_cache.py) gives
    the log-probs of scoring the privileged prompts again (fp32, up to reassociation) and pushes only responses;
    identical prompts (rows 0 and 1) were pushed and kept once; chunked generation keeps one cache per chunk."""
    model = tiny_model(2)
    b = make_batch(seed=5)
    gen, cache = _kept_teacher_prompts(model, b, max_batch_size)
    rescorer = Rescorer(model, max_tokens=max_tokens, temperature=0.7)
    assert rescorer.reads_prompt_cache(gen) and cache is not None
    assert len(cache.chunks) == (1 if max_batch_size is None else 3)
    assert cache.prompt_of_row[0] == cache.prompt_of_row[1] and cache.chunk_of_row[0] == cache.chunk_of_row[1]
    assert cache.chunks[0].keys[0].shape[0] == (2 if max_batch_size else 6)  # rows 0-2 hold two distinct prompts
    pairs = [(1, 0), (2, 0), (0, 3), (3, 1), (4, 5), (5, 4), (4, 6), (6, 4), (1, 3)]
    d0, c0, s0 = rescorer.teacher_logprobs(b, pairs)
    d1, c1, s1 = rescorer.teacher_logprobs(b, pairs, prompt_cache=cache)
    assert (d0 - d1).abs().max() <= 1e-5 and (c0 - c1).abs().max() <= 1e-5
    assert bool((d1[5] == 0).all()) and bool((c1[4] == 0).all())  # the empty response (turn 5)
    assert s1["cached_prompts"] == 1 and s1["prompt_tokens"] == 0 and s1["rows"] == b.size + len(pairs)
    tgt = list(range(b.size)) + [t for _, t in pairs]
    longest = int(b.response_mask.sum(1).max())
    assert s1["token_forwards"] == s1["response_tokens"] <= len(tgt) * (longest - 1) < s0["token_forwards"]
    if max_tokens < 100:
        assert s1["forwards"] > 3  # rows were split into forwards of at most max_tokens context tokens


def test_kept_prompt_cache_is_refused_for_other_prompts_or_another_model():
    model = tiny_model(2)
    b = make_batch(seed=5)
    gen, cache = _kept_teacher_prompts(model, b)
    other = make_batch(seed=6)
    with pytest.raises(ValueError, match="prompt_cache: row 0"):
        Rescorer(model).teacher_logprobs(other, None, prompt_cache=cache)
    with pytest.raises(ValueError, match="made for 7 prompts"):
        Rescorer(model).teacher_logprobs(make_batch(seed=5, m=6), None, prompt_cache=cache)
    assert not Rescorer(tiny_model(3)).reads_prompt_cache(gen)  # another module: other weights
    assert not Rescorer(model, mode="plain").reads_prompt_cache(gen)
    gen.fast_decode = False  # the model's own attention keeps no prompt cache
    assert not Rescorer(model).reads_prompt_cache(gen)


def test_cached_teacher_forcing_equals_the_plain_scorer_for_a_response_mask_with_gaps():
    """A response mask with masked positions inside it (a gap, and a row whose first position is masked): the
    masked positions attend to no key of their own (as in the model's attention under the plain scorer), so the
    three scorers agree; the cached path once let a masked query attend to its own key (0.0165 apart)."""
    model = tiny_model(2)
    b = make_batch(seed=5)
    gen, cache = _kept_teacher_prompts(model, b)
    mask = b.response_mask.clone()
    mask[0, 2:4] = 0  # a gap inside row 0's response
    mask[3, 0] = 0  # row 3 starts with a masked position
    mask[6, 5] = 0
    b.response_mask = mask
    pairs = [(1, 0), (0, 3), (4, 6)]
    rescorer = Rescorer(model, temperature=0.7)
    d_plain, c_plain, _ = Rescorer(model, mode="plain", temperature=0.7).teacher_logprobs(b, pairs)
    d_shared, c_shared, _ = rescorer.teacher_logprobs(b, pairs)
    d_cached, c_cached, _ = rescorer.teacher_logprobs(b, pairs, prompt_cache=cache)
    assert (d_plain - d_shared).abs().max() <= 1e-5 and (c_plain - c_shared).abs().max() <= 1e-5
    assert (d_plain - d_cached).abs().max() <= 1e-5 and (c_plain - c_cached).abs().max() <= 1e-5
    assert bool((d_cached[0, 2:4] == 0).all()) and float(d_cached[0, 4].abs()) > 0
