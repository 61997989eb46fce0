"""HF generation backend on the tiny random model: padding, seeds, stops, log-probs, weight loading."""

from __future__ import annotations

import pytest
import torch
from alignopsd.engine.generation.base import SamplingParams
from alignopsd.engine.generation.hf import HFGenerator, filter_logits
from alignopsd.engine.models.loading import load_causal_lm, load_tokenizer


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


# ---------------------------------------------------------------------------------------------- shared prefixes


def _sibling_and_teacher_prompts(tok) -> list[list[int]]:
    """Rows as a step has them: G=3 siblings of two tasks (identical prompts, then diverging histories), and
    teacher prompts that open with one privileged block before the student's own prompt."""

    def chat(text: str) -> list[int]:
        return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"]

    task_a = "You are in the kitchen. Your task is to put a clean apple in the fridge. " * 2
    task_b = "You are in the bedroom. Your task is to find the key and open the chest. " * 2
    skills = "Skills: look before acting; open a receptacle before taking from it; carry one object. " * 3
    rows = [chat(task_a)] * 3 + [chat(task_b + "You went north.")] + [chat(task_b + "You took the key.")] * 2
    rows += [chat(skills + "Student: go north"), chat(skills + "Student: take apple"), chat("look")]
    return rows


def _check_plan(plan, prompts) -> None:
    """Every group's prefix is common to its rows and leaves each row at least its last token."""
    for r, g in enumerate(plan.group):
        if g >= 0:
            n = plan.length[g]
            assert 0 < n < len(prompts[r]) and prompts[r][:n] == prompts[plan.source[g]][:n]


def test_prefix_plan_groups_siblings_and_teacher_blocks(tiny):
    from alignopsd.engine.generation.prefix import plan_prefixes

    prompts = _sibling_and_teacher_prompts(tiny[1])
    plan = plan_prefixes(prompts)
    _check_plan(plan, prompts)
    g = plan.group
    assert g[0] == g[1] == g[2] >= 0 and g[3] == g[4] == g[5] >= 0 and g[6] == g[7] >= 0  # siblings; teachers
    lengths = [len(p) for p in prompts]
    assert plan.token_forwards(lengths) < 0.7 * len(prompts) * max(lengths)
    assert plan_prefixes([[1, 2, 3], [1, 2, 4]]).length == []  # below min_shared: nothing shared
    assert plan_prefixes([[5] * 20, [5] * 20]).length == [19]  # a row keeps its last token for its own logits


