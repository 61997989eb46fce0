"""Teacher generation: §6 case 47 (own budget, this call only), early stop tags, saved-token counting."""

from __future__ import annotations

import pytest
import torch
from alignopsd.engine.generation.base import GenerationOutput, SamplingParams
from alignopsd.engine.generation.hf import HFGenerator
from alignopsd.engine.generation.teacher import ACTION_STOPS, THINK_STOP, generate_teacher
from alignopsd.engine.models.loading import load_causal_lm, load_tokenizer
from generator_double import GeneratorDouble


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: OpenMP spin-waiting on a shared 2-core machine costs more than it gives
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


class ScriptedBackend(GeneratorDouble):
    """Emits a fixed text per prompt token by token, stopping like the real backends (stop string in the
    decoded continuation, or the token budget). Records the sampling settings it was called with."""

    def __init__(self, tok, scripts: list[str], max_model_len: int = 4096):
        self.tok, self.scripts, self.max_model_len, self.calls = tok, scripts, max_model_len, []

    def generate(self, prompts, sampling, *, keep_prompt_cache=False):
        self.calls.append(sampling)
        out = GenerationOutput(token_ids=[], texts=[], logprobs=[], finish_reasons=[])
        for i, _ in enumerate(prompts):
            ids = self.tok.encode(self.scripts[i], add_special_tokens=False)
            got, reason = [], "length"
            for t in ids[: sampling.max_new_tokens]:
                got.append(t)
                text = self.tok.decode(got)
                if any(s in text for s in sampling.stop):
                    reason = "stop"
                    break
            text = self.tok.decode(got)
            cut = [text.find(s) + len(s) for s in sampling.stop if s in text]
            out.token_ids.append(got)
            out.texts.append(text[: min(cut)] if cut else text)
            out.logprobs.append([0.0] * len(got))
            out.finish_reasons.append(reason)
        return out

    def load_weights(self, state_dict):
        raise NotImplementedError


SCRIPTS = [
    "<think> the apple is on the table </think><action>take apple</action> and some rambling after it",
    "<think> go to the fridge </think><action>open fridge</action>",
    "<think> never closed and far longer than the budget allows for sure, " + "more words " * 40,
]


def test_stop_at_think_without_action_filter(tok):
    backend = ScriptedBackend(tok, SCRIPTS)
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0, seed=4, stop=("</action>",))
    out = generate_teacher(backend, [[1, 2]] * 3, sampling, budget=64, action_filter=False)
    sent = backend.calls[0]
    assert sent.stop == THINK_STOP and sent.max_new_tokens == 64
    assert (sent.temperature, sent.top_p, sent.top_k, sent.do_sample, sent.seed) == (1.0, 1.0, -1, True, 4)
    assert sampling.max_new_tokens == 16 and sampling.stop == ("</action>",)  # the caller's settings untouched
    assert out.thinking[:2] == ["the apple is on the table", "go to the fridge"]
    assert out.thinking_valid.tolist() == [True, True, False]
    assert not out.action_valid.any()  # stopped before the action
    assert out.texts[0].endswith("</think>")
    assert out.stopped_at_tag.tolist() == [True, True, False]
    n0, n1 = len(out.token_ids[0]), len(out.token_ids[1])
    assert len(out.token_ids[2]) == 64 and out.at_budget_fraction == pytest.approx(1 / 3)
    assert out.tokens_saved_estimate == (64 - n0) + (64 - n1)
    assert out.tokens_generated == n0 + n1 + 64
    m = out.metrics()
    assert m["m1/teacher_tokens_saved"] == out.tokens_saved_estimate
    assert m["m1/teacher_tokens_saved_fraction"] == pytest.approx(out.tokens_saved_estimate / (3 * 64))


def test_stop_at_action_with_action_filter(tok):
    backend = ScriptedBackend(tok, SCRIPTS)
    out = generate_teacher(backend, [[1]] * 3, SamplingParams(max_new_tokens=8), budget=64, action_filter=True)
    assert backend.calls[0].stop == ACTION_STOPS
    assert out.action[:2] == ["take apple", "open fridge"] and out.action_valid.tolist() == [True, True, False]
    assert out.texts[0].endswith("</action>") and "rambling" not in out.texts[0]
    ids, mask = out.padded(pad_token_id=2)
    assert ids.shape == mask.shape == (3, 64)  # padded to the budget width
    assert mask.sum(1).tolist() == [len(t) for t in out.token_ids]


def test_case47_budget_for_this_call_only_on_tiny_model(tok):
    """A teacher call with its own (larger) budget gives budget-wide responses; the next student call is back to
    the student budget. (The real 2048/512 scaled down to 40/8 for the tiny model.)"""
    gen = HFGenerator(load_causal_lm("tiny"), tok, max_model_len=128)
    prompt = tok.apply_chat_template([{"role": "user", "content": "go north"}], add_generation_prompt=True)
    prompts = [prompt["input_ids"]] * 2
    student = SamplingParams(max_new_tokens=8, seed=0, stop=("</action>",))
    teacher = generate_teacher(gen, prompts, student, budget=40, action_filter=False)
    assert [len(t) for t in teacher.token_ids] == [40, 40]  # the random model never writes </think>
    assert teacher.at_budget_fraction == 1.0 and teacher.tokens_saved_estimate == 0
    ids, _ = teacher.padded(tok.pad_token_id)
    assert ids.shape == (2, 40)
    after = gen.generate(prompts, student)
    assert max(len(t) for t in after.token_ids) <= 8 and student.max_new_tokens == 8
    none_budget = generate_teacher(gen, prompts, student, budget=None, action_filter=True)
    assert none_budget.budget == 8  # null teacher budget = the student budget
    with pytest.raises(ValueError, match="budget"):  # prompt + budget above the model limit
        generate_teacher(gen, prompts, student, budget=128 - len(prompts[0]) + 1, action_filter=False)


def test_config_errors(tok):
    backend = ScriptedBackend(tok, SCRIPTS, max_model_len=100)
    sp = SamplingParams(max_new_tokens=8, do_sample=True)
    with pytest.raises(ValueError, match="teacher_do_sample"):
        generate_teacher(backend, [[1]], sp, budget=16, action_filter=False, teacher_do_sample=False)
    with pytest.raises(ValueError, match="max_model_len=100"):
        generate_teacher(backend, [[1] * 90], sp, budget=16, action_filter=False)
    with pytest.raises(ValueError, match="budget"):
        generate_teacher(backend, [[1]], sp, budget=0, action_filter=False)
    with pytest.raises(ValueError, match="teacher_prompt_ids"):
        generate_teacher(backend, [[]], sp, budget=4, action_filter=False)
    assert backend.calls == []
