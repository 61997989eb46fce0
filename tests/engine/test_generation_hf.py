"""HF generation backend on the tiny random model: padding, seeds, stops, log-probs, weight loading."""

from __future__ import annotations

import pytest
import torch
from alignopsd.engine.generation.base import SamplingParams
from alignopsd.engine.generation.hf import HFGenerator, filter_logits
from alignopsd.engine.models import load_causal_lm, load_tokenizer


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: OpenMP spin-waiting on a shared 2-core machine costs more than it gives
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny():
    return load_causal_lm("tiny"), load_tokenizer("tiny")


@pytest.fixture(scope="module")
def prompts(tiny):
    _, tok = tiny
    texts = ["go north", "take the apple from the table and put it in the fridge", "look"]
    return [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"]
        for t in texts
    ]


def teacher_forced_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of ``response`` after ``prompt`` with one unpadded forward. [len(response)]"""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, -1), (0.7, 0.9, 50)])
def test_logprobs_match_teacher_forcing_with_left_padding(tiny, prompts, temperature, top_p, top_k):
    model, tok = tiny
    g = HFGenerator(model, tok)
    sp = SamplingParams(max_new_tokens=12, temperature=temperature, top_p=top_p, top_k=top_k, seed=3)
    out = g.generate(prompts, sp)
    assert len(out.token_ids) == len(prompts) == len(out.logprobs) == len(out.texts) == len(out.finish_reasons)
    for p, r, lp in zip(prompts, out.token_ids, out.logprobs):
        assert len(r) == len(lp) >= 1
        ref = teacher_forced_logprobs(model, p, r, temperature)
        torch.testing.assert_close(torch.tensor(lp), ref, atol=2e-4, rtol=0)  # not renormalised by top-p/k


def test_same_seed_same_samples_and_seeds_differ(tiny, prompts):
    model, tok = tiny
    g = HFGenerator(model, tok)
    a = g.generate(prompts, SamplingParams(max_new_tokens=10, seed=7))
    b = g.generate(prompts, SamplingParams(max_new_tokens=10, seed=7))
    c = g.generate(prompts, SamplingParams(max_new_tokens=10, seed=8))
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert a.token_ids != c.token_ids


def test_greedy_batched_equals_single_and_top_k1_is_greedy(tiny, prompts):
    model, tok = tiny
    g = HFGenerator(model, tok)
    greedy = SamplingParams(max_new_tokens=8, do_sample=False)
    batched = g.generate(prompts, greedy)
    singles = [g.generate([p], greedy).token_ids[0] for p in prompts]
    assert batched.token_ids == singles
    topk1 = g.generate(prompts, SamplingParams(max_new_tokens=8, top_k=1, seed=0))
    assert topk1.token_ids == batched.token_ids
    chunked = HFGenerator(model, tok, max_batch_size=2).generate(prompts, greedy)
    assert chunked.token_ids == batched.token_ids
    assert all(r == "length" and len(t) == 8 for r, t in zip(batched.finish_reasons, batched.token_ids))


def test_stop_string_per_row(tiny, prompts):
    """A stop string taken from row 1's greedy text stops row 1 right there; other rows are unaffected."""
    model, tok = tiny
    g = HFGenerator(model, tok)
    base = g.generate(prompts, SamplingParams(max_new_tokens=16, do_sample=False))
    ids = base.token_ids[1]
    # the stop string = the decoded text of tokens 4..6 of row 1 (completes at token index 6)
    stop = tok.decode(ids[4:7], skip_special_tokens=True)
    assert stop.strip() and stop not in tok.decode(ids[:6], skip_special_tokens=True)
    stop_at = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k], skip_special_tokens=True))
    out = g.generate(prompts, SamplingParams(max_new_tokens=16, do_sample=False, stop=(stop,)))
    assert out.token_ids[1] == ids[:stop_at] and out.finish_reasons[1] == "stop"
    assert out.texts[1].endswith(stop) and out.texts[1].count(stop) == 1
    for r in (0, 2):  # unaffected unless the same text happens to appear in them
        full = tok.decode(base.token_ids[r], skip_special_tokens=True)
        if stop not in full:
            assert out.token_ids[r] == base.token_ids[r] and out.finish_reasons[r] == "length"


def test_eos_token_stops_row_and_is_kept(tiny, prompts):
    model, tok = tiny
    base = HFGenerator(model, tok).generate(prompts[:1], SamplingParams(max_new_tokens=10, do_sample=False))
    eos = base.token_ids[0][3]
    k = base.token_ids[0].index(eos)
    g = HFGenerator(model, tok, eos_token_ids=[eos])
    out = g.generate(prompts[:1], SamplingParams(max_new_tokens=10, do_sample=False))
    assert out.token_ids[0] == base.token_ids[0][: k + 1] and out.finish_reasons[0] == "stop"


def test_filter_logits_top_p_and_top_k():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(filter_logits(logits, -1, 0.8))
    assert kept.tolist() == [[True, True, False, False]]
    kept = torch.isfinite(filter_logits(logits, -1, 0.81))
    assert kept.tolist() == [[True, True, True, False]]
    kept = torch.isfinite(filter_logits(logits, 1, 1.0))
    assert kept.tolist() == [[True, False, False, False]]
    kept = torch.isfinite(filter_logits(logits, -1, 0.1))  # always at least the top token
    assert kept.tolist() == [[True, False, False, False]]


def test_load_weights_in_place_and_shared(tiny, prompts):
    _, tok = tiny
    model = load_causal_lm("tiny")
    g = HFGenerator(model, tok)
    sp = SamplingParams(max_new_tokens=6, do_sample=False)
    before = g.generate(prompts[:1], sp)
    g.load_weights(model.state_dict())  # the shared model's own tensors: nothing to copy
    new = {k: v.clone() for k, v in model.state_dict().items()}
    new["model.norm.weight"].mul_(3.0)
    g.load_weights(new)
    assert torch.equal(model.model.norm.weight, new["model.norm.weight"])
    after = g.generate(prompts[:1], sp)
    ref = teacher_forced_logprobs(model, prompts[0], after.token_ids[0], 1.0)
    torch.testing.assert_close(torch.tensor(after.logprobs[0]), ref, atol=2e-4, rtol=0)
    assert after.logprobs[0] != before.logprobs[0]
    with pytest.raises(ValueError, match="unknown parameter"):
        g.load_weights({"nope.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="shape"):
        g.load_weights({"model.norm.weight": torch.zeros(3)})


def test_bad_input(tiny):
    model, tok = tiny
    g = HFGenerator(model, tok, max_model_len=64)
    with pytest.raises(ValueError, match="prompts"):
        g.generate([[]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="max_new_tokens"):
        g.generate([[1] * 60], SamplingParams(max_new_tokens=8))
    assert g.generate([], SamplingParams(max_new_tokens=2)).token_ids == []


def test_training_flag_restored(tiny, prompts):
    _, tok = tiny
    model = load_causal_lm("tiny").train()
    HFGenerator(model, tok).generate(prompts[:1], SamplingParams(max_new_tokens=2))
    assert model.training