def test_prefix_plan_is_the_cheapest_grouping_of_a_step():
    """A step's teacher prompts: one privileged block, then per turn G=4 siblings whose prompts share the task
    (identical at turn 0). Many small groups of identical prompts lose to groups that share the block."""
    import random

    from alignopsd.engine.generation.prefix import PrefixPlan, plan_prefixes

    rng = random.Random(0)
    block = [rng.randrange(1000) for _ in range(250)]
    rows = []
    for turn in range(8):
        task = [rng.randrange(1000) for _ in range(200)]
        hist = [[rng.randrange(1000) for _ in range(150)] for _ in range(4)]
        rows += [block + task + hist[0 if turn == 0 else g] for g in range(4)]
    lengths = [len(r) for r in rows]
    plan = plan_prefixes(rows)
    _check_plan(plan, rows)
    cost = plan.token_forwards(lengths)
    assert all(g >= 0 for g in plan.group)  # every row reads a shared prefix
    one_block = PrefixPlan(group=[0] * len(rows), length=[250], source=[0])
    per_turn = PrefixPlan(group=[r // 4 for r in range(32)], length=[449] + [450] * 7, source=list(range(0, 32, 4)))
    identical_only = PrefixPlan(group=[0, 0, 0, 0] + [-1] * 28, length=[599], source=[0])
    for other in (one_block, per_turn, identical_only):
        assert cost <= other.token_forwards(lengths)
    assert cost < 0.5 * len(rows) * max(lengths)


def test_prefix_plan_takes_one_group_of_all_rows_when_a_row_would_stay_alone():
    """Teacher prompts as a step has them: one privileged block, then pairs of rows with long common tails and a
    row of its own. Pairs would leave that row's whole prompt in the padded suffix batch; one group of all rows
    over the block pushes fewer positions."""
    from alignopsd.engine.generation.prefix import plan_prefixes

    block = list(range(100, 140))
    prompts = [block + [1] * 30, block + [1] * 30, block + [2] * 30, block + [2] * 30, block + [3] * 30]
    plan = plan_prefixes(prompts)
    assert plan.group == [0] * 5 and plan.length == [40] and plan.token_forwards([70] * 5) == 40 + 5 * 30
    assert plan_prefixes(prompts[:4]).length == [69, 69]  # no row alone: the pairs' longer prefixes stay cheaper
    assert plan_prefixes([block + [1] * 30, block[:20]]).length == [19]  # the shorter row keeps its last token


@pytest.fixture(scope="module")
def tiny_gqa(tiny):
    """The tiny Llama with grouped-query attention (6 query heads over 2 key/value heads, width 96), random fp32
    weights."""
    from alignopsd.engine.models.loading import TINY_CONFIG
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(TINY_CONFIG, hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2, **cfg))
    return model.eval(), tiny[1]


def _teacher_prompts(tok) -> list[list[int]]:
    """Teacher prompts of one task: the privileged block, then students' prompts that diverge early and alone."""
    skills = "Skills: look before acting; open a receptacle before taking from it; carry one object. " * 3
    students = ["go north", "take the apple from the table", "open the fridge and look inside", "look"]
    return [
        tok.apply_chat_template([{"role": "user", "content": skills + s}], add_generation_prompt=True)["input_ids"]
        for s in students
    ]


@pytest.mark.parametrize("layout", ["groups", "one_group"])
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("do_sample", [True, False])
def test_shared_prefixes_give_the_plain_tokens_in_fp32(tiny, tiny_gqa, do_sample, gqa, layout, monkeypatch):
    """Shared prefixes kept once and the grouped-matmul decoding (engine/generation/decode_cache.py) against
    plain generation (one padded prefill, the model's own SDPA over a DynamicCache): same tokens, same log-probs.
    Layouts: sibling groups beside a row of its own, and one prefix for all rows. A third of the vocabulary ends
    a row, so rows leave the batch at different steps."""
    from alignopsd.engine.generation.decode_cache import SharedPrefixKV
    from alignopsd.engine.generation.prefix import plan_prefixes

    model, tok = tiny_gqa if gqa else tiny
    assert next(model.parameters()).dtype is torch.float32
    prompts = _sibling_and_teacher_prompts(tok) if layout == "groups" else _teacher_prompts(tok)
    plan = plan_prefixes(prompts)
    assert (plan.group == [0] * len(prompts)) == (layout == "one_group") and len(plan.length) >= 1
    sp = SamplingParams(max_new_tokens=10, temperature=0.8, do_sample=do_sample, seed=11, stop=("look",))
    eos = set(range(3, 49152, 3))
    shared, plain = HFGenerator(model, tok, eos_token_ids=eos), HFGenerator(model, tok, eos_token_ids=eos)
    plain.share_prefixes = plain.fast_decode = False
    calls = {"decode": 0, "prefill": 0}
    attend = SharedPrefixKV.attend

    def counted(self, layer, q, scaling):
        calls["decode" if q.shape[2] == 1 else "prefill"] += 1
        return attend(self, layer, q, scaling)

    monkeypatch.setattr(SharedPrefixKV, "attend", counted)
    b = plain.generate(prompts, sp)
    assert calls == {"decode": 0, "prefill": 0}  # plain: the model's own attention
    a = shared.generate(prompts, sp)
    assert calls["decode"] > 0 and calls["prefill"] == 2 * model.config.num_hidden_layers  # prefixes, suffixes
    assert model.config._attn_implementation == "sdpa"  # the training forward's attention is back
    assert a.token_ids == b.token_ids and a.finish_reasons == b.finish_reasons and a.texts == b.texts
    assert len({len(t) for t in a.token_ids}) > 1  # rows finished at different steps
    torch.testing.assert_close(torch.tensor(sum(a.logprobs, [])), torch.tensor(sum(b.logprobs, [])), atol=1e-4, rtol=0)
    lengths = [len(p) for p in prompts]
    assert plain.prefill_token_forwards == plain.prefill_token_forwards_unshared == len(prompts) * max(lengths)
    assert shared.prefill_token_forwards_unshared == plain.prefill_token_forwards
    assert shared.prefill_token_forwards < 0.7 * plain.prefill_token_forwards  # the prefixes were pushed once


def test_fast_decode_without_shared_prefixes_and_the_attention_restored_on_error(tiny_gqa, prompts, monkeypatch):
    from alignopsd.engine.generation import decode_cache

    model, tok = tiny_gqa
    sp = SamplingParams(max_new_tokens=6, seed=4)
    fast, plain = HFGenerator(model, tok), HFGenerator(model, tok)
    fast.share_prefixes = plain.share_prefixes = plain.fast_decode = False
    a, b = fast.generate(prompts, sp), plain.generate(prompts, sp)
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(torch.tensor(sum(a.logprobs, [])), torch.tensor(sum(b.logprobs, [])), atol=1e-4, rtol=0)

    def broken(self, layer, q, scaling):
        raise RuntimeError("attention failed")

    monkeypatch.setattr(decode_cache.SharedPrefixKV, "attend", broken)
    with pytest.raises(RuntimeError, match="attention failed"):
        fast.generate(prompts, sp)
    assert model.config._attn_implementation == "sdpa" and not model.training


def test_shared_prefix_attention_refuses_what_it_does_not_serve(tiny_gqa):
    from alignopsd.engine.generation.decode_cache import shared_prefix_attention, shared_prefix_supported
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model, _ = tiny_gqa
    assert shared_prefix_supported(model)
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=64)
    assert not shared_prefix_supported(Qwen2ForCausalLM(Qwen2Config(use_sliding_window=True, **small)))
    assert shared_prefix_supported(Qwen2ForCausalLM(Qwen2Config(**small)))
    q = torch.zeros(1, 6, 1, 16)
    with pytest.raises(ValueError, match="without its cache"):
        shared_prefix_attention(model.model.layers[0].self_attn, q, q, q, None)


def test_shared_prefix_logprobs_match_teacher_forcing(tiny):
    model, tok = tiny
    prompts = _sibling_and_teacher_prompts(tok)[3:8]
    out = HFGenerator(model, tok).generate(prompts, SamplingParams(max_new_tokens=6, seed=2))
    for p, r, lp in zip(prompts, out.token_ids, out.logprobs):
        torch.testing.assert_close(torch.tensor(lp), teacher_forced_logprobs(model, p, r, 1.0), atol=2e-4, rtol=0)


def test_identical_prompts_are_pushed_once_and_kept_once(tiny):
    """Rows with the same prompt (siblings' first turns) share one prefill: the same tokens as plain generation in
    fp32, the prefill of the distinct prompts alone, and one kept copy per distinct prompt."""
    model, tok = tiny
    prompts = _sibling_and_teacher_prompts(tok)
    rows = [prompts[0], prompts[3], prompts[0], prompts[5], prompts[3], prompts[0]]
    sp = SamplingParams(max_new_tokens=6, temperature=0.8, seed=3)
    shared, plain, distinct = HFGenerator(model, tok), HFGenerator(model, tok), HFGenerator(model, tok)
    plain.share_prefixes = plain.fast_decode = False
    a = shared.generate(rows, sp, keep_prompt_cache=True)
    b = plain.generate(rows, sp)
    assert a.token_ids == b.token_ids and b.prompt_cache is None
    torch.testing.assert_close(torch.tensor(sum(a.logprobs, [])), torch.tensor(sum(b.logprobs, [])), atol=1e-4, rtol=0)
    distinct.generate([prompts[0], prompts[3], prompts[5]], sp)
    assert shared.prefill_token_forwards == distinct.prefill_token_forwards
    cache = a.prompt_cache
    assert cache.prompt_of_row == [0, 1, 0, 2, 1, 0] and cache.chunk_of_row == [0] * 6
    chunk = cache.chunks[0]
    assert chunk.keys[0].shape[0] == 3 and chunk.valid.sum(1).tolist() == [len(prompts[i]) for i in (0, 3, 5)]
    assert chunk.last_hidden.shape == (3, model.config.hidden_size)
    assert cache.nbytes == sum(t.numel() * 4 for t in (*chunk.keys, *chunk.values))


def test_sample_rows_draws_the_categorical_distribution():
    from alignopsd.engine.generation.hf import sample_rows

    probs = torch.tensor([[0.0, 0.2, 0.0, 0.8], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0], [0.5, 0.0, 1.5, 0.0]])
    n = 20000
    draws = sample_rows(probs.repeat_interleave(n, 0), torch.Generator().manual_seed(0)).view(4, n)
    freq = torch.stack([torch.bincount(d, minlength=4).float() / n for d in draws])
    torch.testing.assert_close(freq, probs / probs.sum(1, keepdim=True), atol=0.012, rtol=0)
    assert bool((freq[probs == 0] == 0).all())  # a token without mass is never drawn
    a = sample_rows(probs, torch.Generator().manual_seed(7))
    assert torch.equal(a, sample_rows(probs, torch.Generator().manual_seed(7)))


def test_sample_rows_marks_a_row_without_a_distribution():
    """NaN, infinite or all-zero rows have nothing to draw from: -1 (once token 0), the other rows draw as usual;
    check_draws names the row's prompt."""
    from alignopsd.engine.generation.hf import check_draws, sample_rows

    nan, inf = float("nan"), float("inf")
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.2, nan, 0.8], [0.0, 0.0, 2.0], [inf, 1.0, 0.0]])
    draws = sample_rows(probs, torch.Generator().manual_seed(0)).tolist()
    assert draws == [1, -1, -1, 2, -1]
    check_draws([1, 2], probs[[0, 3]], [0, 3])
    with pytest.raises(ValueError, match=r"prompt 11 has no distribution .* sum to 0\.0"):
        check_draws(draws, probs, [10, 11, 12, 13, 14])


def test_generate_names_the_prompt_whose_logits_are_nan(tiny, prompts):
    """A model output with NaN logits for one prompt: the sampler raises naming that prompt (it once sampled token
    0 for it); greedy decoding is not checked (argmax of NaN is the model's problem, not a draw)."""
    model, tok = tiny
    gen = HFGenerator(model, tok)
    last_norm = model.model.norm

    def poison(_mod, _args, out):  # the second prompt's final hidden states (every push of the first chunk)
        return out.index_fill(0, torch.tensor([1]), float("nan")) if out.shape[0] > 1 else out

    hook = last_norm.register_forward_hook(poison)
    try:
        with pytest.raises(ValueError, match="sampling: prompt 1 has no distribution"):
            gen.generate(prompts, SamplingParams(max_new_tokens=3, seed=0))
    finally:
        hook.remove()
    assert len(gen.generate(prompts, SamplingParams(max_new_tokens=2, seed=0)).token_ids) == 3


def test_prompt_cache_over_the_byte_limit_is_not_kept(tiny):
    """A generate call whose kept prompts would pass ``prompt_cache_max_bytes`` keeps nothing (the teacher forcing
    then pushes the prompts again), also when only a later chunk would pass it."""
    model, tok = tiny
    prompts = _sibling_and_teacher_prompts(tok)[:4]
    sp = SamplingParams(max_new_tokens=2, seed=3)
    gen = HFGenerator(model, tok)
    full = gen.generate(prompts, sp, keep_prompt_cache=True).prompt_cache
    gen.prompt_cache_max_bytes = full.nbytes
    assert gen.generate(prompts, sp, keep_prompt_cache=True).prompt_cache.nbytes == full.nbytes
    gen.prompt_cache_max_bytes = full.nbytes - 1
    assert gen.generate(prompts, sp, keep_prompt_cache=True).prompt_cache is None
    chunked = HFGenerator(model, tok, max_batch_size=2)
    first = chunked.generate(prompts[:2], sp, keep_prompt_cache=True).prompt_cache
    chunked.prompt_cache_max_bytes = first.nbytes  # the first chunk fits, the second does not
    out = chunked.generate(prompts, sp, keep_prompt_cache=True)
    assert out.prompt_cache is None and len(out.token_ids) == 4


@pytest.mark.parametrize("layout", ["groups", "one_group"])
def test_kept_prompt_keys_and_values_are_the_prompts_own(tiny, layout):
    """Each kept prompt's attended keys/values (shared prefix then its own positions) and last hidden state are
    those of a forward of the prompt alone; with several prefix groups and with one prefix for all rows."""
    model, tok = tiny
    prompts = _sibling_and_teacher_prompts(tok) if layout == "groups" else _teacher_prompts(tok)
    out = HFGenerator(model, tok).generate(prompts, SamplingParams(max_new_tokens=2, seed=0), keep_prompt_cache=True)
    cache = out.prompt_cache
    assert cache.chunks and cache.chunk_of_row == [0] * len(prompts)
    chunk = cache.chunks[0]
    for r, p in enumerate(prompts):
        u = cache.prompt_of_row[r]
        with torch.no_grad():
            res = model.model(input_ids=torch.tensor([p]), use_cache=True)
        kv = res.past_key_values
        valid = chunk.valid[u]
        assert int(valid.sum()) == len(p)
        for layer in (0, model.config.num_hidden_layers - 1):
            k, v = kv.layers[layer].keys[0], kv.layers[layer].values[0]
            torch.testing.assert_close(chunk.keys[layer][u][:, valid], k, atol=1e-5, rtol=0)
            torch.testing.assert_close(chunk.values[layer][u][:, valid], v, atol=1e-5, rtol=0)
        torch.testing.assert_close(chunk.last_hidden[u], res.last_hidden_state[0, -1], atol=1e-5, rtol=0)
